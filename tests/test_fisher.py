"""The Fisher utility (`learnkv.fisher`): the second-order KL cost of dropping a key, against the true cost of
that drop, its sampled estimate against its exact expectation, and the oracle that looks ahead at it."""

import pytest
import torch

from conftest import random_ids
from learnkv import decode, generate
from learnkv.fisher import drop_cost, fisher_attention, step_fisher
from learnkv.model import tiny_model
from learnkv.policies.oracle import Oracle

P, N = 12, 9


@pytest.fixture(scope="module")
def case():
    model = tiny_model(seed=0)
    g = torch.Generator().manual_seed(0)
    prompt, continuation = torch.randint(0, 256, (1, P), generator=g), torch.randint(0, 256, (1, N), generator=g)
    return model, prompt, continuation, step_fisher(model, prompt, continuation, samples=None)


def test_it_is_the_true_cost_of_a_drop_to_second_order(case):
    """Against `drop_cost` (the step's KL with the key masked for that query and KV head alone, everything else
    recomputed): within a quarter wherever the cost is between 1e-5 and 0.1 nats (beyond, the drop is no longer
    small: third-order terms), over both layers and KV heads, three steps, every third key."""
    model, prompt, continuation, exact = case
    H = model.config.num_key_value_heads
    assert [tuple(u.shape) for u in exact] == [(H, N - 1, P + N - 1)] * model.config.num_hidden_layers
    checked = 0
    for layer in range(model.config.num_hidden_layers):
        for head in range(H):
            for step in (0, 4, 7):
                assert (exact[layer][head, step, P + step + 1 :] == 0).all()  # keys the query does not see yet
                for key in range(0, P + step + 1, 3):
                    true = drop_cost(model, prompt, continuation, layer, head, step, key)
                    if 1e-5 <= true <= 0.1:
                        checked += 1
                        assert 0.75 <= float(exact[layer][head, step, key]) / true <= 1.33, (layer, head, step, key)
    assert checked >= 40


def test_sampled_draws_estimate_the_exact_expectation_and_repeat(case):
    model, prompt, continuation, exact = case
    sampled = step_fisher(model, prompt, continuation, samples=2000, seed=1)
    for e, s in zip(exact, sampled):
        assert float((s - e).abs().sum() / e.abs().sum()) < 0.05
    again = step_fisher(model, prompt, continuation, samples=8, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(again, step_fisher(model, prompt, continuation, samples=8, seed=3)))


def test_its_attention_refuses_what_it_does_not_implement(case):
    model = case[0]
    layer = model.model.layers[0].self_attn
    q = k = v = torch.zeros(1, 2, 3, 16)
    for term in ({"softcap": 30.0}, {"sliding_window": 4}, {"position_bias": torch.zeros(1)}):
        with pytest.raises(ValueError, match="does not implement"):
            fisher_attention(layer, q, k, v, None, **term)


def test_the_oracle_reads_it_once_per_prompt_and_replays_within_the_total(tiny, monkeypatch):
    """``oracle:utility=fisher`` through `generate` alone: its future is the Fisher utility, computed once for rows
    that share a prompt and continuation (two budgets of one prompt); scores on one scale (``raw``) across layers
    and heads, so ``global`` ranks them together and holds the total."""
    calls = []
    real = decode.step_fisher
    monkeypatch.setattr(decode, "step_fisher", lambda *a: calls.append(a) or real(*a))
    ids = random_ids(30, seed=2).repeat(2, 1)
    full = generate(tiny, input_ids=ids[:1], policy="full", max_new_tokens=12)
    oracle = Oracle(utility="fisher")
    assert oracle.future_kind == "fisher" and oracle.normalisation == "raw"
    assert Oracle().future_kind == Oracle(utility="output").future_kind == "attention"
    seen = []
    r = generate(tiny, input_ids=ids, policy="oracle", policy_params={"utility": "fisher"}, allocation="global",
                 budget=[12, 16], max_new_tokens=12, forced_tokens=full.tokens.repeat(2, 1),
                 observer=lambda cache: seen.append(sum(int((layer.positions >= 0).sum()) for layer in cache.layers)))
    assert len(calls) == 1 and r.tokens.tolist() == full.tokens.repeat(2, 1).tolist()
    H, L = tiny.config.num_key_value_heads, tiny.config.num_hidden_layers
    assert seen and max(seen) <= (12 + 16) * H * L


def test_the_fidelity_grid_computes_it_once_per_prompt(tiny, monkeypatch):
    """In an evaluation the reference computes a prompt's Fisher utility when the first run that reads it asks, and
    every other budget and allocation of the batch reads the same tensors; the attention oracle never asks."""
    from learnkv.eval import Sample, build_spec, evaluate
    from learnkv.eval.tasks import fidelity

    calls = []
    real = fidelity.step_fisher
    monkeypatch.setattr(fidelity, "step_fisher", lambda *a: calls.append(a) or real(*a))
    items = [Sample.from_ids(random_ids(16, seed=10 + i)[0], id=f"ids/{i}") for i in range(2)]
    spec = build_spec("oracle,oracle:utility=fisher,oracle:utility=fisher:allocation=global", "0.5,0.75", "fidelity",
                      max_new_tokens=6, batch_size=2)
    records = evaluate(tiny, None, spec, samples=items)
    assert len(calls) == 2 and len(records) == 3 * 2
    kl = {(r["policy"], r["budget"]): r["metrics"]["kl"] for r in records}
    assert all(v is not None and v >= 0 for v in kl.values())
