"""A small client of etcd's v3 HTTP/JSON gateway, standard library only.

etcd serves its v3 API as JSON over HTTP (``POST /v3/<service>/<method>``):
keys and values travel base64-encoded, 64-bit integers as decimal strings.
This client covers what membership needs: leases (grant, keep alive,
revoke), put (optionally under a lease), a create-if-absent transaction,
range by prefix, delete, and a watch of a prefix (``watch_prefix``: one
streaming answer whose lines are the changes, read as they come).

Every call has a deadline: the endpoints are tried in turn, each given an
equal share of the time left, and the whole exchange with one endpoint
(connect, send, every read of the answer) ends when its share does, however
slowly a peer trickles bytes. Whatever goes wrong (refused, timed out, an HTTP
error, an answer that is not the JSON etcd sends) becomes ``ClusterError``,
in ``_post`` alone. ``ClusterError.not_found`` marks etcd's NotFound (a
lease that expired), which callers treat differently from an outage.

Thread-safety: an ``EtcdClient`` holds no connection between calls (each
call opens its own), so one client may be used from several threads. A
``PrefixWatch`` is read by one thread; ``close`` may come from any.
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import io
import json
import re
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

# gRPC status code etcd returns for a missing lease (and other missing things).
GRPC_NOT_FOUND = 5
# The most bytes read from one answer: a hostile or broken peer cannot make
# the client buffer without bound.
MAX_RESPONSE_BYTES = 16 << 20


# A watch's connection: probed after 10 s of silence, every 5 s, and given up
# after 3 probes unanswered.
_WATCH_KEEPALIVE = (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))


class _DeadlineSocket:
    """A connected socket whose every send and receive is bounded by the
    time left to one deadline, so no exchange outlives it."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock = sock
        self._deadline: float | None = deadline
        self._io_refs = 0
        self._closed = False

    def lift(self) -> None:
        """No deadline from now on (a watch, once created). TCP keepalives
        instead end a connection whose far end vanished without a word."""
        self._deadline = None
        self._sock.settimeout(None)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for name, value in _WATCH_KEEPALIVE:
                if hasattr(socket, name):
                    self._sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        except OSError:
            pass  # not TCP: nothing to keep alive

    def _arm(self) -> None:
        if self._deadline is None:
            return
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        self._sock.settimeout(left)

    def sendall(self, data: bytes) -> None:
        self._arm()
        self._sock.sendall(data)

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        self._arm()
        return self._sock.recv_into(buffer, nbytes, flags)

    def makefile(self, mode: str = "rb", **_: Any) -> io.BufferedReader:
        if mode != "rb":
            raise ValueError("only reading files")
        self._io_refs += 1
        return io.BufferedReader(socket.SocketIO(self, "rb"))  # type: ignore[arg-type]

    # The file of a response may outlive the connection's close (urllib
    # closes the connection right after reading the headers): the socket is
    # closed when both are done with it, as socket.socket does.
    def _decref_socketios(self) -> None:
        self._io_refs -= 1
        if self._closed and self._io_refs <= 0:
            self._sock.close()

    def close(self) -> None:
        self._closed = True
        if self._io_refs <= 0:
            self._sock.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _DeadlineConnection(http.client.HTTPConnection):
    """An HTTP connection that treats its timeout as a budget for the whole
    exchange, starting when it is made (urllib makes one per request)."""

    def __init__(self, host: str, timeout: float = 1.0, **kw: Any):
        super().__init__(host, timeout=timeout, **kw)
        self._deadline = time.monotonic() + float(timeout)

    def connect(self) -> None:
        super().connect()
        # Kept here too: an answer with "Connection: close" takes conn.sock.
        self.deadline_socket = _DeadlineSocket(self.sock, self._deadline)
        self.sock = self.deadline_socket


class _DeadlineHTTPSConnection(_DeadlineConnection, http.client.HTTPSConnection):
    """As _DeadlineConnection, over TLS (the handshake within the budget)."""


def _connection(endpoint: str, timeout: float, context: ssl.SSLContext | None):
    netloc = urllib.parse.urlsplit(endpoint).netloc
    if endpoint.startswith("https://"):
        return _DeadlineHTTPSConnection(netloc, timeout=timeout, context=context)
    return _DeadlineConnection(netloc, timeout=timeout)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """etcd never redirects: a 3xx (a proxy in the way) is an error, not a
    new request with a new deadline and the token sent elsewhere."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class _DeadlineHandler(urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(_DeadlineConnection, req)


class _DeadlineHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, context: ssl.SSLContext):
        super().__init__(context=context)
        self._tls = context

    def https_open(self, req):
        return self.do_open(_DeadlineHTTPSConnection, req, context=self._tls)


class ClusterError(Exception):
    """A call to the coordination service failed or was refused.

    ``not_found``: etcd answered NotFound (the lease named no longer
    exists), as opposed to the service being unreachable or failing.
    """

    def __init__(
        self,
        message: str,
        *,
        not_found: bool = False,
        bad_token: bool = False,
        too_large: bool = False,
    ):
        super().__init__(message)
        self.not_found = not_found
        self.bad_token = bad_token  # etcd refused the authentication token sent
        self.too_large = too_large  # the answer was over MAX_RESPONSE_BYTES


@dataclasses.dataclass(frozen=True)
class KeyValue:
    """One key of a range answer."""

    key: bytes
    value: bytes
    lease: int  # 0: the key is not attached to a lease
    create_revision: int
    mod_revision: int


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"expected base64 text, got {type(text).__name__}")
    return base64.b64decode(text, validate=True)


def _int(value: Any) -> int:
    """etcd's int64 fields: decimal strings, absent when zero."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected an integer, got {value!r}")
    return int(value)


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


# The largest value ``increase`` stores: a signed 64-bit integer's.
_MAX_COUNT = (1 << 63) - 1


def check_endpoint(endpoint: str) -> str:
    """``http://host:port`` or ``https://host:port`` without a trailing
    slash; ValueError otherwise."""
    parsed = urllib.parse.urlsplit(endpoint)
    try:
        port = parsed.port
    except ValueError:  # not a number, or out of 0-65535
        port = None
    if (
        parsed.scheme not in ("http", "https")
        or not parsed.hostname
        or not re.fullmatch(r"[A-Za-z0-9._:%-]+", parsed.hostname)
        or not port
    ):
        raise ValueError(f"etcd endpoint {endpoint!r}: expected http(s)://HOST:PORT")
    if parsed.username is not None or parsed.password is not None:
        raise ValueError(
            f"etcd endpoint {parsed.scheme}://...@{parsed.hostname}: no user in the endpoint; "
            "give it as cluster.username and cluster.password_file"
        )
    if parsed.path not in ("", "/") or parsed.query or parsed.fragment:
        raise ValueError(f"etcd endpoint {endpoint!r}: expected http(s)://HOST:PORT, no path")
    return endpoint.rstrip("/")


class PrefixWatch:
    """A watch of every key under a prefix, on a connection of its own.

    ``next_change`` blocks until etcd reports changes and returns how many
    keys changed; ``close`` (from any thread) ends the watch, and a
    ``next_change`` waiting then raises ClusterError (and closes the
    connection: only the reading thread touches it), as it does when the
    connection breaks, etcd cancels the watch, or a line is not what etcd
    sends. The watch has no deadline of its own once created (a quiet
    prefix sends nothing): a caller that needs the truth by a time reads
    the keys as well.
    """

    def __init__(self, conn: http.client.HTTPConnection, response, endpoint: str):
        self._conn = conn
        self._response = response
        self.endpoint = endpoint
        self._closed = False
        # The newest revision etcd said this watch is up to (its answers'
        # headers): changes up to it have been reported.
        self.revision = 0

    def next_change(self) -> int:
        try:
            return self._next_change()
        except ClusterError:
            self._conn.close()  # by the reading thread alone: http.client is not thread-safe
            raise

    def _next_change(self) -> int:
        while True:
            try:
                line = self._response.readline(MAX_RESPONSE_BYTES + 1)
            except Exception as e:  # a broken or shut-down stream, however http.client says it
                if self._closed:
                    raise ClusterError("etcd watch: closed") from None
                raise ClusterError(
                    f"etcd watch at {self.endpoint}: {type(e).__name__}: {e}"
                ) from None
            if self._closed:
                raise ClusterError("etcd watch: closed")
            if not line:
                raise ClusterError(f"etcd watch at {self.endpoint}: the stream ended")
            if len(line) > MAX_RESPONSE_BYTES or not line.endswith(b"\n"):
                raise ClusterError(
                    f"etcd watch at {self.endpoint}: a line over the limit, or cut short"
                )
            try:
                answer = json.loads(line)
            except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep
                raise ClusterError(f"etcd watch at {self.endpoint}: not JSON: {e}") from None
            result = answer.get("result") if isinstance(answer, dict) else None
            if not isinstance(result, dict):
                why = answer.get("error") if isinstance(answer, dict) else None
                raise ClusterError(f"etcd watch at {self.endpoint}: {why or 'no result'}")
            if result.get("canceled"):
                reason = result.get("cancel_reason") or "canceled"
                raise ClusterError(f"etcd watch at {self.endpoint}: {reason}")
            events = result.get("events") or []
            if not isinstance(events, list):
                raise ClusterError(f"etcd watch at {self.endpoint}: events is not a list")
            try:
                self.revision = max(self.revision, EtcdClient._revision(result))
            except ClusterError:
                pass  # an answer without a header: no newer revision
            if events:
                return len(events)
            # A progress notice, or the answer to the watch's creation.

    def release(self) -> None:
        """Closes the connection; by the reading thread, once it reads no more."""
        self._conn.close()

    def close(self) -> None:
        """Ends the watch: a reader blocked in next_change wakes and raises
        (and closes the connection). Safe from any thread, more than once."""
        self._closed = True
        sock = getattr(self._conn, "deadline_socket", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class EtcdClient:
    """Calls to one etcd cluster through any of ``endpoints``.

    ``timeout``: the default deadline of a call, in seconds.

    ``https://`` endpoints are reached over TLS: the server's certificate
    is checked against ``ca_file`` (the system's authorities when None) and
    its host name; ``cert_file`` and ``key_file`` are this client's own
    certificate, for an etcd that asks for one (``--client-cert-auth``).
    ``username`` and ``password``: etcd's authentication; the client
    fetches a token (``/v3/auth/authenticate``), sends it with every call,
    and fetches a new one once when etcd says the token is no longer
    valid (a token that expired while the member was idle).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        timeout: float = 2.0,
        *,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        username: str | None = None,
        password: str | None = None,
    ):
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        if not endpoints:
            raise ValueError("etcd: at least one endpoint")
        if not timeout > 0:
            raise ValueError(f"etcd: the call deadline must be positive, not {timeout}")
        self.endpoints = [check_endpoint(e) for e in endpoints]
        self.timeout = float(timeout)
        self._preferred = 0  # the endpoint that answered last is tried first
        if key_file and not cert_file:
            raise ValueError("etcd: a key file without its certificate file")
        if (username is None) != (password is None):
            raise ValueError("etcd: a user name and a password, or neither")
        self._tls: ssl.SSLContext | None = None
        if any(e.startswith("https://") for e in self.endpoints):
            try:
                self._tls = ssl.create_default_context(cafile=ca_file)
                if cert_file:
                    self._tls.load_cert_chain(cert_file, key_file)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"etcd TLS files: {e}") from None
        elif ca_file or cert_file:
            raise ValueError("etcd: TLS files given, but no endpoint is https://")
        self._auth = (username, password) if username is not None else None
        self._token = ""
        self._token_lock = threading.Lock()
        self.authentications = 0  # tokens fetched
        # No proxy from the environment: the service is reached directly.
        handlers: list[Any] = [
            urllib.request.ProxyHandler({}),
            _NoRedirects(),
            _DeadlineHandler(),
        ]
        if self._tls is not None:
            handlers.append(_DeadlineHTTPSHandler(self._tls))
        self._opener = urllib.request.build_opener(*handlers)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = self._token
        return headers

    def _authenticate(self, deadline: float) -> None:
        """A new token from the user name and password (under _token_lock)."""
        assert self._auth is not None
        name, password = self._auth
        answer = self._post_once(
            "/v3/auth/authenticate",
            {"name": name, "password": password},
            deadline - time.monotonic(),
            with_token=False,
        )
        token = answer.get("token")
        if not isinstance(token, str) or not token:
            raise ClusterError("etcd authenticate: no token in the answer")
        self._token = token
        self.authentications += 1

    def _post(self, path: str, body: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        """A call, with a token when the client authenticates: one is
        fetched first when there is none, and once more when etcd says the
        one sent is not valid."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        if self._auth is None:
            return self._post_once(path, body, deadline - time.monotonic())
        with self._token_lock:
            if not self._token:
                self._authenticate(deadline)
            sent = self._token
        try:
            return self._post_once(path, body, deadline - time.monotonic())
        except ClusterError as e:
            if not e.bad_token:
                raise
        with self._token_lock:
            if self._token == sent:  # not fetched again by another thread meanwhile
                self._authenticate(deadline)
        return self._post_once(path, body, deadline - time.monotonic())

    def _in_turn(self, deadline: float, failures: list[str]) -> Iterator[tuple[str, float]]:
        """The endpoints, the one that answered last first, each with an
        equal share of the time left to ``deadline``; one whose turn comes
        after the deadline is noted in ``failures`` and skipped."""
        order = self.endpoints[self._preferred :] + self.endpoints[: self._preferred]
        for i, endpoint in enumerate(order):
            left = deadline - time.monotonic()
            if left <= 0:
                failures.append(f"{endpoint}: deadline passed before trying")
                continue
            yield endpoint, left / (len(order) - i)

    def _post_once(
        self, path: str, body: dict[str, Any], timeout: float, with_token: bool = True
    ) -> dict[str, Any]:
        """POSTs ``body`` to each endpoint in turn until one answers; the one
        place where failures become ClusterError."""
        data = json.dumps(body).encode()
        failures: list[str] = []
        for endpoint, share in self._in_turn(time.monotonic() + timeout, failures):
            request = urllib.request.Request(
                endpoint + path,
                data=data,
                headers=self._headers() if with_token else {"Content-Type": "application/json"},
                method="POST",
            )
            try:
                with self._opener.open(request, timeout=share) as r:
                    raw = r.read(MAX_RESPONSE_BYTES + 1)
                answer = self._decode(raw, endpoint, path)
            except urllib.error.HTTPError as e:
                # etcd answers errors with a status and a JSON body saying why.
                try:
                    info = json.loads(e.read(65536) or b"{}")
                except (ValueError, RecursionError, OSError):
                    info = {}
                if not isinstance(info, dict):  # a proxy's answer, not etcd's
                    info = {}
                message = info.get("message") or info.get("error") or e.reason
                code = info.get("code")
                # 408 and 429 (etcd's "too many requests") are one member's
                # passing state: another may answer.
                if code == GRPC_NOT_FOUND or (e.code < 500 and e.code not in (408, 429)):
                    raise ClusterError(
                        f"etcd {path} at {endpoint}: HTTP {e.code}: {message}",
                        not_found=code == GRPC_NOT_FOUND,
                        bad_token=with_token
                        and bool(self._token)
                        and "invalid auth token" in str(message),
                    ) from None
                # A member without a leader or quorum: another may answer.
                failures.append(f"{endpoint}: HTTP {e.code}: {message}")
                continue
            except ssl.SSLCertVerificationError as e:
                # Another endpoint would not answer better: say why at once.
                raise ClusterError(
                    f"etcd {path} at {endpoint}: TLS: certificate verify failed: {e.verify_message}"
                ) from None
            except (OSError, http.client.HTTPException, socket.timeout) as e:
                reason = getattr(e, "reason", None) or e
                if isinstance(reason, ssl.SSLCertVerificationError):
                    raise ClusterError(
                        f"etcd {path} at {endpoint}: TLS: certificate verify failed: "
                        f"{reason.verify_message}"
                    ) from None
                failures.append(f"{endpoint}: {type(reason).__name__}: {reason}")
                continue
            self._preferred = self.endpoints.index(endpoint)
            return answer
        raise ClusterError(f"etcd {path}: no endpoint answered: {'; '.join(failures)}")

    @staticmethod
    def _decode(raw: bytes, endpoint: str, path: str) -> dict[str, Any]:
        if len(raw) > MAX_RESPONSE_BYTES:
            raise ClusterError(
                f"etcd {path} at {endpoint}: answer over {MAX_RESPONSE_BYTES} B", too_large=True
            )
        try:
            answer = json.loads(raw)
        except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep
            raise ClusterError(f"etcd {path} at {endpoint}: not JSON: {e}") from None
        if not isinstance(answer, dict):
            raise ClusterError(f"etcd {path} at {endpoint}: not a JSON object")
        if "error" in answer and "header" not in answer and "result" not in answer:
            raise ClusterError(
                f"etcd {path} at {endpoint}: {answer.get('message') or answer['error']}",
                not_found=answer.get("code") == GRPC_NOT_FOUND,
            )
        return answer

    # Leases

    def grant(self, ttl: int, timeout: float | None = None) -> int:
        """A new lease of ``ttl`` seconds; its id."""
        answer = self._post("/v3/lease/grant", {"TTL": int(ttl)}, timeout)
        try:
            lease = _int(answer.get("ID"))
        except ValueError as e:
            raise ClusterError(f"etcd lease grant: {e}") from None
        if lease == 0 or answer.get("error"):
            raise ClusterError(f"etcd lease grant refused: {answer.get('error') or answer}")
        return lease

    def keepalive(self, lease: int, timeout: float | None = None) -> int:
        """Renews ``lease``; its TTL. ClusterError(not_found=True) when the
        lease has expired or was revoked."""
        answer = self._post("/v3/lease/keepalive", {"ID": str(lease)}, timeout)
        result = answer.get("result")
        if not isinstance(result, dict):
            raise ClusterError(f"etcd lease keepalive: unexpected answer {answer!r:.200}")
        try:
            ttl = _int(result.get("TTL"))
        except ValueError as e:
            raise ClusterError(f"etcd lease keepalive: {e}") from None
        if ttl <= 0:
            raise ClusterError(f"etcd lease {lease:x} has expired", not_found=True)
        return ttl

    def revoke(self, lease: int, timeout: float | None = None) -> None:
        """Ends ``lease`` and deletes its keys; a lease already gone is fine."""
        try:
            self._post("/v3/lease/revoke", {"ID": str(lease)}, timeout)
        except ClusterError as e:
            if not e.not_found:
                raise

    # Keys

    def put(self, key: bytes, value: bytes, lease: int = 0, timeout: float | None = None) -> int:
        """Stores ``value`` at ``key`` (attached to ``lease`` unless 0); the
        revision of the store after the put."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        answer = self._post("/v3/kv/put", body, timeout)
        return self._revision(answer)

    def create(
        self, key: bytes, value: bytes, lease: int = 0, timeout: float | None = None
    ) -> KeyValue | None:
        """Stores ``value`` at ``key`` only if no such key exists: None when
        stored, else the key that is already there."""
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        body = {
            "compare": [{"target": "CREATE", "key": _b64(key), "create_revision": "0"}],
            "success": [{"request_put": put}],
            "failure": [{"request_range": {"key": _b64(key)}}],
        }
        answer = self._post("/v3/kv/txn", body, timeout)
        if answer.get("succeeded"):
            return None
        try:
            kvs = answer["responses"][0]["response_range"].get("kvs") or []
            found = [self._kv(kv) for kv in kvs]
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise ClusterError(f"etcd txn: unexpected answer: {e!r}") from None
        # The key may have expired between the compare and the range.
        return found[0] if found else None

    def get(self, key: bytes, timeout: float | None = None) -> KeyValue | None:
        """The key ``key``; None when there is none (or etcd sent it in a
        form this client cannot read)."""
        items = self._items(self._post("/v3/kv/range", {"key": _b64(key)}, timeout))
        return next((kv for kv in items if isinstance(kv, KeyValue)), None)

    def increase(self, key: bytes, floor: int, timeout: float | None = None) -> int:
        """Stores at ``key`` (no lease) the decimal integer that is the
        larger of ``floor`` and one more than the integer there, and returns
        it: a compare-and-swap on the key's revision, tried again when
        another writer came between, so callers at once get distinct
        values. A value there that is not a decimal integer below 2^63 - 1
        counts as 0."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClusterError(f"etcd increase of {key[:80]!r}: deadline passed")
            kv = self.get(key, left)
            last = 0
            if kv is not None:
                text = kv.value.decode("ascii", "replace")
                last = int(text) if text.isdigit() and len(text) <= 20 else 0
                if last >= _MAX_COUNT:  # no larger value fits: start again from the floor
                    last = 0
            value = max(int(floor), last + 1)
            compare = (
                {"target": "MOD", "key": _b64(key), "mod_revision": str(kv.mod_revision)}
                if kv is not None
                else {"target": "CREATE", "key": _b64(key), "create_revision": "0"}
            )
            body = {
                "compare": [compare],
                "success": [
                    {"request_put": {"key": _b64(key), "value": _b64(str(value).encode())}}
                ],
            }
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClusterError(f"etcd increase of {key[:80]!r}: deadline passed")
            if self._post("/v3/kv/txn", body, left).get("succeeded"):
                return value

    def range_prefix(
        self, prefix: bytes, timeout: float | None = None
    ) -> tuple[int, list[KeyValue | str]]:
        """Every key under ``prefix``: (revision, items). An item that etcd
        sent in a form this client cannot read is a str saying why, so one
        bad entry does not hide the others."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        end = _b64(prefix_end(prefix))
        body: dict[str, Any] = {"key": _b64(prefix), "range_end": end}
        try:
            answer = self._post("/v3/kv/range", body, timeout)
        except ClusterError as e:
            if not e.too_large:
                raise
            # Values too large all together (entries nobody should have put
            # there): page through them, at the revision of the first page.
            return self._range_in_pages(prefix, deadline)
        return self._revision(answer), self._items(answer)

    def _items(self, answer: dict[str, Any]) -> list[KeyValue | str]:
        kvs = answer.get("kvs") or []
        if not isinstance(kvs, list):
            raise ClusterError("etcd range: kvs is not a list")
        items: list[KeyValue | str] = []
        for kv in kvs:
            try:
                items.append(self._kv(kv))
            except (TypeError, ValueError, AttributeError) as e:
                items.append(f"unreadable entry: {e}")
        return items

    def _range_in_pages(self, prefix: bytes, deadline: float) -> tuple[int, list[KeyValue | str]]:
        """range_prefix one page at a time, halving a page whose answer is
        too large; an entry too large alone is listed as a str and skipped."""
        end = _b64(prefix_end(prefix))
        start, revision, limit = prefix, 0, 64
        items: list[KeyValue | str] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClusterError("etcd range: deadline passed while paging")
            body: dict[str, Any] = {"key": _b64(start), "range_end": end, "limit": limit}
            if revision:
                body["revision"] = revision
            try:
                answer = self._post("/v3/kv/range", body, left)
            except ClusterError as e:
                if not e.too_large:
                    raise
                answer = None
            if answer is None:
                if limit > 1:
                    limit //= 2
                    continue
                # One entry alone is over the limit: learn its key, skip it.
                body["keys_only"] = True
                answer = self._post("/v3/kv/range", body, deadline - time.monotonic())
                page = self._items(answer)
                if not page or not isinstance(page[0], KeyValue):
                    raise ClusterError("etcd range: an entry over the limit has no readable key")
                revision = revision or self._revision(answer)
                items.append(f"entry {page[0].key[:80]!r} over {MAX_RESPONSE_BYTES} B")
                start = page[0].key + b"\0"
                continue
            revision = revision or self._revision(answer)
            page = self._items(answer)
            items.extend(page)
            last = next((kv.key for kv in reversed(page) if isinstance(kv, KeyValue)), None)
            if not answer.get("more") or last is None:
                return revision, items
            start = last + b"\0"

    def watch_prefix(self, prefix: bytes, timeout: float | None = None) -> PrefixWatch:
        """Watches every key under ``prefix`` from now on. Creating it has the
        call deadline (the endpoints in turn, as every call); the watch then
        lives until closed or broken."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        if self._auth is not None:
            with self._token_lock:
                if not self._token:
                    self._authenticate(deadline)
        body = json.dumps(
            {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}}
        )
        failures: list[str] = []
        for endpoint, share in self._in_turn(deadline, failures):
            conn = _connection(endpoint, share, self._tls)
            try:
                conn.request("POST", "/v3/watch", body, self._headers())
                response = conn.getresponse()
                if response.status != 200:
                    raise ClusterError(f"HTTP {response.status}")
                watch = PrefixWatch(conn, response, endpoint)
                # The first line says the watch was created; then no deadline.
                first = response.readline(MAX_RESPONSE_BYTES + 1)
                answer = json.loads(first) if first.endswith(b"\n") else None
                result = answer.get("result") if isinstance(answer, dict) else None
                if not isinstance(result, dict) or not result.get("created"):
                    raise ClusterError(f"not a watch's creation: {first[:200]!r}")
                watch.revision = self._revision(result)
                conn.deadline_socket.lift()
                return watch
            except (
                ClusterError,
                OSError,
                http.client.HTTPException,
                ValueError,
                RecursionError,
            ) as e:
                conn.close()
                failures.append(f"{endpoint}: {type(e).__name__}: {e}")
                continue
        raise ClusterError(f"etcd watch: no endpoint answered: {'; '.join(failures)}")

    def delete_prefix(self, prefix: bytes, timeout: float | None = None) -> int:
        """Deletes every key under ``prefix``; how many were deleted."""
        body = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        answer = self._post("/v3/kv/deleterange", body, timeout)
        try:
            return _int(answer.get("deleted"))
        except ValueError as e:
            raise ClusterError(f"etcd deleterange: {e}") from None

    def delete(self, key: bytes, timeout: float | None = None) -> int:
        answer = self._post("/v3/kv/deleterange", {"key": _b64(key)}, timeout)
        try:
            return _int(answer.get("deleted"))
        except ValueError as e:
            raise ClusterError(f"etcd deleterange: {e}") from None

    @staticmethod
    def _revision(answer: dict[str, Any]) -> int:
        header = answer.get("header")
        try:
            if not isinstance(header, dict):
                raise ValueError("no header")
            return _int(header.get("revision"))
        except ValueError as e:
            raise ClusterError(f"etcd: answer without a revision: {e}") from None

    @staticmethod
    def _kv(kv: Any) -> KeyValue:
        if not isinstance(kv, dict):
            raise ValueError("not an object")
        return KeyValue(
            key=_unb64(kv.get("key")),
            value=_unb64(kv.get("value", "")),
            lease=_int(kv.get("lease")),
            create_revision=_int(kv.get("create_revision")),
            mod_revision=_int(kv.get("mod_revision")),
        )
