"""`cascade bench compare`: Cascade side by side with its peers on the same
work — N blocks of S bytes of seeded random data, T threads — with the
hardware ceiling measured in the same run.

Workloads
- sizes:    block sizes 64 KiB .. 512 MiB; write, hot read, cold read (page
            cache dropped), per-block latency, ratio to the ceiling.
- threads:  the same at 1..cores threads (one block size).
- overflow: Cascade host|file with 0/50/75/90 % of the data beyond the host
            tier's capacity, cold reads, against peers that keep it on disk.
- prefix:   many conversations sharing a few system prompts; bytes stored
            (dedup ratio) with ids named per request and with prefix-chained ids.

Ceilings (measured just before and again just after each workload step, the
better kept): host copy (`memcpy_bandwidth`: the better of memcpy and a
streaming copy, same threads) for memory rows and hot reads from the page
cache; sequential write/read of the same directory (16 MiB requests,
max(4, threads) streams, O_DIRECT and buffered+fdatasync with the page cache
dropped, the better of the two) for file rows; cudaMemcpy from pinned memory
for GPU rows.

Every row's bytes are checked against what was written. A system that cannot
run here is listed with the reason; a row that fails records the error and
the run goes on.

Files: buffers (the shared data and out arrays, the byte check), ceilings,
measure (one system on one workload; ratios and speedups), workloads (the
four workloads and the report they fill), report (tables and Markdown),
command (flags and main).
"""

from cascade.bench.compare.buffers import SharedArrays
from cascade.bench.compare.ceilings import (
    CEILING_MIN_BYTES,
    FILE_CEILING_MIN_BYTES,
    Ceilings,
    file_ceiling,
    gpu_ceiling,
    memcpy_ceiling,
)
from cascade.bench.compare.command import (
    DEFAULT_SIZES,
    WORKLOADS,
    add_arguments,
    list_systems,
    main,
    normalise_args,
)
from cascade.bench.compare.measure import _annotate, measure
from cascade.bench.compare.report import format_markdown, format_report, prefix_table, rows_table
from cascade.bench.compare.workloads import Runner, _keys, run_compare

__all__ = [
    "CEILING_MIN_BYTES",
    "DEFAULT_SIZES",
    "FILE_CEILING_MIN_BYTES",
    "WORKLOADS",
    "Ceilings",
    "Runner",
    "SharedArrays",
    "_annotate",
    "_keys",
    "add_arguments",
    "file_ceiling",
    "format_markdown",
    "format_report",
    "gpu_ceiling",
    "list_systems",
    "main",
    "measure",
    "memcpy_ceiling",
    "normalise_args",
    "prefix_table",
    "rows_table",
    "run_compare",
]
