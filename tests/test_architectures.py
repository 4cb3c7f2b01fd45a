"""The architecture matrix: every decoder family learnkv supports decodes exactly, or is refused in one line.

Each family (tests/architectures.py) is a tiny random-weight model built from the installed transformers' config
class. A supported family must (a) give transformers' own eager decode's logits, to 1e-4, with the full cache and
with a policy whose budget is never reached, on a left-padded batch of two prompts, and (b) hold every layer within
the budget after every step under every policy (a sliding-window layer also within ``window - 1``). A refused family
must raise one line naming its model class before any token is generated.
"""

import pytest
import torch

from architectures import FAMILIES, VOCAB, WINDOW
from conftest import params_for, prefill_for, random_ids
from learnkv import POLICIES, generate

SUPPORTED = [name for name, f in FAMILIES.items() if f.refused is None]
PROMPT, NEW = 14, 8


@pytest.fixture(scope="module")
def models():
    """family -> (eager reference, learnkv model) with the same weights, built once per module."""
    built = {}

    def get(name):
        if name not in built:
            family = FAMILIES[name]
            built[name] = (family.build("eager"), family.build("eager"))
        return built[name]

    return get


def batch():
    """Two prompts of PROMPT and PROMPT - 4 tokens, left-padded into one batch."""
    ids = random_ids(PROMPT, batch=2, seed=1, vocab=VOCAB)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


def decode_logits(model, **kw):
    """Every step's logits ``[B, NEW, V]`` of a learnkv decode, and its result."""
    captured = []
    hook = model.register_forward_hook(lambda m, i, o: captured.append(o.logits[:, -1].clone()))
    try:
        result = generate(model, max_new_tokens=NEW, stop_at_eos=False, **kw)
    finally:
        hook.remove()
    return torch.stack(captured, dim=1), result


def eager_logits(model, ids, mask):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    return torch.stack(out.logits, dim=1), out.sequences[:, ids.shape[1]:]


@pytest.mark.parametrize("name", SUPPORTED)
def test_no_eviction_equals_transformers_eager(models, name):
    eager, ours = models(name)
    ids, mask = batch()
    expected, tokens = eager_logits(eager, ids, mask)
    for policy, budget in (("full", None), ("h2o", PROMPT + NEW)):
        logits, result = decode_logits(ours, input_ids=ids, attention_mask=mask, policy=policy, budget=budget)
        err = (logits - expected).abs().max().item()
        assert err <= 1e-4, f"{name} under {policy}: logits differ from transformers' eager decode by {err:.3g}"
        assert result.tokens.tolist() == tokens.tolist()


def _kv_heads(model) -> int:
    seen = []
    generate(model, input_ids=random_ids(4, vocab=VOCAB), max_new_tokens=1,
             observer=lambda c: seen.append(c.layers[0].keys.shape[1]))
    return seen[0]


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("name", SUPPORTED)
def test_every_layer_within_budget_under_every_policy(models, name, policy):
    _, ours = models(name)
    ids, mask = batch()
    budget = 10  # under the final length (22), over the policies' protected windows
    params = {"learned": {"scorer": params_for(policy, 2, n_kv_heads=_kv_heads(ours)).get("scorer"), "n_sink": 1,
                          "n_recent": 2},
              "paged": {"block_size": 4}}.get(policy, {})
    windows = []
    result = generate(ours, input_ids=ids, attention_mask=mask, policy=policy, budget=budget, max_new_tokens=NEW,
                      stop_at_eos=False, policy_params=params, observer=lambda c: windows.append(c.layer_windows()),
                      **prefill_for(policy))
    for step, (held, w) in enumerate(zip(result.kept_rows, windows)):
        for layer, rows in enumerate(held):
            limit = budget if policy != "full" else PROMPT + NEW
            if w[layer] is not None:
                limit = min(limit, w[layer] - 1)
            assert max(rows) <= limit, f"{name} {policy}: step {step}, layer {layer} holds {rows} (limit {limit})"
    assert result.peak_kv_bytes <= result.full_kv_bytes


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.refused is not None])
def test_refused_in_one_line_before_decoding(models, name):
    eager, _ = models(name)
    ids, mask = batch()
    steps = []
    with pytest.raises(ValueError, match=FAMILIES[name].refused) as err:
        generate(eager, input_ids=ids, attention_mask=mask, policy="h2o", budget=10, max_new_tokens=NEW,
                 on_step=steps.append)
    assert "\n" not in str(err.value) and not steps


def test_windows_are_what_the_config_says(models):
    """The cache learns each layer's window from what the model hands its attention: all, none, or a hybrid."""
    cases = {"mistral-window": [WINDOW, WINDOW], "mistral": [None, None], "gemma2": [WINDOW, None],
             "gemma3-text": [WINDOW, None], "gpt-oss": [WINDOW, None], "qwen2-window": [None, WINDOW]}
    for name, expected in cases.items():
        result = generate(models(name)[1], input_ids=random_ids(4, vocab=VOCAB), max_new_tokens=2)
        assert result.layer_windows == expected, name


def test_a_budget_at_least_the_window_leaves_sliding_layers_to_the_window(models):
    """Mistral with a window of 8 in every layer: at a budget >= window - 1 no policy ever decides (every layer is
    held at its window by age), so h2o decodes exactly as the full cache; below it the policy evicts there too."""
    _, ours = models("mistral-window")
    ids, mask = batch()
    full, _ = decode_logits(ours, input_ids=ids, attention_mask=mask)
    at_window, result = decode_logits(ours, input_ids=ids, attention_mask=mask, policy="h2o", budget=WINDOW - 1)
    assert torch.equal(full, at_window) and result.max_kept_tokens == WINDOW - 1
    below, result = decode_logits(ours, input_ids=ids, attention_mask=mask, policy="h2o", budget=4)
    assert result.max_kept_tokens == 4 and not torch.equal(full, below)


def test_full_cache_bytes_count_sliding_layers_bounded(models):
    """A hybrid model's full cache is bounded in its sliding layer (as transformers' own cache): the full run's peak
    is its full_kv_bytes (kv_share 1), and both count the sliding layer at its window, not every token."""
    _, ours = models("gemma2")  # layer 0 slides (window 8), layer 1 is full
    result = generate(ours, input_ids=random_ids(PROMPT, vocab=VOCAB), max_new_tokens=NEW)
    assert result.kept_rows[NEW - 2] == [[WINDOW - 1], [PROMPT + NEW - 2]]  # what the last pass attends, but itself
    cfg = ours.config
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # keys + values, fp32
    assert result.full_kv_bytes == ((WINDOW - 1) + (PROMPT + NEW - 2) + 2) * per_token  # not 2 * (PROMPT + NEW - 1)
    assert result.peak_kv_bytes == result.full_kv_bytes and result.summary()["kv_share"] == 1.0
    assert result.kept_share() == 1.0  # held over what a full cache of this model holds, step by step
    h2o = generate(ours, input_ids=random_ids(PROMPT, vocab=VOCAB), max_new_tokens=NEW, policy="h2o", budget=10)
    assert h2o.peak_kv_bytes == max(2 * PROMPT, (WINDOW - 1) + 10 + 2) * per_token


def test_a_layer_that_bypasses_learnkv_is_refused_by_structure(tiny):
    """The refusal is structural, not a list of names: a Llama whose layer 1 attends with transformers' eager
    function (its own config) never reaches the cache there, and generate refuses naming that layer."""
    import copy

    from learnkv.model import tiny_model

    model = tiny_model(seed=0)
    attn = model.model.layers[1].self_attn
    attn.config = copy.copy(attn.config)
    attn.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match=r"LlamaForCausalLM cannot decode .* in layer\(s\) 1 at the prefill"):
        generate(model, input_ids=random_ids(12), policy="h2o", budget=8, max_new_tokens=4)


@pytest.mark.parametrize("name, policy", [("gemma2", "h2o"), ("gpt-oss", "full")])  # window + softcap; + sinks
def test_triton_decode_path_equals_torch_path(models, monkeypatch, name, policy):
    """The fused decode kernel (the Triton interpreter here) honours the window, softcap and sinks: the same logits,
    kept positions and tokens as the torch path, with the launcher actually run."""
    pytest.importorskip("triton")
    import learnkv.kernels.decode_attn

    _, ours = models(name)
    ids, mask = batch()
    runs = {}
    calls = []
    real = learnkv.kernels.decode_attn.decode_attention
    monkeypatch.setattr(learnkv.kernels.decode_attn, "decode_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    for mode in ("torch", "triton"):
        monkeypatch.setenv("LEARNKV_KERNELS", mode)
        kept = []
        logits, result = decode_logits(ours, input_ids=ids, attention_mask=mask, policy=policy,
                                       budget=None if policy == "full" else 10,
                                       observer=lambda c: kept.append([layer.positions.clone() for layer in c.layers]))
        runs[mode] = logits, kept, result.tokens
    assert calls, "the Triton path never ran the decode kernel"
    (a_logits, a_kept, a_tokens), (b_logits, b_kept, b_tokens) = runs["torch"], runs["triton"]
    assert (a_logits - b_logits).abs().max().item() <= 1e-4
    assert all(torch.equal(x, y) for sa, sb in zip(a_kept, b_kept) for x, y in zip(sa, sb))
    assert torch.equal(a_tokens, b_tokens)


@pytest.mark.parametrize("term", [{"indices": torch.zeros(1, 1, 1, 2, dtype=torch.long)},
                                  {"position_bias": torch.zeros(1)}, {"is_causal": False}])
def test_an_attention_term_learnkv_does_not_implement_is_refused(tiny, monkeypatch, term):
    """A term a model hands the attention function that would change the result (sparse indices, a relative position
    bias, non-causal attention) is refused in one line naming the attention module, never ignored."""
    from transformers.models.llama import modeling_llama

    real = modeling_llama.LlamaAttention.forward
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", lambda self, *a, **k: real(self, *a, **k, **term))
    with pytest.raises(ValueError, match=rf"LlamaAttention hands its attention {next(iter(term))}, which") as err:
        generate(tiny, input_ids=random_ids(8), policy="h2o", budget=6, max_new_tokens=3)
    assert "\n" not in str(err.value)


def test_shared_block_decisions_are_refused_for_sliding_layers(models):
    """granularity='block' shares one decision across every layer, which layers holding different tokens cannot."""
    _, ours = models("gemma2")
    with pytest.raises(ValueError, match=r"granularity 'block' .* layer 0 has a sliding window of 8") as err:
        generate(ours, input_ids=random_ids(PROMPT, vocab=VOCAB), policy="h2o", budget=10, max_new_tokens=4,
                 granularity="block", block_size=4)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("budget", [6, 10])  # below the window (the policy decides there too), at least the window
@pytest.mark.parametrize("name", ["gemma2", "mistral-window"])
def test_slack_keeps_the_same_tokens_in_sliding_layers(models, name, budget):
    """With slack, a sliding layer's dropped tokens stay in place, dead, until a compaction: the same live tokens and
    the same output as compacting at every step."""
    _, ours = models(name)
    ids, mask = batch()
    runs = []
    for slack in (0, 3):
        kept = []
        logits, result = decode_logits(ours, input_ids=ids, attention_mask=mask, policy="h2o", budget=budget, slack=slack,
                                       observer=lambda c: kept.append([sorted(set(layer.positions[r, h].tolist()) - {-1})
                                                                       for layer in c.layers for r in range(2)
                                                                       for h in range(layer.positions.shape[1])]))
        runs.append((logits, kept, result.kept_rows))
    assert runs[0][1] == runs[1][1] and runs[0][2] == runs[1][2]
    assert (runs[0][0] - runs[1][0]).abs().max().item() <= 1e-5


def test_full_attention_capture_sees_every_key_of_a_sliding_layer(models):
    """The prefill's early queries attend to tokens the window then drops: a policy that records the prefill's
    attention (the oracle's and the fidelity metrics' reference, `step_attention`) sees every key position of every
    layer, and a sliding layer's mass past the window is zero."""
    from learnkv.capture import step_attention

    _, ours = models("gemma2")  # layer 0 slides (window 8)
    prompt, continuation = random_ids(PROMPT, vocab=VOCAB), random_ids(NEW, seed=2, vocab=VOCAB)
    attention = step_attention(ours, prompt, continuation, generate)
    L = PROMPT + NEW - 1
    assert [tuple(a.shape) for a in attention] == [(2, NEW - 1, L)] * 2
    query = torch.arange(PROMPT, L)[:, None]
    past_window = torch.arange(L)[None, :] <= query - WINDOW
    assert attention[0][:, past_window].abs().max() == 0 and attention[1][:, past_window].abs().max() > 0
    assert torch.allclose(attention[0].float().sum(-1), torch.ones(2, NEW - 1), atol=1e-2)
