"""Tiny random-weight decoders of every family the architecture matrix covers (tests/test_architectures.py).

Each family is built from the installed transformers' own config class: 2 layers, fp32, 4 query heads over 2 KV
heads where the family allows GQA, a small vocabulary, large initial weights (peaked attention, so a wrong mask or a
missing term moves the logits far past the tolerance), and a sliding window of `WINDOW` tokens where the config has
one. ``refused`` names the families learnkv refuses, with a pattern of the one-line reason (Bloom always; Falcon
with a transformers older than 5.25).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

WINDOW = 8
VOCAB = 64

BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.2,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, head_dim=None,
           num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           first_k_dense_replace=1, n_group=1, topk_group=1, n_shared_experts=1)
HYBRID = ["sliding_attention", "full_attention"]


@dataclass(frozen=True)
class Family:
    config: str  # the config class's name in transformers
    overrides: dict = field(default_factory=dict)  # None for a BASE key: leave it to the config's default
    refused: str | None = None  # a pattern of the one-line refusal, None: supported

    def build(self, attn_implementation: str = "eager", seed: int = 0):
        import transformers
        from transformers import AutoModelForCausalLM

        dropped = {k for k, v in self.overrides.items() if v is None and k in BASE}
        kw = {k: v for k, v in {**BASE, **self.overrides}.items() if k not in dropped}
        cfg = getattr(transformers, self.config)(**kw)
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation,
                                                dtype=torch.float32).eval()


def falcon_refusal() -> str | None:
    """Falcon computed its attention itself, bypassing transformers' attention interface, before transformers 5.25
    (refused: no eviction would reach its layers); from 5.25 it goes through the interface (supported). Decided by
    what the installed modelling code does, not by a version number."""
    from transformers.models.falcon import modeling_falcon

    if hasattr(modeling_falcon, "ALL_ATTENTION_FUNCTIONS"):
        return None
    return r"FalconForCausalLM cannot decode under a learnkv budget: learnkv's attention never ran"


FAMILIES = {
    "llama": Family("LlamaConfig"),
    "mistral": Family("MistralConfig", {"sliding_window": None}),
    "mistral-window": Family("MistralConfig", {"sliding_window": WINDOW}),
    "qwen2": Family("Qwen2Config"),
    "qwen2-window": Family("Qwen2Config", {"use_sliding_window": True, "sliding_window": WINDOW,
                                           "max_window_layers": 1}),
    "qwen3": Family("Qwen3Config"),
    "qwen3-moe": Family("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}),
    "phi3": Family("Phi3Config", {"sliding_window": None}),
    "phi3-window": Family("Phi3Config", {"sliding_window": WINDOW}),
    "gemma": Family("GemmaConfig"),
    "gemma2": Family("Gemma2Config", {"sliding_window": WINDOW, "attn_logit_softcapping": 5.0}),
    "gemma3-text": Family("Gemma3TextConfig", {"sliding_window": WINDOW, "layer_types": HYBRID}),
    "gpt-oss": Family("GptOssConfig", {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2,
                                       "layer_types": HYBRID}),
    "olmo2": Family("Olmo2Config"),
    "gpt-neox": Family("GPTNeoXConfig", {"num_key_value_heads": None, "head_dim": None}),  # partial rotary, no GQA
    "cohere": Family("CohereConfig"),
    "granite": Family("GraniteConfig"),
    "falcon": Family("FalconConfig", {"head_dim": None, "num_key_value_heads": None, "new_decoder_architecture": True,
                                      "num_kv_heads": 2}, refused=falcon_refusal()),
    "bloom": Family("BloomConfig", {"head_dim": None, "num_key_value_heads": None, "n_layer": 2, "n_head": 4},
                    refused=r"BloomForCausalLM cannot decode under a learnkv budget: learnkv's attention never ran"),
    "stablelm": Family("StableLmConfig"),  # its decoder layer passes no kwargs on: the cache reaches it by context
    "deepseek-v2": Family("DeepseekV2Config", MLA),
    "deepseek-v3": Family("DeepseekV3Config", MLA),
}
