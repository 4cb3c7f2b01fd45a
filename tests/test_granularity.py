"""Layer-shared block mode: one decision for every layer and KV head, whole blocks only, budget held."""

import pytest
import torch

from conftest import params_for, random_ids
from learnkv import POLICIES, generate
from learnkv.pooling import rank_percentiles, shared_token_scores

EVICTING = [name for name, cls in POLICIES.items() if cls.evicts]


@pytest.mark.parametrize("policy", EVICTING)
def test_block_mode_shares_decisions_and_evicts_whole_blocks(tiny, policy):
    bs, budget = 8, 48
    ids = random_ids(45, batch=2, seed=11)
    snapshots = []

    def observe(cache):
        snapshots.append([layer.positions.clone() for layer in cache.layers])

    params = params_for(policy, 2)
    if policy == "lazy":
        params["window"] = 4
    result = generate(tiny, input_ids=ids, policy=policy, budget=budget, max_new_tokens=30, granularity="block",
                      block_size=bs, policy_params=params, observer=observe)
    assert result.max_kept_tokens <= budget
    for step, layers in enumerate(snapshots):
        first = layers[0][:, :1]
        for pos in layers:
            assert torch.equal(pos, first.expand_as(pos)), "layers or heads disagree"
        if step == 0:
            continue
        before = snapshots[step - 1][0][:, 0]  # [B, T_prev] positions before this step (plus one new slot)
        after = layers[0][:, 0]
        for b in range(before.shape[0]):
            slots = before[b].tolist() + [after[b, -1].item()]
            removed = [i for i, p in enumerate(slots) if p not in set(after[b].tolist())]
            assert len(removed) % bs == 0
            for k in range(0, len(removed), bs):  # removed slots come in aligned whole blocks
                block = removed[k: k + bs]
                assert block[0] % bs == 0 and block == list(range(block[0], block[0] + bs))


def test_block_mode_at_budget_above_length_is_full(tiny):
    ids = random_ids(30, seed=12)
    full = generate(tiny, input_ids=ids, policy="full", max_new_tokens=20)
    block = generate(tiny, input_ids=ids, policy="h2o", budget=64, max_new_tokens=20, granularity="block")
    assert block.tokens.tolist() == full.tokens.tolist()


def test_bad_granularity(tiny):
    with pytest.raises(ValueError, match="granularity must be"):
        generate(tiny, input_ids=random_ids(8), policy="h2o", budget=8, granularity="page")


def test_rank_percentiles_by_hand():
    scores = torch.tensor([[3.0, 1.0, 2.0, 9.0, 2.0]])
    valid = torch.tensor([[True, True, True, False, True]])
    # valid values 3, 1, 2, 2 -> ranks 3, 0, 1 (tie: the earlier slot ranks lower), 2 -> /3
    assert torch.allclose(rank_percentiles(scores, valid), torch.tensor([[1.0, 0.0, 1 / 3, 0.0, 2 / 3]]))


def test_shared_scores_average_layers_and_heads():
    layer0 = torch.tensor([[[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]]])  # [B=1, H=2, T=3]: heads disagree
    layer1 = torch.tensor([[[0.0, 5.0, 9.0], [0.0, 5.0, 9.0]]])
    positions = torch.arange(3).expand(1, 2, 3)
    pooled = shared_token_scores([layer0, layer1], positions)
    # layer 0: head means (0+1)/2, (0.5+0.5)/2, (1+0)/2 = 0.5 each; layer 1: 0, 0.5, 1
    assert torch.allclose(pooled, torch.tensor([[0.25, 0.5, 0.75]]))


def test_mass_pooling_keeps_what_a_few_heads_need():
    """Rank pooling and mass pooling disagree on a token one head needs badly and the others ignore."""
    # 4 heads, 3 tokens. Token 0 has 0.9 of head 0's attention and 0.02 elsewhere; token 1 a steady 0.3 in the others
    head0 = [0.9, 0.04, 0.06]
    others = [0.02, 0.3, 0.68]
    scores = torch.tensor([[head0, others, others, others]])  # [B=1, H=4, T=3]
    positions = torch.arange(3).expand(1, 4, 3)
    mass = shared_token_scores([scores], positions, "mean_mass")
    rank = shared_token_scores([scores], positions, "mean_rank")
    assert torch.allclose(mass, torch.tensor([[0.24, 0.235, 0.525]]))  # token 0 above token 1
    assert torch.allclose(rank, torch.tensor([[0.25, 0.375, 0.875]]))  # token 0 below token 1 (last in 3 heads of 4)
    padded = positions.clone()
    padded[..., 2] = -1
    assert shared_token_scores([scores], padded, "mean_mass")[0, 2] == 0  # padding carries no mass
    with pytest.raises(ValueError, match="unknown pooling rule 'max'"):
        shared_token_scores([scores], positions, "max")


@pytest.mark.parametrize("policy, rule", [("h2o", "mean_mass"), ("tova", "mean_mass"), ("snapkv", "mean_mass"),
                                          ("oracle", "mean_mass"), ("learned", "mean_rank"), ("knorm", "mean_rank"),
                                          ("roco", "mean_rank"), ("lazy", "mean_rank")])
def test_block_mode_pools_with_the_policy_rule(tiny, monkeypatch, policy, rule):
    """Attention-mass policies pool mass; scores on no shared scale pool ranks (`learnkv.pooling`)."""
    import learnkv.pooling as pooling

    used = []
    real = pooling.shared_token_scores
    monkeypatch.setattr(pooling, "shared_token_scores", lambda *a: used.append(a[2]) or real(*a))
    generate(tiny, input_ids=random_ids(24, seed=13), policy=policy, budget=32, max_new_tokens=16,
             granularity="block", block_size=8, policy_params=params_for(policy, 2))  # the prompt fits: decode-time
    assert used and set(used) == {rule}
