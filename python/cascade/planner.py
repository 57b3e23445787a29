"""Load or compute: a cost model of the store's tiers and of the engine's
prefill, and the plan it gives for one prompt.

A prompt of n tokens has B full blocks; a lookup says which tier holds each
(`CascadeStore.locate_batch`). Loading a block costs its bytes over the rate
its tier reaches into the engine's memory; computing m tokens after a prefix
of p costs the engine's prefill time t(m, p). The planner compares:

- compute:            every token computed;
- load_prefix(k):     the first k blocks loaded, the rest computed. When the
                      loaded blocks come from memory tiers and the engine
                      loads layer by layer, the forward pass of layer l waits
                      only for layer l's KV, so the time is about the larger
                      of the two plus one layer's share of the other;
                      otherwise load, then compute;
- front_back(s):      the first s blocks computed while blocks s..H are
                      loaded (their ids chain the whole prefix, so their KV
                      is the KV this prompt's front produces), then the tokens
                      after them computed on top: max(compute front, load
                      back) + compute tail.

and returns the cheapest, with the predicted time of each part and a line a
person can read ("9,216 tokens from file at 1.4 GB/s, 7,168 computed;
predicted 612 ms"). Measurements feed it: each load's bytes and seconds by
tier (an exponentially weighted rate), each forward pass's (m, p, seconds)
(a least-squares fit of t(m, p) = c0 + c1*m + c2*m*(p + m/2), the last term
being attention over the prefix and the new tokens). Before the first
forward it uses a default rate in tokens per second.

Thread-safe: one lock around the model's state. Pure Python, no torch.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass, field

# Tiers whose blocks sit in memory the GPU can copy from while the forward
# pass runs (layer-by-layer overlap applies).
MEMORY_TIERS = ("gpu", "host", "pool", "node")


@dataclass
class TierRate:
    """The rate loads from one tier reach into the engine's memory."""

    gbps: float
    latency_s: float = 0.0
    samples: int = 0
    source: str = "default"  # default / probe / measured

    def seconds(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / (self.gbps * 1e9)


class PrefillModel:
    """t(m, p) = c0 + c1*m + c2*m*(p + m/2), fit by least squares over the
    most recent observations; a default rate until there are enough. A shape
    seen before is predicted by what it measured (an average of its recent
    steps), which a three-term fit over other shapes can miss by tens of
    percent."""

    SEEN_SMOOTHING = 0.5  # weight of a shape's newest step in its average
    SEEN_SHAPES = 1024  # shapes remembered, the least recently seen dropped first

    def __init__(self, default_tokens_per_s: float = 8000.0, window: int = 64):
        if default_tokens_per_s <= 0:
            raise ValueError("default_tokens_per_s must be positive")
        self.default_tokens_per_s = float(default_tokens_per_s)
        self.obs: collections.deque = collections.deque(maxlen=window)
        self.coef: tuple[float, float, float] | None = None
        self.seen: collections.OrderedDict = collections.OrderedDict()

    def observe(self, m: int, p: int, seconds: float) -> None:
        if m <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        self.obs.append((float(m), float(p), float(seconds)))
        self.coef = self._fit()
        key = (int(m), int(p))
        old = self.seen.pop(key, None)
        a = self.SEEN_SMOOTHING
        self.seen[key] = float(seconds) if old is None else a * seconds + (1 - a) * old
        while len(self.seen) > self.SEEN_SHAPES:
            self.seen.popitem(last=False)

    def _fit(self) -> tuple[float, float, float] | None:
        # Each row scaled by 1/t: relative errors, so a 30 ms step and a 2 s
        # step weigh alike.
        rows = [(1.0 / t, m / t, m * (p + m / 2.0) / t, 1.0) for m, p, t in self.obs]
        if not rows:
            return None
        shapes = {(m, p) for m, p, _ in self.obs}
        if len(shapes) < 3:
            # Too few distinct shapes for three coefficients: a rate per token
            # through the mean of what was seen.
            tokens = sum(m for m, _p, _t in self.obs)
            secs = sum(t for _m, _p, t in self.obs)
            return (0.0, secs / tokens, 0.0) if tokens > 0 else None
        # Normal equations of the 3-term least squares, solved by Gaussian
        # elimination; coefficients clamped at 0 (time never falls with work).
        a = [[0.0] * 3 for _ in range(3)]
        b = [0.0] * 3
        for *x, t in rows:
            for i in range(3):
                b[i] += x[i] * t
                for j in range(3):
                    a[i][j] += x[i] * x[j]
        sol = _solve3(a, b)
        tokens = sum(m for m, _p, _t in self.obs)
        per_token = (0.0, sum(t for _m, _p, t in self.obs) / tokens, 0.0)
        if sol is None or any(not math.isfinite(v) for v in sol):
            return per_token
        c0, c1, c2 = (max(0.0, v) for v in sol)
        if c1 == 0.0 and c2 == 0.0:
            return per_token
        return (c0, c1, c2)

    def predict(self, m: int, p: int = 0) -> float:
        if m <= 0:
            return 0.0
        seen = self.seen.get((int(m), int(p)))
        if seen is not None:
            return seen
        if self.coef is None:
            return m / self.default_tokens_per_s
        c0, c1, c2 = self.coef
        return c0 + c1 * m + c2 * m * (p + m / 2.0)


def _length_bucket(tokens: int) -> int:
    """The power of two nearest a prompt's length: the corrections learned
    at one length serve the lengths within a factor of about 1.4 of it."""
    return 1 << max(0, round(math.log2(max(1, tokens))))


def _kind_key(kind: str, layered: bool, tier: str = "") -> str:
    """The key of a correction: the plan's kind (a layered load is a kind of
    its own) and the slowest tier it loads from."""
    key = f"{kind} layered" if layered else kind
    return f"{key} from {tier}" if tier else key


def _solve3(a: list[list[float]], b: list[float]) -> list[float] | None:
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-30:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(3):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, 4):
                    m[r][c] -= f * m[col][c]
    return [m[i][3] / m[i][i] for i in range(3)]


@dataclass
class Plan:
    """What to do for one prompt (every row of a batch alike)."""

    kind: str  # compute / load_prefix / front_back
    tokens: int
    block_size: int
    load_first: int = 0  # first loaded block
    load_end: int = 0  # one past the last loaded block
    front_tokens: int = 0  # computed before the loaded blocks (front_back)
    tail_tokens: int = 0  # computed after them
    held_tokens: int = 0  # leading tokens the engine held already (neither loaded nor computed)
    bytes_by_tier: dict = field(default_factory=dict)
    layer_overlap: bool = False
    rows: int = 1  # prompts served together, every part scaled by them
    # seconds: load, compute, total; the learned correction in total (and its key)
    predicted: dict = field(default_factory=dict)
    alternatives: dict = field(default_factory=dict)  # kind -> predicted total seconds
    rates: dict = field(default_factory=dict)  # tier -> GB/s used

    @property
    def loaded_blocks(self) -> int:
        return self.load_end - self.load_first

    @property
    def loaded_tokens(self) -> int:
        """Tokens taken from loaded blocks (the last one may be used in part)."""
        return self.tokens - self.held_tokens - self.front_tokens - self.tail_tokens

    @property
    def computed_tokens(self) -> int:
        return self.front_tokens + self.tail_tokens

    def describe(self, measured_s: float | None = None) -> str:
        parts = []
        if self.held_tokens:
            parts.append(f"{self.held_tokens:,} held by the engine")
        if self.loaded_blocks:
            tiers = ", ".join(
                f"{b // max(1, self._bpt()):,} tokens from {t} at {_rate(self.rates.get(t, 0))}"
                for t, b in self.bytes_by_tier.items()
            )
            parts.append(tiers)
        if self.kind == "front_back":
            parts.append(f"the first {self.front_tokens:,} computed meanwhile")
            parts.append(f"{self.tail_tokens:,} after them")
        else:
            parts.append(f"{self.computed_tokens:,} computed")
        if self.layer_overlap and self.loaded_blocks:
            parts.append("layer by layer")
        line = "; ".join(parts) + f"; predicted {self.predicted.get('total', 0) * 1e3:.0f} ms"
        if measured_s is not None:
            line += f", measured {measured_s * 1e3:.0f} ms"
        return line

    def _bpt(self) -> int:
        tokens = self.loaded_tokens
        total = sum(self.bytes_by_tier.values())
        return total // tokens if tokens else 1


def _rate(gbps: float) -> str:
    return f"{gbps:.1f} GB/s" if gbps >= 0.1 else f"{gbps * 1e3:.1f} MB/s"


class LoadPlanner:
    """The cost model and the plans. `tiers` are the store's pipeline names
    (top first); bytes_per_token is the KV of one token on this engine rank;
    layers its layer count (the share of a layer-by-layer overlap)."""

    def __init__(
        self,
        tiers,
        bytes_per_token: int,
        layers: int,
        *,
        layer_overlap: bool = False,
        overlap_optional: bool = False,
        front_back: bool = True,
        default_tokens_per_s: float = 8000.0,
        rates: dict | None = None,
        smoothing: float = 0.3,
        traces: int = 256,
        chunk_tokens: int | None = None,
    ):
        """chunk_tokens: the engine computes a prompt in chunks of at most this
        many tokens, one forward pass each (chunked prefill); the compute time
        of m tokens is then the sum of its chunks'. None: one pass."""
        if bytes_per_token <= 0 or layers <= 0:
            raise ValueError("bytes_per_token and layers must be positive")
        if chunk_tokens is not None and chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        if not 0 < smoothing <= 1:
            raise ValueError("smoothing must be in (0, 1]")
        self.tiers = list(tiers)
        self.bytes_per_token = int(bytes_per_token)
        self.layers = int(layers)
        self.layer_overlap = layer_overlap
        # The engine carries out each plan's choice between a layer-by-layer
        # load and one load before the forward pass (the transformers prefix
        # cache does); otherwise every load from memory tiers is layered.
        self.overlap_optional = overlap_optional
        self.front_back = front_back
        self.smoothing = smoothing
        self.prefill = PrefillModel(default_tokens_per_s)
        defaults = {"gpu": 200.0, "host": 20.0, "pool": 20.0, "node": 20.0, "file": 1.0}
        self._mu = threading.Lock()
        self.rates = {t: TierRate(defaults.get(t, 1.0)) for t in self.tiers}
        for t, r in (rates or {}).items():
            self.set_rate(t, r)
        self.queued: collections.Counter = collections.Counter()  # tier -> bytes loading now
        self.trace: collections.deque = collections.deque(maxlen=traces)
        self.counts: collections.Counter = collections.Counter()  # plans by kind
        self.errors: list[float] = []  # |predicted - measured| / measured, recent
        # Per kind of plan (compute, load_prefix, load_prefix layered,
        # front_back): measured over predicted, averaged over the recorded
        # outcomes. What the parts' models miss when they run together (the
        # GIL, the GPU or the memory they share) shows up here, and the next
        # plans of that kind are predicted with it.
        self.correction: dict[str, float] = {}  # key -> seconds per prompt added

    # -- what it learns ---------------------------------------------------------------

    def set_rate(self, tier: str, gbps: float, latency_s: float = 0.0, source: str = "probe"):
        """A rate known before any load (a probe at open)."""
        if gbps <= 0:
            raise ValueError(f"rate of {tier}: must be positive, got {gbps}")
        with self._mu:
            self.rates[tier] = TierRate(float(gbps), float(latency_s), 0, source)

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """A load of nbytes from `tier` into the engine's memory took seconds."""
        if nbytes <= 0 or seconds <= 0:
            return
        gbps = nbytes / seconds / 1e9
        with self._mu:
            r = self.rates.setdefault(tier, TierRate(gbps))
            if r.samples == 0:
                r.gbps = gbps
            else:
                r.gbps = (1 - self.smoothing) * r.gbps + self.smoothing * gbps
            r.samples += 1
            r.source = "measured"

    def observe_prefill(self, new_tokens: int, prefix_tokens: int, seconds: float) -> None:
        with self._mu:
            self.prefill.observe(new_tokens, prefix_tokens, seconds)

    def loading(self, tier: str, nbytes: int):
        """Context manager: bytes being loaded from a tier (later plans wait behind them)."""
        planner = self

        class _Queued:
            def __enter__(self):
                with planner._mu:
                    planner.queued[tier] += nbytes

            def __exit__(self, *exc):
                with planner._mu:
                    planner.queued[tier] -= nbytes

        return _Queued()

    # -- the plan -----------------------------------------------------------------------

    def plan(
        self,
        tokens: int,
        block_size: int,
        where: list[int],
        rows: int = 1,
        computed_tokens: int = 0,
    ) -> Plan:
        """where[j]: the pipeline index of the tier holding block j (-1: a
        miss), for the prompt's full blocks; rows: prompts of this length
        served together (every part scales with them); computed_tokens: the
        leading tokens the engine already holds (a multiple of block_size:
        its own prefix cache), which cost nothing and are never loaded
        (their entries of where are not read). Loads only the leading hits."""
        if tokens <= 0 or block_size <= 0 or rows <= 0:
            raise ValueError("tokens, block_size and rows must be positive")
        if computed_tokens < 0 or computed_tokens % block_size or computed_tokens >= tokens:
            raise ValueError(
                f"computed_tokens {computed_tokens} must be a multiple of the block size "
                f"{block_size} below the prompt's {tokens} tokens"
            )
        have = computed_tokens // block_size
        hits = have
        for w in where[have:]:
            if w < 0 or w >= len(self.tiers):
                break
            hits += 1
        # The last token is always computed (its logits are the point); the
        # block holding it may still be loaded for the tokens before it.
        hits = max(have, min(hits, -(-(tokens - 1) // block_size)))
        idx = [0] * have + list(where[have:hits])
        with self._mu:
            return self._plan(tokens, block_size, idx, rows, have)

    def compute_seconds(self, m: int, p: int = 0) -> float:
        """Predicted time to compute m tokens after a prefix of p, chunk by chunk."""
        with self._mu:
            return self._compute(m, p)

    def _compute(self, m: int, p: int) -> float:
        # REQUIRES: self._mu held.
        c = self.chunk_tokens
        if c is None or m <= c:
            return self.prefill.predict(m, p)
        total = 0.0
        while m > 0:
            step = min(c, m)
            total += self.prefill.predict(step, p)
            m -= step
            p += step
        return total

    def _plan(self, tokens: int, bs: int, tier_idx: list[int], rows: int, have: int = 0) -> Plan:
        hits = len(tier_idx)
        bpb = self.bytes_per_token * bs * rows

        def pre(m: int, p: int) -> float:
            return rows * self._compute(m, p)

        # Prefix sums of load seconds, and the largest tier latency of every
        # leading and trailing run, so that every candidate is O(1).
        cum = [0.0]
        mem = [True]
        lat_head = [0.0]  # lat_head[k]: blocks [0, k)
        for j in range(hits):
            if j < have:  # in the engine already: nothing to load
                cum.append(0.0)
                mem.append(True)
                lat_head.append(0.0)
                continue
            t = self.tiers[tier_idx[j]]
            r = self.rates[t]
            cum.append(cum[-1] + bpb / (r.gbps * 1e9))
            mem.append(mem[-1] and t in MEMORY_TIERS)
            lat_head.append(max(lat_head[-1], r.latency_s))
        lat_tail = [0.0] * (hits + 1)  # lat_tail[s]: blocks [s, hits)
        for j in range(hits - 1, have - 1, -1):
            lat_tail[j] = max(lat_tail[j + 1], self.rates[self.tiers[tier_idx[j]]].latency_s)
        # The slowest tier (the highest pipeline index) of every leading and
        # trailing run: the tier a candidate's correction is kept under.
        slow_head = [-1]
        for j in range(hits):
            slow_head.append(max(slow_head[-1], tier_idx[j] if j >= have else -1))
        slow_tail = [-1] * (hits + 1)
        for j in range(hits - 1, -1, -1):
            slow_tail[j] = max(slow_tail[j + 1], tier_idx[j])
        wait = {t: q / (self.rates[t].gbps * 1e9) for t, q in self.queued.items() if q > 0}
        queued_s = max(wait.values(), default=0.0)

        corr = self.correction

        bucket = _length_bucket(tokens)

        def corrected(key: str, total: float) -> float:
            # The correction learned at this prompt length (none: the model
            # alone, so each kind of plan is tried at each length); never
            # below half the model's own figure, whatever was learned.
            c = corr.get(f"{key} @{bucket}", 0.0)
            return max(0.5 * total, total + rows * c)

        def key_of(kind: str, layered: bool, slowest: int) -> str:
            return _kind_key(kind, layered, self.tiers[slowest] if slowest >= 0 else "")

        done = have * bs  # tokens the engine holds already
        best = Plan(
            "compute",
            tokens,
            bs,
            load_first=have,
            load_end=have,
            tail_tokens=tokens - done,
            held_tokens=done,
        )
        full = corrected("compute", pre(tokens - done, done))
        best.predicted = {"load": 0.0, "compute": pre(tokens - done, done), "total": full}
        best_key, best_model = "compute", pre(tokens - done, done)
        alts = {"compute": best.predicted["total"]}
        L = self.layers

        def cached(k: int) -> int:
            return min(k * bs, tokens - 1)

        for k in range(have + 1, hits + 1):
            load = queued_s + lat_head[k] + cum[k]
            comp = pre(tokens - cached(k), cached(k))
            # Layer by layer the forward pass waits only for each layer's
            # KV; its fixed costs (a stream, an event per layer) can make a
            # short prompt slower than one load before the forward, so both
            # are weighed, each with what its own outcomes taught.
            if self.layer_overlap and mem[k]:
                ways = (True, False) if self.overlap_optional else (True,)
            else:
                ways = (False,)
            for overlap in ways:
                model = max(load + comp / L, comp + load / L) if overlap else load + comp
                ckey = key_of("load_prefix", overlap, slow_head[k])
                total = corrected(ckey, model)
                key = "load_prefix"
                if total < alts.get(key, math.inf):
                    alts[key] = total
                if total < best.predicted["total"]:
                    best_key, best_model = ckey, model
                    best = Plan(
                        "load_prefix",
                        tokens,
                        bs,
                        load_first=have,
                        load_end=k,
                        tail_tokens=tokens - cached(k),
                        held_tokens=done,
                        layer_overlap=overlap,
                    )
                    best.predicted = {"load": load, "compute": comp, "total": total}
        if self.front_back and hits >= 2 and have == 0:
            for s in range(1, hits):
                load = queued_s + lat_tail[s] + cum[hits] - cum[s]
                front = pre(s * bs, 0)
                tail = pre(tokens - cached(hits), cached(hits))
                ckey, model = key_of("front_back", False, slow_tail[s]), max(front, load) + tail
                total = corrected(ckey, model)
                if total < alts.get("front_back", math.inf):
                    alts["front_back"] = total
                if total < best.predicted["total"]:
                    best_key, best_model = ckey, model
                    best = Plan(
                        "front_back",
                        tokens,
                        bs,
                        load_first=s,
                        load_end=hits,
                        front_tokens=s * bs,
                        tail_tokens=tokens - cached(hits),
                    )
                    best.predicted = {"load": load, "compute": front + tail, "total": total}
        best.rows = rows
        best.predicted["correction"] = best.predicted["total"] - best_model
        best.predicted["correction_key"] = best_key
        best.predicted["correction_bucket"] = bucket
        # Whether an outcome of this kind of plan at this length had been
        # learned: a plan the model alone predicted is the planner trying it.
        best.predicted["learned"] = f"{best_key} @{bucket}" in corr
        by: dict = collections.Counter()
        for j in range(best.load_first, best.load_end):
            by[self.tiers[tier_idx[j]]] += bpb
        best.bytes_by_tier = dict(by)
        best.rates = {t: self.rates[t].gbps for t in by}
        best.alternatives = alts
        self.counts[best.kind] += 1
        return best

    def record(self, plan: Plan, measured_s: float, learn: bool = True, **phases) -> dict:
        """The outcome of a plan: kept in the trace (newest last) with the
        prediction, for metrics and for a person reading why. learn=False:
        an outcome other work shared (a batch of several requests) is kept
        but teaches the corrections nothing."""
        entry = {
            "time": time.time(),
            "kind": plan.kind,
            "tokens": plan.tokens,
            "loaded_tokens": plan.loaded_tokens,
            "computed_tokens": plan.computed_tokens,
            "predicted_s": plan.predicted.get("total", 0.0),
            "measured_s": measured_s,
            "phases_s": phases,
            "why": plan.describe(measured_s),
        }
        with self._mu:
            self.trace.append(entry)
            if measured_s > 0:
                self.errors.append(abs(entry["predicted_s"] - measured_s) / measured_s)
                del self.errors[:-256]
                if learn:
                    self._correct(plan, measured_s)
        return entry

    CORRECTION_SMOOTHING = 0.3  # weight of the newest outcome

    def _correct(self, plan: Plan, measured_s: float) -> None:
        # REQUIRES: self._mu held.
        predicted = plan.predicted.get("total", 0.0)
        key = plan.predicted.get("correction_key")
        if predicted <= 0 or key is None or not math.isfinite(measured_s):
            return
        rows = max(1, plan.rows)
        # What the model alone predicted, per prompt, and what it missed by.
        model = (predicted - plan.predicted.get("correction", 0.0)) / rows
        missed = measured_s / rows - model
        a = self.CORRECTION_SMOOTHING
        # Kept for the kind of plan at this prompt length; a key's first
        # outcome is taken whole.
        bucket = plan.predicted.get("correction_bucket")
        if bucket is not None:
            key = f"{key} @{bucket}"
        old = self.correction.get(key)
        self.correction[key] = missed if old is None else a * missed + (1 - a) * old

    def stats(self) -> dict:
        """Rates, the prefill fit, plan counts and the recent prediction error."""
        with self._mu:
            return {
                "rates": {
                    t: {
                        "gbps": r.gbps,
                        "latency_s": r.latency_s,
                        "samples": r.samples,
                        "source": r.source,
                    }
                    for t, r in self.rates.items()
                },
                "prefill_coef": self.prefill.coef,
                "prefill_samples": len(self.prefill.obs),
                "plans": dict(self.counts),
                "correction": dict(self.correction),
                "mean_abs_error": (sum(self.errors) / len(self.errors)) if self.errors else None,
            }
