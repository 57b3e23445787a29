"""Benchmark harness behind `cascade bench`.

Every benchmark measures its hardware ceiling in the same run (multi-threaded
memcpy for host memory, raw O_DIRECT for files, cudaMemcpy for PCIe) and
reports the ratio, because these machines are noisy and a GB/s figure alone
says little. Results are plain dicts, printed as tables and written as JSON.
"""

from cascade.bench.common import Progress, format_table, parse_size_arg, timed  # noqa: F401
