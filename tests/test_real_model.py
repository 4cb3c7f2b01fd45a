"""The bundled SmolLM2-135M-Instruct: exactness against transformers and a smoke run of every policy."""

import pytest
import torch

from conftest import params_for
from learnkv import POLICIES, generate
from learnkv.model import ModelLoadError, load_model, prepare_smollm2

pytestmark = pytest.mark.slow

PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?"


@pytest.fixture(scope="module")
def eager_smollm2():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(prepare_smollm2(), dtype=torch.float32, attn_implementation="eager").eval()


def test_learnkv_attention_matches_eager(smollm2, eager_smollm2):
    model, tok = smollm2
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = eager_smollm2(ids).logits
    captured = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: captured.append(o))
    try:
        generate(model, input_ids=ids, policy="full", max_new_tokens=1)
    finally:
        hook.remove()
    assert (captured[0][0, -1] - ref[0, -1]).abs().max().item() < 1e-4


def test_full_reproduces_hf_generate(smollm2, eager_smollm2):
    model, tok = smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    expected = eager_smollm2.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)
    ours = generate(model, tok, input_ids=ids, policy="full", max_new_tokens=64, stop_at_eos=False)
    assert ours.tokens[0].tolist() == expected[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_decodes_64_tokens_at_budget_64(smollm2, policy):
    model, tok = smollm2
    budget = None if policy == "full" else 64
    result = generate(model, tok, PROMPT, policy=policy, budget=budget, max_new_tokens=64, stop_at_eos=False,
                      policy_params=params_for(policy, model.config.num_hidden_layers, model="smollm2-135m-instruct",
                                               n_kv_heads=model.config.num_key_value_heads))
    assert result.tokens.shape == (1, 64)
    if policy != "full":
        assert result.max_kept_tokens <= 64
        assert result.peak_kv_bytes < result.full_kv_bytes
    assert result.texts[0].strip()


def test_missing_model_path_is_one_line():
    with pytest.raises(ModelLoadError) as err:
        load_model("/no/such/dir/model")
    assert "does not exist" in str(err.value) and "\n" not in str(err.value)
