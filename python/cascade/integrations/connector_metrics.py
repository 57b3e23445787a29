"""The connector's counters (per step, summed over workers, exported to
Prometheus) and its optional JSON-lines trace of each step."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger("cascade.integrations.connector")


# ---------------------------------------------------------------------------
# Metrics and traces

# Counter keys, what they count, and their Prometheus names (prefix added).
COUNTERS = {
    "lookup_requests": ("lookup_requests_total", "Requests looked up in Cascade when scheduled"),
    "lookup_tokens": (
        "lookup_tokens_total",
        "Prompt tokens looked up in Cascade (beyond vLLM's own prefix cache)",
    ),
    "hit_tokens": (
        "hit_tokens_total",
        "Prompt tokens found in Cascade (in lite mode: that would have been loaded)",
    ),
    "miss_tokens": ("miss_tokens_total", "Prompt tokens looked up and not found in Cascade"),
    "load_blocks": ("load_blocks_total", "Blocks loaded into the engine's pages"),
    "load_bytes": ("load_bytes_total", "Bytes loaded into the engine's pages"),
    "load_errors": ("load_errors_total", "Blocks that failed to load (recomputed by the engine)"),
    "load_seconds": (
        "load_seconds_total",
        "Seconds the workers spent loading blocks into pages (summed over workers)",
    ),
    "plan_skipped_tokens": (
        "plan_skipped_tokens_total",
        "Tokens found in Cascade that the load-or-compute plan computed instead of loading",
    ),
    "save_blocks": ("save_blocks_total", "Blocks saved into Cascade"),
    "save_bytes": ("save_bytes_total", "Bytes saved into Cascade"),
    "save_present_blocks": (
        "save_present_blocks_total",
        "Blocks not saved because Cascade already held them",
    ),
    "save_errors": ("save_errors_total", "Blocks that failed to save (a later miss, nothing more)"),
    "save_dropped_blocks": (
        "save_dropped_blocks_total",
        "Blocks not saved because a load of their request failed in the same step",
    ),
}
# Per tier, labelled ``tier``: keys "tier_hits:<tier>" and "tier_misses:<tier>".
TIER_COUNTERS = {
    "tier_hits:": ("tier_hits_total", "Store hits per tier while loading blocks"),
    "tier_misses:": (
        "tier_misses_total",
        "Store misses per tier while loading blocks (looked for lower down)",
    ),
}


class ConnectorMetrics:
    """Thread-safe counters: ``take()`` returns and clears what accrued since the last take."""

    def __init__(self):
        self._lock = threading.Lock()
        self._delta: dict[str, float] = defaultdict(float)
        self.totals: dict[str, float] = defaultdict(float)

    def add(self, key: str, value: float = 1) -> None:
        if not value:
            return
        with self._lock:
            self._delta[key] += value
            self.totals[key] += value

    def add_tier(self, kind: str, tier: str, value: int) -> None:
        """``kind``: "hits" or "misses"."""
        self.add(f"tier_{kind}:{tier}", value)

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self._delta = dict(self._delta), defaultdict(float)
        return out


def merge_counters(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


class PrometheusCounters:
    """Prometheus counters for ``ConnectorMetrics.take()`` dicts.

    ``counter_cls`` is prometheus_client's Counter or a wrapper of it (vLLM
    hands its own to connectors); ``labelnames``/``labelvalues`` tell engines
    apart. Names are ``<prefix><name>``.
    """

    def __init__(self, counter_cls, labelnames: Sequence[str] = (), prefix: str = "cascade_"):
        self._labelnames = list(labelnames)
        self._counters = {
            key: counter_cls(name=prefix + name, documentation=doc, labelnames=self._labelnames)
            for key, (name, doc) in COUNTERS.items()
        }
        self._tiers = {
            key: counter_cls(
                name=prefix + name, documentation=doc, labelnames=self._labelnames + ["tier"]
            )
            for key, (name, doc) in TIER_COUNTERS.items()
        }

    def observe(self, data: Mapping[str, float], labelvalues: Sequence[Any] = ()) -> None:
        labels = [str(v) for v in labelvalues]
        for key, value in data.items():
            if value <= 0:
                continue
            kind, sep, tier = key.partition(":")
            if sep and kind + sep in self._tiers:
                self._child(self._tiers[kind + sep], labels + [tier]).inc(value)
            elif key in self._counters:
                self._child(self._counters[key], labels).inc(value)

    @staticmethod
    def _child(counter, labels):
        return counter.labels(*labels) if labels else counter


class TraceRecorder:
    """Appends one JSON line per event to a file shared by every process.

    Each line is written with one ``write`` on an O_APPEND descriptor, so
    lines of different processes do not interleave.
    """

    def __init__(self, path: str | None, role: str):
        self.role = role
        self.path = path
        self._fd = None
        if path:
            parent = os.path.dirname(os.path.abspath(path))
            os.makedirs(parent, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._host = socket.gethostname()

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def record(
        self, op: str, request_id: str, *, blocks: int, bytes: int = 0, ms: float = 0.0, **extra
    ) -> None:
        if self._fd is None:
            return
        line = {
            "ts": round(time.time(), 6),
            "host": self._host,
            "pid": os.getpid(),
            "role": self.role,
            "op": op,
            "request_id": request_id,
            "blocks": blocks,
            "bytes": bytes,
            "ms": round(ms, 3),
        }
        line.update(extra)
        try:
            os.write(self._fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())
        except OSError as e:  # a full disk must not stop inference
            logger.warning("Cascade trace %s: %s; tracing stops", self.path, e)
            self.close()

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
