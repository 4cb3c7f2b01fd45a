"""Every policy, one matrix: the cache's invariants hold at every step (and a hypothesis property test)."""

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import params_for, prefill_for, random_ids
from learnkv import POLICIES, generate, make_policy
from learnkv.policies.base import LayerView, Policy

EVICTING = [name for name, cls in POLICIES.items() if cls.evicts]


def check_invariants(cache, budget, seen_positions, previous=None):
    """Called after every forward pass: the budget, protected tokens and order hold in every layer and head.
    ``previous`` maps (layer, row, head) to the positions held after the last pass: a sink a prefill policy
    already dropped (it protects its own sinks and window) cannot be protected by the decode policy afterwards."""
    previous = {} if previous is None else previous
    policy = cache.policy
    newest = max(seen_positions)
    fresh = {p for p in seen_positions if p > previous.get("newest", -1)}  # fed in this pass
    for layer in cache.layers:
        pos = layer.positions  # [B, H, T]
        held = pos.shape[-1] - layer.n_dead
        assert held <= budget, f"layer {layer.layer_idx} holds {held} > budget {budget}"
        assert 0 <= layer.n_dead <= cache.slack, f"{layer.n_dead} dead slots with slack {cache.slack}"
        assert ((pos >= 0).sum(-1) <= held).all()
        assert layer.keys.shape[-2] == pos.shape[-1] == layer.values.shape[-2]
        for name, t in layer.state.items():
            assert t.shape[-1] == pos.shape[-1], f"state {name} misaligned"
        for b in range(pos.shape[0]):
            for h in range(pos.shape[1]):
                kept = pos[b, h][pos[b, h] >= 0].tolist()
                assert kept == sorted(kept) and len(set(kept)) == len(kept), "kept tokens out of order"
                held_before = previous.get((layer.layer_idx, b, h), seen_positions)
                must = {p for p in seen_positions if p < policy.n_sink and p in held_before}
                must |= {p for p in seen_positions if p > newest - policy.n_recent and (p in held_before or p in fresh)}
                missing = must - set(kept)
                assert not missing, f"protected positions {sorted(missing)} evicted (layer {layer.layer_idx})"
                previous[layer.layer_idx, b, h] = set(kept)
    previous["newest"] = newest


def run_checked(model, policy, budget, prompt_len, new_tokens, seed=0, slack=0, **params):
    ids = random_ids(prompt_len, seed=seed)
    fed, held = list(range(prompt_len)), {}

    def observe(cache):
        if cache.step > 0:
            fed.append(prompt_len + cache.step - 1)
        check_invariants(cache, budget, fed, held)

    params = {**params_for(policy, model.config.num_hidden_layers), **params}
    return generate(model, input_ids=ids, policy=policy, budget=budget, max_new_tokens=new_tokens,
                    policy_params=params, observer=observe, slack=slack,
                    **(prefill_for(policy) if prompt_len > budget else {}))


@pytest.mark.parametrize("budget", [32, 48])
@pytest.mark.parametrize("policy", EVICTING)
def test_invariants_every_step(tiny, policy, budget):
    result = run_checked(tiny, policy, budget, prompt_len=30, new_tokens=40)
    assert result.max_kept_tokens <= budget
    assert all(max(k) <= budget for k in result.kept_per_step)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    policy=st.sampled_from(EVICTING),
    budget=st.integers(min_value=20, max_value=60),
    prompt_len=st.integers(min_value=1, max_value=50),
    new_tokens=st.integers(min_value=1, max_value=30),
    n_sink=st.integers(min_value=0, max_value=4),
    window=st.integers(min_value=1, max_value=8),
    slack=st.sampled_from([0, 0, 1, 7]),
)
# a prompt one token over the budget: the prefill policy (snapkv) drops a token inside the decode policy's window
@example(policy="lazy", budget=20, prompt_len=21, new_tokens=3, n_sink=0, window=7, slack=0)
def test_invariants_property(tiny, policy, budget, prompt_len, new_tokens, n_sink, window, slack):
    params = {"n_sink": n_sink}
    if policy in ("lazy", "snapkv", "rkv"):
        params["window"] = window
    elif policy == "paged":
        params = {"block_size": window, "n_sink": n_sink, "n_recent": 1}
    else:
        params["n_recent"] = window
    result = run_checked(tiny, policy, budget, prompt_len, new_tokens, slack=slack, **params)
    assert result.max_kept_tokens <= budget


@dataclass
class PositionEcho(Policy):
    """Test double: its state records each slot's position when the slot is new; scores are random."""

    name = "echo"
    needs_attention = False

    def update(self, view: LayerView) -> None:
        if "pos" not in view.state:
            view.state["pos"] = view.positions.float()
        else:
            view.state["pos"][..., -view.n_new:] = view.positions[..., -view.n_new:].float()
        assert torch.equal(view.state["pos"], view.positions.float()), "policy state out of step with the cache"

    def score(self, view: LayerView) -> torch.Tensor:
        return torch.rand(view.positions.shape, generator=torch.Generator().manual_seed(view.step))


@pytest.mark.parametrize("policy", EVICTING)
def test_scores_are_the_callers_to_keep(tiny, policy, monkeypatch):
    """What `score` returns stays what it was when later steps update the policy's state in place: trace
    recording keeps teacher scores until a decision's horizon has passed."""
    cls = POLICIES[policy]
    real, real_layers, returned = cls.score, cls.score_layers, []
    monkeypatch.setattr(cls, "score", lambda self, view: returned.append(((s := real(self, view)), s.clone()))
                        or s)
    monkeypatch.setattr(cls, "score_layers", lambda self, view, views: returned.append(
        ((s := real_layers(self, view, views)), s.clone())) or s)  # a stacked step's (PagedEviction's from state)
    # slack: evicted slots stay in place, so the state is updated in place between compactions (as in a
    # recording, which never evicts)
    generate(tiny, input_ids=random_ids(12, seed=3), policy=policy, budget=16, max_new_tokens=16,
             stop_at_eos=False, slack=8, policy_params={**params_for(policy, tiny.config.num_hidden_layers),
                                                        **({"block_size": 4} if policy == "paged" else {})})
    assert returned
    assert all(torch.equal(got, when) for got, when in returned), "a score tensor changed after it was returned"


def test_policy_state_stays_aligned_after_compaction(tiny):
    result = generate(tiny, input_ids=random_ids(30, seed=9), policy=PositionEcho(n_sink=2, n_recent=3), budget=12,
                      max_new_tokens=25)
    assert result.max_kept_tokens == 12


# -- bad input -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(policy="h2o", budget=0), "budget must be >= 1"),
        (dict(policy="h2o", budget=-5), "budget must be >= 1"),
        (dict(policy="h2o", budget=1.5), "fraction must be in (0, 1]"),
        (dict(policy="h2o", budget=0.0), "fraction must be in (0, 1]"),
        (dict(policy="nope", budget=8), "unknown policy 'nope'; known policies: full, streaming"),
        (dict(policy="streaming", budget=16, policy_params={"n_sink": 10, "n_recent": 10}), "do not fit in a budget of 16"),
        (dict(policy="lazy", budget=16, policy_params={"window": 9}), "do not fit in a budget of 16"),
        (dict(policy="h2o", budget=None), "needs a budget"),
        (dict(policy="h2o", budget=8, policy_params={"bogus": 1}), "has no parameter bogus"),
        (dict(policy="lazy", budget=64, policy_params={"variant": "v2"}), "variant must be one of"),
    ],
)
def test_bad_input_is_a_clear_value_error(tiny, kwargs, message):
    with pytest.raises(ValueError) as err:
        generate(tiny, input_ids=random_ids(10), max_new_tokens=4, **kwargs)
    assert message in str(err.value)


def test_empty_prompt_is_a_clear_value_error(tiny):
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(tiny, input_ids=torch.zeros(1, 0, dtype=torch.long), policy="full", max_new_tokens=4)


def test_make_policy_lists_known_names():
    with pytest.raises(ValueError) as err:
        make_policy("h20")
    for name in POLICIES:
        assert name in str(err.value)


def test_budget_fraction_resolves_against_full_length(tiny):
    result = generate(tiny, input_ids=random_ids(30), policy="streaming", budget=0.5, max_new_tokens=10)
    assert result.budget == 20 and result.max_kept_tokens == 20


@pytest.mark.parametrize("name", EVICTING)
def test_docstring_names_the_normalisation_across_heads_and_layers(name, tmp_path):
    """Issue 42: each evicting policy says how its scores compare across heads and layers, the rule
    `learnkv.allocation.normalisation_for` applies to it."""
    from learnkv.allocation import normalisation_for  # only this test reads the allocation rules
    from learnkv.scorer.artifact import export_scorer  # the learned policy's rule is read from its artifact
    from learnkv.scorer.model import Scorer

    scorer = {"scorer": str(export_scorer(Scorer(2), tmp_path / "s", model="test", n_kv_heads=2))}
    rule = normalisation_for(make_policy(name, **(scorer if name == "learned" else {})))
    doc = " ".join(POLICIES[name].__doc__.split())
    assert f"are ``{rule}``" in doc or f"would be ``{rule}``" in doc, f"{name}'s docstring does not name ``{rule}``"
    assert "normalisation_for" in doc
