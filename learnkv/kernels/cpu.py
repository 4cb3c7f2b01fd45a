"""Shortcuts of the references for the CPU decode loop, equal to them bit for bit (tests/test_fast_paths.py).

A shortcut covers one common case in fewer or cheaper tensor ops and returns None outside it, so the caller falls
back to the reference. It is not a spec: `kernels.reference` stays the one definition of every result. The one
shortcut that is not a function of tensors, `move_slot_run`, moves slots in place where the reference gathers them
(`gather_tokens_reference`): equal on every slot it is asked to fill.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor

from learnkv.kernels.reference import kept_slots_reference, per_row, protected_or_dead


def one_drop_rows(keep, live, B: int, H: int, T: int) -> list[int] | None:
    """Each row's drop (0 or 1) from its ``keep`` and ``live`` slots (one int, or one per row; host values), or None
    where a row drops more than one live slot, keeps more slots than it has, or there is no row."""
    keeps = [keep] * B if isinstance(keep, int) else list(keep)
    lives = [live] * B if isinstance(live, int) else list(live)
    drops = [n - k for n, k in zip(lives, keeps)]
    if B * H == 0 or any(d not in (0, 1) for d in drops) or max(keeps) > T:
        return None
    return drops


def mark_victims(positions: Tensor, victim: Tensor, drops: list[int]) -> None:
    """Mark the slot ``victim [B, H, 1]`` of every row whose drop is 1 dead (position -1), in place."""
    if all(drops):
        positions.scatter_(-1, victim, -1)
    elif any(drops):
        dropping = torch.tensor(drops, dtype=torch.bool, device=victim.device).view(-1, 1, 1)
        positions.scatter_(-1, victim, positions.gather(-1, victim).masked_fill(dropping, -1))


def mark_one_drop(scores: Tensor, positions: Tensor, keep, n_sink, n_recent, live) -> bool:
    """`kernels.reference.mark_one_drop_reference` where no row drops more than one live slot: each dropping row's
    victim (`one_drop_victims`) marked dead in place; False, marking nothing, where the argmin leaves the case to
    the reference."""
    found = one_drop_victims(scores, positions, keep, n_sink, n_recent, live)
    if found is None:
        return False
    mark_victims(positions, *found)
    return True


def one_drop_victims(scores: Tensor, positions: Tensor, keep, n_sink, n_recent,
                     live) -> tuple[Tensor, list[int]] | None:
    """The slot each ``(b, h)`` row drops when no row drops more than one live slot: ``victim [B, H, 1]`` and each
    row's drop (0 or 1), or None in the cases `select_keep_one_drop` leaves to the reference.

    The victim is the argmin of the reference's priorities over the live slots (protected and dead ones +inf; the
    first among ties, so the older slot goes, as the reference's preference for recent slots does). A row that
    drops nothing keeps every live slot whatever its victim. Marking the victims dead (position -1) leaves the
    live slots `select_keep_reference` keeps, without building its kept index (`learnkv.cache.BudgetCache` marks
    them so when it does not compact): at a stacked decode step of 30 layers x 8 rows x ~800 slots the index and
    the mask made back from it cost ~3x this argmin.
    """
    B, H, T = scores.shape
    drops = one_drop_rows(keep, live, B, H, T)
    if drops is None:
        return None
    # the reference's priorities on live slots (protected ones +inf; a protected slot is never dead), dead ones +inf
    # here so that the argmin finds the lowest live one
    live_prio = scores.float().masked_fill(protected_or_dead(positions, n_sink, n_recent), float("inf"))
    # [B, H, 1]: the lowest live priority and its slot (argmin's: the oldest among ties), in one pass; a row's
    # minimum is NaN where it holds a NaN (torch's min propagates it), so the row minima tell every case
    lowest, victim = live_prio.min(dim=-1, keepdim=True)
    # one synchronisation for every case the argmin would not reproduce (NaN > -inf is False too): a NaN or -inf
    # priority on a live slot, or a row whose every live slot is +inf (the argmin then lands on a dead slot)
    if bool((~(lowest > float("-inf"))).any() | (positions.gather(-1, victim) < 0).any()):
        return None
    return victim, drops


def select_keep_one_drop(scores: Tensor, positions: Tensor, keep, n_sink, n_recent, live) -> Tensor | None:
    """`select_keep_reference` (token granularity) when no row drops more than one live slot, else None.

    That is every decode step of a policy that evicts at each overflow: the new token puts a row one over its
    budget. The reference ranks every slot with two sorts per step; here the one slot that goes is the argmin of
    the same priorities (`one_drop_victims`), dead and padding slots go with it, and the kept slots are listed by a
    cumulative sum.

    Parameters
    ----------
    keep, live : int or sequence of int
        Slots to keep, and the live (non-negative position) slots of each row, one for every row or one per row;
        ``live`` is what the caller knows of ``positions`` (`learnkv.cache.BudgetLayer.live`), so the case is
        decided on the host.

    Returns None (use the reference) when a row drops more than one live slot or asks for more than it holds, and
    where the argmin could differ from the reference's order: a NaN or -inf priority on a live slot (it would tie
    with, or rank among, the dead slots' -inf), or a row whose lowest live priority is not below every dead slot's
    masked one (all of its live slots +inf).
    """
    found = one_drop_victims(scores, positions, keep, n_sink, n_recent, live)
    if found is None:
        return None
    victim, drops = found
    B, H = scores.shape[:2]
    keeps = [keep] * B if isinstance(keep, int) else list(keep)
    dropping = torch.tensor(drops, dtype=torch.bool, device=scores.device).view(B, 1, 1).expand(B, H, 1)
    kept = (positions >= 0).scatter(-1, victim, ~dropping)
    return list_kept(kept, max(keeps), per_row(keeps, B, scores.device))


def select_keep_listed(scores: Tensor, positions: Tensor, keep, n_sink, n_recent, block_size: int = 1) -> Tensor:
    """`select_keep_reference`, its kept slots listed by `list_kept` where the reference sorts every slot of every
    row: at ~1.3k slots and 3 KV heads, ~0.4 of ~5 ms at 48 rows in blocks (a block eviction of 1.6 rows in 30
    layers), ~25 of ~80 ms at 480 rows in tokens (a compaction of batch 16 in 30 layers)."""
    B, H, T = scores.shape
    if isinstance(keep, int) and T <= keep:
        return torch.arange(T, device=scores.device).expand(B, H, T).clone()
    kept = kept_slots_reference(scores, positions, keep, n_sink, n_recent, block_size)
    counts = kept.sum(-1, keepdim=True)
    return list_kept(kept, int(counts.max()) if kept.numel() else 0, counts)


def list_kept(kept: Tensor, K: int, counts: Tensor) -> Tensor:
    """`list_kept_reference` by a cumulative sum, not a sort: ``K`` the most slots any row keeps and ``counts`` each
    row's (``[B, H, 1]``, or ``[B, 1, 1]`` alike in every KV head), known to the caller. A row that keeps
    ``k < K`` slots lists them after ``K - k`` entries of -1, as the reference does."""
    B, H, T = kept.shape
    dest = torch.where(kept, kept.cumsum(-1) + (K - 1 - counts), K)  # slots not kept land in an extra column, cut
    out = torch.full((B, H, K + 1), -1, dtype=torch.int64, device=kept.device)
    out.scatter_(-1, dest, torch.arange(T, device=kept.device).expand(B, H, T))
    return out[..., :K]


def slot_runs(slots: Tensor, first: int, most: int | None = None) -> list[tuple[int, int, int, int, int]] | None:
    """The runs of kept slots that move right when each of ``M`` rows takes into its slots ``first, first + 1, ..``
    the slots ``slots [M, H, W]`` (ascending where >= 0; a -1 entry leaves a dead slot, whose keys and values are
    never read). A run is ``(row, head, dest, length, shift)``: slots ``[dest - shift, dest - shift + length)`` go
    to ``[dest, dest + length)``. Listed right to left within each row's head, the order `move_slot_run` must
    take them in: a run's destination then holds no slot a run still to move reads. None where a kept slot would
    move left (no such order; the caller gathers instead), or where there are more than ``most`` runs (each is a
    call from Python, ~1.5 us: a gather of the rows costs less than ~100 of them a row and head).

    A block eviction of a dense cache shifts a row's live slots left of the block right by the block (its fillers
    are dead, and the slots right of it stay), so a moved row is one run a head; R-KV's tokens evicted all along a
    row make one a token."""
    W = slots.shape[-1]
    shift = torch.arange(first, first + W, device=slots.device) - slots
    moves = (slots >= 0) & (shift != 0)
    # one value a run: shifts of slots that do not move are set apart, so a run starts and ends where it changes
    shift = shift.masked_fill(~moves, torch.iinfo(torch.int64).min)
    differs = shift[..., 1:] != shift[..., :-1]
    starts = (moves & F.pad(differs, (1, 0), value=True)).nonzero()
    if most is not None and len(starts) > most:
        return None
    ends = (moves & F.pad(differs, (0, 1), value=True)).nonzero()[:, 2]
    shifts = shift[tuple(starts.unbind(1))]
    if bool((shifts < 0).any()):
        return None
    runs = torch.cat([starts, (ends - starts[:, 2] + 1)[:, None], shifts[:, None]], dim=1)
    runs[:, 2] += first
    return [tuple(run) for run in runs.flip(0).tolist()]


def move_slot_run(buf: Tensor, row: int, head: int, dest: int, length: int, shift: int) -> None:
    """Move the slots ``[dest - shift, dest - shift + length)`` of ``buf [B, H, C, D]`` (contiguous, on the CPU) in
    row ``row`` and KV head ``head`` to ``[dest, dest + length)``, in place: one memmove, which may overlap. A slot
    read once and written once, where a gather through a workspace and a copy back read and write it twice."""
    B, H, C, D = buf.shape
    if not (buf.device.type == "cpu" and buf.is_contiguous() and 0 <= row < B and 0 <= head < H and length >= 0
            and 0 <= dest - shift and dest + length <= C):
        raise ValueError(f"no run of {length} slots from {dest - shift} to {dest} in row {row}, head {head} of "
                         f"{tuple(buf.shape)} {buf.device} {'contiguous' if buf.is_contiguous() else 'strided'}")
    size = buf.element_size() * D
    base = buf.data_ptr() + (row * H + head) * C * size
    ctypes.memmove(base + dest * size, base + (dest - shift) * size, length * size)
