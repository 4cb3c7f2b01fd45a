"""The decode loop and the budgeted cache on the tiny random model: exactness against references."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import eos_token, params_for, prefill_for, random_ids
from learnkv import POLICIES, generate, generate_steps
from learnkv.model import tiny_model

def hf_greedy(ids, new_tokens):
    ref = tiny_model(seed=0, attn_implementation="eager")
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_budget_at_least_length_reproduces_hf_generate(tiny, policy):
    ids = random_ids(37, seed=1)
    new = 24
    expected = hf_greedy(ids, new)
    budget = None if policy == "full" else ids.shape[1] + new
    result = generate(tiny, input_ids=ids, policy=policy, budget=budget, max_new_tokens=new,
                      policy_params=params_for(policy, 2))
    assert result.tokens.tolist() == expected.tolist()
    assert result.max_kept_tokens == ids.shape[1] + new - 1  # nothing was ever evicted


def test_full_ignores_budget(tiny):
    ids = random_ids(20, seed=2)
    a = generate(tiny, input_ids=ids, policy="full", max_new_tokens=10)
    b = generate(tiny, input_ids=ids, policy="full", budget=4, max_new_tokens=10)
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.peak_kv_bytes == a.full_kv_bytes


def _masked_reference_attention(layer_masks):
    """Eager attention over the full sequence with one additive mask [B, Hq, L, L] per layer."""
    from transformers import AttentionInterface

    def fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        G = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(G, dim=1)
        v = value.repeat_interleave(G, dim=1)
        w = torch.matmul(query, k.transpose(2, 3)) * scaling + layer_masks[module.layer_idx]
        p = torch.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(p, v).transpose(1, 2).contiguous(), None

    AttentionInterface.register("learnkv_test_masked", fn)
    return "learnkv_test_masked"


@pytest.mark.parametrize("policy,budget,granularity,slack", [
    ("h2o", 24, "token", 0), ("lazy", 30, "token", 0), ("snapkv", 20, "token", 0), ("paged", 40, "token", 0),
    ("knorm", 16, "token", 0), ("learned", 20, "token", 0), ("h2o", 32, "block", 0), ("learned", 40, "block", 0),
    ("h2o", 24, "token", 5), ("tova", 16, "token", 3), ("learned", 20, "token", 4), ("rkv", 20, "token", 0),
])
def test_eviction_matches_masked_full_forward(tiny, policy, budget, granularity, slack):
    """Decoding with eviction and explicit positions == a full-length forward that masks the evicted tokens.

    With slack, evicted slots stay in the cache dead (position -1) until a compaction: they must be masked exactly.
    """
    ids = random_ids(30, seed=3)
    new = 20
    kept_after = []  # per forward pass: per layer [B, H, T] positions kept after eviction
    step_logits = []

    def observe(cache):
        kept_after.append([layer.positions.clone() for layer in cache.layers])

    mode = {"granularity": granularity, "block_size": 8, "slack": slack}
    result = generate(tiny, input_ids=ids, policy=policy, budget=budget, max_new_tokens=new, observer=observe,
                      policy_params=params_for(policy, 2), **mode)
    assert result.max_kept_tokens <= budget
    seq = torch.cat([ids, result.tokens[:, :-1]], dim=1)  # every token that was fed to the model
    L, P = seq.shape[1], ids.shape[1]
    cfg = tiny.config
    H, Hq = cfg.num_key_value_heads, cfg.num_attention_heads
    masks = []
    for layer in range(cfg.num_hidden_layers):
        allowed = torch.ones(1, H, L, L, dtype=torch.bool).tril()
        for row in range(P, L):  # decode step s = row - P + 1 sees what step s-1 kept, plus itself
            kept = kept_after[row - P][layer][0]  # [H, T]
            kept = torch.where(kept >= 0, kept, row)  # dead slots (slack) hide nothing extra; row is visible anyway
            visible = torch.zeros(H, L, dtype=torch.bool)
            visible.scatter_(1, kept, True)
            visible[:, row] = True
            allowed[0, :, row] = visible
        allowed = allowed.repeat_interleave(Hq // H, dim=1)
        masks.append(torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min))
    ref = tiny_model(seed=0, attn_implementation=_masked_reference_attention(masks))
    with torch.no_grad():
        ref_logits = ref(seq).logits[0, P - 1:]  # rows that predicted each generated token
    # our run's greedy tokens must be the reference's argmax at every step, and the logits must agree
    assert ref_logits.argmax(-1).tolist() == result.tokens[0].tolist()
    ours = _collect_logits(tiny, ids, policy, budget, new, params_for(policy, 2), **mode)
    assert (ours - ref_logits).abs().max().item() <= 1e-4


def _collect_logits(model, ids, policy, budget, new, params, **mode):
    """Logits of every step of a budgeted greedy decode (captured through a forward hook on lm_head)."""
    captured = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: captured.append(o[0, -1].clone()))
    try:
        generate(model, input_ids=ids, policy=policy, budget=budget, max_new_tokens=new, policy_params=params, **mode)
    finally:
        hook.remove()
    return torch.stack(captured)


def _two_prompts():
    """Prompts of 26 and 17 tokens, and the left-padded batch of both: ``(a, b, ids, mask)``."""
    a, b = random_ids(26, seed=4)[0], random_ids(17, seed=5)[0]
    ids = torch.zeros(2, 26, dtype=torch.long)
    mask = torch.zeros(2, 26, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 9:], mask[1, 9:] = b, 1
    return a, b, ids, mask


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"oracle"}))  # the oracle's rows: tests/test_eval.py
def test_left_padded_batch_equals_single_rows(tiny, policy):
    """Batch > 1 with left padding: each row decodes exactly as it does alone."""
    a, b, ids, mask = _two_prompts()
    budget = None if policy == "full" else 20
    params = params_for(policy, 2) | ({"block_size": 4} if policy == "paged" else {})  # 16 + 16 + 1 > 20
    more = prefill_for(policy) if budget else {}
    batch = generate(tiny, input_ids=ids, attention_mask=mask, policy=policy, budget=budget, max_new_tokens=16,
                     policy_params=params, **more)
    for row, single in ((0, a), (1, b)):
        alone = generate(tiny, input_ids=single[None], policy=policy, budget=budget, max_new_tokens=16,
                         policy_params=params, **more)
        assert batch.tokens[row].tolist() == alone.tokens[0].tolist(), f"row {row}"


@pytest.mark.parametrize("policy", ["h2o", "lazy", "rkv", "snapkv", "learned", "random"])
def test_a_row_that_stops_early_leaves_the_other_row_as_alone(tiny, policy):
    """Rows of a batch under eviction, one stopping at EOS many steps before the other: both decode as alone (the
    stopped row keeps being fed padding, which must not move the other row's evictions or its own tokens)."""
    a, b, ids, mask = _two_prompts()
    params, more = params_for(policy, 2), prefill_for(policy)
    kw = dict(policy=policy, budget=20, max_new_tokens=24, policy_params=params, **more)
    free = [generate(tiny, input_ids=p[None], **kw).tokens[0].tolist() for p in (a, b)]
    # EOS := a token row b writes early that row a never writes, so b stops there and a runs to the end
    eos = next(t for t in free[1][3:12] if t not in free[0])
    with eos_token(tiny, eos):
        batch = generate(tiny, input_ids=ids, attention_mask=mask, **kw)
        alone = [generate(tiny, input_ids=p[None], **kw) for p in (a, b)]
    assert batch.new_tokens[1] < 12 and batch.new_tokens[0] == 24, batch.new_tokens
    for row in (0, 1):
        n = alone[row].new_tokens[0]
        assert batch.new_tokens[row] == n
        assert batch.tokens[row, :n].tolist() == alone[row].tokens[0, :n].tolist(), f"row {row}"


def test_layer0_keys_stay_aligned_with_positions(tiny):
    """After many evictions, the key in a slot is still the key of the token at that slot's position."""
    ids = random_ids(25, seed=6)
    snapshots = []
    result = generate(tiny, input_ids=ids, policy="h2o", budget=12, max_new_tokens=20,
                      observer=lambda c: snapshots.append((c.layers[0].keys.clone(), c.layers[0].positions.clone())))
    seq = torch.cat([ids, result.tokens], dim=1)
    keys, positions = snapshots[-1]
    # layer-0 keys depend only on (token, position): recompute them for the whole sequence with a full cache
    full = []
    generate(tiny, input_ids=seq[:, :-1], policy="full", max_new_tokens=1,
             observer=lambda c: full.append(c.layers[0].keys.clone()))
    full_keys = full[0]  # [1, H, L, D]
    for h in range(keys.shape[1]):
        assert torch.allclose(keys[0, h], full_keys[0, h, positions[0, h]], atol=1e-5)


def test_sampling_is_seeded(tiny):
    ids = random_ids(12, seed=7)
    kw = dict(input_ids=ids, policy="h2o", budget=10, max_new_tokens=12, do_sample=True, temperature=1.5, top_p=0.9)
    a = generate(tiny, seed=1, **kw).tokens
    b = generate(tiny, seed=1, **kw).tokens
    c = generate(tiny, seed=2, **kw).tokens
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()


def test_prefill_longer_than_budget_is_compressed(tiny):
    ids = random_ids(50, seed=8)
    result = generate(tiny, input_ids=ids, policy="snapkv", budget=16, max_new_tokens=4)
    assert result.kept_per_step[0] == [16, 16]
    assert result.peak_kv_bytes == 50 * 2 * tiny.config.num_hidden_layers * 2 * 16 * 4  # the prompt, transiently


def test_decoding_hands_the_cache_under_the_name_this_transformers_expects(tiny):
    """transformers 5.24 deprecated `past_key_values`; the old name warns on every forward, the new one is absent
    before it. `cache_kwargs` picks the one forward takes, so decoding warns about neither."""
    import inspect
    import warnings

    from learnkv.model import cache_kwargs

    (name,) = cache_kwargs(tiny, None)
    assert name in inspect.signature(type(tiny).forward).parameters
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        generate(tiny, input_ids=random_ids(12, seed=3), policy="h2o", budget=8, max_new_tokens=4)


def test_on_step_counts_the_tokens_each_row_generates(tiny):
    """The progress hook sees, step by step, how many rows generated a token: a row past its EOS stops counting,
    so the counts sum to the tokens generated (what evaluate's bar shows)."""
    ids = random_ids(12, batch=2, seed=8)
    free = generate(tiny, input_ids=ids, max_new_tokens=20, stop_at_eos=False)
    eos = int(free.tokens[1, 3])
    seen = []
    with eos_token(tiny, eos):
        result = generate(tiny, input_ids=ids, max_new_tokens=20, on_step=seen.append)
    assert sum(seen) == sum(result.new_tokens) and seen[0] == 2 and seen[-1] == 1
    assert len(seen) == max(result.new_tokens)


def test_the_loop_written_by_hand_is_generate(tiny):
    """`prefill` then `decode_step` per token, over a cache built by hand, give `generate`'s tokens, kept counts and
    row ends: padded rows, per-row budgets, sampling, and an EOS that ends the rows at different steps."""
    from learnkv.cache import BudgetCache
    from learnkv.decode import DecodeState, decode_step, prefill, sampler, stop_tokens
    from learnkv.settings import resolve_policy_rows

    ids = torch.cat([random_ids(30, seed=5), torch.cat([torch.zeros(1, 9, dtype=torch.long), random_ids(21, seed=6)], 1)])
    mask = (torch.arange(30)[None] >= torch.tensor([[0], [9]])).long()
    new, budgets = 12, [16, 20]
    with eos_token(tiny, 180):  # sampled at step 4 of row 1 and step 7 of row 0
        ref = generate(tiny, input_ids=ids, attention_mask=mask, policy="h2o", budget=budgets, max_new_tokens=new,
                       do_sample=True, seed=4, top_k=20)
        rows = resolve_policy_rows("h2o", budgets)
        cache = BudgetCache(tiny.config.num_hidden_layers, rows, budgets, last_step=new - 1)
        state = DecodeState(cache, sampler(do_sample=True, seed=4, top_k=20), *stop_tokens(tiny, None))
        prefill(tiny, state, ids, mask)
        while len(state.tokens) < new and not bool(state.finished.all()):
            decode_step(tiny, state)
    assert torch.stack(state.tokens, 1).tolist() == ref.tokens.tolist()
    assert state.new_tokens == ref.new_tokens and cache.kept_rows == ref.kept_rows
    assert min(ref.new_tokens) < new, "no row hit the EOS: the test proves less than it says"
    assert max(max(max(rows) for rows in step) for step in cache.kept_rows[1:]) <= max(budgets)


def test_installed_attention_is_put_back():
    from learnkv import attention

    model = tiny_model(seed=0, attn_implementation="eager")
    with attention.installed(model):
        assert model.config._attn_implementation == attention.NAME
        generate(model, input_ids=random_ids(8), policy="h2o", budget=6, max_new_tokens=3)
        assert model.config._attn_implementation == attention.NAME  # generate inside leaves the block's choice
    assert model.config._attn_implementation == "eager"
    generate(model, input_ids=random_ids(8), policy="h2o", budget=6, max_new_tokens=3)
    assert model.config._attn_implementation == "eager"  # generate puts the caller's attention back


class _ReadBacks(TorchDispatchMode):
    """Counts device-to-host reads (``.item()``, ``int()``, ``bool()`` of a tensor): on a GPU each is a sync."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # under inference mode (`generate`'s) a read-back dispatches as the composite `item` / `is_nonzero`,
        # elsewhere as the `_local_scalar_dense` they decompose into: one of them per read, never both
        self.n += func.overloadpacket.__name__ in ("_local_scalar_dense", "item", "is_nonzero")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("eos", [False, True])
def test_the_full_cache_decode_reads_back_once_a_step_at_most(tiny, eos):
    """The decode loop reads back whether rows are still going once a step, and not at all where no EOS can end a
    row (a GPU then never waits on the device between steps)."""
    import contextlib

    def reads(n_new: int) -> int:
        counter = _ReadBacks()
        with eos_token(tiny, 255) if eos else contextlib.nullcontext(), counter:
            generate(tiny, input_ids=random_ids(12, batch=2), policy="full", max_new_tokens=n_new, stop_at_eos=eos)
        return counter.n

    assert reads(20) - reads(10) == (10 if eos else 0)


@pytest.mark.parametrize("policy", ["full", "h2o", "snapkv", "rkv"])
def test_generate_runs_in_inference_mode_with_the_same_result(tiny, policy):
    """`generate` runs under inference mode (its result's tensors are inference tensors) and decodes exactly what the
    same decode under ``no_grad`` does: every token, every row, slack and a prompt over the budget included."""
    kw = dict(input_ids=random_ids(20, batch=2), policy=policy, max_new_tokens=12, stop_at_eos=False)
    if policy != "full":
        kw.update(budget=10, slack=3)
    kept = {"fast": [], "plain": []}

    def watching(run):  # every layer's slot positions after every forward pass
        return lambda cache: kept[run].append([cache.layer_positions(i).clone() for i in range(2)])

    fast = generate(tiny, observer=watching("fast"), **kw)
    with torch.no_grad():
        plain = generate.__wrapped__(tiny, observer=watching("plain"), **kw)
    assert fast.tokens.is_inference() and not plain.tokens.is_inference()
    assert torch.equal(fast.tokens, plain.tokens)
    assert len(kept["fast"]) == len(kept["plain"]) == 12
    for a, b in zip(kept["fast"], kept["plain"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_generate_steps_is_generate_one_step_at_a_time(tiny, policy):
    """`generate_steps`: two decodes resumed in turns in one thread (as bench/turns.py runs them) each yield after
    the prefill and after every step what `generate` tells ``on_step``, run in inference mode, and end with the
    same tokens and kept slots as `generate` alone; bad arguments are refused at the call, before any step."""
    kw = dict(input_ids=random_ids(20, batch=2), policy=policy, max_new_tokens=9, stop_at_eos=False)
    if policy != "full":
        kw.update(budget=10, slack=3)
    told = []
    alone = generate(tiny, on_step=told.append, **kw)
    a, b = generate_steps(tiny, **kw), generate_steps(tiny, **dict(kw, policy="full", budget=None))
    yielded, ended = [], {}
    while len(ended) < 2:
        for name, steps in (("a", a), ("b", b)):
            if name in ended:
                continue
            try:
                rows = next(steps)
            except StopIteration as end:
                ended[name] = end.value
            else:
                if name == "a":
                    yielded.append(rows)
                    assert torch.is_inference_mode_enabled() is False  # the caller's mode between steps
    assert yielded == told == [2] * 9
    assert ended["a"].tokens.is_inference() and torch.equal(ended["a"].tokens, alone.tokens)
    assert ended["a"].kept_per_step == alone.kept_per_step
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_steps(tiny, **dict(kw, max_new_tokens=0))
