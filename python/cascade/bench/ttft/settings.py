"""The flags of `cascade bench ttft` resolved into the run's settings: device
and dtype, prompt lengths and concurrencies, modes, token budget, and the
host and file budgets (--quick fills in a seconds-long CPU run)."""

from __future__ import annotations

MODES = ("full", "hot", "cold", "hot80", "cold80", "auto", "coldauto")
GiB = 1 << 30


def _int_list(text: str, what: str) -> list[int]:
    out = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1
        if part.endswith("k"):
            part, mult = part[:-1], 1024
        if not part.isdigit() or int(part) <= 0:
            raise ValueError(f"{what}: expected positive integers, got {text!r}")
        out.append(int(part) * mult)
    if not out:
        raise ValueError(f"{what}: empty")
    return out


def _resolve(args):
    import torch

    from cascade.config import parse_size

    if args.quick:
        args.device = "cpu" if args.device == "auto" else args.device
        args.model = "tiny" if args.model == "auto" else args.model
        args.lengths = args.lengths or "256,512"
        args.concurrency = args.concurrency or "1,2"
        args.block_size = 64 if args.block_size == 256 else args.block_size
        args.token_budget = args.token_budget or 512
        args.repeats = 1
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch has no usable CUDA device here")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device}: cpu or cuda")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    gpu = device.type == "cuda"
    if args.model == "auto":
        args.model = "llama3-8b" if gpu else "tiny"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if gpu else "float32"
    dtype = getattr(torch, args.dtype)
    lengths = _int_list(
        args.lengths or ("4096,8192,16384,32768" if gpu else "1024,2048,4096"), "--lengths"
    )
    conc = _int_list(args.concurrency or ("1,8,16" if gpu else "1,4"), "--concurrency")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise ValueError(f"--modes: unknown mode {m!r} (one of {', '.join(MODES)})")
    modes = ["full"] + [m for m in MODES[1:] if m in modes]
    if not 0 < args.hit_ratio < 1:
        raise ValueError(f"--hit-ratio must be in (0, 1), got {args.hit_ratio}")
    if args.block_size <= 0:
        raise ValueError("--block-size must be positive")
    if args.repeats <= 0:
        raise ValueError("--repeats must be positive")
    budget = args.token_budget or (16384 if gpu else 4096)
    if budget <= 0:
        raise ValueError("--token-budget must be positive")
    host_budget = (
        int(0.6 * _available_memory())
        if args.host_budget == "auto"
        else parse_size(args.host_budget, "--host-budget")
    )
    file_budget = parse_size(args.file_budget, "--file-budget")
    return dict(
        device=device,
        gpu=gpu,
        dtype=dtype,
        lengths=lengths,
        concurrency=conc,
        modes=modes,
        budget=budget,
        host_budget=host_budget,
        file_budget=file_budget,
    )


def _available_memory() -> int:
    from cascade.machine import _meminfo

    return _meminfo().get("MemAvailable") or 8 * GiB
