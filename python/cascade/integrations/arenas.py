"""Host arenas that engines' stores left behind.

An engine's store names its host arena after the engine (or its process), holds
a lock on it while it is open, and removes it when it closes. Engines end their
workers with SIGKILL (vLLM without ``--shutdown-timeout``, SGLang always), so a
store is often never closed, and its arena, with every page it committed,
stays in shared memory. The integrations remove such arenas when a store of
theirs starts."""

from __future__ import annotations

import fcntl
import os
import re
import stat
import time


def remove_stale_arenas(shm_dir: str, name: re.Pattern[str], min_age_s: float = 10.0) -> list[str]:
    """Removes the files in ``shm_dir`` whose name ``name`` matches in full
    and that are stale arenas; returns their paths. A file is removed only when
    it is this user's regular file, mode 0600, one link, no store holds its
    lock, and it is older than ``min_age_s`` (a store creates its file just
    before it locks it). It is opened without blocking (a FIFO of that name
    would otherwise hold the caller up) and removed only while its name still
    names the file locked."""
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    now = time.time()
    for entry in names:
        if not name.fullmatch(entry):
            continue
        path = os.path.join(shm_dir, entry)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if (
                not stat.S_ISREG(st.st_mode)
                or st.st_uid != os.geteuid()
                or stat.S_IMODE(st.st_mode) != 0o600
                or st.st_nlink != 1
                or now - st.st_ctime < min_age_s
            ):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live store holds it
            try:
                current = os.lstat(path)
            except OSError:
                continue
            if (current.st_dev, current.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(path)
                removed.append(path)
        finally:
            os.close(fd)
    return removed
