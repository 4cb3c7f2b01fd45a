"""The oracle: its future attention is the full-cache run's, and it replays the full-cache continuation."""

import torch

from conftest import random_ids
from learnkv import generate
from learnkv.model import tiny_model
from learnkv.policies.base import LayerView
from learnkv.policies.oracle import Oracle, full_attention


def test_full_attention_matches_eager_output_attentions():
    model = tiny_model(seed=0)
    ids = random_ids(20, batch=2, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding in row 1
    ours = full_attention(model, ids, mask)
    eager = tiny_model(seed=0, attn_implementation="eager")
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = eager(ids, attention_mask=mask, position_ids=pos, output_attentions=True).attentions
    H = model.config.num_key_value_heads
    for layer, a in enumerate(ref):
        grouped = a.view(2, H, -1, 20, 20).mean(2)  # [B, H, N, N], query head j*G+g -> KV head j
        assert torch.allclose(ours[layer][0], grouped[0], atol=1e-6)
        assert torch.allclose(ours[layer][1, :, :14, :14], grouped[1, :, 6:, 6:], atol=1e-6)


def test_oracle_score_is_future_attention_mass():
    N, H = 12, 2
    attn = torch.rand(1, H, N, N, generator=torch.Generator().manual_seed(0))
    oracle = Oracle(horizon=3)
    oracle.future = [attn]
    positions = torch.tensor([0, 2, 5, 7, 8])[None, None].expand(1, H, 5)
    view = LayerView(layer=0, step=4, keys=torch.zeros(1, H, 5, 4), values=torch.zeros(1, H, 5, 4),
                     positions=positions, n_new=1)
    scores = oracle.score(view)
    for h in range(H):
        for slot, p in enumerate([0, 2, 5, 7, 8]):
            expected = sum(float(attn[0, h, s, p]) for s in (9, 10, 11))  # newest position 8: rows 9..11
            assert abs(scores[0, h, slot].item() - expected) < 1e-5


def test_oracle_replays_the_full_continuation_within_budget(tiny):
    ids = random_ids(30, seed=2)
    full = generate(tiny, input_ids=ids, policy="full", max_new_tokens=20)
    oracle = generate(tiny, input_ids=ids, policy="oracle", budget=16, max_new_tokens=20)
    assert oracle.tokens.tolist() == full.tokens.tolist()
    assert oracle.max_kept_tokens <= 16


def test_forced_tokens_are_fed_and_returned(tiny):
    ids = random_ids(10, seed=3)
    forced = random_ids(8, seed=4)
    r = generate(tiny, input_ids=ids, policy="h2o", budget=12, max_new_tokens=8, forced_tokens=forced)
    assert r.tokens.tolist() == forced.tolist()
