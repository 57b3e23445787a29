"""How the binding takes DLPack producers that report CUDA memory: it asks
them to export for the legacy default stream (DLPack stream 1) once per GPU
and batch, falls back to a plain import where a producer takes no stream or
refuses one, and keeps what it imported alive for as long as a batch runs.

The producers here report a CUDA device but hand out numpy's capsule (host
memory), so these paths run without a GPU; the store then sees host buffers."""

import gc

import numpy as np
import pytest


class ClaimsCuda:
    """A producer that says its memory is on GPU 0 and records the `stream`
    of every export. takes_stream=False: its __dlpack__ takes no stream
    (TypeError); refuse: an exception to raise when a stream is asked for."""

    def __init__(self, arr: np.ndarray, takes_stream: bool = True, refuse=None):
        self.arr = arr
        self.takes_stream = takes_stream
        self.refuse = refuse
        self.streams: list = []

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kw):
        if "stream" in kw:
            if not self.takes_stream:
                raise TypeError("__dlpack__() got an unexpected keyword argument 'stream'")
            if self.refuse is not None:
                raise self.refuse
        self.streams.append(kw.get("stream"))
        return self.arr.__dlpack__(**{k: v for k, v in kw.items() if k != "stream"})


def block(seed: int, n: int = 8192) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_a_cuda_producer_is_exported_for_the_default_stream(store):
    p = ClaimsCuda(block(1))
    assert store.put("a", p)
    assert p.streams == [1]
    assert store.get("a") == block(1).tobytes()


def test_one_export_for_the_stream_per_gpu_and_batch(store):
    producers = [ClaimsCuda(block(10 + i)) for i in range(4)]
    assert store.put_batch([f"b{i}" for i in range(4)], producers) == 4
    assert [p.streams for p in producers] == [[1], [None], [None], [None]]
    for i in range(4):
        assert store.get(f"b{i}") == block(10 + i).tobytes()


@pytest.mark.parametrize("how", ["no stream argument", "stream refused"])
def test_a_producer_that_will_not_take_a_stream_is_imported_as_it_is(store, how):
    arr = block(2)
    if how == "no stream argument":
        p = ClaimsCuda(arr, takes_stream=False)
    else:
        p = ClaimsCuda(arr, refuse=BufferError("another device than the current one"))
    assert store.put("c", p)
    assert p.streams == [None]  # the plain import
    assert store.get("c") == arr.tobytes()


def test_other_errors_of_the_export_are_raised(store):
    p = ClaimsCuda(block(3), refuse=RuntimeError("the producer is broken"))
    with pytest.raises(RuntimeError, match="the producer is broken"):
        store.put("d", p)
    assert not store.contains("d")


def test_an_async_batch_keeps_what_it_imported_alive(store):
    # The caller drops every reference to its buffers while the batch runs:
    # the imported capsules keep the bytes.
    n = 64
    producers = [ClaimsCuda(block(100 + i, 65536)) for i in range(n)]
    handle = store.put_batch_async([f"e{i}" for i in range(n)], producers)
    del producers
    gc.collect()
    assert handle.wait() == n
    outs = [ClaimsCuda(np.zeros(65536, dtype=np.uint8)) for _ in range(n)]
    views = [o.arr for o in outs]
    got = store.get_batch_async([f"e{i}" for i in range(n)], outs)
    del outs
    gc.collect()
    found, sizes = got.wait()
    assert found == n and sizes == [65536] * n
    for i in range(n):
        assert np.array_equal(views[i], block(100 + i, 65536)), i


def test_one_buffer_of_rows_from_a_cuda_producer(store):
    rows = np.stack([block(200 + i) for i in range(8)])
    p = ClaimsCuda(rows)
    assert store.put_batch([f"f{i}" for i in range(8)], p) == 8
    assert p.streams == [1]
    out = ClaimsCuda(np.zeros_like(rows))
    found, _ = store.get_batch([f"f{i}" for i in range(8)], out)
    assert found == 8 and np.array_equal(out.arr, rows)
