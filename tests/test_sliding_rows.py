"""A window of rows kept among spare rows (`learnkv.sliding_rows`): the rows of a plain shifting window, and the same
bits when reduced."""

import pytest
import torch

from learnkv.features import window_std
from learnkv.sliding_rows import laid_out, push_row, slid, window_view


@pytest.mark.parametrize("window,spare", [(1, 1), (3, 1), (4, 8), (16, 8), (64, 16), (5, 40)])
@pytest.mark.parametrize("start", [0, 5])  # the window laid out at the prefill, or at a later step
def test_pushed_rows_are_the_shifting_window(window, spare, start):
    g = torch.Generator().manual_seed(window * 100 + spare + start)
    B, H, T = 2, 3, 37
    shifting = torch.rand(B, H, window, T, generator=g) ** 4  # attention-like, oldest row first
    state = laid_out(shifting.clone(), spare, start)
    assert state.shape == (B, H, window + spare, T)
    for step in range(start + 1, start + 3 * (spare + 1) + 2):  # past the top three times
        row = torch.rand(B, H, T, generator=g) ** 4
        push_row(state, row, window, spare, step)
        shifting = torch.cat([shifting[:, :, 1:], row[:, :, None]], dim=2)
        rows = window_view(state, window, spare, step)
        assert torch.equal(rows, shifting), f"step {step}"
        # reductions over the view: the bits of the contiguous window's (CPU sums by a cascade whose order is the
        # rows' order, not their addresses)
        assert torch.equal(rows.mean(dim=2), shifting.mean(dim=2))
        assert torch.equal(rows.amax(dim=2), shifting.amax(dim=2))
        assert torch.equal(window_std(rows), window_std(shifting))


def test_a_window_still_filling_is_its_rows():
    rows = torch.rand(1, 2, 3, 5)
    assert window_view(rows, 4, 8, 2) is rows  # 3 of 4 rows: not laid out yet
    assert window_view(rows, 3, 0, 2) is rows  # no spare rows: the rows in order


@pytest.mark.parametrize("window,spare", [(1, 1), (3, 2), (8, 8), (5, 0)])
@pytest.mark.parametrize("prefill", [1, 4, 9])  # a prompt shorter than the window, or longer
def test_slid_is_the_window_of_every_step(window, spare, prefill):
    """`slid` (SnapKV's and R-KV's update): the window of the last ``window`` rows after every step, a prefill of
    several queries and then decode steps of one; the state itself, written in place, once the window is full."""
    g = torch.Generator().manual_seed(window * 10 + spare + prefill)
    B, H, T = 2, 3, 11
    rows = torch.rand(B, H, prefill, T, generator=g)
    state = slid(None, rows, window, spare, 0)
    every = rows.clone()  # the state may view the prefill's rows (no spare rows), which its pushes then write
    for step in range(1, 2 * (window + spare) + 3):
        row = torch.rand(B, H, 1, T, generator=g)
        out = slid(state, row, window, spare, step)
        assert (out is state) == (state.shape[2] == window + spare)  # in place exactly when laid out
        state, every = out, torch.cat([every, row], dim=2)
        assert torch.equal(window_view(state, window, spare, step), every[:, :, -window:]), f"step {step}"
