"""shm_path safety: the store creates its arena file itself, adopts only a
stale arena of its own user, and never truncates or deletes a file it did not
create."""

import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

import cascade

FOREIGN = b"someone else's bytes\n" * 500


def _snapshot(path):
    st = os.lstat(path)
    with open(path, "rb") as f:
        return f.read(), st.st_ino, stat.S_IMODE(st.st_mode), st.st_uid


def _plant(path, mode=0o600, uid=None, data=FOREIGN):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    os.write(fd, data)
    os.close(fd)
    os.chmod(path, mode)
    if uid is not None:
        os.chown(path, uid, -1)


@pytest.fixture
def root():
    if os.geteuid() != 0:
        pytest.skip("needs root (device nodes, files of another uid)")


@pytest.mark.parametrize(
    "mode,uid,why",
    [
        (0o644, None, "mode 0644"),
        (0o600, 65534, "owned by uid 65534"),
        (0o600, None, "no Cascade arena header"),
    ],
    ids=["mode-0644", "other-uid", "no-header"],
)
def test_existing_foreign_file_is_refused_and_untouched(make_config, root, mode, uid, why):
    cfg = make_config()
    _plant(cfg.shm_path, mode, uid)
    before = _snapshot(cfg.shm_path)
    with pytest.raises(cascade.InvalidArgumentError, match=why) as e:
        cascade.CascadeStore(cfg)
    assert cfg.shm_path in str(e.value)
    assert _snapshot(cfg.shm_path) == before
    with pytest.raises(cascade.InvalidArgumentError):
        cascade.ShmBackend(1 << 20, cfg.shm_path)
    assert _snapshot(cfg.shm_path) == before


def test_second_hard_link_is_refused(make_config, tmp_path):
    cfg = make_config()
    _plant(cfg.shm_path)
    other = cfg.shm_path + "-link"
    os.link(cfg.shm_path, other)
    try:
        with pytest.raises(cascade.InvalidArgumentError, match="2 links"):
            cascade.CascadeStore(cfg)
        assert _snapshot(other)[0] == FOREIGN
    finally:
        os.unlink(other)


def test_dev_null_is_refused_and_kept(make_config, root):
    cfg = make_config()
    cfg.shm_path = "/dev/null"
    before = os.lstat("/dev/null")
    with pytest.raises(cascade.CascadeError, match="/dev/null.*not a regular file"):
        cascade.CascadeStore(cfg)
    after = os.lstat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino


def test_device_node_is_refused_and_kept(make_config, root):
    cfg = make_config()
    os.mknod(cfg.shm_path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # a /dev/null of our own
    with pytest.raises(cascade.CascadeError, match="not a regular file"):
        cascade.CascadeStore(cfg)
    assert stat.S_ISCHR(os.lstat(cfg.shm_path).st_mode)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_other_file_types_are_refused(make_config, kind):
    cfg = make_config()
    if kind == "fifo":
        os.mkfifo(cfg.shm_path, 0o600)
    else:
        os.mkdir(cfg.shm_path, 0o700)
    try:
        with pytest.raises(cascade.CascadeError, match="not a regular file"):
            cascade.CascadeStore(cfg)
        assert os.path.lexists(cfg.shm_path)
    finally:
        if kind == "directory":
            os.rmdir(cfg.shm_path)


def test_symlink_is_refused_and_target_untouched(make_config, tmp_path):
    cfg = make_config()
    target = tmp_path / "target"
    target.write_bytes(FOREIGN)
    os.chmod(target, 0o600)
    os.symlink(target, cfg.shm_path)
    with pytest.raises(cascade.CascadeError, match="symbolic link"):
        cascade.CascadeStore(cfg)
    assert os.path.islink(cfg.shm_path)
    assert target.read_bytes() == FOREIGN


def test_dangling_symlink_is_refused_and_nothing_created(make_config, tmp_path):
    cfg = make_config()
    target = tmp_path / "would-be-created"
    os.symlink(target, cfg.shm_path)
    try:
        with pytest.raises(cascade.CascadeError, match="symbolic link"):
            cascade.CascadeStore(cfg)
        assert not target.exists()
    finally:
        os.unlink(cfg.shm_path)


def test_created_arena_is_private(make_config):
    cfg = make_config()
    old = os.umask(0)  # the mode does not depend on the umask
    try:
        with cascade.CascadeStore(cfg) as s:
            s.put("x", b"1")
            st = os.lstat(cfg.shm_path)
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
            assert st.st_uid == os.geteuid()
            with open(cfg.shm_path, "rb") as f:
                assert f.read(13) == b"CASCADE-ARENA"
    finally:
        os.umask(old)
    assert not os.path.lexists(cfg.shm_path)


def test_capacity_over_free_space_keeps_an_existing_file(make_config):
    cfg = make_config(capacity=1 << 55)
    _plant(cfg.shm_path)
    before = _snapshot(cfg.shm_path)
    with pytest.raises(cascade.CascadeError):
        cascade.CascadeStore(cfg)
    assert _snapshot(cfg.shm_path) == before


def test_capacity_over_free_space_leaves_no_file(make_config):
    cfg = make_config(capacity=1 << 55)
    with pytest.raises(ValueError, match="free space"):
        cascade.CascadeStore(cfg)
    assert not os.path.lexists(cfg.shm_path)


# In a process of its own, under a limit on its address space: a capacity
# far over the free space is refused before anything sized by it is made.
_HUGE_CAPACITY = textwrap.dedent("""
    import resource, sys, cascade
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    cfg = cascade.CascadeConfig()
    cfg.pipeline, cfg.shm_path, cfg.shm_capacity_bytes = "host", sys.argv[1], 1 << 55
    cfg.num_io_threads = 1
    try:
        cascade.CascadeStore(cfg)
    except ValueError as e:
        print("refused:", e)
""")


@pytest.mark.skipif(
    "libasan" in os.environ.get("LD_PRELOAD", ""),
    reason="AddressSanitizer reserves terabytes of address space: no process of it runs under "
    "RLIMIT_AS",
)
def test_a_capacity_over_free_space_is_refused_before_memory_is_spent(make_config):
    cfg = make_config()
    r = subprocess.run(
        [sys.executable, "-c", _HUGE_CAPACITY, cfg.shm_path],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "refused:" in r.stdout, r.stdout + r.stderr
    assert "free space" in r.stdout
    assert not os.path.lexists(cfg.shm_path)


_CHILD = textwrap.dedent("""
    import sys, cascade
    cfg = cascade.CascadeConfig()
    cfg.pipeline, cfg.shm_path, cfg.shm_capacity_bytes = "host", sys.argv[1], 8 << 20
    cfg.num_io_threads = 1
    with cascade.CascadeStore(cfg) as s:
        s.put("planted", b"OLD-ARENA-BYTES!" * 4096)
        print("ready", flush=True)
        sys.stdin.read()  # until the parent closes stdin (or kills us)
""")


def _child_store(path):
    p = subprocess.Popen(
        [sys.executable, "-c", _CHILD, path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "ready"
    return p


def test_stale_arena_of_a_killed_store_is_adopted_and_reset(make_config):
    cfg = make_config(capacity=8 << 20)
    child = _child_store(cfg.shm_path)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert os.path.exists(cfg.shm_path)  # left behind by the crash
    with cascade.CascadeStore(cfg) as s:
        assert s.get("planted") is None  # old contents are not served
        with open(cfg.shm_path, "rb") as f:
            assert b"OLD-ARENA-BYTES!" not in f.read()
        s.put("new", b"fresh")
        assert s.get("new") == b"fresh"
    assert not os.path.lexists(cfg.shm_path)


def test_stale_arena_and_capacity_over_free_space(make_config):
    cfg = make_config(capacity=8 << 20)
    child = _child_store(cfg.shm_path)
    child.send_signal(signal.SIGKILL)
    child.wait()
    before = _snapshot(cfg.shm_path)
    cfg.shm_capacity_bytes = 1 << 55
    with pytest.raises(ValueError, match="free space"):
        cascade.CascadeStore(cfg)
    assert _snapshot(cfg.shm_path) == before


def test_live_store_in_another_process_means_busy(make_config):
    cfg = make_config(capacity=8 << 20)
    child = _child_store(cfg.shm_path)
    try:
        with pytest.raises(cascade.BusyError, match="in use"):
            cascade.CascadeStore(cfg)
        assert os.path.exists(cfg.shm_path)
    finally:
        child.stdin.close()
        assert child.wait(timeout=60) == 0
    assert not os.path.lexists(cfg.shm_path)  # the child removed its own arena


def test_close_removes_only_its_own_file(make_config):
    cfg = make_config()
    s = cascade.CascadeStore(cfg)
    s.put("x", b"1")
    os.unlink(cfg.shm_path)  # someone replaces the path while the store is open
    _plant(cfg.shm_path)
    before = _snapshot(cfg.shm_path)
    s.close()
    assert _snapshot(cfg.shm_path) == before


def test_default_shm_path_is_per_user():
    assert cascade.CascadeConfig().shm_path == f"/dev/shm/cascade-{os.geteuid()}"
