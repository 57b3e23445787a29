"""Results of the stress modes: counts, failures, the summary table, JSON."""

from __future__ import annotations

import json
import time

# Counts that make a run fail when non-zero.
FAILING = ("wrong", "lost", "crashes", "hangs", "exceptions", "reopen_failures")
# Columns of the summary table, in order (mode-specific counts follow).
COLUMNS = (
    "runs",
    "ops",
    "hits",
    "misses",
    "wrong",
    "lost",
    "crashes",
    "hangs",
    "errors",
    "seconds",
)


class ModeResult:
    """What one mode did and found."""

    def __init__(self, mode: str):
        self.mode = mode
        self.counts: dict[str, float] = {}
        self.by_kind: dict[str, int] = {}  # ops (or corruptions, fault kinds) by kind
        self.errors: dict[
            str, int
        ] = {}  # store errors by exception class (expected under pressure)
        self.failures: list[str] = []  # described, first ones kept
        self.started = time.monotonic()
        self.seconds = 0.0
        for k in (
            "runs",
            "ops",
            "hits",
            "misses",
            "wrong",
            "lost",
            "crashes",
            "hangs",
            "exceptions",
        ):
            self.counts[k] = 0

    def add(self, key: str, n: float = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def merge_counts(self, counts: dict, prefix: str = "") -> None:
        for k, v in counts.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.add(prefix + k, v)

    def merge_dict(self, target: dict, counts: dict) -> None:
        for k, v in counts.items():
            target[k] = target.get(k, 0) + v

    def fail(self, text: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(text)

    def finish(self) -> ModeResult:
        self.seconds = time.monotonic() - self.started
        return self

    @property
    def ok(self) -> bool:
        return all(self.counts.get(k, 0) == 0 for k in FAILING)

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "counts": self.counts,
            "by_kind": self.by_kind,
            "errors": self.errors,
            "failures": self.failures,
        }


def format_summary(results: list[ModeResult]) -> str:
    head = ["mode"] + list(COLUMNS) + ["result"]
    rows = []
    for r in results:
        row = [r.mode]
        for c in COLUMNS:
            if c == "seconds":
                row.append(f"{r.seconds:.1f}")
            elif c == "errors":
                row.append(str(sum(r.errors.values())))
            else:
                row.append(str(r.counts.get(c, 0)))
        row.append("ok" if r.ok else "FAIL")
        rows.append(row)
    widths = [
        max(len(h), *(len(x[i]) for x in rows)) if rows else len(h) for i, h in enumerate(head)
    ]
    lines = [
        "  ".join(h.rjust(w) for h, w in zip(head, widths)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in rows]
    out = ["cascade stress: summary", *lines]
    for r in results:
        extra = {
            k: v
            for k, v in r.counts.items()
            if k not in COLUMNS and k != "exceptions" or (k == "exceptions" and v)
        }
        out.append("")
        out.append(f"[{r.mode}] " + ", ".join(f"{k}={v}" for k, v in sorted(extra.items())))
        if r.by_kind:
            out.append(
                f"[{r.mode}] by kind: "
                + ", ".join(f"{k}={v}" for k, v in sorted(r.by_kind.items()))
            )
        if r.errors:
            out.append(
                f"[{r.mode}] store errors (expected under pressure, not failures): "
                + ", ".join(f"{k}={v}" for k, v in sorted(r.errors.items()))
            )
        for f in r.failures[:12]:
            out.append(f"[{r.mode}] FAILURE: {f}")
        if len(r.failures) > 12:
            out.append(f"[{r.mode}] ... {len(r.failures) - 12} more failures (see --json)")
    return "\n".join(out)


def write_json(path: str, results: list[ModeResult], argv: list[str]) -> None:
    with open(path, "w") as f:
        json.dump(
            {
                "argv": argv,
                "ok": all(r.ok for r in results),
                "modes": [r.to_json() for r in results],
            },
            f,
            indent=2,
        )
