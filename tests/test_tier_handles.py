"""One tier used on its own: TierHandle and its named subclasses (HostBackend,
FileBackend, GPUBackend, and the older names ShmBackend, LustreBackend) answer
with one rule; the file tier's options answer to file_* and lustre_* names."""

import os

import numpy as np
import pytest

import cascade
from random_data import random_bytes

GPU = bool(cascade.HAVE_CUDA) and cascade.gpu_usable(0)
MiB = 1 << 20


def _config(shm_path, tmp_path):
    cfg = cascade.CascadeConfig()
    cfg.shm_capacity_bytes = 16 * MiB
    cfg.shm_path = shm_path
    cfg.file_path = str(tmp_path / "tier")
    cfg.gpu_capacity_bytes = 64 * MiB
    cfg.num_io_threads = 2
    return cfg


# name -> (tier kind, opener(shm_path, tmp_path))
OPENERS = {
    "ShmBackend": ("host", lambda shm, tmp: cascade.ShmBackend(16 * MiB, shm, threads=2)),
    "HostBackend": ("host", lambda shm, tmp: cascade.HostBackend(16 * MiB, path=shm, threads=2)),
    "LustreBackend": ("file", lambda shm, tmp: cascade.LustreBackend(str(tmp / "d"), threads=2)),
    "FileBackend": ("file", lambda shm, tmp: cascade.FileBackend(str(tmp / "d"), threads=2)),
    "GPUBackend": ("gpu", lambda shm, tmp: cascade.GPUBackend(64 * MiB, threads=2)),
    "TierHandle-host": ("host", lambda shm, tmp: cascade.TierHandle("host", _config(shm, tmp))),
    "TierHandle-file": ("file", lambda shm, tmp: cascade.TierHandle("file", _config(shm, tmp))),
    "TierHandle-gpu": ("gpu", lambda shm, tmp: cascade.TierHandle("gpu", _config(shm, tmp))),
}


@pytest.fixture(params=sorted(OPENERS))
def handle(request, shm_path, tmp_path):
    kind, opener = OPENERS[request.param]
    if kind == "gpu" and not GPU:
        pytest.skip("no usable CUDA GPU (or a build without CUDA)")
    with opener(shm_path, tmp_path) as h:
        assert h.kind == kind
        yield h


def test_found_rule_hit_miss_too_small(handle):
    data = random_bytes(10_000, seed=1)
    assert handle.put("blk", data)
    out = np.zeros(20_000, dtype=np.uint8)
    assert handle.get("blk", out) == (True, data.nbytes)  # a hit
    assert np.array_equal(out[: data.nbytes], data)
    assert handle.get("missing", out) == (False, 0)  # a miss
    small = np.full(100, 0xEE, dtype=np.uint8)
    with pytest.raises(cascade.BufferTooSmallError) as e:  # out too small
        handle.get("blk", small)
    assert e.value.needed == data.nbytes
    assert isinstance(e.value, cascade.InvalidArgumentError)
    assert (small == 0xEE).all()  # nothing written


def test_found_rule_in_batches(handle):
    data = random_bytes(10_000, seed=2)
    assert handle.put_batch(["a", "b"], [data, data]) == 2
    outs = [
        np.zeros(20_000, dtype=np.uint8),
        np.zeros(20_000, dtype=np.uint8),
        np.zeros(100, dtype=np.uint8),
    ]
    n, sizes = handle.get_batch(["a", "missing", "b"], outs)
    assert n == 1  # the too-small item is not counted
    assert sizes == [data.nbytes, 0, data.nbytes]
    assert np.array_equal(outs[0][: data.nbytes], data)


def test_remove_contains_close(handle):
    assert handle.put("k", b"v" * 4096)
    assert "k" in handle and handle.contains("k")
    assert handle.remove("k") is True
    assert handle.remove("k") is False
    assert handle.get_stats()["blocks"] == 0
    handle.close()
    assert handle.closed
    with pytest.raises(cascade.UnavailableError):
        handle.contains("k")


def test_names_are_one_class():
    for name in ("HostBackend", "ShmBackend", "FileBackend", "LustreBackend", "GPUBackend"):
        assert issubclass(getattr(cascade, name), cascade.TierHandle), name
    assert issubclass(cascade.ShmBackend, cascade.HostBackend)
    assert issubclass(cascade.LustreBackend, cascade.FileBackend)


def test_calls_of_one_tier(shm_path, tmp_path):
    with cascade.HostBackend(16 * MiB, shm_path) as h:
        assert h.path == shm_path and h.device == -1
        assert h.put("k", b"x" * 8192)
        with pytest.raises(cascade.NotSupportedError):
            h.compact()
        with pytest.raises(cascade.NotSupportedError):
            h.trim()
        lease = h.acquire("k")  # the block in the arena, no copy
        assert lease.size == 8192 and lease.device == -1
        with pytest.raises(cascade.BusyError):
            h.close()
        # A get into the block's own bytes would change a stored block.
        torch = pytest.importorskip("torch")
        view = torch.from_dlpack(lease)
        assert h.put("other", b"y" * 8192)
        with pytest.raises(cascade.InvalidArgumentError, match="holds stored blocks"):
            h.get("other", view)
        with pytest.raises(cascade.InvalidArgumentError, match="holds stored blocks"):
            h.get_batch(["other"], [view])
        del view
        lease.release()
        out = bytearray(8192)
        assert h.get("k", out) == (True, 8192) and out == b"x" * 8192
    with cascade.FileBackend(str(tmp_path / "d"), segment_size_bytes=MiB) as f:
        assert f.path == str(tmp_path / "d")
        assert f.put("k", b"x" * 8192, is_prefix=True)
        f.flush()
        f.compact()
        with pytest.raises(cascade.NotSupportedError):
            f.acquire("k")


def test_tier_handle_takes_tier_names(shm_path, tmp_path):
    cfg = _config(shm_path, tmp_path)
    with cascade.TierHandle("lustre", cfg) as h:  # a pipeline alias of file
        assert h.kind == "file"
    with cascade.TierHandle(tier="shm", config=cfg) as h:
        assert h.kind == "host"
    with pytest.raises(cascade.InvalidArgumentError):
        cascade.TierHandle("host|file", cfg)
    with pytest.raises(cascade.InvalidArgumentError):
        cascade.TierHandle("remote", cfg)


def test_host_and_file_handles_refuse_device_buffers(shm_path, tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    t = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    with cascade.ShmBackend(16 * MiB, shm_path) as h:
        with pytest.raises(ValueError, match="ShmBackend stores host buffers"):
            h.put("k", t)
    with cascade.FileBackend(str(tmp_path / "d")) as f:
        with pytest.raises(ValueError, match="FileBackend stores host buffers"):
            f.put("k", t)


# ---- file_* and lustre_* names ----------------------------------------------------------


def test_config_attribute_aliases():
    cfg = cascade.CascadeConfig()
    cfg.lustre_path = "/a"
    cfg.lustre_stripe_size = 1 << 20
    cfg.lustre_stripe_count = 4
    assert (cfg.file_path, cfg.file_stripe_size, cfg.file_stripe_count) == ("/a", 1 << 20, 4)
    cfg.file_path = "/b"
    assert cfg.lustre_path == "/b"


def test_config_dict_and_yaml_take_both_names(tmp_path):
    new = cascade.load_config(
        {"file_path": "/x", "file_stripe_size": "1MiB", "file_stripe_count": 2}
    )
    old = cascade.load_config(
        {"lustre_path": "/x", "lustre_stripe_size": "1MiB", "lustre_stripe_count": 2}
    )
    assert new.to_dict() == old.to_dict()
    assert old.file_path == "/x" and old.file_stripe_size == 1 << 20 and old.file_stripe_count == 2
    d = old.to_dict()
    assert "file_path" in d and "lustre_path" not in d  # one name out
    assert cascade.load_config({"file_path": "/x", "lustre_path": "/x"}).file_path == "/x"
    with pytest.raises(ValueError, match="lustre_path and file_path name one option"):
        cascade.load_config({"file_path": "/x", "lustre_path": "/y"})
    for key in ("file_path", "lustre_path"):
        y = tmp_path / f"{key}.yaml"
        y.write_text(f"cascade:\n  pipeline: host|file\n  {key}: {tmp_path / 'dir'}\n")
        assert cascade.load_config(str(y)).file_path == str(tmp_path / "dir")


@pytest.mark.parametrize("key", ["file_path", "lustre_path"])
def test_store_opens_with_either_name(make_config, tmp_path, key):
    cfg = make_config(pipeline="host|file", **{key: str(tmp_path / "tier")})
    with cascade.CascadeStore(cfg) as store:
        store.put("k", b"x" * 4096)
        store.flush()
        s = store.get_stats()
        assert s["host_used"] == s["shm_used"] > 0
        assert set(s["tiers"]) == {"host", "file"}
    cfg = make_config(pipeline="file", **{key: str(tmp_path / "tier")})
    with cascade.CascadeStore(cfg) as store:
        assert store.get("k") == b"x" * 4096
        s = store.get_stats()
        assert s["file_hits"] == s["lustre_hits"] == 1


def test_connector_store_options_take_the_older_name(tmp_path):
    from cascade.integrations.connector_config import parse_connector_config, worker_store_config

    cfg = parse_connector_config(
        {
            "store_pipeline": "host|file",
            "storage_path": str(tmp_path / "s"),
            "store": {"lustre_path": str(tmp_path / "mine")},
        }
    )
    store_cfg = worker_store_config(cfg, engine_key="e", rank=0, world=1)
    assert store_cfg.file_path == str(tmp_path / "mine")
    assert os.path.isdir(store_cfg.file_path)
