"""Running work in a forked child under a watchdog.

Every mode runs its stores in child processes, so a crash (SIGSEGV,
SIGABRT) or a hang is observed and reported instead of taking the harness
down. ``run_child(fn, deadline)`` forks, runs ``fn()`` in the child, and
returns what it returned (JSON-serialisable) with how the child ended:
``ok``, ``crash`` (a signal), ``hang`` (past the deadline: killed), or
``error`` (an exception or a non-zero exit). The harness itself starts no
threads and opens no store, so forking it is safe.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
import traceback

HANG_EXIT = 97  # a child's own watchdog found an operation past its deadline


class ChildResult:
    def __init__(
        self, status: str, value=None, detail: str = "", seconds: float = 0.0, pid: int = 0
    ):
        self.status = status  # ok | crash | hang | error
        self.value = value
        self.detail = detail
        self.seconds = seconds
        self.pid = pid

    def __repr__(self):
        return f"ChildResult({self.status}, {self.detail!r})"


_OUT_PATH = None  # in a child: where its result goes


def _child_main(fn, out_path: str) -> None:
    global _OUT_PATH
    _OUT_PATH = out_path
    code = 0
    try:
        value = fn()
        with open(out_path, "w") as f:
            json.dump({"value": value}, f)
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        try:
            with open(out_path, "w") as f:
                json.dump({"error": traceback.format_exc(limit=8)}, f)
        except OSError:
            pass
        code = 3
    os._exit(code)


def spawn(fn) -> tuple[int, str]:
    """Forks a child running fn(); returns (pid, path of its result file)."""
    fd, out_path = tempfile.mkstemp(prefix="cascade-stress-", suffix=".json")
    os.close(fd)
    pid = os.fork()
    if pid == 0:
        _child_main(fn, out_path)
    return pid, out_path


def wait(
    pid: int,
    out_path: str,
    deadline: float | None,
    started: float,
    progress_path: str | None = None,
    progress_deadline: float | None = None,
    killed_by_us: bool = False,
) -> ChildResult:
    """Waits for a spawned child. deadline: absolute time.monotonic() after which
    it is killed and reported as a hang. With progress_path, the child is also a
    hang when that file has not changed for progress_deadline seconds."""
    last_progress = None
    last_change = time.monotonic()
    status = None
    sleep = 0.001
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            break
        now = time.monotonic()
        hung = deadline is not None and now > deadline
        what = ""
        if progress_path and progress_deadline:
            cur = _read(progress_path)
            if cur != last_progress:
                last_progress, last_change = cur, now
            elif now - last_change > progress_deadline:
                hung, what = True, cur.strip()
        if hung:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            _unlink(out_path)
            return ChildResult(
                "hang", detail=what or "past its deadline", seconds=now - started, pid=pid
            )
        time.sleep(sleep)
        sleep = min(sleep * 2, 0.02)
    seconds = time.monotonic() - started
    data = _load(out_path)
    _unlink(out_path)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGKILL and killed_by_us:
            return ChildResult("killed", seconds=seconds, pid=pid)
        return ChildResult(
            "crash", detail=f"killed by signal {signal.Signals(sig).name}", seconds=seconds, pid=pid
        )
    code = os.WEXITSTATUS(status)
    if code == HANG_EXIT:
        return ChildResult(
            "hang",
            value=(data or {}).get("value"),
            detail=(data or {}).get("hang", "hang"),
            seconds=seconds,
            pid=pid,
        )
    if code != 0 or data is None or "error" in data:
        return ChildResult(
            "error",
            detail=(data or {}).get("error", f"exit status {code}"),
            seconds=seconds,
            pid=pid,
        )
    return ChildResult("ok", value=data.get("value"), seconds=seconds, pid=pid)


def run_child(
    fn,
    deadline_s: float,
    progress_path: str | None = None,
    progress_deadline_s: float | None = None,
) -> ChildResult:
    started = time.monotonic()
    pid, out = spawn(fn)
    return wait(pid, out, started + deadline_s, started, progress_path, progress_deadline_s)


def report_hang(what: str) -> None:
    """Called by a child's own watchdog: records what hung and exits HANG_EXIT."""
    path = _OUT_PATH
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"hang": what}, f)
        except OSError:
            pass
    os._exit(HANG_EXIT)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _load(path: str):
    try:
        with open(path) as f:
            text = f.read()
        return json.loads(text) if text else None
    except (OSError, ValueError):
        return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
