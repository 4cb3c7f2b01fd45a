"""Bytes moved per decode step on a GPU, on paper: a 7B model's weights, its KV cache, and eviction's reads and
writes as learnkv's kernels and decode loop make them, turned into time at HBM bandwidth (issue 43, item 6).

    python bench/gpu_on_paper.py                 # Qwen2.5-7B shapes, H100 (3.35 TB/s), slack 16
    python bench/gpu_on_paper.py --slack 64 --bandwidth 4.8e12

A decode step of a memory-bound model takes at least (bytes it moves) / (HBM bandwidth). This counts, per step,
every byte the step reads or writes in HBM (caches ignored, so each pass over a tensor counts), from the access
patterns of the code as it is (`learnkv/kernels/*.py`, `learnkv/attention.py`, `learnkv/cache.py`), and nothing else: no
launch latency (each layer's eviction adds ~10 small launches, ~0.3-1 ms per step over 28 layers, which bounds
batch 1 more than bandwidth does), no compute, no overlap. So the times are lower bounds and the speedups are what
bandwidth alone predicts. Per (layer, batch row, KV head) and slot, with D the head dim (bf16 K/V: 2D bytes each),
G query heads per KV head and S slots held (budget + slack / 2 on average: dead slots wait for a compaction):

- attention, `kernels.decode_attention` (every policy, the full cache included, on CUDA), in one pass over K and V
  (its schedule wherever ``8 G < 2D``, as here): K and V read once and positions once, 2 * 2D + 8; a policy that
  reads attention also has each query head's raw scores written and read back (8 G) and the group-reduced
  probabilities written (fp32, 4; 8 for the learned policy, which is handed the group mean and the max,
  ``group_reduce="mean+max"``). The full cache and StreamingLLM read no attention: 2 * 2D + 8, a FlashDecoding-style
  pass (2 * 2D) and the positions. (Before 2026-11-29 every policy took two passes, reading K twice and positions
  twice: 3 * 2D + 16 + 4; before that the learned policy took torch eager attention: 2 * 2D + 28 G + 9.)
- H2O's state update (`kernels.update_token_state`): the group mean read, ``acc`` read and written, then cloned as
  the score: 12 + 8.
- StreamingLLM's score: positions read, fp32 score written: 12.
- the learned policy's tracker update (`kernels.decode_features`, every step): the group mean and max 8, positions
  twice 16, 8 state tensors read and written 64, the 16-row window kept among 8 spare rows (`learnkv.sliding_rows`:
  its 15 surviving rows read, the new one written, and every 9th step the 15 moved back to the top: 60 + 4 + 60 / 9
  = 70.7; shifted in place before, 15 read and 16 written, 124); at a refresh (every ``REFRESH`` steps, the policy's
  default) the same launch also reads the key and value norms cached per slot, 8 (K and V only for the new slot;
  before issue 43's refresh pass, in full: 2 * 2D), and writes the 19 fp32 features, 76, which the scorer
  (`kernels.scorer_mlp`) reads to write a score, 80: (8 + 76 + 80) / REFRESH per step (before 2026-11-28 the
  features were written at every step: 8 + 76 + 80 / REFRESH); the latest refresh's scores cloned at every
  eviction, 8.
- eviction without compaction, every step once over the budget with slack (`kernels.mark_one_drop`): scores and
  positions (read twice) for each row's lowest-ranked live slot, 4 + 16; before 2026-11-30 a selection (below) and
  ~45 bytes of index, mask and position passes (`kernels.reference.mark_dead`).
- selection (`kernels.select_keep`, at each compaction; every step without slack): priorities from scores and
  positions (read twice) written as int64 keys, 4 + 16 + 8; a radix select reading the keys once per 4-bit digit of
  (32 + index bits) and once more to write the kept indices: 8 * (passes + 1) + 8.
- compaction, once every ``slack`` evictions (`kernels.gather_tokens` of K, V, positions and the policy's fp32 state
  channels): each kept slot read and written, 2 * (2 * 2D + 8 + 4 * channels) / slack per step.

The new token's K/V writes and the small per-row buffers are left out (one slot per step, not per held slot).

``--fixed`` counts a change that is not made (docs/gpu-on-paper.md): a radix select on 8-bit digits (half the
passes). (Four more are made: the one-pass decode attention, the learned policy's key and value norms kept per slot,
its group mean and max from the fused attention instead of torch eager, and its features written at a refresh
only.)
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

HBM_H100 = 3.35e12  # bytes/s, H100 SXM
#: the learned policy's feature window and its spare rows (`learnkv.features.WINDOW`, `SPARE_ROWS`; this script
#: imports no torch: tests/test_bench.py checks they agree)
WINDOW, SPARE_ROWS = 16, 8
#: the learned policy's default refresh (`learnkv.policies.learned.Learned.refresh`; checked there too)
REFRESH = 8


@dataclass(frozen=True)
class Model:
    """Shapes of a decoder (Qwen2.5-7B's by default: config.json of Qwen/Qwen2.5-7B)."""

    layers: int = 28
    hidden: int = 3584
    intermediate: int = 18944
    q_heads: int = 28
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 152064
    bytes: int = 2  # bf16

    def weight_bytes(self) -> int:
        """Every weight a decode step reads: the layers' projections, biases and norms, the final norm and the LM
        head (untied); the embedding table is only indexed (B rows)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attn = 2 * h * h + 2 * h * kv + (h + 2 * kv)  # q, o; k, v; the q/k/v biases
        mlp = 3 * h * self.intermediate
        params = self.layers * (attn + mlp + 2 * h) + h + self.vocab * h
        return params * self.bytes

    def kv_slot_bytes(self) -> int:
        """K and V bytes of one slot of one KV head."""
        return 2 * self.head_dim * self.bytes


def select_bytes(slots: int, digit_bits: int = 4) -> float:
    """`kernels.select_keep` per slot: the priority kernel and the radix select's passes over the int64 keys."""
    passes = math.ceil((32 + max(slots - 1, 0).bit_length()) / digit_bits)
    return 4 + 16 + 8 + 8 * (passes + 1) + 8


def per_slot_bytes(policy: str, m: Model, slots: int, slack: int, fixed: bool = False) -> dict[str, float]:
    """Bytes per held slot, per (layer, batch row, KV head), of one decode step, by part (``fixed``: with the
    change of the module docstring)."""
    kv, G = m.kv_slot_bytes(), m.q_heads // m.kv_heads
    # kernels.decode_attention: one pass over K and V and the positions; the raw scores of the G query heads written
    # and read back, then the group mean written, for a policy that reads attention (the two-pass schedule, K read
    # twice, is the launcher's choice only where 8 G >= 2D, not for this model: tests/test_bench.py checks it)
    fused = kv + 8 + 8 * G + 4
    if policy == "full (FlashDecoding)":
        return {"attention": kv}
    if policy == "full":
        return {"attention": kv + 8}
    select = select_bytes(slots, 8 if fixed else 4)
    # with slack a step marks its one victim, and a selection comes with each compaction; without, every step
    evict = {"mark one drop": 4 + 16, "select": select / slack} if slack else {"select": select}
    if policy == "streaming":
        return {"attention": kv + 8, "score": 12, **evict, "compaction": 2 * (kv + 8) / slack}
    if policy == "h2o":
        return {"attention": fused, "score": 12 + 8, **evict, "compaction": 2 * (kv + 8 + 4) / slack}
    if policy == "learned":
        norms = 8  # two fp32 norms cached per slot, read instead of K and V (`learnkv.features.NORMS`)
        rows = WINDOW + SPARE_ROWS  # the tracker's window among its spare rows
        window = 4 * (WINDOW - 1) + 4 + 4 * (WINDOW - 1) / (SPARE_ROWS + 1)
        update = 8 + 16 + 64 + window  # the group mean and max read: 8
        read_out = (norms + 76 + 80) / REFRESH  # features written and scored at a refresh only
        channels = 8 + rows + 2 + 1  # 8 [B, H, T] tracker tensors, the window's rows, the 2 norms, the refresh's scores
        attention = fused + 4  # the fused kernel writes the group max besides the mean
        return {"attention": attention, "score": update + read_out + 8, **evict,
                "compaction": 2 * (kv + 8 + 4 * channels) / slack}  # fmt: skip
    raise ValueError(policy)


POLICIES = ("full", "full (FlashDecoding)", "streaming", "h2o", "learned")


def step_bytes(policy: str, m: Model, batch: int, context: int, fraction: float | None, slack: int,
               fixed: bool = False) -> dict:
    """Bytes of one decode step at ``batch`` rows whose full cache would hold ``context`` tokens; an evicting policy
    holds ``fraction`` of it (+ slack / 2 dead slots on average)."""
    slots = context if fraction is None else math.ceil(fraction * context) + slack // 2
    parts = per_slot_bytes(policy, m, slots, slack, fixed)
    rows = m.layers * batch * m.kv_heads * slots
    out = {"weights": m.weight_bytes(), **{k: v * rows for k, v in parts.items()}}
    out["total"] = sum(out.values())
    return out


def fmt_gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="8192,32768")
    p.add_argument("--fractions", default="0.25,0.5")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--slack", type=int, default=16)
    p.add_argument("--bandwidth", type=float, default=HBM_H100, help="HBM bytes/s (H100 SXM: 3.35e12)")
    p.add_argument("--memory", type=float, default=80e9, help="HBM bytes, to flag a full cache that does not fit")
    p.add_argument("--fixed", action="store_true", help="count the change of the docstring (not made)")
    args = p.parse_args(argv)
    m = Model()
    contexts = [int(x) for x in args.contexts.split(",")]
    fractions = [float(x) for x in args.fractions.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    print(f"model: {m}\nweights read per step: {fmt_gb(m.weight_bytes())} GB; K+V per token: "
          f"{m.layers * m.kv_heads * m.kv_slot_bytes() / 1e3:.0f} kB; bandwidth {args.bandwidth / 1e12:.2f} TB/s; "
          f"slack {args.slack}{'; with 8-bit radix digits (--fixed), not made' if args.fixed else ''}\n")  # fmt: skip
    print("| context | batch | policy | budget | weights GB | attention GB | eviction GB | total GB | step ms (bound) "
          "| speedup vs full | vs FlashDecoding full |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for ctx in contexts:
        for b in batches:
            full = step_bytes("full", m, b, ctx, None, args.slack, args.fixed)["total"]
            flash = step_bytes("full (FlashDecoding)", m, b, ctx, None, args.slack)["total"]
            fits = m.weight_bytes() + b * ctx * m.layers * m.kv_heads * m.kv_slot_bytes() <= args.memory
            runs = [("full", None), ("full (FlashDecoding)", None)]
            runs += [(n, f) for f in fractions for n in POLICIES if not n.startswith("full")]
            for name, frac in runs:
                r = step_bytes(name, m, b, ctx, frac, args.slack, args.fixed)
                evict = r["total"] - r["weights"] - r["attention"]
                note = "" if fits or frac is not None else " (does not fit)"
                print(f"| {ctx} | {b} | {name}{note} | {'-' if frac is None else f'{frac:.0%}'} | "
                      f"{fmt_gb(r['weights'])} | {fmt_gb(r['attention'])} | {fmt_gb(evict)} | {fmt_gb(r['total'])} | "
                      f"{r['total'] / args.bandwidth * 1e3:.2f} | {full / r['total']:.2f}x | "
                      f"{flash / r['total']:.2f}x |")


if __name__ == "__main__":
    main()
