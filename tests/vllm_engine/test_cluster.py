"""vLLM's real engine (CPU) across a cluster of node servers: an engine whose
connector uses node A's pool server saves a prompt; a fresh engine on node
B's pool server (the same cluster, its own arena) serves the same prompt
from what node A saved: the whole prefix but the last block is loaded, and
the tokens and log-probabilities are those of a full prefill. Servers of one
host map each other's arenas; the transport-only case runs too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from real_engine import BS, close_llm, generate, make_llm, metrics, prompt

from cascade import _core

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/cluster_helpers.py
from cluster_helpers import in_process_cluster  # noqa: E402

pytestmark = pytest.mark.skipif(not _core.HAVE_UCX, reason="built without a transport (UCX)")


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "transport"])
def test_an_engine_on_another_node_serves_the_prefix_this_one_saved(model_dir, mapped):
    n = 1500
    p = prompt(n, seed=21)
    with in_process_cluster(3, map_same_host=mapped) as (socks, servers):
        # vLLM keeps one KV transfer group per process: the engines run one
        # after the other, as on two machines.
        a = make_llm(model_dir, {"pool_socket": socks[0]})
        try:
            ref = generate(a, [p], salt="reference")[0]  # ids of its own: a full prefill
            generate(a, [p])  # saved through node A, pushed to the blocks' owners
        finally:
            close_llm(a)
        assert servers[0].cluster_drain(30000)

        b = make_llm(model_dir, {"pool_socket": socks[1], "lookup_timeout_ms": 30000})
        try:
            got = generate(b, [p])[0]
            m = metrics(b)
        finally:
            close_llm(b)
        hit = ((n - 1) // BS) * BS
        assert got[2] == hit  # vLLM computed only the tokens after the hit
        assert m["vllm:cascade_hit_tokens"] == hit
        assert got[0] == ref[0]
        assert got[1] == pytest.approx(ref[1], abs=1e-3)
        st = servers[1].cluster_stats()
        assert st["remote_hits"] > 0 and st["checksum_failures"] == 0
        if mapped:  # copied from the owners' arenas, nothing over UCX
            assert st["mapped_leases"] + st["fetched_mapped"] > 0
            assert st["fetched"] == st["fetched_mapped"]
        else:
            assert st["fetched"] > 0 and st["fetched_mapped"] == 0 and st["mapped_leases"] == 0
