"""Thread counts of the backends: 0 (one per core) or 1..1024, anything else
InvalidArgumentError naming the argument, never an abort."""

import pytest

import cascade


@pytest.mark.skipif(not hasattr(cascade, "LustreBackend"), reason="no file tier in this build")
@pytest.mark.parametrize("threads", [-1, -1000, 1025, 1 << 30])
def test_lustre_backend_rejects_bad_threads(tmp_path, threads):
    with pytest.raises(
        cascade.InvalidArgumentError, match=r"threads must be 0 \(one per core\) or 1 to 1024"
    ):
        cascade.LustreBackend(str(tmp_path / "d"), threads=threads)


@pytest.mark.skipif(not hasattr(cascade, "LustreBackend"), reason="no file tier in this build")
@pytest.mark.parametrize("threads", [0, 1, 3])
def test_lustre_backend_accepts_good_threads(tmp_path, threads):
    with cascade.LustreBackend(str(tmp_path / "d"), threads=threads) as b:
        assert b.put("k", b"v" * 4096)
        assert b.contains("k")
    assert b.closed


@pytest.mark.parametrize("threads", [-1, 1025])
def test_shm_backend_rejects_bad_threads(shm_path, threads):
    with pytest.raises(cascade.InvalidArgumentError, match="1024"):
        cascade.ShmBackend(1 << 20, shm_path, threads)


@pytest.mark.parametrize("threads", [-1, 1025])
def test_store_rejects_bad_io_threads(make_config, threads):
    cfg = make_config()
    cfg.num_io_threads = threads
    with pytest.raises(cascade.InvalidArgumentError, match="1024"):
        cascade.CascadeStore(cfg)
