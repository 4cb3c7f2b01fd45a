"""R-KV: attention importance minus key redundancy, compressed back to the budget every `buffer` tokens."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from learnkv.policies.base import LayerView, Policy
from learnkv.fields import setting
from learnkv.sliding_rows import slid, window_view

DEFAULT_WINDOW = 8  # observation tokens α: README table, `run_math.py --window_size`, `R1KV(window_size=8)`
DEFAULT_BUFFER = 128  # B_buffer: README table, `run_math.py --divide_length 128`
#: the observed rows are kept among this many more (`learnkv.sliding_rows`): a decode step writes one row in place
SPARE_ROWS = 8


@dataclass
class RKV(Policy):
    """R-KV (Cai et al., https://arxiv.org/abs/2505.24133; github.com/Zefan-Cai/R-KV).

    Read from the official code at d15c976 (2025-06-13): ``rkv/compression/r1_kv.py`` (``R1KV.update_kv``),
    ``rkv/utils.py`` (``compute_attention_scores``, ``cal_similarity``), ``rkv/modeling.py`` (query cache,
    trigger), ``run_math.py``, README; and at later commits ``rkv/utils.py`` @ cc5a9b9 (same math, batched),
    ``HuggingFace/run_math.py`` @ e9f54c4 (defaults) and ``rkv/serving.py`` @ 03a625b (the same defaults).

    Per KV head, over the cached slots, with the last ``window`` slots as the observation window (the tokens of
    the last ``window`` queries, always kept) and the slots before it as the candidates:

    - importance: the attention of the last ``window`` queries to the candidates, softmax over the candidates
      only, averaged over the queries, then max-pooled over neighbouring slots (``kernel_size``, stride 1,
      edges see fewer slots);
    - redundancy: the cosine similarity of every pair of cached keys (window included, self-similarity 0);
      in each row i the entry of the *last* key with similarity > ``threshold`` is zeroed (the newest of a
      group of near-duplicates is spared; a row with none zeroes its first-slot entry, as the source's fallback
      index 0 does); the column mean over all rows, softmax over all cached slots;
    - score = ``mix_lambda`` * importance - (1 - ``mix_lambda``) * redundancy; the window gets the top score.

    The source compresses at every ``buffer``-th token of the sequence (prompt included; ``divide_length``
    128) if the cache then holds at least ``budget`` tokens, and once at prefill if the prompt does (observed
    by the prompt's last ``window`` queries), each time down to ``budget`` tokens. No sink tokens. Its non-default
    options are not reproduced (``divide_method="newline"``, ``compression_content="think"``, ``retain_direction``
    other than "last").

    Deviations, for equal KV bytes across policies and for determinism:

    - the budget counts the buffer: the source keeps ``budget`` tokens and grows to ``budget + buffer``; here
      the cache evicts down to ``budget - buffer + 1`` and fills back up to ``budget`` (``interval = buffer``),
      so the source's R-KV at budget B corresponds to this one at about B + buffer;
    - GQA: the source max-pools the group's query heads' *logits* then applies one softmax; the attention
      function hands per-head probabilities, so the group's max probability is renormalised over the
      candidates (identical without GQA, and when the heads share a softmax normaliser; the source marks
      "softmax then reduce head" as a TODO). The source recomputes the window's attention against the current
      keys; here the rows are kept as state and renormalised over the candidates, which is the same as long as
      no eviction falls inside the window (guaranteed by ``buffer >= window``) and always without GQA;
    - slots stay in time order: the source stores the kept tokens in top-k score order, so after its first
      compression "the last similar key" and the pooling neighbours follow that order, not time;
    - fp32 throughout (the source: the model's bf16), per batch row (the source at d15c976 uses row 0's keys
      for every row), padding excluded, ties to the more recent token (the source's topk is unordered).

    Cost: at every step one observed row, written in place (the window is kept among `SPARE_ROWS` more rows,
    `learnkv.sliding_rows`, as SnapKV's is); the scores only when the cache evicts (every ``buffer`` steps). The
    redundancy is O(T D) for the column sums plus the search for each key's newest near-duplicate, newest slots
    first (`redundancy`): O(T * 64 * D) per KV head and batch row where near-duplicates are recent (most of SmolLM2's
    keys), O(T^2 D) where a key has none. At batch 16 and ~1.2k slots an eviction of ~1.8 rows (each row evicts on
    its own phase) costs ~160 ms, ~77 of them the redundancy (bench/RESULTS.md, "R-KV at batch 16").

    Compared across heads and layers (``allocation=head|global``) its scores are ``rank``
    (`learnkv.allocation.normalisation_for`).

    Parameters
    ----------
    window : int or None
        Observation window α (and protected recent window). None: the source's 8, capped at a quarter of the
        budget so small budgets work.
    buffer : int or None
        B_buffer, the eviction period, at least ``window``. None: the source's 128, capped at a quarter of the
        budget (but not below the window).
    mix_lambda : float
        λ, 0.1 (README, run scripts; the class default is 0.07).
    kernel_size : int
        Max-pooling kernel (odd), 7.
    threshold : float
        Cosine similarity above which two keys are near-duplicates, 0.5.
    """

    name = "rkv"
    group_reduce = "max"  # the source max-pools over the group's query heads
    needs_dense_slots = True  # the max pool and "the last similar key" read neighbouring slots
    rowwise = True  # each row from its own keys and observed rows
    reads_layer = True
    per_row_fields = ("n_sink", "n_recent", "interval", "buffer")  # the buffer only sets the schedule
    window: int | None = setting(None, ge=1)
    buffer: int | None = setting(None, ge=1)
    mix_lambda: float = setting(0.1, ge=0.0, le=1.0)
    kernel_size: int = setting(7, ge=1)
    threshold: float = setting(0.5, ge=0.0, le=1.0)

    @property
    def obs_window(self) -> int:
        return self.window or DEFAULT_WINDOW

    def resolve_defaults(self, budget: int) -> dict:
        cap = max(1, budget // 4)
        window = self.window if self.window is not None else min(DEFAULT_WINDOW, cap)
        buffer = self.buffer if self.buffer is not None else max(min(DEFAULT_BUFFER, cap), window)
        if buffer < window:  # as the source's serving config requires; keeps the observed rows exact (see above)
            raise ValueError(f"rkv: buffer ({buffer}) must be >= window ({window})")
        if self.kernel_size % 2 == 0:
            raise ValueError(f"rkv: kernel_size must be a positive odd number, got {self.kernel_size}")
        return {"window": window, "buffer": buffer, "interval": buffer, "n_recent": window}

    def update(self, view: LayerView) -> None:
        rows = view.attn  # [B, H, W, T]; the cache zero-pads old rows for new slots (causally exact)
        obs = view.state.get("obs_attn")
        window = slid(obs, rows, self.obs_window, SPARE_ROWS, view.step)  # a decode step: one row written in place
        if window is not obs:
            view.state["obs_attn"] = window

    def score(self, view: LayerView) -> Tensor:
        valid = view.valid
        B, H, T = valid.shape
        n = T - min(self.obs_window, T)  # candidates: the slots before the observation window
        if n == 0:
            return torch.zeros(B, H, T, device=view.keys.device)
        red = redundancy(view.keys, valid, self.threshold)
        window = window_view(view.state["obs_attn"], self.obs_window, SPARE_ROWS, view.step)
        rows = window[..., :n].float() * valid[:, :, None, :n]
        mass = rows.sum(dim=-1, keepdim=True)  # 0 only for padding query rows
        seen = mass > 0
        imp = (rows / mass.clamp_min(1e-30) * seen).sum(dim=2) / seen.sum(dim=2).clamp_min(1)  # [B, H, n]
        k = self.kernel_size
        imp = F.max_pool1d(imp.reshape(B * H, 1, n), kernel_size=k, stride=1, padding=k // 2).reshape(B, H, n)
        s = self.mix_lambda * imp - (1 - self.mix_lambda) * red[..., :n]
        top = s.masked_fill(~valid[..., :n], float("-inf")).amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0)
        return torch.cat([s, top.expand(B, H, T - n)], dim=-1)


def redundancy(keys: Tensor, valid: Tensor, threshold: float, block: int = 64) -> Tensor:
    """``[B, H, T]`` R-KV redundancy of each cached key (a distribution over the valid slots; 0 on padding).

    keys ``[B, H, T, D]``, valid ``[B, H, T]`` bool, threshold in [0, 1]. Without the ``[B, T, T]`` cosine matrix:

    - the column sum of the cosines over the valid rows, diagonal excluded, is each key's dot product with the sum
      of the valid keys less its own square (O(T D), float64);
    - each row's newest near-duplicate (the entry the source zeroes, then subtracted from its column) is looked for
      among the newest ``block`` slots for every row in one matmul, then among the next older ``2 * block``, ``4 *
      block``... slots for the rows that have not found one yet (`_newest_near`). With near-duplicates among recent
      keys, as R-KV assumes, most rows stop in the first block (SmolLM2's keys after a batch-8 prefill of ~1k
      tokens: 97.6% of the valid rows, bench/RESULTS.md); a row with none anywhere is compared with every slot, as
      in the dense matrix.

    The cosines that decide "near" are fp32 products of the same unit keys as the dense matrix's (the same entries
    are zeroed: tests/test_scoring_speed.py); the column sums are another summation (float64 dot products instead of
    a fp32 column sum), so the scores differ from the dense code's (kept in that test file) by rounding, relative
    < 1e-6 (its tolerance), with the same kept slots. Peak memory: ``[B, R, C]`` fp32 for the R rows still looking
    in a block of C slots, instead of ``[B, T, T]`` and two bool masks of that size.
    """
    B, H, T, D = keys.shape
    k = keys.float()
    norm = k.norm(dim=-1, keepdim=True)
    k = (k / (norm + 1e-8)).view(B * H, T, D)  # the KV heads folded into the batch: one search for every head
    square = (norm / (norm + 1e-8))[..., 0].double().view(B * H, T) ** 2  # each unit key's own cosine (0 if zero)
    v = valid.reshape(B * H, T)
    first = v.int().argmax(dim=-1)  # [B * H] the oldest cached slot (the source's fallback index 0)
    padded = not bool(valid.all())  # one synchronisation per call; without padding the masks change nothing
    last, value = _newest_near(k, v if padded else None, threshold, block, first)
    k64 = k.double()
    total = v.double()[:, None, :] @ k64  # [B * H, 1, D] the sum of the valid keys
    col = (k64 @ total.transpose(-1, -2))[..., 0] - square  # the column sums, diagonal excluded
    col.scatter_add_(-1, last, -(value.double() * v))  # less each valid row's zeroed entry
    mean = (col / v.sum(dim=-1, keepdim=True).clamp_min(1)).float()
    return mean.masked_fill(~v, float("-inf")).softmax(dim=-1).nan_to_num(0.0).view(B, H, T)


def _newest_near(k: Tensor, valid: Tensor | None, threshold: float, block: int, first: Tensor) -> tuple[Tensor, Tensor]:
    """Each valid row's entry R-KV zeroes in the cosine matrix of ``k [B, T, D]`` (unit rows; ``valid [B, T]``, or
    None without padding; a padding row's entries are never read): the column of the newest other valid key with
    cosine > ``threshold``, else the oldest valid slot ``first [B]`` (the source's fallback); and that cosine (0 on
    the diagonal). ``[B, T]`` long and float.

    Blocks of slots from the newest (``block``, then doubling), each compared with the rows that have found nothing
    newer: the first with every row (whose own slots are then a diagonal of the block), later ones with the rows
    left, gathered (one synchronisation per block)."""
    B, T, D = k.shape
    left = torch.ones(B, T, dtype=torch.bool, device=k.device) if valid is None else valid.clone()
    c0 = max(T - block, 0)
    cos = k @ k[:, c0:].transpose(-1, -2)  # [B, T, T - c0]
    cos[:, c0:].diagonal(dim1=-2, dim2=-1).zero_()  # row c0 + i against slot c0 + i
    col, hit = _newest_above(cos, threshold, valid, c0)  # a padding row's find is never read (`redundancy`)
    last = torch.where(hit, col + c0, 0)
    value = torch.where(hit, cos.gather(-1, col[..., None])[..., 0], 0.0)
    left &= ~hit
    c1, size = c0, block * 2
    while c1 > 0:
        n = int(left.sum(dim=-1).max())  # one synchronisation per block
        if n == 0:
            break
        rows = torch.sort((~left).to(torch.uint8), dim=-1, stable=True).indices[:, :n]  # the rows left first
        c0 = max(c1 - size, 0)
        cos = k.gather(1, rows[..., None].expand(*rows.shape, D)) @ k[:, c0:c1].transpose(-1, -2)  # [B, n, c1 - c0]
        own = (rows - c0).clamp(0, c1 - c0 - 1)[..., None]
        cos.scatter_(-1, own, cos.gather(-1, own) * ((rows < c0) | (rows >= c1))[..., None])  # the diagonal: 0
        col, hit = _newest_above(cos, threshold, valid, c0)
        hit &= left.gather(1, rows)  # rows no longer looking were gathered as padding
        last.scatter_(1, rows, torch.where(hit, col + c0, last.gather(1, rows)))
        value.scatter_(1, rows, torch.where(hit, cos.gather(-1, col[..., None])[..., 0], value.gather(1, rows)))
        left.scatter_(1, rows, left.gather(1, rows) & ~hit)
        c1, size = c0, size * 2
    # no near-duplicate anywhere: the oldest valid slot (the diagonal's 0 for that slot itself)
    nobody = left if valid is None else left & valid
    fallback = (k @ k.gather(1, first[:, None, None].expand(B, 1, D)).transpose(-1, -2))[..., 0]  # [B, T]
    fallback[torch.arange(B, device=k.device), first] = 0.0
    return torch.where(nobody, first[:, None], last), torch.where(nobody, fallback, value)


def _newest_above(cos: Tensor, threshold: float, valid: Tensor | None, c0: int) -> tuple[Tensor, Tensor]:
    """In ``cos [B, R, C]``, the cosines of R rows with the slots ``c0 .. c0 + C`` (``valid [B, T]`` or None), each
    row's newest valid slot with cosine > ``threshold`` as a column of the block (0 where none), and whether it has
    one: ``[B, R]`` long and bool. The largest of the columns' numbers 1..C where near, in int16 (a 64-slot block of
    ~1.3k rows: ~0.17 ms against ~0.65 for the same maximum in fp32 and ~0.6 for a flip and an ``argmax`` over
    bytes; int32 beyond 32,767 slots)."""
    C = cos.shape[-1]
    number = torch.arange(1, C + 1, dtype=torch.int16 if C < 2**15 else torch.int32, device=cos.device)
    if valid is not None:
        number = number * valid[:, None, c0 : c0 + C]  # a padding slot is never near
    newest = torch.mul(cos > threshold, number).amax(dim=-1)
    return (newest.long() - 1).clamp_min(0), newest > 0
