"""Recurrence at length: the live observer agrees with the trace features' definition, and the CLI runs live."""

import numpy as np
import pytest
import torch

from conftest import random_ids
from learnkv import generate
from learnkv.__main__ import main
from learnkv.traces.recurrence import (
    MRI_BINS,
    RecurrenceObserver,
    format_mri,
    live_report,
    mri_distribution,
    table_of_runs,
)


def _hand_mri(attn_rows: list[torch.Tensor], n_prompt: int) -> np.ndarray:
    """LazyEviction's MRI by hand for one KV head: the longest gap between steps where a token's attention from
    the current query (max over the group's heads) is above uniform, counted from the step before it arrived."""
    n_steps = len(attn_rows)
    T = attn_rows[-1].shape[-1]
    mri = np.zeros(T)
    for t in range(T):
        born = max(t - n_prompt + 1, 0)  # the step that fed it (0 = prefill)
        last = max(born - 1, 0) if t >= n_prompt else 0
        for step in range(max(born, 1), n_steps + 1):
            row = attn_rows[step - 1]
            n_visible = row.shape[-1]
            if t < n_visible and float(row[:, t].max()) * n_visible >= 1.0:
                mri[t] = max(mri[t], step - last)
                last = step
    return mri


def test_observer_mri_is_the_hand_computed_one(tiny):
    captured = []

    class Spy(RecurrenceObserver):
        def update(self, view):
            super().update(view)
            if view.layer == 0 and view.step > 0:
                captured.append(view.attn[0, 0, :, -1, :].clone())  # [G, T] KV head 0, the step's query

    obs = Spy(n_layers=2)
    generate(tiny, input_ids=random_ids(12, seed=1), policy=obs, max_new_tokens=30, stop_at_eos=False)
    run = obs.tokens(prompt_len=12)
    assert run["mri"].shape == (2, 2, 12 + 29) and run["output"].sum() == 29 and obs.last_step == 29
    assert np.array_equal(run["mri"][0, 0], _hand_mri(captured, 12))
    assert run["span"][0, 0, 0] == 29 and run["span"][0, 0, -1] == 0


def test_tables_and_distribution_of_runs():
    mri = np.array([[[0, 1, 5, 40, 3]]], dtype=float)
    run = {"mri": mri, "span": np.array([[[60, 60, 60, 60, 2]]]), "output": np.array([False, False, True, True, True])}
    layers, share, count = table_of_runs([run], gaps=(2, 32))
    assert layers == [0] and count.tolist() == [[4, 4]] and share.tolist() == [[0.5, 0.25]]
    dist = mri_distribution([run])
    assert dist["prompt"][0] == 0.5 and dist["prompt"][1] == 0.5
    assert dist["output"].sum() == pytest.approx(1.0) and dist["output"][[2, 3, 6]].tolist() == pytest.approx([1 / 3] * 3)
    assert len(dist["output"]) == len(MRI_BINS) and "never" in format_mri(dist)


def test_live_report_writes_both_plots(tiny, tmp_path):
    runs = []
    for seed in (1, 2):
        obs = RecurrenceObserver(n_layers=2)
        generate(tiny, input_ids=random_ids(10, seed=seed), policy=obs, max_new_tokens=20, stop_at_eos=False)
        runs.append(dict(obs.tokens(10), generated=20))
    text, png, mri = live_report(runs, tmp_path / "rec.png", tmp_path / "mri.png")
    assert png.stat().st_size > 1000 and mri.stat().st_size > 1000
    assert "median 20" in text and "| all |" in text and "output tokens" in text


def test_cli_needs_a_directory_or_a_source(capsys):
    assert main(["recurrence"]) == 2
    assert "trace directory or --source" in capsys.readouterr().err
    assert main(["recurrence", "--source", "nope"]) == 2
    assert "unknown prompt source" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_live_on_the_real_model(tmp_path, capsys):
    assert main(["recurrence", "--source", "chain", "--prompts", "1", "--max-new-tokens", "24", "--out",
                 str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "prompts: 1" in out and (tmp_path / "recurrence.png").exists() and (tmp_path / "mri.png").exists()
