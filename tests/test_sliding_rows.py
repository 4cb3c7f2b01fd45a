"""A window of rows kept among spare rows (`learnkv.sliding_rows`): the rows of a plain shifting window, and the same
bits when reduced."""

import pytest
import torch

from learnkv.features import window_std
from learnkv.sliding_rows import laid_out, push_row, window_view


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
