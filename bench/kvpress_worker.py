"""The kvpress side of bench/kvpress_parity.py: runs in .venv-kvpress (bench/kvpress_venv.sh), never in learnkv's.

    .venv-kvpress/bin/python bench/kvpress_worker.py --model MODEL_DIR --threads 1

Reads one JSON request per line on stdin, ``{"run": NAME, "ids": [...], "new_tokens": N, "budget": B,
"interval": I}``, times one greedy generation of exactly N new tokens (prefill included) and answers one JSON line
``{"run", "seconds", "tokens"}`` on stdout. NAME is one of:

- ``generate``: transformers' ``model.generate`` with no press (this venv's transformers);
- ``knorm``: ``DecodingPress(KnormPress(), compression_interval=I, target_size=B)``;
- ``observed``: ``DecodingPress(ObservedAttentionPress(), ...)`` on the eager attention, kvpress's H2O-like press
  (its score, under DecodingPress, is the attention of the queries of the current step, not a running sum).

Each press decodes as kvpress's own pipeline does (``KVPressTextGenerationPipeline.generate_answer``: a greedy loop
of ``model(...)`` calls on a ``DynamicCache`` with explicit positions, inside ``with press(model):``), without its
stop at EOS so every run makes N tokens. Imports only torch, transformers and kvpress (learnkv is not installed
here).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from kvpress import DecodingPress, KnormPress, ObservedAttentionPress
from transformers import AutoModelForCausalLM, DynamicCache


def press_for(name: str, budget: int, interval: int):
    base = {"knorm": KnormPress, "observed": ObservedAttentionPress}[name]()
    return DecodingPress(base_press=base, compression_interval=interval, target_size=budget)


def press_decode(model, press, ids: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]`` greedy tokens: kvpress's pipeline loop (prefill, then one ``model`` call per token), no EOS stop."""
    cache = DynamicCache()
    with press(model):
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        out = model(input_ids=ids, past_key_values=cache, position_ids=positions, logits_to_keep=1)
        tokens = [out.logits[0, -1].argmax()]
        for i in range(n - 1):
            out = model(input_ids=tokens[-1].view(1, 1), past_key_values=cache,
                        position_ids=positions[:, -1:] + 1 + i)
            tokens.append(out.logits[0, -1].argmax())
    return torch.stack(tokens)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a local transformers folder (the parity bench passes SmolLM2's)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    models = {}  # by attention implementation: ObservedAttentionPress needs the eager one's weights

    def model_for(attn: str):
        if attn not in models:
            models[attn] = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                                attn_implementation=attn).eval()
        return models[attn]

    for line in sys.stdin:
        req = json.loads(line)
        name = req["run"]
        model = model_for("eager" if name == "observed" else "sdpa")
        ids = torch.tensor([req["ids"]])
        n = req["new_tokens"]
        gen = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=model.config.eos_token_id)
        with torch.inference_mode():
            start = time.perf_counter()
            if name == "generate":
                tokens = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)[0, ids.shape[1]:]
            else:
                tokens = press_decode(model, press_for(name, req["budget"], req["interval"]), ids, n)
            seconds = time.perf_counter() - start
        print(json.dumps({"run": name, "seconds": seconds, "tokens": tokens.tolist()}), flush=True)


if __name__ == "__main__":
    main()
