"""CascadeConnector under real vLLM (0.33) across a cluster of node servers:
an engine on node A saves a prompt's KV through its node's pool server; an
engine on node B, with its own pool server in the same cluster, finds the
whole prefix in its scheduler's lookup (asked through its workers, whose
store asks its pool server, which asks the blocks' owners) and loads it byte
for byte. Run by `make test-vllm` (tests/vllm/vllm_harness.py)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed here: `make test-vllm` runs these tests in .venv-vllm",
)

from vllm_harness import SAMPLED_TOKEN, Engine, make_vllm_config, write_tiny_llama  # noqa: E402

from cascade import _core  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/cluster_helpers.py
from cluster_helpers import in_process_cluster  # noqa: E402

BS = 16
PROMPT = list(range(500, 580))  # 5 full blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.skipif(not _core.HAVE_UCX, reason="built without a transport (UCX)")
@pytest.mark.parametrize("layerwise", [False, True])
def test_an_engine_on_another_node_loads_the_prefix_this_one_saved(model_dir, layerwise):
    def engine(sock):
        vc = make_vllm_config(
            model_dir, {"pool_socket": sock, "lookup_timeout_ms": 30000, "use_layerwise": layerwise}
        )
        return Engine(vc, num_blocks=64)

    with in_process_cluster(3) as (socks, servers):
        # vLLM keeps one KV transfer group per process: the engines run one
        # after the other, as on two machines.
        a = engine(socks[0])
        try:
            a.add("a", PROMPT)
            a.run()
            assert a.ranks[0].wait_all_saves()
            assert a.ranks[0].counters()["save_blocks"] == 5
        finally:
            a.close()
        assert servers[0].cluster_drain(10000)

        b = engine(socks[1])
        try:
            req = b.add("b", PROMPT)
            # The whole prefix but the last block, whose last token vLLM computes.
            assert b.connector.get_num_new_matched_tokens(req, 0) == (4 * BS, False)
            out, kv_out = b.step()
            assert out.scheduled_new_reqs[0].num_computed_tokens == 4 * BS
            assert not kv_out.invalid_block_ids
            for i in range(4):
                assert b.page_is_computed("b", i, PROMPT)
            b.run()
            assert list(req.output_token_ids) == [SAMPLED_TOKEN] * 2
            assert b.ranks[0].counters()["load_blocks"] == 4
        finally:
            b.close()
        stats = servers[1].cluster_stats()
        # Node B's server fetched the blocks from their owners, or (servers of
        # one host map each other's arenas) its client copied them from there.
        assert stats["remote_hits"] > 0 and stats["fetched"] + stats["mapped_leases"] > 0
        assert stats["checksum_failures"] == 0
        assert servers[1].stats()["connections"] == 1 and servers[0].stats()["connections"] == 1
