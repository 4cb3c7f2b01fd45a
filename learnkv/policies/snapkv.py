"""SnapKV: attention of an observation window of recent queries, pooled."""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from learnkv.policies.base import LayerView, Policy
from learnkv.fields import setting
from learnkv.sliding_rows import laid_out, push_row, slid, window_view

DEFAULT_WINDOW = 64
#: the window's state holds this many rows beyond the window (`learnkv.sliding_rows`): a decode step writes one row
SPARE_ROWS = 16
#: with ``running_sum``, the window's sum of each slot's attention, float64 per-token state
WINDOW_SUM = "window_sum"


@dataclass
class SnapKV(Policy):
    """SnapKV (Li et al., https://arxiv.org/abs/2404.14469; github.com/FasterDecoding/SnapKV).

    Score = attention of the last ``window`` queries to the keys before the window, averaged over the window,
    smoothed by 1-D average pooling (``kernel_size``, zero padding), averaged over the query heads of each KV head;
    the window's own tokens are always kept.
    At prefill the window is the prompt's last queries. During decoding the window slides: the attention rows
    of the last ``window`` queries are kept as state and the cache is rescored whenever it overflows (how
    kvpress's DecodingPress applies SnapKV at decode time). A decode window still filling (a prefill policy's
    state dropped, a prompt shorter than the window) is kept at its full size, zero rows standing for the steps
    not seen, and the rows seen are averaged.
    Compared across heads and layers (``allocation=head|global``) its scores are ``mass``
    (`learnkv.allocation.normalisation_for`): each head's divided by its live total.

    Parameters
    ----------
    window : int or None
        Observation window (and protected recent window). None: kvpress's 64, capped at a quarter of the budget.
        Rows of one batch may have their own (budget fractions resolve to a window per row): the batch's policy
        (`for_batch`) keeps the largest window's attention rows and scores each row over its own.
    kernel_size : int
        Average-pooling kernel, 5 as in kvpress.
    running_sum : bool
        Decode steps score from the window's sum kept as per-token state in float64 (`WINDOW_SUM`: plus the row
        that enters, minus the row that leaves, 24 bytes a slot a step) instead of averaging the window's ``window``
        rows (4 bytes each) at every step; the same mean within float64 rounding, not bit for bit: torch's mean
        sums the rows in a cascade. Off by default, so the tables measured before it stay reproducible. The prefill
        averages the rows as without it, and so do rows of one batch with windows of their own; a window still
        filling divides its sum by the rows seen.
    """

    name = "snapkv"
    pooling = "mean_mass"  # the window's attention: comparable across layers and heads
    # its 1-D average pool mixes neighbouring slots, but only live ones (`live_order`): dead slots may stay (slack)
    per_row_fields = ("n_sink", "n_recent", "interval", "window")  # the window: see `for_batch`
    window: int | None = setting(None, ge=1)
    kernel_size: int = setting(5, ge=1)
    running_sum: bool = setting(False)
    #: each row's window when the rows of a batch differ (set by `for_batch`; not a parameter)
    row_windows: tuple[int, ...] | None = field(default=None, compare=False, repr=False)
    #: with ``running_sum``: (decode step, query rows in the window after it), the mean's divisor (every layer sees
    #: the same steps); not a parameter
    _window_rows: tuple[int, int] = field(default=(-1, 0), init=False, compare=False, repr=False)

    @property
    def rowwise(self) -> bool:
        """Each row is scored from its own window rows alone, so the cache may stack every layer's rows in one view
        and score them at once; not when the rows have windows of their own (`row_windows`, read by row index)."""
        return not self.row_windows

    @property
    def obs_window(self) -> int:
        return max(self.row_windows) if self.row_windows else self.window or DEFAULT_WINDOW

    def for_batch(self, rows: Sequence["SnapKV"]) -> "SnapKV":
        windows = tuple(p.obs_window for p in rows)
        return self if len(set(windows)) == 1 else dataclasses.replace(self, row_windows=windows)

    def params(self) -> dict:
        return {k: v for k, v in super().params().items() if k != "row_windows"}

    def resolve_defaults(self, budget: int) -> dict:
        window = self.window if self.window is not None else min(DEFAULT_WINDOW, max(1, budget // 4))
        return {"window": window, "n_recent": window}

    def update(self, view: LayerView) -> None:
        rows = view.attn  # [B, H, W, T]; the cache zero-padded old rows for new slots (causally exact)
        W, buf = self.obs_window, view.state.get("window_attn")
        if rows.shape[2] == 1 and view.step >= 1:  # a decode step: one row pushed into a window at its full size
            if self.running_sum and not self.row_windows:
                self._running_update(view, buf, rows[:, :, 0])
            else:
                push_row(self._full_size(view, buf)[0], rows[:, :, 0], W, SPARE_ROWS, view.step)
                self._count_row(view.step)
            return
        window = slid(buf, rows, W, SPARE_ROWS, view.step)
        if window is not buf:
            view.state.pop(WINDOW_SUM, None)  # a window laid out anew: averaged from its rows
            view.state["window_attn"] = window

    def _full_size(self, view: LayerView, buf: Tensor | None) -> tuple[Tensor, int]:
        """The window of the step before ``view.step`` laid out at its full size among the spare rows, and the rows
        of it seen: ``buf`` itself where it is so, else its rows so far (none, or at most ``W``: a prefill policy's
        state dropped, a prompt shorter than the window) after zero rows standing for the steps not seen, into the
        state. At its full size it never changes shape: a window growing a row a step would be a new tensor, and
        every layer's state stacked anew by the cache (`learnkv.slots.link_layers`), at each of its first ``W``
        decode steps (~50 ms a step at batch 16 and ~600 slots, bench/RESULTS.md)."""
        W, step = self.obs_window, view.step
        if buf is not None and buf.shape[2] == W + SPARE_ROWS:
            # a window this decode laid out counts its rows (`_window_rows`); another is full
            return buf, self._window_rows[1] if self._window_rows[0] >= step - 1 else W
        B, H, _, T = view.attn.shape
        n_seen = 0 if buf is None else buf.shape[2]
        zeros = view.attn.new_zeros(B, H, W - n_seen, T)
        rows = zeros if buf is None else torch.cat([zeros, buf], dim=2)
        buf = view.state["window_attn"] = laid_out(rows, SPARE_ROWS, step - 1)
        self._window_rows = (step - 1, n_seen)
        return buf, n_seen

    def _count_row(self, step: int) -> None:
        """The step's row counted into the rows seen (`_window_rows`, at most the window), once per step, whether
        the cache updates layer by layer or all at once."""
        if self._window_rows[0] != step:
            seen = self._window_rows[1] if self._window_rows[0] == step - 1 else self.obs_window
            self._window_rows = (step, min(seen + 1, self.obs_window))

    def _running_update(self, view: LayerView, buf: Tensor | None, row: Tensor) -> None:
        """A decode step with ``running_sum``: ``row [B, H, T]`` pushed into the window (at its full size,
        `_full_size`), in place, and into its sum (plus the row, minus the row that leaves)."""
        W, step, state = self.obs_window, view.step, view.state
        total = state.get(WINDOW_SUM)
        if total is None:
            buf, n_seen = self._full_size(view, buf)
            total = state[WINDOW_SUM] = window_view(buf, W, SPARE_ROWS, step - 1).sum(dim=2, dtype=torch.float64)
            self._window_rows = (step - 1, n_seen)
        leaving = window_view(buf, W, SPARE_ROWS, step - 1)[:, :, 0]  # before the push moves or overwrites it
        total.add_(row.double().sub_(leaving))
        push_row(buf, row, W, SPARE_ROWS, step)
        self._count_row(step)

    def score(self, view: LayerView) -> Tensor:
        attn = window_view(view.state["window_attn"], self.obs_window, SPARE_ROWS, view.step)
        # a window this decode laid out while it fills holds zero rows before the rows seen: those alone are averaged
        # (a view of them reduces as the contiguous rows of a growing window would, bit for bit)
        seen = self._window_rows[1] if self._window_rows[0] == view.step else attn.shape[2]
        positions = view.positions
        if not self.row_windows:
            total = view.state.get(WINDOW_SUM)
            mean = attn[:, :, -seen:].mean(dim=2) if total is None else total.div(seen).float()
            return self._score(mean, self.obs_window, positions)
        scores = attn.new_empty(attn.shape[0], attn.shape[1], attn.shape[3])
        for w in sorted(set(self.row_windows)):  # each row exactly as alone: its own last w query rows
            rows = [b for b, x in enumerate(self.row_windows) if x == w]
            scores[rows] = self._score(attn[rows][:, :, -min(w, seen):].mean(dim=2), w, positions[rows])
        return scores

    def _score(self, s: Tensor, window: int, positions: Tensor) -> Tensor:
        """Scores from ``s [B, H, T]``, the window's mean attention to each slot."""
        B, H, T = s.shape
        s, dest = live_order(s, positions)
        n_prefix = T - min(window, T)  # the window's own keys are kept, and not pooled into neighbours
        k = self.kernel_size
        pooled = avg_pool(s[..., :n_prefix], k)
        # like kvpress, the window gets the highest prefix score (it is protected by the cache anyway)
        top = pooled.amax(dim=-1, keepdim=True) if n_prefix else s.new_zeros(B, H, 1)
        scores = torch.cat([pooled, top.expand(B, H, T - n_prefix)], dim=-1)
        return scores if dest is None else scores.gather(-1, dest.clamp(max=T - 1))


def live_order(s: Tensor, positions: Tensor, shortcut: bool | None = None) -> tuple[Tensor, Tensor | None]:
    """``s [B, H, T]`` laid out as a compacted cache would hold it: each row's live slots (position >= 0) in order
    at its right end, +0.0 before them (what a padding or filler slot holds), and ``dest``, each slot's index there
    (``T`` for a dead one), to map the scores back; ``(s, None)`` where every row already is so (a dense cache).

    The pool then sees each live slot's live neighbours, never a dead slot between them: a live slot's pooled score
    is the one it gets in the compacted cache, bit for bit (the same values summed in the same order; extra zeros at
    the left are the pooling's own padding), so slots may be marked dead instead of compacted at every eviction. A
    dead slot's score is meaningless (the cache never keeps a dead slot).

    ``shortcut`` (default: on CPU only) returns ``(s, None)`` for a dense cache; without it a dense cache is scattered
    onto itself (the same scores for its live slots)."""
    T = s.shape[-1]
    valid = positions >= 0
    s = s.masked_fill(~valid, 0.0)  # in a compacted cache already so; a slot marked dead keeps its old attention
    n = valid.sum(-1, keepdim=True)
    slot = torch.arange(T, device=s.device)
    # the shortcut reads a flag back from the device: on a GPU a sync per layer and step (the H200 lease's profile,
    # bench/profile_step.py) costs more than the scatter
    if (s.device.type == "cpu" if shortcut is None else shortcut) and bool((valid | (slot < T - n)).all()):
        return s, None
    dest = torch.where(valid, valid.cumsum(-1) - 1 + (T - n), T)
    return s.new_zeros(*s.shape[:-1], T + 1).scatter_(-1, dest, s)[..., :T], dest


def avg_pool(x: Tensor, k: int) -> Tensor:
    """``F.avg_pool1d(x, k, stride=1, padding=k // 2)`` over the last axis of ``x [B, H, n]``, cut to ``n``.

    On CPU in fp32 as ``k`` shifted adds, with the same bits as the pooling call (its CPU loop sums each window
    left to right from +0.0, skipping the zero padding, and divides by ``k``; adding a padding zero to a sum that
    is never -0.0 changes nothing). The call costs ~50 us per row of ``B * H`` on one core (n ~ 500), the adds
    ~0.15 ms whatever the rows: 1.8x faster at 12 rows, 4x at 48 (bench/scoring_ab.py), so below 4 rows, on CUDA and
    in half precision (other accumulation orders) the pooling call itself.
    """
    B, H, n = x.shape
    if x.device.type != "cpu" or x.dtype != torch.float32 or n == 0 or B * H < 4:
        pooled = F.avg_pool1d(x.reshape(B * H, 1, n), kernel_size=k, stride=1, padding=k // 2)
        return pooled[..., :n].reshape(B, H, n)
    p = k // 2
    padded = F.pad(x, (p, k - 1 - p))  # padded[i + j] is the window's j-th input for output i
    acc = padded[..., :n] + 0.0  # 0.0 + x, as the loop starts its sum: -0.0 becomes +0.0
    for j in range(1, k):
        acc += padded[..., j : j + n]
    return acc / k
