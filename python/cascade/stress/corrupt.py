"""Mode `corrupt`: damage a closed store's directory, reopen, read everything.

A file tier (FileBackend: the store's file tier on its own, with 64 KiB
segments so a directory has many; blocks of inline and page-aligned sizes,
some removed and re-put) is built, flushed and closed once. Each
trial copies that directory and applies several corruptions, each one of:

    flip          random bytes of a file XORed with random values
    zero_page     a 4 KiB page of a segment zeroed
    truncate      a segment cut at a random length
    dup_page      a page of one segment copied over a page of another
    swap_pages    two pages (of one or two segments) exchanged
    rm_summary    a segment's summary deleted (the reopen must scan it)
    bad_summary   a summary's bytes garbled, or the summary truncated
    other_file    bytes of another file of the directory garbled (lock, keys)
    plant         a valid-looking record image for another block, with bytes
                  that are not that block's, written inside a block's payload
                  (what a client controlling a block's bytes can do), with the
                  header pages of the host block and of the victim destroyed
                  and the summary deleted, so a resynchronising scan meets it

then a fresh process reopens the directory and reads every id: each read is
a miss or the exact bytes (`wrong` otherwise). A reopen that refuses the
damaged directory is counted (`refused`), a crash or hang is a failure.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
import time

import numpy as np

import cascade
from cascade import _core
from cascade.stress import proc
from cascade.stress.blocks import KeySpace
from cascade.stress.report import ModeResult

PAGE = 4096
RECORD_MAGIC = 0x52534143
INLINE_MAX = PAGE - 64
KINDS = [
    "flip",
    "zero_page",
    "truncate",
    "dup_page",
    "swap_pages",
    "rm_summary",
    "bad_summary",
    "other_file",
    "plant",
]


def _open(path: str, segment_bytes: int):
    return cascade.FileBackend(path, segment_size_bytes=segment_bytes, threads=2)


def build(ks: KeySpace, path: str, segment_bytes: int, seed: int) -> dict:
    rng = random.Random(seed)
    store = _open(path, segment_bytes)
    for k in range(ks.keys):
        store.put(ks.block_id(k), ks.array(k))
    removed = rng.sample(range(ks.keys), ks.keys // 8)
    for k in removed:
        store.remove(ks.block_id(k))
    for k in removed[: len(removed) // 2]:
        store.put(ks.block_id(k), ks.array(k))
    store.flush()
    store.close()
    return {"files": len(os.listdir(path))}


def read_all(ks: KeySpace, path: str, segment_bytes: int) -> dict:
    try:
        store = _open(path, segment_bytes)
    except cascade.CascadeError as e:
        return {"refused": f"{type(e).__name__}: {e}"}
    out = np.empty(ks.max_size, dtype=np.uint8)
    hits = misses = wrong = 0
    failures = []
    for k in range(ks.keys + 4):  # the last few were never stored
        found, size = store.get(ks.block_id(k), out)
        if not found:
            misses += 1
        elif k < ks.keys and ks.check(k, out, size):
            hits += 1
        else:
            hits += 1
            wrong += 1
            failures.append(ks.describe(k, out, size))
    store.close()
    return {"hits": hits, "misses": misses, "wrong": wrong, "failures": failures[:5]}


# ---- corruptions ---------------------------------------------------------------------------------
def _files(d: str):
    names = sorted(os.listdir(d))
    segs = [n for n in names if n.startswith("seg-") and n.endswith(".dat")]
    sums = [n for n in names if n.startswith("seg-") and n.endswith(".sum")]
    others = [n for n in names if n not in segs and n not in sums]
    return segs, sums, others


def _size(p: str) -> int:
    return os.path.getsize(p)


def _rw(p: str, off: int, data: bytes | None = None, n: int = 0) -> bytes:
    with open(p, "r+b") as f:
        f.seek(off)
        if data is None:
            return f.read(n)
        f.write(data)
        return b""


def records(p: str):
    """(offset, payload_length, id bytes) of the records found walking a segment."""
    with open(p, "rb") as f:
        data = f.read()
    out, off = [], 0
    while off + 64 <= len(data):
        (magic,) = struct.unpack_from("<I", data, off)
        if magic != RECORD_MAGIC:
            off += PAGE
            continue
        (plen,) = struct.unpack_from("<Q", data, off + 24)
        if plen >= 1 << 40:
            off += PAGE
            continue
        out.append((off, plen, data[off + 8 : off + 24]))
        off += PAGE if plen <= INLINE_MAX else PAGE + -(-plen // PAGE) * PAGE
    return out


def _plant(d: str, segs: list[str], rng: random.Random, ks: KeySpace) -> bool:
    seg = rng.choice(segs)
    p = os.path.join(d, seg)
    recs = records(p)
    hosts = [r for r in recs if r[1] > INLINE_MAX and r[1] >= 2 * PAGE]
    if not hosts:
        return False
    host_off, host_len, _ = rng.choice(hosts)
    pages = host_len // PAGE  # whole payload pages of the host
    victim = rng.randrange(ks.keys)
    vsize = ks.size(victim)
    need = 1 if vsize <= INLINE_MAX else 1 + -(-vsize // PAGE)
    if need > pages:
        victim = min(range(ks.keys), key=ks.size)
        vsize = ks.size(victim)
        need = 1 if vsize <= INLINE_MAX else 1 + -(-vsize // PAGE)
        if need > pages:
            return False
    at = host_off + PAGE + PAGE * rng.randrange(pages - need + 1)
    forged = bytes(rng.getrandbits(8) for _ in range(min(vsize, 64))) + os.urandom(
        max(0, vsize - 64)
    )
    seg_id = int(seg[4:20], 16)
    header = _core.stress_forge_record_header(ks.block_id(victim), forged, seg_id, at)
    image = header + (forged if vsize <= INLINE_MAX else b"\0" * (PAGE - 64) + forged)
    _rw(p, at, image)
    _rw(p, host_off, b"\0" * PAGE)  # the host's own header is lost: a scan looks inside its payload
    vid = bytes.fromhex(ks.block_id(victim))
    for other in segs:  # the victim's real record is lost too
        q = os.path.join(d, other)
        for off, _, rid in records(q):
            if rid == vid and not (q == p and off == at):
                _rw(q, off, b"\0" * 64)
    summary = os.path.join(d, seg[:-4] + ".sum")
    if os.path.exists(summary):
        os.unlink(summary)
    return True


def corrupt_once(d: str, kind: str, rng: random.Random, ks: KeySpace) -> bool:
    """Applies one corruption of `kind`; False when the directory offered nothing to damage."""
    segs, sums, others = _files(d)
    segs = [s for s in segs if _size(os.path.join(d, s)) > 0]
    if kind in ("zero_page", "truncate", "dup_page", "swap_pages", "plant", "flip") and not segs:
        return False
    if kind == "flip":
        p = os.path.join(d, rng.choice(segs + sums))
        n = _size(p)
        if n == 0:
            return False
        for _ in range(rng.randint(1, 8)):
            off = rng.randrange(n)
            byte = _rw(p, off, n=1)
            _rw(p, off, bytes([byte[0] ^ rng.randint(1, 255)]))
    elif kind == "zero_page":
        p = os.path.join(d, rng.choice(segs))
        n = _size(p)
        off = rng.randrange(max(1, n // PAGE)) * PAGE
        _rw(p, off, b"\0" * min(PAGE, n - off))
    elif kind == "truncate":
        p = os.path.join(d, rng.choice(segs))
        n = _size(p)
        cut = rng.randrange(n)
        os.truncate(p, cut - cut % PAGE if rng.random() < 0.5 else cut)
    elif kind in ("dup_page", "swap_pages"):
        a, b = os.path.join(d, rng.choice(segs)), os.path.join(d, rng.choice(segs))
        na, nb = _size(a) // PAGE, _size(b) // PAGE
        if not na or not nb:
            return False
        pa, pb = rng.randrange(na) * PAGE, rng.randrange(nb) * PAGE
        da = _rw(a, pa, n=PAGE)
        if kind == "swap_pages":
            db = _rw(b, pb, n=PAGE)
            _rw(a, pa, db)
        _rw(b, pb, da)
    elif kind == "rm_summary":
        if not sums:
            return False
        os.unlink(os.path.join(d, rng.choice(sums)))
    elif kind == "bad_summary":
        if not sums:
            return False
        p = os.path.join(d, rng.choice(sums))
        n = _size(p)
        r = rng.random()
        if r < 0.3 or n == 0:
            os.truncate(p, rng.randrange(n) if n else 0)
        elif r < 0.6:
            _rw(p, rng.randrange(n), os.urandom(rng.randint(1, 64)))
        else:
            off = rng.randrange(n)
            byte = _rw(p, off, n=1)
            _rw(p, off, bytes([byte[0] ^ (1 << rng.randrange(8))]))
    elif kind == "other_file":
        cands = [o for o in others if os.path.isfile(os.path.join(d, o))]
        if not cands:
            return False
        p = os.path.join(d, rng.choice(cands))
        n = _size(p)
        if n == 0:
            return False
        _rw(p, rng.randrange(n), os.urandom(rng.randint(1, 16)))
    elif kind == "plant":
        return _plant(d, segs, rng, ks)
    return True


def run(args, scratch, result: ModeResult) -> ModeResult:
    rng = random.Random(args.seed)
    ks = KeySpace(args.seed, args.corrupt_keys, 200, args.max_block)
    pristine = scratch.path("corrupt-pristine")
    seg_bytes = 64 << 10
    b = proc.run_child(
        lambda: build(ks, pristine, seg_bytes, args.seed), args.iteration_deadline * 4
    )
    if b.status != "ok":
        result.add(
            "crashes" if b.status == "crash" else "hangs" if b.status == "hang" else "exceptions"
        )
        result.fail(f"building the store failed: {b.status} {b.detail}")
        return result.finish()
    trial_dir = scratch.path("corrupt-trial")
    deadline = time.monotonic() + args.corrupt_seconds if args.corrupt_seconds else None
    trial = 0
    while (trial < args.trials) if deadline is None else (time.monotonic() < deadline):
        shutil.rmtree(trial_dir, ignore_errors=True)
        shutil.copytree(pristine, trial_dir)
        applied = []
        for _ in range(rng.randint(1, 2 * args.corruptions - 1)):
            kind = rng.choice(KINDS)
            if corrupt_once(trial_dir, kind, rng, ks):
                applied.append(kind)
                result.by_kind[kind] = result.by_kind.get(kind, 0) + 1
        result.add("corruptions", len(applied))
        r = proc.run_child(lambda: read_all(ks, trial_dir, seg_bytes), args.iteration_deadline)
        result.add("runs")
        trial += 1
        what = ",".join(sorted(set(applied)))
        if r.status == "ok":
            v = r.value
            if "refused" in v:
                result.add("refused")
                continue
            result.add("ops", v["hits"] + v["misses"])
            for k in ("hits", "misses", "wrong"):
                result.add(k, v[k])
            for f in v["failures"]:
                result.fail(f"trial {trial} ({what}): {f}")
        elif r.status == "crash":
            result.add("crashes")
            result.fail(f"trial {trial} ({what}): reopen/read crashed: {r.detail}")
        elif r.status == "hang":
            result.add("hangs")
            result.fail(f"trial {trial} ({what}): reopen/read hung")
        else:
            result.add("exceptions")
            result.fail(
                f"trial {trial} ({what}): "
                f"{r.detail.strip().splitlines()[-1] if r.detail else r.status}"
            )
    shutil.rmtree(trial_dir, ignore_errors=True)
    return result.finish()
