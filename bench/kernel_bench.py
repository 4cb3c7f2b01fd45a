"""Kernel benchmark: each eviction kernel against its torch reference, then whole decode steps, as markdown tables.

    python bench/kernel_bench.py            # CUDA: bf16, Hq 32, H 8, D 128, B in {1, 8, 32}, T in {4k, 16k, 32k}
    python bench/kernel_bench.py --quick    # fewer shapes (on CPU: the reference path only, small fp32 shapes)

On CUDA every kernel runs both ways (Triton launcher and reference) timed with `triton.testing.do_bench`, and
the Triton result is checked against the reference ("check": = exact, ~ within tolerance). On CPU only the
references run (the Triton interpreter is a test tool, not a backend), timed with `time.perf_counter`.

GB/s counts the bytes a kernel must move at least once (inputs read plus outputs written), so it is comparable
with the plain copy bandwidth measured for each shape on its K tensor (``torch.empty_like(k).copy_(k)``, read +
write, the "copy K" row); "% copy" is the ratio. The decode attention kernel reads K and V once where its one-pass
schedule moves fewer bytes (`kernels.decode_attn.one_pass`), and writes and reads back each query head's raw scores
when probabilities are asked for; its two-pass schedule reads K twice and cannot exceed about 2/3 of copy bandwidth.

The second table times whole decode steps of a random-weight Llama with the benchmark's head shapes (hidden
``Hq * D``, MLP 3.5x hidden, ``--layers`` layers, a 1024-token vocabulary so the LM head is negligible: a per-layer
figure) over a cache pre-filled with random keys and values, through the real decode path (`BudgetCache`, learnkv
attention, the policy, selection and compaction; kernels or references as `LEARNKV_KERNELS` picks):

- "full": the full cache of T tokens; "no eviction": the full cache at the budget's size (what a budgeted step
  costs without the eviction work); "policy": the budgeted cache, evicting every step (lazy: every W steps).
- slack: dead slots a layer may hold before it compacts (`BudgetCache`, ``--slacks``). At 0 every eviction
  compacts the cache; with slack S a per-token policy compacts once every S + 1 steps and attends over up to S
  dead slots. Policies that group neighbouring slots (paged, snapkv) always compact, so they get one row.
- eviction share = 1 - no eviction / policy: the state update, scoring, selection and compaction (and the dead
  slots' share of attention) as a share of the budgeted decode step.
- speed-up = full / policy: budgeted over full-cache tokens/s.

Every cache appends into preallocated slots (no per-step concatenation), as a serving engine's would.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

# the repo root first: learnkv from this checkout, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learnkv.kernels import reference as ref  # noqa: E402
from learnkv.cli import thread_count  # noqa: E402


def timer(device: str):
    """``time(fn) -> ms``: do_bench on CUDA, median of perf_counter runs on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=10, rep=50)

    def cpu_time(fn):  # the minimum: least disturbed by other processes on a shared CPU
        fn()
        runs, start = [], time.perf_counter()
        while len(runs) < 3 or (len(runs) < 20 and time.perf_counter() - start < 0.2):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        return 1e3 * min(runs)

    return cpu_time


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def check(actual, expected, exact: bool, atol: float = 1e-2, rtol: float = 1e-2) -> str:
    actual = actual if isinstance(actual, tuple) else (actual,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    if exact:
        return "=" if all(torch.equal(a, e) for a, e in zip(actual, expected)) else "MISMATCH"
    ok = all(torch.allclose(a.float(), e.float(), atol=atol, rtol=rtol) for a, e in zip(actual, expected))
    return "~" if ok else "MISMATCH"


def cases(B: int, T: int, Hq: int, H: int, D: int, dtype, device: str, use_triton: bool):
    """(name, reference call, triton call or None, bytes moved, exact?) for one shape; the first is the copy."""
    g = torch.Generator(device=device).manual_seed(B * 100003 + T)
    q = torch.randn(B, Hq, 1, D, generator=g, device=device).to(dtype)
    k = torch.randn(B, H, T, D, generator=g, device=device).to(dtype)
    v = torch.randn(B, H, T, D, generator=g, device=device).to(dtype)
    kpos = torch.arange(T, device=device).expand(B, H, T).contiguous()
    qpos = torch.full((B,), T - 1, device=device)
    scores = torch.rand(B, H, T, generator=g, device=device)
    keep = T // 2
    index = ref.select_keep_reference(scores, kpos, keep, 4, 64)
    probs_bytes = B * H * T * 4
    kept_bytes = B * H * keep * D * k.element_size()
    triton_ok = use_triton
    yield "copy K", lambda: torch.empty_like(k).copy_(k), None, 2 * nbytes(k), True
    if triton_ok:
        from learnkv.kernels.block_score import block_scores
        from learnkv.kernels.compact import gather_tokens
        from learnkv.kernels.decode_attn import decode_attention
        from learnkv.kernels.features import decode_features
        from learnkv.kernels.scorer import scorer_mlp
        from learnkv.kernels.select import select_keep
        from learnkv.kernels.state_update import update_token_state

    yield ("decode_attention", lambda: ref.decode_attention_reference(q, k, v, kpos, qpos),
           (lambda: decode_attention(q, k, v, kpos, qpos)) if triton_ok else None,
           nbytes(q, k, v, kpos, q) + probs_bytes, False)  # fmt: skip
    # the schedule the launcher does not pick for these shapes (K read twice), and the output alone (the full cache)
    yield ("decode_attention 2 passes", lambda: ref.decode_attention_reference(q, k, v, kpos, qpos),
           (lambda: decode_attention(q, k, v, kpos, qpos, passes=2)) if triton_ok else None,
           nbytes(q, k, v, kpos, q) + probs_bytes, False)  # fmt: skip
    yield ("decode_attention no probs", lambda: ref.decode_attention_reference(q, k, v, kpos, qpos, None, None)[0],
           (lambda: decode_attention(q, k, v, kpos, qpos, None, None)[0]) if triton_ok else None,
           nbytes(q, k, v, kpos, q), False)  # fmt: skip
    for bs in (1, 16):
        yield (f"select_keep bs={bs}", lambda bs=bs: ref.select_keep_reference(scores, kpos, keep, 4, 64, bs),
               (lambda bs=bs: select_keep(scores, kpos, keep, 4, 64, bs)) if triton_ok else None,
               nbytes(scores, kpos, index), True)  # fmt: skip
    yield ("gather_tokens K", lambda: ref.gather_tokens_reference(k, index, -2),
           (lambda: gather_tokens(k, index, -2)) if triton_ok else None,
           nbytes(index) + 2 * kept_bytes, True)  # fmt: skip
    yield ("block_scores bs=16", lambda: ref.block_scores_reference(k, v, 16),
           (lambda: block_scores(k, v, 16)) if triton_ok else None, nbytes(k, v), False)  # fmt: skip

    # every H2O/RoCo/LazyEviction statistic at once (the worst case; a policy updates only its own); the update is
    # in place, so each timed call starts from the same copies and the check compares one call of each
    attn = scores / T
    attn_max = scores * 2e-4
    names = ("acc", "s1", "s2", "count", "ts", "mri")
    state = {n: torch.rand(B, H, T, generator=g, device=device).round() for n in names}

    def update(fn, st):
        fn(attn, attn_max, kpos, 7, 1, 1e-4, **st)
        return tuple(st.values())

    fresh = lambda: {n: t.clone() for n, t in state.items()}  # noqa: E731
    yield ("update_token_state (all 6)", lambda: update(ref.update_token_state_reference, fresh()),
           (lambda: update(update_token_state, fresh())) if triton_ok else None,
           nbytes(attn, attn_max, kpos) + 2 * nbytes(*state.values()), False)  # fmt: skip

    F, hidden = 19, 32  # the exported scorer's features and default width
    feats = torch.randn(B * H * T, F, generator=g, device=device).to(dtype)
    shapes = ((F,), (F,), (F, hidden), (hidden,), (hidden,), ())
    w = [torch.randn(shape, generator=g, device=device) for shape in shapes]
    w[1] = w[1].abs() + 0.5
    yield ("scorer_mlp", lambda: ref.scorer_mlp_reference(feats, *w),
           (lambda: scorer_mlp(feats, *w)) if triton_ok else None, nbytes(feats) + B * H * T * 4, False)  # fmt: skip

    # the learned policy's decode step: tracker state in place + the features the scorer reads, one launch per layer
    from learnkv.features import STATE, WINDOW, group_mean_max

    step = 40  # past the window: every statistic is live
    # the group mean and max of the step's attention, as the fused decode attention hands them to the learned policy
    tracker_attn = group_mean_max(torch.softmax(torch.randn(B, H, Hq // H, 1, T, generator=g, device=device), dim=-1))
    tracker_state = {n: (torch.rand(B, H, T, generator=g, device=device) * step).floor() for n in STATE}
    tracker_state["f.acc"] = tracker_state["f.acc"] / T
    tracker_state["f.acc_sq"] = tracker_state["f.acc_sq"] / T**2
    tracker_state["f.win"] = torch.rand(B, H, WINDOW, T, generator=g, device=device) / T
    fresh_tracker = lambda: {n: t.clone() for n, t in tracker_state.items()}  # noqa: E731
    yield ("decode_features",
           lambda: ref.decode_features_reference(tracker_attn, k, v, kpos, 3, 32, step, fresh_tracker()),
           (lambda: decode_features(tracker_attn, k, v, kpos, 3, 32, step, fresh_tracker())) if triton_ok else None,
           nbytes(tracker_attn, k, v, kpos) + 2 * nbytes(*tracker_state.values()) + B * H * T * F * 4,
           False)  # fmt: skip


def step_model(Hq: int, H: int, D: int, layers: int, dtype, device: str):
    """A random-weight Llama with these attention shapes (Llama-8B's MLP ratio), on the learnkv attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from learnkv import attention

    attention.register()
    hidden = Hq * D
    cfg = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=7 * hidden // 2, num_hidden_layers=layers,
                      num_attention_heads=Hq, num_key_value_heads=H, head_dim=D, max_position_embeddings=1 << 17,
                      attn_implementation=attention.NAME)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def untrained_scorer(model, out: Path) -> str:
    """A seeded, untrained scorer artifact bound to the step model's shape: the learned policy's decode step costs
    the same whatever its weights hold, so its row times the real path (tracker, features, MLP, selection)."""
    from learnkv.scorer.artifact import export_scorer
    from learnkv.scorer.model import Scorer

    torch.manual_seed(0)
    cfg = model.config
    return str(export_scorer(Scorer(cfg.num_hidden_layers), out, model="bench-step-model",
                             n_kv_heads=cfg.num_key_value_heads))


@torch.no_grad()
def decode_step_ms(model, policy: str, B: int, T: int, budget: int | None, steps: int, time_ms,
                   slack: int = 0, scorer: str | None = None) -> tuple[float, int]:  # fmt: skip
    """Milliseconds per decode step over a cache pre-filled with ``T`` random tokens, through `BudgetCache`, and
    the slack the cache applied (0 for policies that always compact). ``scorer``: the learned policy's artifact."""
    from learnkv.cache import BudgetCache
    from learnkv.model import cache_kwargs
    from learnkv.policies import make_policy

    cfg = model.config
    device, dtype = model.device, model.dtype
    p = make_policy(policy, **({"scorer": scorer} if policy == "learned" else {}))
    p = p.resolve(budget) if p.evicts else p
    # the full cache grows by a token per step for as long as the timer runs: room for that, allocated up front
    cache = BudgetCache(cfg.num_hidden_layers, p, budget if p.evicts else None, slack=slack,
                        capacity=None if p.evicts else T + 4096)  # fmt: skip
    H, D = cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator(device=device).manual_seed(T)
    cache.begin_step(torch.arange(T, device=device).expand(B, T))  # a prefill of random keys and values
    for layer in cache.layers:
        layer.update(torch.randn(B, H, T, D, generator=g, device=device).to(dtype),
                     torch.randn(B, H, T, D, generator=g, device=device).to(dtype))  # fmt: skip
    cache.end_step()
    tok = torch.zeros(B, 1, dtype=torch.long, device=device)
    pos = torch.full((B, 1), T, dtype=torch.long, device=device)
    one_each = [1] * B

    def run():
        nonlocal pos
        for _ in range(steps):
            cache.begin_step(pos, one_each)  # the count the decode loop hands over (counting it would sync)
            model(input_ids=tok, position_ids=pos, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1,
                  learnkv_cache=cache)  # fmt: skip
            cache.end_step()
            pos = pos + 1

    return time_ms(run) / steps, cache.slack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--threads", type=thread_count, default=1, help="CPU threads (more get descheduled on a busy machine)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (overrides the defaults)")
    parser.add_argument("--contexts", default=None, help="comma-separated context lengths T (overrides the defaults)")
    parser.add_argument("--budget", type=float, default=0.25, help="decode-step table: budget as a share of T")
    parser.add_argument("--policies", default="h2o,lazy,paged",
                        help="decode-step table: comma-separated policies ('learned' runs a seeded untrained scorer "
                             "of the step model's shape: timing only)")
    parser.add_argument("--slacks", default="0,64", help="decode-step table: comma-separated cache slacks")
    parser.add_argument("--layers", type=int, default=2, help="decode-step table: decoder layers of the model")
    parser.add_argument("--steps", type=int, default=8, help="decode-step table: steps per timed run")
    parser.add_argument("--skip-kernels", action="store_true", help="only the decode-step table")
    parser.add_argument("--skip-steps", action="store_true", help="only the kernel table")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(args.threads)
    if device == "cuda":
        dtype, Hq, H, D = torch.bfloat16, 32, 8, 128
        batches, contexts = ([1, 32], [4096, 32768]) if args.quick else ([1, 8, 32], [4096, 16384, 32768])
    else:
        dtype, Hq, H, D = torch.float32, 8, 2, 64
        batches, contexts = ([1, 4], [512, 2048]) if args.quick else ([1, 4, 8], [512, 2048, 4096])
    batches = [int(x) for x in args.batches.split(",")] if args.batches else batches
    contexts = [int(x) for x in args.contexts.split(",")] if args.contexts else contexts
    time_ms = timer(device)
    from learnkv import kernels

    # the one switch decides: Triton rows on CUDA, and on CPU too under LEARNKV_KERNELS=triton TRITON_INTERPRET=1
    # (how CI checks this script's Triton path before a GPU session spends its time on it)
    triton_rows = kernels.use_triton(torch.empty(0, device=device))
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {name}; {dtype}, Hq={Hq}, H={H}, D={D}; LEARNKV_KERNELS={kernels.kernel_mode()}; "
          f"{time.strftime('%Y-%m-%d')}\n")  # fmt: skip
    if not args.skip_kernels:
        print("keep = T/2, n_sink = 4, n_recent = 64\n")
        print("| kernel | B | T | impl | ms | GB/s | % copy | check |")
        print("|---|---|---|---|---|---|---|---|")
        for B in batches:
            for T in contexts:
                copy_gbs = None
                rows = cases(B, T, Hq, H, D, dtype, device, triton_rows)
                for kernel, reference, triton_fn, moved, exact in rows:
                    impls = [("reference", reference)] + ([("triton", triton_fn)] if triton_fn is not None else [])
                    for impl, fn in impls:
                        ms = time_ms(fn)
                        gbs = moved / ms / 1e6
                        copy_gbs = copy_gbs or gbs
                        verdict = check(fn(), reference(), exact) if impl == "triton" else ""
                        impl = "torch" if kernel == "copy K" else impl
                        print(f"| {kernel} | {B} | {T} | {impl} | {ms:.3f} | {gbs:.1f} | {100 * gbs / copy_gbs:.0f} "
                              f"| {verdict} |")  # fmt: skip
                    if device == "cuda":
                        torch.cuda.empty_cache()
        print()
    if args.skip_steps:
        return
    model = step_model(Hq, H, D, args.layers, dtype, device)
    print(f"decode steps: {args.layers} layers, hidden {Hq * D}, budget {args.budget:g} of T, {args.steps} steps per "
          "timed run; ms per step\n")  # fmt: skip
    print("| B | T | budget | full | no eviction | policy | slack | ms | eviction share | speed-up vs full |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    slacks = [int(s) for s in args.slacks.split(",")]
    policies = args.policies.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-scorer-") as tmp:  # the learned row's untrained artifact
        scorer = untrained_scorer(model, Path(tmp) / "scorer") if "learned" in policies else None
        for B in batches:
            for T in contexts:
                budget = max(1, int(args.budget * T))
                full, _ = decode_step_ms(model, "full", B, T, None, args.steps, time_ms)
                floor, _ = decode_step_ms(model, "full", B, budget, None, args.steps, time_ms)
                for policy in policies:
                    for slack in slacks:
                        ms, applied = decode_step_ms(model, policy, B, budget, budget, args.steps, time_ms, slack,
                                                     scorer)
                        if device == "cuda":  # each row starts from the same free memory (batch 128 x 32k: ~40 GB)
                            torch.cuda.empty_cache()
                        if applied != slack and slack != slacks[0]:
                            continue  # the policy always compacts: its row is already printed
                        print(f"| {B} | {T} | {budget} | {full:.2f} | {floor:.2f} | {policy} | {applied} | {ms:.2f} | "
                              f"{100 * (1 - floor / ms):.1f}% | {full / ms:.2f}x |")  # fmt: skip
                if device == "cuda":
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
