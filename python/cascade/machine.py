"""What machine are we on: cores, memory, /dev/shm, disks, GPUs (for `cascade info`
and for the header of every benchmark report)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from typing import NamedTuple


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _disks(paths) -> list[dict]:
    seen, out = set(), []
    for p in paths:
        if not p or not os.path.exists(p):
            continue
        try:
            du = shutil.disk_usage(p)
        except OSError:
            continue
        fs = _fs_type(p)
        key = (du.total, fs)
        if key in seen:
            continue
        seen.add(key)
        out.append({"path": p, "fs": fs, "total_bytes": du.total, "free_bytes": du.free})
    return out


def _read_text(path: str) -> str:
    """A kernel file's text; empty where it cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


class Mount(NamedTuple):
    point: str  # "" when no mount was found
    fs: str  # "unknown" then
    options: list[str]
    source: str


def _mount_of(path: str, mounts: str | None = None) -> Mount:
    """The mount that holds path, from /proc/mounts (or `mounts`, its text)."""
    path = os.path.realpath(path)
    if mounts is None:
        mounts = _read_text("/proc/mounts")
    best = Mount("", "unknown", [], "")
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        point = parts[1]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best.point):
            best = Mount(point, parts[2], parts[3].split(","), parts[0])
    return best


def _fs_type(path: str) -> str:
    return _mount_of(path).fs


def arena_pages(path: str, mounts: str | None = None, shmem_enabled: str | None = None) -> str:
    """The pages a host arena file at `path` is mapped with: "2 MiB" on a
    tmpfs that gives huge pages to the arena (mounted with huge=always,
    within_size or advise: the arena asks with MADV_HUGEPAGE; or every
    tmpfs, when the kernel forces them), "4 KiB" on other tmpfs mounts,
    "unknown" elsewhere."""
    directory = os.path.dirname(os.path.abspath(path)) or "/"
    mount = _mount_of(directory, mounts)
    if mount.fs != "tmpfs":
        return "unknown"
    if shmem_enabled is None:
        shmem_enabled = _read_text("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    chosen = shmem_enabled[shmem_enabled.find("[") + 1 : shmem_enabled.find("]")]
    if chosen == "deny":
        return "4 KiB"
    if chosen == "force":
        return "2 MiB"
    huge = next((o.split("=", 1)[1] for o in mount.options if o.startswith("huge=")), "never")
    return "2 MiB" if huge in ("always", "within_size", "advise") else "4 KiB"


def _gpus() -> list[dict]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        r = subprocess.run(
            [
                exe,
                "--query-gpu=name,memory.total,pci.bus_id,driver_version",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = []
    for line in r.stdout.strip().splitlines():
        name, mem, bus, drv = [x.strip() for x in line.split(",")]
        gpus.append(
            {"name": name, "memory_bytes": int(float(mem)) << 20, "pci": bus, "driver": drv}
        )
    return gpus


def machine_info(extra_paths=()) -> dict:
    """A dict describing this machine."""
    from cascade import _core

    mem = _meminfo()
    return {
        "hostname": platform.node(),
        "kernel": platform.release(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_bytes": mem.get("MemTotal", 0),
        "memory_available_bytes": mem.get("MemAvailable", 0),
        "shm": _disks(["/dev/shm"])[0] if os.path.exists("/dev/shm") else None,
        "disks": _disks(["/", "/tmp", os.getcwd(), *extra_paths]),
        "gpus": _gpus(),
        "build": {
            "cuda": _core.HAVE_CUDA,
            "io_uring": _core.HAVE_URING,
            "mpi": _core.HAVE_MPI,
            "ucx": _core.HAVE_UCX,
        },
        "gpu_usable": bool(_core.gpu_usable(0)),
        "python": platform.python_version(),
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_info(info: dict) -> str:
    lines = [
        f"host      {info['hostname']} (Linux {info['kernel']}, Python {info['python']})",
        f"cpu       {info['cpu']}, {info['cores']} cores",
        f"memory    {human_bytes(info['memory_bytes'])} "
        f"({human_bytes(info['memory_available_bytes'])} available)",
    ]
    shm = info.get("shm")
    if shm:
        lines.append(
            f"/dev/shm  {human_bytes(shm['total_bytes'])} {shm['fs']} "
            f"({human_bytes(shm['free_bytes'])} free)"
        )
    for d in info["disks"]:
        lines.append(
            f"disk      {d['path']}: {d['fs']}, {human_bytes(d['total_bytes'])} "
            f"({human_bytes(d['free_bytes'])} free)"
        )
    if info["gpus"]:
        for i, g in enumerate(info["gpus"]):
            lines.append(
                f"gpu {i}     {g['name']}, {human_bytes(g['memory_bytes'])}, driver {g['driver']}"
            )
    else:
        lines.append("gpu       none found")
    b = info["build"]
    lines.append(
        f"build     cuda={'yes' if b['cuda'] else 'no'} "
        f"io_uring={'yes' if b['io_uring'] else 'no'} mpi={'yes' if b['mpi'] else 'no'}; gpu tier "
        f"usable: {'yes' if info['gpu_usable'] else 'no'}"
    )
    return "\n".join(lines)
