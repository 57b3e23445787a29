"""`cascade bench ttft`: time to first token with and without Cascade.

A Llama-architecture model with random weights (built from a config, nothing
downloaded: a tiny one on CPU, Llama-3-8B-shaped in bf16 on a GPU) serves
prompts of several lengths at several concurrencies: c prompts arrive
together and are served first come first served, as many per forward as fit
a token budget and the GPU memory left for their KV; a prompt's time to
first token is the time until its group's last-token logits exist. Modes:

- full:    full prefill, no store (the baseline, and the reference logits);
- hot:     the prefix loaded from the host tier (shared-memory arena);
- cold:    the prefix loaded from the file tier, cold: a new store opened on
           the directory (empty host tier), O_DIRECT reads, the files' pages
           dropped first;
- hot80 / cold80: at most 80% of each prompt (whole blocks) from the store,
           the rest computed.

Every cached run is checked against the full prefill: prompt 0's loaded KV
bytes equal to the KV the prefill computed, last-token logits within the
dtype's tolerance, and the same greedy next token (a differing token is always
listed; it fails unless the reference nearly ties there). A failure is
printed loudly and the command exits with status 1. Beside it, in the same
run: the pinned host-to-device copy bandwidth (the PCIe ceiling) and, for
single-prompt rows, the time to prefill the uncached suffix with the prefix
already resident on the GPU; the goal ratio is
TTFT_cached / (KV bytes / link ceiling + that suffix time), the link being
PCIe for the host tier and the slower of PCIe and the directory's O_DIRECT
read (measured at start) for the file tier.

Timed regions hold only serving: warm-ups, stores (the KV of each prompt is
saved after its full-prefill group) and checks are untimed. A row costs about
one full prefill per repeat, the saves and the file writes; rows that do not
fit the host or file budget, or the GPU memory, or start after --time-limit,
say so instead of running.

Files: command (flags and main), settings (flags resolved: device, dtype,
lengths, budgets), model (the random-weight Llama), ceilings (PCIe and
the file tier's O_DIRECT read), stores (the store behind each mode), serving (first come first
served groups and their TTFT), checks (cached output against the full
prefill), runner (every row, every mode), report (the table and the goal).
"""

from cascade.bench.ttft.checks import NEAR_TIE_ULPS, compare_logits, failures, greedy_mismatches
from cascade.bench.ttft.command import add_ttft_arguments, main
from cascade.bench.ttft.model import PRESETS, build_model
from cascade.bench.ttft.report import format_report, goal_rows
from cascade.bench.ttft.runner import TtftBench
from cascade.bench.ttft.serving import schedule
from cascade.bench.ttft.settings import MODES, GiB

__all__ = [
    "GiB",
    "MODES",
    "NEAR_TIE_ULPS",
    "PRESETS",
    "TtftBench",
    "add_ttft_arguments",
    "build_model",
    "compare_logits",
    "failures",
    "format_report",
    "goal_rows",
    "greedy_mismatches",
    "main",
    "schedule",
]
