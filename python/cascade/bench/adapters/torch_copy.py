"""PyTorch host<->GPU copies, the "GPU-PCIe torch.cuda" row: put is
`torch.from_numpy(row).to("cuda")` (one device tensor per block, kept until
clear), get copies each device tensor back into its host row with
`.copy_()` (what `.cpu()` does, minus allocating a new host tensor). Two
variants: pinned host memory (the harness's buffers registered with
cudaHostRegister, asynchronous copies, one synchronize per batch) and
pageable memory (synchronous copies staged by the driver).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from cascade.bench.adapters.base import Adapter

_problem_cache: dict = {}


def _torch_problem() -> str | None:
    """None when torch with a usable CUDA GPU can be imported in this process."""
    if "answer" in _problem_cache:
        return _problem_cache["answer"]
    answer = None
    if "torch" not in sys.modules:
        if importlib.util.find_spec("torch") is None:
            answer = "torch is not installed"
        else:
            # Import it in a child first: on one machine, loading torch after
            # cascade's core (built with MPI) aborted the process
            # ("free(): invalid pointer"); that must cost a row, not the run.
            code = "import cascade, torch; print('CASCADE-TORCH', torch.cuda.is_available())"
            try:
                p = subprocess.run(
                    [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
                )
                if p.returncode != 0:
                    tail = [x for x in (p.stderr or "").splitlines() if x.strip()]
                    answer = (
                        "importing torch after cascade fails in this environment (exit status "
                        f"{p.returncode}: {tail[-1] if tail else 'no message'}); import torch "
                        "first: python -c 'import torch, sys; from cascade.cli import main; "
                        "sys.exit(main(sys.argv[1:]))' bench compare ..."
                    )
            except (OSError, subprocess.SubprocessError) as e:
                answer = f"could not try importing torch: {e}"
    if answer is None:
        import torch

        if not torch.cuda.is_available():
            answer = (
                f"torch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() is False)"
            )
    _problem_cache["answer"] = answer
    return answer


def register_host(arrays) -> list:
    """Pins numpy arrays in place with cudaHostRegister (through torch's
    runtime bindings); returns the base addresses for unregister_host."""
    import torch

    rt = torch.cuda.cudart()
    done: list = []
    for arr in arrays:
        err = rt.cudaHostRegister(arr.ctypes.data, arr.nbytes, 0)
        if int(err) != 0:
            unregister_host(done)
            raise RuntimeError(f"cudaHostRegister failed: {err}")
        done.append(arr.ctypes.data)
    return done


def unregister_host(bases) -> None:
    import torch

    rt = torch.cuda.cudart()
    for b in bases:
        rt.cudaHostUnregister(b)


def pinned_copy_ceiling(nbytes: int, repeats: int = 3) -> dict:
    """cudaMemcpy from and to pinned memory through torch: best H2D and D2H GB/s."""
    import time

    import torch

    nbytes = max(64 << 20, min(nbytes, 1 << 30))
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = {"h2d": 0.0, "d2h": 0.0}
    for _ in range(repeats + 1):  # the first pass warms up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        best["h2d"] = max(best["h2d"], nbytes / (t1 - t0) / 1e9)
        best["d2h"] = max(best["d2h"], nbytes / (t2 - t1) / 1e9)
    del host, dev
    torch.cuda.empty_cache()
    return {
        "kind": "cudaMemcpy pinned (torch)",
        "bytes": nbytes,
        "write_gbps": best["h2d"],
        "read_gbps": best["d2h"],
        "gbps": min(best["h2d"], best["d2h"]),
        "device": torch.cuda.get_device_name(),
    }


class _TorchCopy(Adapter):
    medium = "gpu"
    compare_to = "cascade-gpu"
    uses_threads = False
    workloads = ("sizes",)
    pinned = False

    @classmethod
    def why_unavailable(cls) -> str | None:
        return _torch_problem()

    @classmethod
    def versions(cls) -> dict:
        import torch

        return {"torch": torch.__version__, "cuda": str(torch.version.cuda)}

    def setup(self, wl) -> None:
        import torch

        self.torch = torch
        self.wl = wl
        self.dev: dict = {}
        self.registered = register_host([wl.data, wl.out]) if self.pinned else []
        self.src = torch.from_numpy(wl.data)
        self.dst = torch.from_numpy(wl.out)

    def put_many(self, indices):
        torch = self.torch
        for i in indices:
            self.dev[i] = self.src[i].to("cuda", non_blocking=self.pinned)
        torch.cuda.synchronize()
        return None

    def get_many(self, indices):
        torch = self.torch
        for i in indices:
            t = self.dev.get(i)
            if t is None:
                raise RuntimeError(f"{self.name}: block {i} missing")
            self.dst[i].copy_(t, non_blocking=self.pinned)
        torch.cuda.synchronize()
        return None

    def clear(self) -> None:
        self.dev = {}

    def footprint(self) -> int | None:
        return sum(t.numel() for t in self.dev.values())

    def teardown(self) -> None:
        self.dev = {}
        if getattr(self, "registered", None):
            unregister_host(self.registered)
            self.registered = []
        if getattr(self, "torch", None) is not None:
            self.torch.cuda.empty_cache()


class TorchPinned(_TorchCopy):
    name = "torch-pinned"
    compare_to = "cascade-gpu-pinned"
    pinned = True
    description = (
        "torch .to('cuda') / .copy_() from host memory registered with cudaHostRegister, async"
    )


class TorchPageable(_TorchCopy):
    name = "torch-pageable"
    description = "torch .to('cuda') / .copy_() from pageable host memory"


ADAPTERS = [TorchPinned, TorchPageable]
