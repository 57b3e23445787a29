"""`vllm serve` (vLLM's real CPU engine, its OpenAI server) with the Cascade
connector from --kv-transfer-config, prompts as token ids over HTTP: hits
shown on /metrics, a restarted server hitting the file tier, and two servers
sharing one node pool (`cascade serve`), also across a kill and restart of
that pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml
from real_engine import BS, SERVER_ENV, VllmServer, file_tier, free_port, prompt

from cascade import serve_status

PROMPT_TOKENS = 1500
HIT = (PROMPT_TOKENS - 1) // BS * BS


@pytest.fixture
def servers(model_dir, work):
    d, shm = work
    started: list[VllmServer] = []

    def start(extra, name):
        srv = VllmServer(
            model_dir,
            {"host_capacity": "64MiB", "shm_dir": shm, **extra},
            os.path.join(d, name + ".log"),
        )
        started.append(srv)
        return srv.wait_ready()

    yield start
    for srv in started:
        srv.stop()


def test_serve_hits_on_metrics_and_a_restarted_server_hits_the_file_tier(servers, work):
    d, shm = work
    files = file_tier(d)
    p = prompt(PROMPT_TOKENS, seed=7)
    a = servers(files, "a")
    full = a.complete(p)
    assert a.counter("vllm:cascade_save_blocks_total") == HIT // BS
    assert a.counter("vllm:cascade_hit_tokens_total") == 0
    assert a.complete(p) == full
    # The connector's counters on vLLM's Prometheus endpoint, labelled like vLLM's own.
    assert a.counter("vllm:cascade_lookup_requests_total") == 2
    assert a.counter("vllm:cascade_lookup_tokens_total") == 2 * PROMPT_TOKENS
    assert a.counter("vllm:cascade_hit_tokens_total", engine="0") == HIT
    assert a.counter("vllm:cascade_miss_tokens_total") == 2 * PROMPT_TOKENS - HIT
    assert a.counter("vllm:cascade_load_blocks_total") == HIT // BS
    assert a.counter("vllm:cascade_load_bytes_total") == a.counter("vllm:cascade_save_bytes_total")
    assert a.counter("vllm:cascade_tier_hits_total", tier="host") == HIT // BS
    # vLLM (no --shutdown-timeout) ends its worker with SIGKILL: the store is never
    # closed and its arena stays. The next engine's workers remove it.
    a.stop()
    left = os.listdir(shm)
    b = servers(files, "b")
    assert not set(left) & set(os.listdir(shm))
    assert len(os.listdir(shm)) == 1  # b's own
    if left:
        assert "removed the host arena of a stopped worker" in b.text()
    assert b.complete(p) == full
    assert b.counter("vllm:cascade_hit_tokens_total") == HIT
    assert b.counter("vllm:cascade_tier_hits_total", tier="file") == HIT // BS
    assert b.counter("vllm:cascade_load_errors_total") == 0


class PoolServer:
    """`cascade serve` on a host arena of its own; stop() ends it."""

    def __init__(self, d: str, shm: str, log: str = "pool.log", metrics_port: int = 0):
        self.socket = os.path.join(d, "pool.sock")
        self.metrics_port = metrics_port
        config = os.path.join(d, "pool.yaml")
        with open(config, "w") as f:
            store = {"shm_path": os.path.join(shm, "pool"), "shm_capacity_bytes": "64MiB"}
            serve = {"socket": self.socket, "metrics_port": metrics_port}
            yaml.safe_dump({**store, "serve": serve}, f)
        self.log = open(os.path.join(d, log), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cascade", "serve", "--config", config],
            env=SERVER_ENV,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )
        deadline = time.monotonic() + 30
        while not os.path.exists(serve_status.info_path(self.socket)):
            assert self.proc.poll() is None, f"cascade serve exited: {self.text()}"
            assert time.monotonic() < deadline, f"cascade serve not up: {self.text()}"
            time.sleep(0.05)

    def text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def clients(self) -> int:
        """Clients connected now (served on the metrics port)."""
        url = f"http://127.0.0.1:{self.metrics_port}/stats.json"
        return len(json.load(urllib.request.urlopen(url, timeout=10))["clients"])

    def kill(self) -> None:
        """SIGKILL, and the info file it leaves removed."""
        self.proc.kill()
        self.proc.wait()
        os.unlink(serve_status.info_path(self.socket))
        self.log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def loads_what_the_other_saved(saver, loader, q: list[int], deadline: float) -> None:
    """``saver``, which has saved nothing yet, answers prompt ``q``; once its
    saves are done (they finish after its reply; at most until ``deadline``),
    ``loader``, which has hit nothing yet, answers ``q`` the same, loading
    the whole prefix."""
    q_full = saver.complete(q)
    while saver.counter("vllm:cascade_save_blocks_total") < HIT // BS:
        assert time.monotonic() < deadline, "the saving replica did not save the prompt"
        time.sleep(0.1)
    assert loader.complete(q) == q_full
    assert loader.counter("vllm:cascade_hit_tokens_total") == HIT


def test_two_servers_share_the_node_pool(servers, work):
    d, shm = work
    pool = PoolServer(d, shm)
    try:
        p = prompt(PROMPT_TOKENS, seed=8)
        a = servers({"pool_socket": pool.socket}, "replica-a")
        full = a.complete(p)
        assert a.counter("vllm:cascade_save_blocks_total") == HIT // BS
        # Replica B, another engine process on the same pool, started while A runs.
        b = servers({"pool_socket": pool.socket}, "replica-b")
        assert b.complete(p) == full
        assert b.counter("vllm:cascade_hit_tokens_total") == HIT
        assert b.counter("vllm:cascade_load_blocks_total") == HIT // BS
        assert b.counter("vllm:cascade_save_blocks_total") == 0  # nothing new to save
        assert b.counter("vllm:cascade_load_errors_total") == 0
        # A different prompt saved by B is a hit for A.
        loads_what_the_other_saved(b, a, prompt(PROMPT_TOKENS, seed=9), time.monotonic() + 30)
    finally:
        for srv in (a, b) if "b" in locals() else ():
            srv.stop()
        pool.stop()


def test_running_servers_use_the_node_pool_again_after_it_is_killed_and_started_again(
    servers, work
):
    """The pool server is killed with SIGKILL while two `vllm serve` run on
    it, and started again: its arena comes back with the blocks (the
    engines' stores let go of it at once), the engines' stores connect again
    by themselves, and each engine loads what the other saved before the
    kill and after it."""
    d, shm = work
    port = free_port()
    pool = PoolServer(d, shm, metrics_port=port)
    try:
        p, q = prompt(PROMPT_TOKENS, seed=10), prompt(PROMPT_TOKENS, seed=11)
        a = servers({"pool_socket": pool.socket}, "replica-a")
        b = servers({"pool_socket": pool.socket}, "replica-b")
        full = a.complete(p)
        connected = pool.clients()
        pool.kill()
        pool = PoolServer(d, shm, log="pool-again.log", metrics_port=port)
        assert "still mapped by its clients" not in pool.text(), pool.text()
        deadline = time.monotonic() + 30
        while pool.clients() < connected:
            assert time.monotonic() < deadline, f"{pool.clients()} of {connected} clients back"
            time.sleep(0.05)
        assert b.complete(p) == full
        assert b.counter("vllm:cascade_hit_tokens_total") == HIT
        assert b.counter("vllm:cascade_load_errors_total") == 0
        loads_what_the_other_saved(b, a, q, deadline)
    finally:
        for srv in (a, b) if "b" in locals() else ():
            srv.stop()
        pool.stop()
