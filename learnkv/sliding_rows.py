"""A sliding window of rows in per-slot state (the last W steps' attention to each slot), kept among W + spare rows.

SnapKV's observation window and the learned policy's feature window hold, for every slot, one row per recent step.
Shifting W rows down at every decode step to append one rewrites the whole window each step (at 1.5k slots and
batch 8, SnapKV's 64 rows cost more than its scoring; bench/RESULTS.md). Kept among ``W + spare`` rows, the window
instead moves down one row per step, written in place, and back to the top every ``spare + 1`` steps (one move of
W - 1 rows): the window after step ``t`` is rows ``t % (spare + 1)`` to that + W, a view that reduces as a
contiguous tensor of its rows would, bit for bit (tests/test_sliding_rows.py). The owner of
the state calls `push_row` at every decode step, as the cache calls a policy's update at every step.
"""

from __future__ import annotations

import torch
from torch import Tensor


def first_row(step: int, spare: int) -> int:
    """Where the window after step ``step`` starts among its ``W + spare`` rows."""
    return step % (spare + 1)


def window_view(state: Tensor, window: int, spare: int, step: int) -> Tensor:
    """``[B, H, n, T]``, the window's rows after step ``step``, oldest first: a view of ``state [B, H, window + spare,
    T]``, or ``state`` itself when it holds its rows in order (any other row count: a window still filling)."""
    if spare == 0 or state.shape[2] != window + spare:
        return state
    first = first_row(step, spare)
    return state[:, :, first : first + window]


def laid_out(rows: Tensor, spare: int, step: int) -> Tensor:
    """``rows [B, H, W, T]`` (a full window, oldest first) in ``W + spare`` rows as after step ``step``; zero rows
    around it."""
    if spare == 0:
        return rows
    first = first_row(step, spare)
    B, H, _, T = rows.shape
    return torch.cat([rows.new_zeros(B, H, first, T), rows, rows.new_zeros(B, H, spare - first, T)], dim=2)


def in_rows(state: Tensor, window: int, spare: int, step: int) -> Tensor:
    """The window state after step ``step`` in ``window + spare`` rows: ``state`` itself, or laid out once
    (`laid_out`) when it holds a full window's rows in order (a state another owner, without spare rows, created)."""
    return laid_out(state, spare, step) if spare and state.shape[2] == window else state


def appended(state: Tensor | None, rows: Tensor, window: int, spare: int, step: int) -> Tensor:
    """The window after step ``step``: ``rows [B, H, q, T]`` (oldest first) appended to the window ``state`` held
    after step ``step - 1`` (None: none yet), its last ``window`` rows kept; laid out among the spare rows once it is
    full (`laid_out`), else its rows in order. The general path (a prefill, a window still filling, a step of several
    queries); a decode step on a full window is `push_row`, in place."""
    rows = rows[:, :, -window:]
    if state is not None:
        rows = torch.cat([window_view(state, window, spare, step - 1), rows], dim=2)[:, :, -window:]
    return laid_out(rows, spare, step) if rows.shape[2] == window else rows


def push_row(state: Tensor, row: Tensor, window: int, spare: int, step: int) -> None:
    """Decode step ``step``: append ``row [B, H, T]`` to the window of step ``step - 1`` in ``state [B, H, window +
    spare, T]`` (the oldest row drops out), in place."""
    first = first_row(step, spare)
    if first == 0:  # back to the top: the previous window's newest W - 1 rows, row by row (each before its source)
        for j in range(window - 1):
            state[:, :, j] = state[:, :, spare + 1 + j]
    state[:, :, first + window - 1] = row


def slid(state: Tensor | None, rows: Tensor, window: int, spare: int, step: int) -> Tensor:
    """The window after step ``step`` with ``rows [B, H, q, T]`` added to the window ``state`` of step ``step - 1``:
    ``state`` itself, the row pushed in place (`push_row`), for a decode step on a full window; else `appended`'s
    window (a new tensor, or without spare rows a view of ``rows``), which the policy stores in its state."""
    if state is not None and state.shape[2] == window + spare and rows.shape[2] == 1:
        push_row(state, rows[:, :, 0], window, spare, step)
        return state
    return appended(state, rows, window, spare, step)
