"""R-KV: attention importance minus key redundancy, compressed back to the budget every `buffer` tokens."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from learnkv.policies.base import LayerView, Policy
from learnkv.fields import setting

DEFAULT_WINDOW = 8  # observation tokens α: README table, `run_math.py --window_size`, `R1KV(window_size=8)`
DEFAULT_BUFFER = 128  # B_buffer: README table, `run_math.py --divide_length 128`


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

    Cost: the redundancy is O(T^2 D) per KV head and batch row and a [B, T, T] fp32 matrix per KV head at a
    time, only when the cache evicts (every ``buffer`` steps).

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
        obs = rows if obs is None else torch.cat([obs, rows], dim=2)
        view.state["obs_attn"] = obs[:, :, -self.obs_window :, :]

    def score(self, view: LayerView) -> Tensor:
        valid = view.valid
        B, H, T = valid.shape
        n = T - min(self.obs_window, T)  # candidates: the slots before the observation window
        if n == 0:
            return torch.zeros(B, H, T, device=view.keys.device)
        red = redundancy(view.keys, valid, self.threshold)
        rows = view.state["obs_attn"][..., :n].float() * valid[:, :, None, :n]
        mass = rows.sum(dim=-1, keepdim=True)  # 0 only for padding query rows
        seen = mass > 0
        imp = (rows / mass.clamp_min(1e-30) * seen).sum(dim=2) / seen.sum(dim=2).clamp_min(1)  # [B, H, n]
        k = self.kernel_size
        imp = F.max_pool1d(imp.reshape(B * H, 1, n), kernel_size=k, stride=1, padding=k // 2).reshape(B, H, n)
        s = self.mix_lambda * imp - (1 - self.mix_lambda) * red[..., :n]
        top = s.masked_fill(~valid[..., :n], float("-inf")).amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0)
        return torch.cat([s, top.expand(B, H, T - n)], dim=-1)


def redundancy(keys: Tensor, valid: Tensor, threshold: float) -> Tensor:
    """``[B, H, T]`` R-KV redundancy of each cached key (a distribution over the valid slots; 0 on padding).

    keys ``[B, H, T, D]``, valid ``[B, H, T]`` bool, threshold in [0, 1]. Peak memory: one ``[B, T, T]`` fp32
    cosine matrix and two bool masks of that size, one KV head at a time.

    Cost: the ``[B, T, T]`` matmul and five passes over its result (compare, flip, argmax, column sum, and the
    padding masks only where a row has padding); the row's "has a near-duplicate" test reads the one entry the
    argmax found instead of a sixth pass (``any``). The same bits as doing all of them (tests/test_rkv.py).
    """
    B, H, T, _ = keys.shape
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    first = valid.int().argmax(dim=-1)  # [B, H] the oldest cached slot (the source's fallback index 0)
    n_valid = valid.sum(dim=-1).clamp_min(1)
    padded = not bool(valid.all())  # one synchronisation per call; without padding the masks change nothing
    out = torch.empty(B, H, T, device=keys.device)
    for h in range(H):
        v = valid[:, h]
        cos = k[:, h] @ k[:, h].transpose(-1, -2)  # [B, T, T]
        cos.diagonal(dim1=-2, dim2=-1).zero_()
        if padded:
            cos.masked_fill_(~v[:, :, None], 0.0).masked_fill_(~v[:, None, :], 0.0)  # padding: 0, never near
        near = (cos > threshold).flip(-1)  # newest slot first
        found = near.view(torch.uint8).argmax(dim=-1, keepdim=True)  # the first True, or 0 if the row has none
        last = T - 1 - found[..., 0]  # the newest near-duplicate of each row
        last = torch.where(near.gather(-1, found)[..., 0], last, first[:, h, None])
        del near
        cos.scatter_(-1, last[..., None], 0.0)
        mean = cos.sum(dim=1) / n_valid[:, h, None]
        out[:, h] = mean.masked_fill(~v, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
    return out
