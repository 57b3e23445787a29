"""Every bad input the core issue lists: a clear error or a documented
behaviour, never a crash, never a lost block."""

import numpy as np
import pytest

import cascade
from random_data import random_bytes


def test_wrong_types(store):
    with pytest.raises(TypeError, match="block key"):
        store.put(12345, b"x")
    with pytest.raises(TypeError, match="must be a contiguous buffer"):
        store.put("k", 3.14)
    with pytest.raises(TypeError, match="must be a contiguous buffer"):
        store.put("k", [1, 2, 3])
    with pytest.raises(TypeError, match="read-only"):
        store.get("k", b"immutable bytes")


def test_batch_keys_must_be_ordered(store):
    # A set's order is not the caller's: pairing it with a list of buffers
    # would store blocks under the wrong keys.
    keys = {"k1", "k2", "k3"}
    with pytest.raises(TypeError):
        store.put_batch(keys, [b"1", b"2", b"3"])
    with pytest.raises(TypeError):
        store.get_batch(keys, [bytearray(1) for _ in range(3)])
    with pytest.raises(TypeError):
        store.contains_batch(iter(["k1", "k2"]))
    assert store.contains_batch(["k1", "k2", "k3"]) == [False, False, False]
    # Tuples, lists and other indexable sequences pair up in order.
    assert store.put_batch(("k1", "k2"), [b"1", b"2"]) == 2
    assert store.put_batch(np.array(["k3"]), [b"3"]) == 1
    assert [store.get(k) for k in ("k1", "k2", "k3")] == [b"1", b"2", b"3"]


def test_empty_and_huge_keys(store):
    with pytest.raises(ValueError, match="empty"):
        store.put("", b"x")
    huge = "k" * (1 << 20)  # documented: any non-empty key is hashed to an id
    assert store.put(huge, b"v")
    assert store.get(huge) == b"v"


def test_out_buffer_too_small_writes_nothing(store):
    data = random_bytes(10_000, 1)
    store.put("blk", data)
    out = np.full(20_000, 0x5A, dtype=np.uint8)
    with pytest.raises(cascade.BufferTooSmallError) as e:
        store.get("blk", out[:9_999])
    assert e.value.needed == 10_000
    assert isinstance(e.value, ValueError)
    assert (out == 0x5A).all()  # nothing written, not even inside the view
    assert store.get("blk", out) == (True, 10_000)


def test_get_batch_small_buffer_reports_size(store):
    store.put("blk", random_bytes(5000, 2))
    small = np.zeros(10, np.uint8)
    count, sizes = store.get_batch(["blk"], [small])
    assert count == 0 and sizes == [5000]
    assert not small.any()


def test_capacity_zero_and_larger_than_shm(make_config):
    with pytest.raises(ValueError, match="shm_capacity_bytes is 0"):
        cascade.CascadeStore(make_config(capacity=0))
    with pytest.raises(ValueError, match="larger than the free space"):
        cascade.CascadeStore(make_config(capacity=1 << 50))


def test_block_larger_than_tier(make_config):
    with cascade.CascadeStore(make_config(capacity=1 << 20)) as store:
        store.put("keep", b"precious")
        with pytest.raises(ValueError, match="larger than every tier"):
            store.put("big", random_bytes((1 << 20) + 1))
        assert store.get("keep") == b"precious"


def test_second_store_on_same_path_is_refused(make_config):
    cfg = make_config()
    with cascade.CascadeStore(cfg) as first:
        first.put("mine", b"data")
        with pytest.raises(cascade.BusyError, match="in use"):
            cascade.CascadeStore(cfg)
        assert first.get("mine") == b"data"  # the first store is untouched


def test_missing_shm_directory(make_config):
    cfg = make_config()
    cfg.shm_path = "/nonexistent-dir/cascade"
    with pytest.raises(cascade.CascadeError, match="nonexistent-dir"):
        cascade.CascadeStore(cfg)


def test_all_blocks_leased_means_put_returns_false(make_config):
    # The only way to pin blocks from Python today is a concurrent reader; a
    # full store whose blocks can all be evicted always accepts a put.
    with cascade.CascadeStore(make_config(capacity=128 << 10)) as store:
        assert store.put("a", random_bytes(64 << 10, 1))
        assert store.put("b", random_bytes(64 << 10, 2))
        assert store.put("c", random_bytes(64 << 10, 3))  # evicts a
        assert store.get_stats()["evictions"] >= 1


def test_bad_config_values():
    with pytest.raises(ValueError, match="unknown CascadeConfig option"):
        cascade.load_config({"shm_capacity": 10})
    with pytest.raises(ValueError, match="cannot read"):
        cascade.load_config({"shm_capacity_bytes": "lots"})
    with pytest.raises(ValueError, match="not one of"):
        cascade.load_config({"eviction_policy": "random"})
    with pytest.raises(ValueError, match="tiers must be ordered"):
        cascade.load_config({"pipeline": "file|host", "lustre_path": "/tmp"}).validate()
    with pytest.raises(cascade.NotSupportedError, match="compression"):
        cascade.load_config({"compression_enabled": True}).validate()
    with pytest.raises(ValueError, match="power of two"):
        cascade.load_config({"index_shards": 100}).validate()


def test_device_tensor_without_cuda_is_clear(store):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; covered by the GPU tests")
    meta = torch.empty(10, device="meta")
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        store.put("meta", meta)


def test_file_at_shm_path_that_is_not_an_arena_is_left_alone(make_config):
    cfg = make_config()
    with open(cfg.shm_path, "wb") as f:  # not ours: no arena header, mode 0644
        f.write(b"garbage")
    with pytest.raises(cascade.InvalidArgumentError, match="not a Cascade arena"):
        cascade.CascadeStore(cfg)
    with open(cfg.shm_path, "rb") as f:
        assert f.read() == b"garbage"


def test_buffers_of_python_objects_are_refused(store):
    # Their bytes are pointers: a get into one would corrupt the interpreter.
    objects = np.array([object(), "x"], dtype=object)
    with pytest.raises(TypeError, match="holds Python objects"):
        store.put("obj", objects)
    store.put("obj", b"\x01" * 16)
    with pytest.raises(TypeError, match="holds Python objects"):
        store.get("obj", objects)
    mixed = np.zeros(2, dtype=[("n", "i8"), ("o", "O")])
    with pytest.raises(TypeError, match="holds Python objects"):
        store.get("obj", mixed)
    assert store.get("obj") == b"\x01" * 16


def test_a_single_key_is_not_a_batch_of_characters(store):
    rows = np.zeros((32, 16), np.uint8)
    for keys in ("0123456789abcdef0123456789abcdef", b"key"):
        with pytest.raises(TypeError, match="not a single str or bytes"):
            store.put_batch(keys, rows)
        with pytest.raises(TypeError, match="not a single str or bytes"):
            store.contains_batch(keys)
    assert not store.contains("0")


def test_one_buffer_for_a_batch_has_a_row_per_key(store):
    six_rows = np.zeros((6, 1024), np.uint8)
    with pytest.raises(ValueError, match="6 rows for 3 keys"):
        store.put_batch(["a", "b", "c"], six_rows)
    with pytest.raises(ValueError, match="6 rows for 3 keys"):
        store.get_batch(["a", "b", "c"], six_rows)
    assert store.put_batch(["a", "b", "c"], six_rows[:3]) == 3
    assert store.put_batch(["d", "e"], np.zeros(2048, np.uint8)) == 2  # 1-D: split evenly


def test_torch_views_whose_values_are_not_their_bytes_are_refused(store):
    torch = pytest.importorskip("torch")
    z = torch.tensor([1 + 2j, 3 + 4j])
    x = torch.tensor([1.0, 2.0])
    for view in (z.conj(), x._neg_view()):
        with pytest.raises(ValueError, match="would not export it through DLPack"):
            store.put("v", view)
    store.put("x", x)
    with pytest.raises(ValueError, match="would not export"):
        store.get("x", torch.zeros(2)._neg_view())
    store.put("y", x._neg_view().resolve_neg())  # resolved: its bytes are its values
    out = torch.zeros(2)
    assert store.get("y", out) == (True, 8) and out.tolist() == [-1.0, -2.0]


class _ReadOnlyDlpack:
    """A producer that exports through DLPack only, read-only (DLPack 1.0's flag)."""

    def __init__(self, array):
        self._a = array
        self._a.flags.writeable = False

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_a_read_only_dlpack_tensor_can_be_put_not_got_into(store):
    src = _ReadOnlyDlpack(np.arange(16, dtype=np.uint8))
    assert store.put("ro", src)
    assert store.get("ro") == bytes(range(16))
    with pytest.raises(TypeError, match="for writing"):
        store.get("ro", _ReadOnlyDlpack(np.zeros(16, np.uint8)))


def test_tensors_that_require_grad_are_read_but_not_written(store):
    torch = pytest.importorskip("torch")
    w = torch.nn.Parameter(torch.arange(4, dtype=torch.float32))
    assert store.put("w", w)
    assert store.put_batch(["w2"], [w]) == 1
    with pytest.raises(ValueError, match="requires grad"):
        store.get("w", torch.nn.Parameter(torch.zeros(4)))
    out = torch.zeros(4)
    assert store.get("w", out) == (True, 16) and out.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_one_key_takes_a_whole_buffer_of_rows(store):
    rows = np.arange(12, dtype=np.uint8).reshape(3, 4)
    assert store.put_batch(["one"], rows) == 1
    out = np.zeros((3, 4), np.uint8)
    assert store.get_batch(["one"], out)[0] == 1 and np.array_equal(out, rows)


def test_get_batch_into_a_destination_the_store_refuses_raises(store):
    """A lease's view (memory that holds stored blocks) as a destination is
    refused by get() and by get_batch() alike. Before, get_batch() answered
    as for a miss, every item of the batch a 0, the valid ones too."""
    torch = pytest.importorskip("torch")
    store.put("a", np.arange(100, dtype=np.uint8))
    store.put("b", np.full(100, 7, np.uint8))
    lease = store.acquire("a")
    view = torch.from_dlpack(lease)
    try:
        with pytest.raises(cascade.InvalidArgumentError, match="holds stored blocks"):
            store.get("b", view)
        with pytest.raises(cascade.InvalidArgumentError, match="holds stored blocks"):
            store.get_batch(["b", "a"], [view, np.zeros(100, np.uint8)])
        assert bytes(view.numpy()) == bytes(range(100))
    finally:
        del view
        lease.release()
    # A buffer too small is still reported through the sizes.
    n, sizes = store.get_batch(["b"], [np.zeros(10, np.uint8)])
    assert n == 0 and sizes == [100]


def test_a_released_lease_as_a_buffer_says_it_was_released(store):
    """A lease released, passed as data or as a destination: the error says
    why its export failed, not only that it failed."""
    store.put("a", np.arange(100, dtype=np.uint8))
    lease = store.acquire("a")
    assert store.put("copy", lease)  # a live lease is a buffer like any other
    lease.release()
    with pytest.raises(TypeError, match="data: .*the lease was released"):
        store.put("b", lease)
    with pytest.raises(TypeError, match="out: .*the lease was released"):
        store.get("a", lease)
    assert store.get("copy") == bytes(range(100))


@pytest.mark.parametrize(
    "name", ["num_io_threads", "index_shards", "pool_channels", "shm_table_slots"]
)
def test_a_bool_is_not_a_count(name):
    """`num_io_threads: yes` in a YAML file is True; before, it was taken as 1."""
    with pytest.raises(ValueError, match=name):
        cascade.config_from_dict({name: True})


@pytest.mark.parametrize("name", ["shm_path", "file_path"])
def test_a_path_with_a_nul_is_refused(name):
    """Before, the store took the path up to the NUL: another arena or
    directory than the one configured, and logs naming the configured one."""
    with pytest.raises(ValueError, match="NUL"):
        cascade.config_from_dict({name: "/tmp/cascade-nul\0.configured"})


def test_messages_name_what_was_given_and_stay_short():
    """Two names of one option with different values are both named (before:
    "file_path and file_path"), and an unknown option of 100 kB is not
    echoed whole."""
    with pytest.raises(ValueError, match="lustre_path and file_path name one option"):
        cascade.config_from_dict({"lustre_path": "/tmp/a", "file_path": "/tmp/b"})
    with pytest.raises(ValueError) as e:
        cascade.config_from_dict({"x" * 100_000: 1})
    assert len(str(e.value)) < 5_000


def test_inspect_of_a_missing_directory_prints_the_message_plain(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "cascade", "inspect", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert r.stderr.startswith("cascade inspect: ") and "'" not in r.stderr.split(": ", 1)[1][:1]


def test_inspect_of_a_directory_no_file_tier_wrote_says_so(tmp_path):
    # Before, any directory (/proc, a parent of the ranks' directories)
    # printed an empty table and OK, which reads as "its blocks are intact".
    import subprocess
    import sys

    def inspect(path):
        return subprocess.run(
            [sys.executable, "-m", "cascade", "inspect", str(path)], capture_output=True, text=True
        )

    other = tmp_path / "other"
    (other / "rank-0").mkdir(parents=True)
    (other / "rank-1").mkdir()
    (other / "notes.txt").write_text("x")
    r = inspect(other)
    assert r.returncode == 2
    assert "is not a file tier's directory" in r.stderr
    assert "rank-0, rank-1: inspect those" in r.stderr
    assert "OK" not in r.stdout

    empty = tmp_path / "empty"
    empty.mkdir()
    r = inspect(empty)
    assert r.returncode == 0
    assert "an empty directory" in r.stdout

    # A directory a file tier opened is inspected as before.
    tier = tmp_path / "tier"
    store = cascade.CascadeStore(
        cascade.config_from_dict(
            {"pipeline": "file", "file_path": str(tier), "file_capacity_bytes": 64 << 20}
        )
    )
    store.put(b"k" * 16, b"v" * 4096)
    store.close()
    r = inspect(tier)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("OK")
    assert "an empty directory" not in r.stdout
