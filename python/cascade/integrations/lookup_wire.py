"""The lookup socket between the connector's scheduler and its workers: files and wire format.

Files. Each worker rank serving lookups owns a private directory,
``<socket_dir>/cascade-lookup-<sha256(engine key)[:16]>-r<rank>/`` (mode
0700, owned by the worker's user; a directory that is not is refused), that
holds the socket ``sock`` (0600), ``secret`` (0600): 32 random bytes made
afresh each time the service starts, and ``lock`` (0600), which the service
holds locked (``flock``) while it runs: a second service of the same engine
key and rank is refused while the first lives, and a directory whose lock
nobody holds is a killed service's, removed by the next worker that starts
(``remove_stale_service_dirs``). Only processes of the same user can reach
any of them; the scheduler reads the secret from there before it connects.

Messages. Every message starts with a 10-byte header, little-endian:
magic ``b"CSLK"`` (4), version (1), kind (1), n (u32), followed by a body
whose size the kind and n fix:

==============  =========  ======  ====================================
kind            direction  n       body
==============  =========  ======  ====================================
1 challenge     service    32      service nonce (32 random bytes)
2 auth          client     64      client nonce (32) + client MAC (32)
3 welcome       service    32      service MAC (32)
4 prefix        client     count   count x 16-byte block ids
5 locate        client     count   count x 16-byte block ids
0x80 ok         service    length  none: the leading ``length`` ids are held
0x84 tiers      service    length  ``length`` bytes: for each of the leading
                                   ``length`` ids held, the pipeline index
                                   of the tier holding it (0 = top)
0x81 bad        service    0       none: malformed request; then closed
0x82 failed     service    0       none: the store failed; still served
0x83 refused    service    0       none: wrong MAC; then closed
==============  =========  ======  ====================================

MACs are HMAC-SHA256 under the secret of ``b"cascade-lookup/1 client\\0"``
(client) or ``b"cascade-lookup/1 server\\0"`` (service) followed by the
service nonce and the client nonce, compared in constant time; the secret
never crosses the socket. A prefix or locate request carries at most
``MAX_IDS`` ids. A prefix request is answered ok, a locate request tiers
(or either with one of the statuses below). Locate came after prefix in
the same version: a service that predates it answers bad request and
closes, and a client then asks that service prefixes only.
No message is ever unpickled or evaluated.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import os
import re
import secrets
import socket
import stat
import struct
import tempfile
import time
from collections.abc import Sequence

MAGIC = b"CSLK"
VERSION = 1
HEADER = struct.Struct("<4sBBI")

CHALLENGE, AUTH, WELCOME, PREFIX, LOCATE = 1, 2, 3, 4, 5
ST_OK, ST_BAD_REQUEST, ST_FAILED, ST_REFUSED, ST_TIERS = 0x80, 0x81, 0x82, 0x83, 0x84
MAX_TIER = 254  # tier indices fit a byte
_STATUS_NAMES = {
    ST_OK: "ok",
    ST_TIERS: "tiers",
    ST_BAD_REQUEST: "bad request",
    ST_FAILED: "lookup failed",
    ST_REFUSED: "refused",
}

ID_BYTES = 16
NONCE_BYTES = 32
SECRET_BYTES = 32
MAX_IDS = 1 << 18  # 4 MiB of ids: a 4M-token prompt in 16-token blocks

SOCKET_NAME = "sock"
SECRET_NAME = "secret"
LOCK_NAME = "lock"
_CLIENT_TAG = b"cascade-lookup/1 client\x00"
_SERVER_TAG = b"cascade-lookup/1 server\x00"
_SUN_PATH_MAX = 107


class WireError(Exception):
    """The peer broke the protocol, refused us, or closed mid-message."""


class BadMessage(WireError):
    """A request that is not well formed (the service answers ``bad`` and closes)."""


class Deadline:
    """A point in time every step of one exchange must finish by."""

    __slots__ = ("at",)

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return self.at - time.monotonic()

    def timeout(self) -> float:
        """Seconds left, for a socket timeout; TimeoutError when none are."""
        left = self.left()
        if left <= 0:
            raise TimeoutError("lookup deadline passed")
        return left


def status_name(status: int) -> str:
    return _STATUS_NAMES.get(status, f"kind {status}")


# ---------------------------------------------------------------------------
# Files


def service_dir(socket_dir: str, engine_key: str, rank: int) -> str:
    """The private directory of one rank's lookup service."""
    short = hashlib.sha256(engine_key.encode()).hexdigest()[:16]
    return os.path.join(socket_dir or tempfile.gettempdir(), f"cascade-lookup-{short}-r{rank}")


def socket_address(socket_dir: str, engine_key: str, rank: int) -> str:
    """The Unix socket of one rank's lookup service."""
    return os.path.join(service_dir(socket_dir, engine_key, rank), SOCKET_NAME)


def _check_private(st: os.stat_result, path: str, *, directory: bool) -> None:
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind_ok or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        what = "directory (mode 0700)" if directory else "file (mode 0600)"
        raise PermissionError(
            f"{path} is not a private {what} of this user; "
            "remove it or choose another lookup_socket_dir"
        )


def _open_private_dir(path: str) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _check_private(os.fstat(fd), path, directory=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlink_at(name: str, dfd: int) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        pass


class ServiceBusy(OSError):
    """Another live lookup service holds the directory (the same engine key and rank)."""


def _lock_service_dir(dfd: int, path: str) -> int:
    """The directory's ``lock`` file, open and locked by this process; ServiceBusy when a
    live service holds it."""
    while True:
        fd = os.open(
            LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd
        )
        try:
            _check_private(os.fstat(fd), os.path.join(path, LOCK_NAME), directory=False)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ServiceBusy(
                    f"{path}: another lookup service of this engine and rank is running; give "
                    "each vLLM server on a node its own engine_id (or lookup_socket_dir)"
                ) from None
            # A service closing meanwhile unlinks the file it held: lock the
            # one the directory names.
            held, named = os.fstat(fd), os.stat(LOCK_NAME, dir_fd=dfd, follow_symlinks=False)
            if (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino):
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


# How long a service waits for a directory another worker's sweep of stale
# ones holds (for moments) or removes under it, before it reports it busy.
_TAKE_BACK_S = 1.0


def create_service_dir(path: str) -> tuple[bytes, int]:
    """Makes (or takes back) the service's private directory, locks it, and writes a fresh
    secret in it: the secret and the lock's descriptor (held for the service's life; given
    back to ``remove_service_dir``). ServiceBusy when a live service holds it."""
    deadline = time.monotonic() + _TAKE_BACK_S
    while True:
        try:
            return _create_service_dir(path)
        except (ServiceBusy, FileNotFoundError):
            # Another worker removing the directory as a killed service's
            # holds its lock a moment, or removes it under this one.
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


def _create_service_dir(path: str) -> tuple[bytes, int]:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    dfd = _open_private_dir(path)
    lock_fd = -1
    try:
        lock_fd = _lock_service_dir(dfd, path)
        for name in (SOCKET_NAME, SECRET_NAME, SECRET_NAME + ".new"):
            _unlink_at(name, dfd)  # left by a dead service of the same engine and rank
        secret = secrets.token_bytes(SECRET_BYTES)
        fd = os.open(
            SECRET_NAME + ".new",
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dfd,
        )
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, secret)
        finally:
            os.close(fd)
        os.replace(SECRET_NAME + ".new", SECRET_NAME, src_dir_fd=dfd, dst_dir_fd=dfd)
        return secret, lock_fd
    except BaseException:
        if lock_fd >= 0:
            os.close(lock_fd)
        raise
    finally:
        os.close(dfd)


def read_secret(path: str) -> bytes:
    """The secret of the service whose directory is ``path`` (checked private to this user)."""
    dfd = _open_private_dir(path)
    try:
        # O_NONBLOCK: a FIFO under the name would block the open until a
        # writer came; the check below then refuses it.
        fd = os.open(
            SECRET_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd
        )
    finally:
        os.close(dfd)
    try:
        _check_private(os.fstat(fd), os.path.join(path, SECRET_NAME), directory=False)
        data = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != SECRET_BYTES:
        raise WireError(f"{os.path.join(path, SECRET_NAME)} does not hold a lookup secret")
    return data


def remove_service_dir(path: str, lock_fd: int) -> None:
    """Removes the directory of the service holding its lock as ``lock_fd`` (its socket,
    secret and lock), then lets go of the lock."""
    try:
        try:
            dfd = _open_private_dir(path)
        except OSError:
            return
        try:
            for name in (SOCKET_NAME, SECRET_NAME, LOCK_NAME):
                _unlink_at(name, dfd)
        finally:
            os.close(dfd)
        try:
            os.rmdir(path)
        except OSError:
            pass
    finally:
        os.close(lock_fd)


_SERVICE_DIR = re.compile(r"cascade-lookup-[0-9a-f]{16}-r[0-9]+")


def remove_stale_service_dirs(
    socket_dir: str, min_age_s: float = 10.0, keep_engine_key: str = ""
) -> list[str]:
    """Removes the lookup directories in ``socket_dir`` (the temp dir when empty) of this
    user's services that ended without closing (killed): those whose lock no live service
    holds, at least ``min_age_s`` old, but those of ``keep_engine_key`` (its ranks take
    their own back). The paths removed."""
    base = socket_dir or tempfile.gettempdir()
    own = os.path.basename(service_dir(base, keep_engine_key, 0))[:-1] if keep_engine_key else ""
    try:
        names = os.listdir(base)
    except OSError:
        return []
    removed = []
    for name in names:
        if not _SERVICE_DIR.fullmatch(name) or (own and name.startswith(own)):
            continue
        path = os.path.join(base, name)
        try:
            dfd = _open_private_dir(path)
        except OSError:
            continue  # not this user's, not private, or gone
        try:
            if time.time() - os.fstat(dfd).st_mtime < min_age_s:
                continue
            lock_fd = _lock_service_dir(dfd, path)
        except OSError:  # ServiceBusy: a live service
            continue
        finally:
            os.close(dfd)
        remove_service_dir(path, lock_fd)
        removed.append(path)
    return removed


def listen(address: str) -> socket.socket:
    """A listening socket at ``address`` (in a private directory), mode 0600."""
    if len(os.fsencode(address)) > _SUN_PATH_MAX:
        raise ValueError(
            f"lookup socket path {address!r} is longer than {_SUN_PATH_MAX} bytes; "
            "choose a shorter lookup_socket_dir"
        )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(address)
        os.chmod(address, 0o600)
        sock.listen(64)
        sock.settimeout(0.25)  # accept() wakes to notice close()
    except BaseException:
        sock.close()
        raise
    return sock


def connect(address: str, deadline: Deadline) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(deadline.timeout())
        sock.connect(address)  # a full backlog (a stopped service) fails at once, no wait
    except BaseException:
        sock.close()
        raise
    return sock


def peer_is_same_user(sock: socket.socket) -> bool:
    """Whether the connected peer runs as this process's user (where the OS tells)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return True
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    _pid, uid, _gid = struct.unpack("iII", creds)
    return uid == os.geteuid()


# ---------------------------------------------------------------------------
# Messages


def _recv_exact(
    sock: socket.socket, n: int, deadline: Deadline, buf: bytearray | None = None, got: int = 0
) -> bytes:
    buf = buf if buf is not None else bytearray(n)
    view = memoryview(buf)
    while got < n:
        sock.settimeout(deadline.timeout())
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _send(sock: socket.socket, kind: int, n: int, body: bytes, deadline: Deadline) -> None:
    sock.settimeout(deadline.timeout())
    sock.sendall(HEADER.pack(MAGIC, VERSION, kind, n) + body)


def _parse_header(raw: bytes, error=WireError) -> tuple[int, int]:
    magic, version, kind, n = HEADER.unpack(raw)
    if magic != MAGIC:
        raise error(f"bad magic {magic!r}")
    if version != VERSION:
        raise error(f"protocol version {version}, this side speaks {VERSION}")
    return kind, n


def _recv_fixed(sock: socket.socket, kind: int, n: int, deadline: Deadline) -> bytes:
    """A message that must be ``kind`` with an ``n``-byte body (handshake)."""
    got_kind, got_n = _parse_header(_recv_exact(sock, HEADER.size, deadline))
    if got_kind == ST_REFUSED:
        raise WireError("refused: the lookup secret does not match")
    if got_kind != kind or got_n != n:
        raise WireError(
            f"expected message kind {kind} of {n} bytes, got kind {got_kind} of {got_n}"
        )
    return _recv_exact(sock, n, deadline)


def _macs(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> tuple[bytes, bytes]:
    nonces = server_nonce + client_nonce
    return (
        hmac.new(secret, _CLIENT_TAG + nonces, hashlib.sha256).digest(),
        hmac.new(secret, _SERVER_TAG + nonces, hashlib.sha256).digest(),
    )


def client_handshake(sock: socket.socket, secret: bytes, deadline: Deadline) -> None:
    """Proves to the service that we hold the secret, and checks that it does."""
    server_nonce = _recv_fixed(sock, CHALLENGE, NONCE_BYTES, deadline)
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    client_mac, server_mac = _macs(secret, server_nonce, client_nonce)
    _send(sock, AUTH, 2 * NONCE_BYTES, client_nonce + client_mac, deadline)
    if not hmac.compare_digest(_recv_fixed(sock, WELCOME, len(server_mac), deadline), server_mac):
        raise WireError("the service does not hold the lookup secret")


def server_handshake(sock: socket.socket, secret: bytes, deadline: Deadline) -> bool:
    """Whether the client proved it holds the secret (within the deadline)."""
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    _send(sock, CHALLENGE, NONCE_BYTES, server_nonce, deadline)
    try:
        body = _recv_fixed(sock, AUTH, 2 * NONCE_BYTES, deadline)
    except WireError:
        return False
    client_nonce, mac = body[:NONCE_BYTES], body[NONCE_BYTES:]
    client_mac, server_mac = _macs(secret, server_nonce, client_nonce)
    if not hmac.compare_digest(mac, client_mac):
        _send(sock, ST_REFUSED, 0, b"", deadline)
        return False
    _send(sock, WELCOME, len(server_mac), server_mac, deadline)
    return True


def encode_ids(ids: Sequence) -> bytes:
    """16 bytes per id (32-hex str or 16 bytes); ValueError for anything else."""
    if all(isinstance(i, str) and len(i) == 2 * ID_BYTES for i in ids):
        body = bytes.fromhex("".join(ids))
    else:
        body = b"".join(
            bytes(i) if isinstance(i, (bytes, bytearray)) else bytes.fromhex(str(i)) for i in ids
        )
    if len(body) != ID_BYTES * len(ids):
        raise ValueError("lookup ids must be block ids (32 hex characters or 16 bytes)")
    return body


def send_request(
    sock: socket.socket, ids: Sequence, deadline: Deadline, kind: int = PREFIX
) -> None:
    """A prefix request (kind PREFIX) or a locate request (LOCATE)."""
    if kind not in (PREFIX, LOCATE):
        raise ValueError(f"request kind {kind} is not prefix or locate")
    if len(ids) > MAX_IDS:
        raise ValueError(f"{len(ids)} ids in one lookup, at most {MAX_IDS}")
    _send(sock, kind, len(ids), encode_ids(ids), deadline)


def recv_answer(sock: socket.socket, deadline: Deadline) -> tuple[int, int]:
    status, n = _parse_header(_recv_exact(sock, HEADER.size, deadline))
    if status not in _STATUS_NAMES:
        raise WireError(f"unexpected answer kind {status}")
    return status, n


def recv_request(sock: socket.socket, timeout_s: float) -> list | None:
    """The next prefix request's ids (32-hex str); None when the peer closed
    between requests. BadMessage for a malformed one or another kind."""
    got = recv_query(sock, timeout_s)
    if got is None:
        return None
    kind, ids = got
    if kind != PREFIX:
        raise BadMessage(f"unexpected request kind {kind}")
    return ids


def recv_query(sock: socket.socket, timeout_s: float) -> tuple[int, list] | None:
    """The next request: its kind (PREFIX or LOCATE) and ids (32-hex str);
    None when the peer closed between requests.

    Waits for a request as long as it takes; once its first byte is in, the
    rest must come within ``timeout_s``. BadMessage for a malformed one."""
    buf = bytearray(HEADER.size)
    sock.settimeout(None)
    got = sock.recv_into(buf, HEADER.size)
    if got == 0:
        return None
    deadline = Deadline(timeout_s)
    kind, n = _parse_header(_recv_exact(sock, HEADER.size, deadline, buf, got), BadMessage)
    if kind not in (PREFIX, LOCATE):
        raise BadMessage(f"unexpected request kind {kind}")
    if n > MAX_IDS:
        raise BadMessage(f"{n} ids in one request, at most {MAX_IDS}")
    h = _recv_exact(sock, n * ID_BYTES, deadline).hex()
    step = 2 * ID_BYTES
    return kind, [h[i : i + step] for i in range(0, len(h), step)]


def send_tiers(sock: socket.socket, tiers: Sequence[int], deadline: Deadline) -> None:
    """The answer to a locate request: the tier index of each leading held id."""
    if any(not 0 <= t <= MAX_TIER for t in tiers):
        raise ValueError(f"tier indices must be 0 to {MAX_TIER}")
    _send(sock, ST_TIERS, len(tiers), bytes(tiers), deadline)


def recv_tiers(sock: socket.socket, n: int, asked: int, deadline: Deadline) -> list[int]:
    """The body of a tiers answer of n entries to a locate request of ``asked`` ids."""
    if n > asked:
        raise WireError(f"a tiers answer of {n} entries to a locate of {asked} ids")
    body = _recv_exact(sock, n, deadline)
    if any(t > MAX_TIER for t in body):
        raise WireError(f"a tier index above {MAX_TIER}")
    return list(body)


def send_answer(sock: socket.socket, status: int, n: int, deadline: Deadline) -> None:
    _send(sock, status, n, b"", deadline)
