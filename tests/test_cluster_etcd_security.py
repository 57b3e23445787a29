"""Membership against an etcd that asks for TLS (a client certificate too)
and for a user name and password, as production etcd clusters do: real etcd
processes, certificates made by the openssl command for each test."""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from cascade.cluster import ClusterError, EtcdClient, Membership, cluster_options
from etcd_process import ETCD, SKIP_REASON, EtcdProcess

OPENSSL = shutil.which("openssl")
pytestmark = [
    pytest.mark.skipif(ETCD is None, reason=SKIP_REASON),
    pytest.mark.skipif(OPENSSL is None, reason="the openssl command is not installed"),
]


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def openssl(*args: str) -> None:
    subprocess.run([OPENSSL, *args], check=True, capture_output=True, timeout=60)


def make_pki(d: str) -> dict[str, str]:
    """A certificate authority, a server certificate for 127.0.0.1 and a
    client certificate, all signed by it; a second authority that signed
    nothing here."""
    p = {n: os.path.join(d, n) for n in ("ca.key", "ca.pem", "other.key", "other.pem")}
    for name in ("ca", "other"):
        openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-keyout", p[f"{name}.key"], "-out", p[f"{name}.pem"], "-subj", f"/CN=test {name}",
        )  # fmt: skip
    ext = os.path.join(d, "san.ext")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        key, csr, pem = (os.path.join(d, f"{name}.{x}") for x in ("key", "csr", "pem"))
        openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
            "-subj", f"/CN={name}",
        )  # fmt: skip
        openssl(
            "x509", "-req", "-in", csr, "-CA", p["ca.pem"], "-CAkey", p["ca.key"],
            "-CAcreateserial", "-days", "2", "-out", pem, "-extfile", ext,
        )  # fmt: skip
        p[f"{name}.key"], p[f"{name}.pem"] = key, pem
    return p


@pytest.fixture
def tmpdir_() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="cascade-etcd-tls-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tls_etcd(tmpdir_) -> Iterator[tuple[EtcdProcess, dict[str, str]]]:
    pki = make_pki(tmpdir_)
    context = ssl.create_default_context(cafile=pki["ca.pem"])
    context.load_cert_chain(pki["client.pem"], pki["client.key"])
    server = EtcdProcess(
        os.path.join(tmpdir_, "data"),
        scheme="https",
        extra_args=(
            f"--cert-file={pki['server.pem']}",
            f"--key-file={pki['server.key']}",
            f"--trusted-ca-file={pki['ca.pem']}",
            "--client-cert-auth",
        ),
        context=context,
    )
    server.start()
    yield server, pki
    server.kill()


def test_members_over_tls_with_client_certificates(tls_etcd):
    etcd, pki = tls_etcd

    def client(**kw) -> EtcdClient:
        return EtcdClient([etcd.endpoint], timeout=2.0, **kw)

    good = dict(ca_file=pki["ca.pem"], cert_file=pki["client.pem"], key_file=pki["client.key"])
    a = Membership(client(**good), "t", "a", lease_ttl=3, refresh_seconds=0.2)
    b = Membership(client(**good), "t", "b", lease_ttl=3, refresh_seconds=0.2)
    try:
        assert a.start() and b.start()
        wait_for(lambda: a.view().ids() == b.view().ids() == ["a", "b"], 5, "both see both")
        wait_for(lambda: a.state()["watching"], 5, "the watch runs over TLS")
        b.close()
        wait_for(lambda: a.view().ids() == ["a"], 3, "a sees b leave")
    finally:
        a.close()
        b.close()

    # The server's certificate from an authority the client does not trust:
    # refused at once, saying why.
    with pytest.raises(ClusterError, match="TLS: certificate verify failed"):
        client(
            ca_file=pki["other.pem"], cert_file=pki["client.pem"], key_file=pki["client.key"]
        ).grant(5)
    # No client certificate where etcd asks for one: no answer.
    with pytest.raises(ClusterError):
        client(ca_file=pki["ca.pem"]).grant(5)
    # Plain HTTP to a TLS port: no answer either.
    with pytest.raises(ClusterError):
        EtcdClient([etcd.endpoint.replace("https://", "http://")], timeout=1.0).grant(5)


def test_bad_tls_settings_are_refused_with_their_reason(tmpdir_):
    with pytest.raises(ValueError, match="no endpoint is https"):
        EtcdClient(["http://127.0.0.1:1"], ca_file="/x")
    with pytest.raises(ValueError, match="TLS files"):
        EtcdClient(["https://127.0.0.1:1"], ca_file=os.path.join(tmpdir_, "absent.pem"))
    with pytest.raises(ValueError, match="key file without"):
        EtcdClient(["https://127.0.0.1:1"], key_file="/k")
    with pytest.raises(ValueError, match="user name and a password"):
        EtcdClient(["http://127.0.0.1:1"], username="u")
    for bad in (
        {"endpoints": "http://x:1", "ca_file": "/ca.pem"},
        {"endpoints": "https://x:1", "key_file": "/k"},
        {"endpoints": "http://x:1", "username": "u"},
        {"endpoints": "http://x:1", "password_file": "/p"},
        {"endpoints": "https://x:1", "ca_file": 3},
    ):
        with pytest.raises(ValueError):
            cluster_options(bad, "/s")
    o = cluster_options(
        {"endpoints": "https://x:1", "ca_file": "/ca", "username": "u", "password_file": "/p"},
        "/s",
    )
    assert o.ca_file == "/ca" and o.username == "u" and o.password_file == "/p"


def test_a_password_file_that_is_no_small_regular_file_is_refused(tmp_path):
    """A FIFO (which held the start), a device without end (which grew the
    memory until the kernel ended the server), a file too large: each
    refused with a message naming the option."""
    from cascade.serve import _etcd_client

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 10_000)
    good = tmp_path / "good"
    good.write_text("secret\n")
    for path, why in (
        (fifo, "not a regular file"),
        ("/dev/zero", "not a regular file"),
        (big, "more than"),
    ):
        o = cluster_options(
            {"endpoints": "http://127.0.0.1:1", "username": "u", "password_file": str(path)}, "/s"
        )
        with pytest.raises(ValueError, match=f"cluster.password_file: .*{why}"):
            _etcd_client(o)
    o = cluster_options(
        {"endpoints": "http://127.0.0.1:1", "username": "u", "password_file": str(good)}, "/s"
    )
    assert _etcd_client(o) is not None


def call(endpoint: str, path: str, body: dict, token: str = "") -> dict:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = token
    req = urllib.request.Request(endpoint + path, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


@pytest.fixture
def auth_etcd(tmpdir_) -> Iterator[EtcdProcess]:
    # Tokens that expire after one idle second, so a member meets an
    # expired one.
    server = EtcdProcess(os.path.join(tmpdir_, "data"), extra_args=("--auth-token-ttl=1",))
    server.start()
    e = server.endpoint
    call(e, "/v3/auth/user/add", {"name": "root", "password": "root-secret"})
    call(e, "/v3/auth/role/add", {"name": "root"})
    call(e, "/v3/auth/user/grant", {"user": "root", "role": "root"})
    call(e, "/v3/auth/role/add", {"name": "cascade"})
    prefix = b"/cascade/"
    call(
        e,
        "/v3/auth/role/grant",
        {
            "name": "cascade",
            "perm": {
                "key": base64.b64encode(prefix).decode(),
                "range_end": base64.b64encode(b"/cascade0").decode(),
                "permType": "READWRITE",
            },
        },
    )
    call(e, "/v3/auth/user/add", {"name": "member", "password": "pa ss\u00e9"})
    call(e, "/v3/auth/user/grant", {"user": "member", "role": "cascade"})
    call(e, "/v3/auth/enable", {})
    yield server
    server.kill()


def test_members_authenticate_and_renew_an_expired_token(auth_etcd):
    e = auth_etcd.endpoint
    # Without a user: refused, and the error says so.
    with pytest.raises(ClusterError, match="user name|permission|token"):
        EtcdClient([e], timeout=2.0).range_prefix(b"/cascade/t/")
    with pytest.raises(ClusterError, match="authentication failed|invalid"):
        EtcdClient([e], timeout=2.0, username="member", password="wrong").range_prefix(
            b"/cascade/t/"
        )

    def member(name: str) -> Membership:
        client = EtcdClient([e], timeout=2.0, username="member", password="pa ss\u00e9")
        return Membership(client, "t", name, lease_ttl=4, refresh_seconds=0.2)

    a, b = member("a"), member("b")
    try:
        assert a.start() and b.start()
        wait_for(lambda: a.view().ids() == b.view().ids() == ["a", "b"], 5, "both see both")
        wait_for(lambda: a.state()["watching"], 5, "the watch runs with a token")
        # A client left idle past the token's TTL gets a new token on its next call.
        idle = EtcdClient([e], timeout=2.0, username="member", password="pa ss\u00e9")
        assert idle.range_prefix(b"/cascade/t/")[1]
        time.sleep(2.5)
        _, items = idle.range_prefix(b"/cascade/t/")
        assert len(items) == 2 and idle.authentications == 2
        failures = a.state()["refresh_failures"] + a.state()["renew_failures"]
        time.sleep(1.5)
        assert a.state()["refresh_failures"] + a.state()["renew_failures"] == failures
        b.close()
        wait_for(lambda: a.view().ids() == ["a"], 3, "a sees b leave")
    finally:
        a.close()
        b.close()
