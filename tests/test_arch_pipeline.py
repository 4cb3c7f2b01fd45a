"""Past the decode loop on an MLA model and on hybrid sliding/full models (tiny, random weights): traces, training,
the learned policy, and serving.

The traces record the heads the cache holds (one latent head for MLA), a sliding layer's labels follow its tokens
as its window drops the oldest, and the trained scorer decodes within budget, below and above the window. The
serving path (the vLLM plugin and the paged simulator), which governs one full-attention cache per layer, refuses
in one line every model of the architecture matrix whose attention is not that, and serves the others.
"""

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import learnkv.attention as attention
from learnkv.config import load_config
from learnkv.decode import generate
from learnkv.policies import make_policy
from learnkv.prompts import Prompt
from learnkv.scorer.artifact import ArtifactError, load_scorer, read_artifact_manifest
from learnkv.traces.collect import CollectConfig, collect
from learnkv.traces.onpolicy import record
from learnkv.traces.record import FLOAT_LABELS, Recorder
from learnkv.traces.store import TraceError, load_traces

from learnkv.serving.vllm import compat

from architectures import BASE, FAMILIES, WINDOW

TEXTS = ["Tom has 3 apples and buys 5 more. How many apples does he have now? Count them.",
         "A train travels 60 km per hour for 2 hours. How far does it go?",
         "What is 15 plus 27?"]
PROMPTS = [Prompt(id=f"p{i}", source="test", text=t, answer="", split=s)
           for i, (t, s) in enumerate(zip(TEXTS, ["train", "validation", "train"]))]
TEACHERS = ("h2o", "snapkv", "lazy", "rkv")


def build(family: str, tokenizer):
    """The architecture matrix's tiny model of ``family`` with the tokenizer's vocabulary, on learnkv's attention."""
    fam = FAMILIES[family]
    attention.register()
    fam = dataclasses.replace(fam, overrides={**fam.overrides, "vocab_size": len(tokenizer)})
    return fam.build(attn_implementation=attention.NAME)


@pytest.fixture(scope="module")
def models(smollm2_tokenizer):
    return {f: build(f, smollm2_tokenizer) for f in ("deepseek-v3", "gemma3-text")}


@pytest.mark.parametrize("family, policy, heads", [("deepseek-v3", "full", 1), ("deepseek-v3", "h2o", 1),
                                                   ("gemma3-text", "full", 2), ("gemma3-text", "h2o", 2)])
def test_collect_train_and_decode_with_the_learned_policy(models, smollm2_tokenizer, tmp_path, family, policy, heads):
    """Traces (full cache, or on-policy under h2o), a two-epoch fit, and the exported scorer decoding: the manifest
    and artifact carry the cached KV heads (one latent head for MLA, not the config's 4), and every layer stays
    within the budget, below the sliding window (every layer governed) and above it (only the full layers)."""
    from learnkv.scorer.fit import train

    model, tok = models[family], smollm2_tokenizer
    cfg = load_config(None, [f"trace_dir={tmp_path / 'traces'}", f"out_dir={tmp_path / 'out'}", "wandb.mode=disabled",
                             "collect.prompts=2", "collect.val_prompts=1", "collect.max_new_tokens=24",
                             "collect.decisions_per_prompt=2", "collect.horizon=6", "collect.chat=false",
                             f"collect.teachers=[{','.join(TEACHERS)}]", f"collect.policy={policy}",
                             "train.max_epochs=2", "train.batch_size=4"])
    manifest, stats = collect(cfg.trace_dir, cfg.collect, model=model, tokenizer=tok, prompts=PROMPTS, progress=False)
    assert manifest["n_kv_heads"] == heads and stats.rows > 0
    assert {r["n_heads"] for r in load_traces(cfg.trace_dir)} == {heads}
    assert {r["layer"] for r in load_traces(cfg.trace_dir)} == {0, 1}  # both layers: sliding and full
    artifact, metrics, _ = train(cfg, progress=False)
    assert read_artifact_manifest(artifact)["n_kv_heads"] == heads and metrics
    for budget in (WINDOW - 3, WINDOW + 4):  # below and above the window's 7 held tokens
        out = generate(model, tok, TEXTS[:2], policy="learned", budget=budget, max_new_tokens=16, chat=False,
                       policy_params={"scorer": str(artifact), "n_sink": 1, "n_recent": 2})
        assert out.max_kept_tokens <= budget
        assert max(n for step in out.kept_rows for layer in step for n in layer) <= budget


def test_mla_content_traces_are_refused_in_one_line(models, smollm2_tokenizer, tmp_path):
    """MLA caches a latent and its rotary key part, not value vectors: content traces are refused before decoding."""
    cfg = CollectConfig(prompts=2, val_prompts=1, max_new_tokens=24, horizon=6, chat=False, record_values=True)
    with pytest.raises(TraceError, match=r"^DeepseekV3ForCausalLM caches a latent .* not value vectors") as err:
        collect(tmp_path, cfg, model=models["deepseek-v3"], tokenizer=smollm2_tokenizer, prompts=PROMPTS,
                progress=False)
    assert "\n" not in str(err.value)


def test_a_model_the_cache_cannot_govern_is_refused_before_any_trace(smollm2_tokenizer, tmp_path):
    """Bloom's attention bypasses transformers' interface: collection (full cache or on-policy, so train.py too)
    stops in `generate`'s one line after the first prefill, and writes no shard or manifest."""
    fam = FAMILIES["bloom"]
    model = dataclasses.replace(fam, overrides={**fam.overrides, "vocab_size": len(smollm2_tokenizer)}).build()
    for policy in ("full", "h2o"):
        cfg = CollectConfig(prompts=2, val_prompts=1, max_new_tokens=24, horizon=6, chat=False, policy=policy)
        with pytest.raises(ValueError, match=r"^BloomForCausalLM cannot decode under a learnkv budget: ") as err:
            collect(tmp_path / policy, cfg, model=model, tokenizer=smollm2_tokenizer, prompts=PROMPTS, progress=False)
        assert "\n" not in str(err.value)
        assert not [p for p in (tmp_path / policy).iterdir() if not p.name.startswith(".lock")]


def test_sliding_layer_labels_follow_the_tokens_the_window_drops(models, smollm2_tokenizer):
    """In a sliding layer the window drops the oldest tokens during a decision's horizon (the slots move). Three
    routes to the labels agree: the full-cache recorder with compaction (slots move: matched by position), with
    slack enough that nothing compacts (slots stay), and the on-policy branch at a budget no row reaches."""
    model, tok = models["gemma3-text"], smollm2_tokenizer
    texts, steps = TEXTS[:2], [frozenset({2, 7}), frozenset({4, 11})]
    branched, result = record(model, tok, texts, make_policy("h2o", n_recent=4), [1000, 1000], steps, TEACHERS,
                              horizon=6, label_budget=0.25, max_new_tokens=24, chat=False)
    runs = {}
    for slack in (0, 1000):
        rec = Recorder(n_layers=2, teachers=TEACHERS, decision_steps=tuple(steps), horizon=6, label_budget=0.25)
        full = generate(model, tok, texts, policy=rec, max_new_tokens=24, chat=False, slack=slack)
        assert full.tokens.tolist() == result.tokens.tolist()
        runs[slack] = [rec.decisions(b, full.new_tokens[b]) for b in range(2)]
    sliding = 0  # gemma3-text's layer types: sliding, full
    for b in range(2):
        assert len(branched[b]) == len(runs[0][b]) == len(runs[1000][b]) == 4
        assert any(d.layer == sliding and d.positions.shape[-1] == WINDOW for d in runs[0][b])  # the window is full
        for d, moved, kept in zip(branched[b], runs[0][b], runs[1000][b]):
            assert (d.step, d.layer) == (moved.step, moved.layer) == (kept.step, kept.layer)
            assert torch.equal(d.positions, moved.positions) and torch.equal(d.positions, kept.positions)
            for k in FLOAT_LABELS:
                assert torch.allclose(moved.labels[k], kept.labels[k], rtol=1e-4, atol=1e-6), (d.layer, k)
                assert torch.allclose(d.labels[k], kept.labels[k], rtol=1e-4, atol=1e-6), (d.layer, k)
            for k in TEACHERS:  # the acting runs are the same (slack 0): teachers match exactly
                assert torch.allclose(d.teachers[k], moved.teachers[k], rtol=1e-4, atol=1e-6), k
            if d.layer != sliding:  # near-uniform attention of this tiny model ties the sliding layer's top-k
                assert torch.equal(d.labels["reenter"], moved.labels["reenter"])
            assert torch.equal(moved.labels["reenter"], kept.labels["reenter"])


#: the families of the architecture matrix whose attention is not one plain full-attention cache per layer
NOT_SERVED = {"mistral-window": "a sliding window of 8 tokens", "phi3-window": "a sliding window of 8 tokens",
              "qwen2-window": "1 of its 2 layers are sliding_attention", "gemma3-text": "1 of its 2 layers are sliding",
              "gemma2": "sliding_attention .*; attention logit softcapping \\(5.0\\)",
              "gpt-oss": "1 of its 2 layers are sliding", "deepseek-v2": "multi-head latent attention",
              "deepseek-v3": "multi-head latent attention"}


def family_config(name: str):
    """The config of the matrix's tiny model of family ``name`` (no weights built)."""
    import transformers

    fam = FAMILIES[name]
    kw = {k: v for k, v in {**BASE, **fam.overrides}.items() if not (v is None and k in BASE)}
    return getattr(transformers, fam.config)(**kw)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_vllm_plugin_serves_full_attention_models_and_refuses_the_others_in_one_line(name):
    """`compat.refuse_model` (run by the plugin's attention backends at model load and by the connector at start-up,
    before any request) on vLLM's ``ModelConfig`` shape: every family of the matrix is either served or refused in
    one line naming the model."""
    cfg = family_config(name)
    model_config = SimpleNamespace(model=f"tiny/{name}", hf_config=cfg, hf_text_config=cfg, use_mla=False)
    if name not in NOT_SERVED:
        assert compat.architecture_refusal(cfg) is None
        compat.refuse_model(model_config)
        return
    with pytest.raises(RuntimeError, match=rf"^learnkv vLLM plugin cannot serve tiny/{name} \(\w+\): .*"
                                           rf"{NOT_SERVED[name]}") as err:
        compat.refuse_model(model_config)
    assert "\n" not in str(err.value)


def test_vllm_attention_backend_refuses_terms_it_does_not_compute():
    """The check at model load (`compat.refuse_impl`, in both learnkv backends' ``__init__``), on the attributes
    vLLM's CPU and Triton implementations set: plain attention passes, each extra term is refused in one line; given
    the model's config, the model-level line comes first."""
    plain = dict(sinks=None, alibi_slopes=None, logits_soft_cap=0, sliding_window=(-1, -1))
    compat.refuse_impl(SimpleNamespace(**plain))
    compat.refuse_impl(SimpleNamespace(**{**plain, "logits_soft_cap": None, "sliding_window": None}))
    for change, word in [({"sinks": torch.zeros(4)}, "attention sinks"), ({"alibi_slopes": [0.5]}, "ALiBi"),
                         ({"logits_soft_cap": 50.0}, "attention logit softcapping \\(50.0\\)"),
                         ({"sliding_window": (7, 0)}, "a sliding window \\(7, 0\\)")]:
        with pytest.raises(RuntimeError, match=rf"^learnkv vLLM plugin: an attention layer of this model uses {word}"):
            compat.refuse_impl(SimpleNamespace(**{**plain, **change}))
    # given the model being loaded (vLLM builds the backends before it starts the connector), the model-level line
    cfg = family_config("gemma3-text")
    model_config = SimpleNamespace(model="tiny/gemma3-text", hf_config=cfg, hf_text_config=cfg, use_mla=False)
    with pytest.raises(RuntimeError, match=r"^learnkv vLLM plugin cannot serve tiny/gemma3-text \(\w+\): 1 of its 2 "
                                           r"layers are sliding_attention \(window 8\)"):
        compat.refuse_impl(SimpleNamespace(**{**plain, "sliding_window": (7, 0)}), model_config)
    llama = family_config("llama")
    compat.refuse_impl(SimpleNamespace(**plain),
                       SimpleNamespace(model="tiny/llama", hf_config=llama, hf_text_config=llama, use_mla=False))


def test_paged_simulator_refuses_what_the_plugin_refuses(models):
    from learnkv.serving.runtime import ServingRuntime
    from learnkv.serving.simulator import PagedSimulator

    runtime = ServingRuntime.__new__(ServingRuntime)  # never reached: the model is refused first
    for family, word in [("gemma3-text", "1 of its 2 layers are sliding"), ("deepseek-v3", "multi-head latent")]:
        model = models[family]
        with pytest.raises(ValueError, match=rf"^PagedSimulator cannot serve {type(model).__name__}: {word}"):
            PagedSimulator(model, runtime, num_blocks=8)


def test_committed_gemma_scorer_is_bound_to_gemma_3_270m():
    """docs/results/train-gemma/scorer (configs/train-gemma.yaml, docs/architectures.md's Gemma table) stays loadable
    with its digest, bound to Gemma-3-270M's name, 18 layers and one KV head, and refused for another model."""
    path = Path(__file__).resolve().parent.parent / "docs" / "results" / "train-gemma" / "scorer"
    _, manifest = load_scorer(path, expect_model="gemma-3-270m", expect_layers=18, expect_kv_heads=1)
    assert manifest["model"] == "gemma-3-270m" and manifest["architecture"]["content_dim"] == 256
    assert load_scorer(path, expect_model="/home/u/.cache/learnkv/models/gemma-3-270m")[1] == manifest
    with pytest.raises(ArtifactError, match="trained for model 'gemma-3-270m'"):
        load_scorer(path, expect_model="smollm2-135m-instruct")
