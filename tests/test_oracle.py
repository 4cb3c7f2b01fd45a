"""The oracle: its future attention is the full-cache run's, and it replays the full-cache continuation."""

import pytest
import torch

from conftest import random_ids
from learnkv import generate
from learnkv.model import tiny_model
from learnkv.policies.base import LayerView
from learnkv.capture import full_attention, step_attention
from learnkv.policies.oracle import Oracle


def test_full_attention_matches_eager_output_attentions():
    model = tiny_model(seed=0)
    ids = random_ids(20, batch=2, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding in row 1
    ours = full_attention(model, ids, mask, generate)
    eager = tiny_model(seed=0, attn_implementation="eager")
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = eager(ids, attention_mask=mask, position_ids=pos, output_attentions=True).attentions
    H = model.config.num_key_value_heads
    for layer, a in enumerate(ref):
        grouped = a.view(2, H, -1, 20, 20).mean(2)  # [B, H, N, N], query head j*G+g -> KV head j
        assert torch.allclose(ours[layer][0], grouped[0], atol=1e-6)
        assert torch.allclose(ours[layer][1, :, :14, :14], grouped[1, :, 6:, 6:], atol=1e-6)


@pytest.mark.parametrize("start", [0, 4])
def test_oracle_score_is_future_attention_mass(start):
    N, H = 12, 2
    attn = torch.rand(H, N - start, N, generator=torch.Generator().manual_seed(0))  # query rows from `start` on
    oracle = Oracle(horizon=3).with_future([[attn]])
    positions = torch.tensor([0, 2, 5, 7, 8])[None, None].expand(1, H, 5)
    view = LayerView(layer=0, step=4, keys=torch.zeros(1, H, 5, 4), values=torch.zeros(1, H, 5, 4),
                     positions=positions, n_new=1)
    scores = oracle.score(view)
    for h in range(H):
        for slot, p in enumerate([0, 2, 5, 7, 8]):
            expected = sum(float(attn[h, s - start, p]) for s in (9, 10, 11))  # newest position 8: rows 9..11
            assert abs(scores[0, h, slot].item() - expected) < 1e-5


def test_with_future_keeps_every_setting():
    oracle = Oracle(n_sink=2, n_recent=0.25, interval=3, block_size=4, horizon=7)
    attn = torch.rand(2, 3, 8)
    clone = oracle.with_future([[attn]])
    assert clone == oracle and clone.future[0][0] is attn and oracle.future is None  # settings equal, self untouched


def test_oracle_scores_nothing_ahead_past_the_end_and_refuses_before_the_start():
    H = 2
    attn = torch.rand(H, 3, 8, generator=torch.Generator().manual_seed(0))  # queries at positions 5..7, keys 0..7
    oracle = Oracle(horizon=4).with_future([[attn]])
    positions = torch.tensor([0, 3, 7, 9])[None, None].expand(1, H, 4)  # newest 9: the row is past its end
    view = LayerView(layer=0, step=5, keys=torch.zeros(1, H, 4, 4), values=torch.zeros(1, H, 4, 4),
                     positions=positions, n_new=1)
    assert oracle.score(view).abs().sum() == 0
    early = LayerView(layer=0, step=0, keys=torch.zeros(1, H, 2, 4), values=torch.zeros(1, H, 2, 4),
                      positions=torch.tensor([0, 3])[None, None].expand(1, H, 2), n_new=1)
    with pytest.raises(ValueError, match="no future before position 5"):
        oracle.score(early)


def test_step_attention_is_the_decode_rows_of_the_full_attention():
    model = tiny_model(seed=0)
    prompt, continuation = random_ids(9, seed=5), random_ids(7, seed=6)
    rows = step_attention(model, prompt, continuation, generate)
    seq = torch.cat([prompt, continuation[:, :-1]], dim=1)
    whole = full_attention(model, seq, torch.ones_like(seq), generate)
    assert len(rows) == len(whole)
    for ours, ref in zip(rows, whole):
        assert ours.dtype == torch.float16 and ours.shape == (ref.shape[1], 6, 15)
        assert torch.allclose(ours.float(), ref[0, :, 9:, :], atol=1e-3)


def test_oracle_handed_the_reference_attention_decodes_as_computing_its_own(tiny):
    """The fidelity task hands the oracle its reference's attention; decoding it there or letting `generate`
    compute it gives the same kept tokens, also in a left-padded batch whose rows stop at different lengths."""
    ids = [random_ids(14, seed=7)[0], random_ids(9, seed=8)[0]]
    batch = torch.zeros(2, 14, dtype=torch.long)
    mask = torch.zeros(2, 14, dtype=torch.long)
    for b, row in enumerate(ids):
        batch[b, 14 - len(row):], mask[b, 14 - len(row):] = row, 1
    forced = random_ids(12, batch=2, seed=9)
    lengths = [12, 8]  # row 1's continuation ends early; the rest of its forced row is padding
    future = [step_attention(tiny, ids[b][None], forced[b : b + 1, :n], generate) for b, n in enumerate(lengths)]
    kept = {}
    for name, given in (("handed", future), ("own", None)):
        seen = []
        generate(tiny, input_ids=batch, attention_mask=mask, policy="oracle", budget=10, max_new_tokens=12,
                 forced_tokens=forced, future=given,
                 observer=lambda cache: seen.append([layer.positions.clone() for layer in cache.layers]))
        kept[name] = seen
    # row 0 replays its whole forced row either way: the same tokens kept at every step
    for handed, own in zip(kept["handed"], kept["own"]):
        for a, b in zip(handed, own):
            assert torch.equal(a[0], b[0])


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


def test_fidelity_hands_the_oracle_its_reference_attention_not_a_copy(tiny, monkeypatch):
    """At length the reference's attention is most of a batch's memory (~1 GB a prompt at 2,700 tokens): the
    oracle must look ahead at those very tensors; each row of the batch still decodes as it would alone."""
    from learnkv.eval.tasks import base
    from learnkv.eval.tasks.base import RunConfig, Sample
    from learnkv.eval.tasks.fidelity import Fidelity

    task = Fidelity(max_new_tokens=10)
    batch = [Sample(f"ids/{i}", random_ids(n, seed=20 + i)) for i, n in enumerate((16, 11))]
    refs = task.reference_batch(tiny, None, batch)
    handed = []
    real_generate = base.generate

    def spy(*args, **kwargs):
        handed.append(kwargs.get("future"))
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(base, "generate", spy)
    metrics, _ = task.run_batch(tiny, None, batch, refs, RunConfig("oracle", {}, [8, 8]))
    assert all(a is b for row, ref in zip(handed[0], refs) for a, b in zip(row, ref.attention))
    alone = [task.run_batch(tiny, None, [s], [r], RunConfig("oracle", {}, [8]))[0][0] for s, r in zip(batch, refs)]
    for got, want in zip(metrics, alone):
        assert got["kl"] == pytest.approx(want["kl"], abs=1e-5)
        assert got["attention_recall"] == pytest.approx(want["attention_recall"], abs=1e-5)


def test_output_utility_weights_the_future_mass_by_the_residual_stream_error(tiny):
    """``utility="output"``: each slot's future mass times ``||W_o,g (v_i - o)||`` (root mean square over the KV
    head's query heads), ``o`` the live values averaged by that mass; computed here head by head from o_proj."""
    from learnkv.allocation import normalisation_for

    N, H, T, D = 12, 2, 5, 16
    attn = torch.rand(H, N - 4, N, generator=torch.Generator().manual_seed(3))
    future = [[attn, attn]] * 2  # per row, per layer
    plain = Oracle(horizon=3).with_future(future)
    oracle = Oracle(horizon=3, utility="output").with_future(future, tiny)
    positions = torch.tensor([[0, 2, 5, 7, 8], [-1, 1, 5, 6, 8]])[:, None].expand(2, H, T)
    values = torch.randn(2, H, T, D, generator=torch.Generator().manual_seed(4))
    view = LayerView(layer=1, step=4, keys=torch.zeros(2, H, T, D), values=values, positions=positions, n_new=1)
    mass = plain.score(view)
    got = oracle.score(view)
    w_o = tiny.model.layers[1].self_attn.o_proj.weight.detach()  # [hidden, Hq * D]
    G = tiny.config.num_attention_heads // H
    for b in range(2):
        for h in range(H):
            live = positions[b, h] >= 0
            weight = mass[b, h] * live
            out = (weight[:, None] * values[b, h]).sum(0) / weight.sum()
            for i in range(T):
                sq = [float((w_o[:, (h * G + g) * D : (h * G + g + 1) * D] @ (values[b, h, i] - out)).square().sum())
                      for g in range(G)]
                want = float(mass[b, h, i]) * (sum(sq) / G) ** 0.5
                assert got[b, h, i].item() == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert normalisation_for(oracle) == "raw" and normalisation_for(plain) == "mass"
    assert oracle.params()["utility"] == "output" and "utility" not in plain.params()


@pytest.mark.parametrize("allocation", ["uniform", "head", "global"])
def test_output_utility_oracle_replays_the_full_continuation_within_the_total(tiny, allocation):
    ids = random_ids(30, seed=2)
    full = generate(tiny, input_ids=ids, policy="full", max_new_tokens=20)
    seen = []
    r = generate(tiny, input_ids=ids, policy="oracle", policy_params={"utility": "output"}, allocation=allocation,
                 budget=16, max_new_tokens=20,
                 observer=lambda cache: seen.append(sum(int((layer.positions >= 0).sum()) for layer in cache.layers)))
    assert r.tokens.tolist() == full.tokens.tolist()
    H = tiny.config.num_key_value_heads
    assert seen and max(seen) <= 16 * H * tiny.config.num_hidden_layers


def test_output_utility_refuses_a_model_without_output_projections():
    class Bare(torch.nn.Module):
        config = type("Config", (), {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})

    with pytest.raises(ValueError, match="reads each layer's self_attn.o_proj; Bare has 0 for 2 layers"):
        Oracle(utility="output").with_future([[torch.zeros(2, 1, 4)]], Bare())
    with pytest.raises(ValueError, match="needs the model's output projections"):
        Oracle(utility="output").with_future([[torch.zeros(2, 1, 4)]])
