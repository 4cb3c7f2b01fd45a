"""Command line.

    python -m learnkv policies
    python -m learnkv generate --policy lazy --budget 64 --max-new-tokens 64 --prompt "What is 12 times 7?"
    python -m learnkv collect --out traces/ --prompts 16 [--shard i/n] [--batch-size 4]
    python -m learnkv collect --out traces-rkv/ --policy rkv --budget 0.25,0.5     # under eviction (on-policy)
    python -m learnkv merge traces/
    python -m learnkv recurrence traces/
    python -m learnkv recurrence --source chain --prompts 2 --max-new-tokens 1536 --out docs/chain/
    python -m learnkv compare docs/results/long-chain-smollm2/finished runs/eval-long-chain-horizon --baseline learned
    python -m learnkv diagnose-chain --policy rkv --budget 0.5 --prefill-policy snapkv --limit 8 --batch-size 8

`generate` prints the continuation(s), then one JSON line: policy, budget, max_kept_tokens, peak_kv_bytes,
tokens_per_s and the rest of `GenerationResult.summary()`.
"""

from __future__ import annotations

import argparse
import json
import sys

from learnkv.cli import Interruptible, OneLineParser, set_threads, shard_of, thread_count

# imports inside functions: each subcommand imports only what it runs, so `--help` and a bad argument answer at once


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m learnkv", description="learned KV-cache eviction")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("policies", help="list the registered eviction policies, one per line")

    gen = sub.add_parser("generate", help="decode a prompt under an eviction policy and a KV budget")
    gen.add_argument("--policy", default="full", help="registered policy name (see `policies`)")
    gen.add_argument("--budget", default=None, help="tokens per layer and KV head (e.g. 64) or a fraction (e.g. 0.25)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    gen.add_argument("--model", default=None, help="bundled alias, local folder or hub id (default: SmolLM2-135M)")
    gen.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="policy hyperparameter")
    gen.add_argument("--prefill-policy", default=None, metavar="ITEM",
                     help="compresses a prompt over the budget at the prefill (e.g. snapkv or snapkv:window=16); "
                          "needed by lazy, which observes nothing there")
    gen.add_argument("--scorer", default=None, help="exported scorer for --policy learned (train.py prints its path)")
    gen.add_argument("--granularity", choices=("token", "block"), default="token",
                     help="block: whole blocks, one decision for all layers and KV heads (as a paged serving engine)")
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument("--slack", type=int, default=0,
                     help="dead slots a layer may hold before it compacts (same kept tokens; faster on GPU)")
    gen.add_argument("--allocation", default="uniform", metavar="MODE",
                     help="how a row's budget is shared by layers and KV heads: uniform (default), head (Ada-KV), "
                          "pyramid (PyramidKV) or global (one budget for the whole model); docs/allocation.md")
    gen.add_argument("--allocation-floor", type=float, default=None, metavar="F",
                     help="head and global: every KV head keeps at least F x budget of its own top tokens (0.2)")
    gen.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--special-tokens", action="store_true",
                     help="read special tokens typed in a prompt (<|im_end|>) as control tokens; by default they are "
                          "plain text, as chat front-ends treat what a user types")
    gen.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads")

    col = sub.add_parser("collect", help="collect attention traces (features, labels, teacher scores) into shards")
    col.add_argument("--out", required=True, help="trace directory (resumes if it already holds shards)")
    col.add_argument("--prompts", type=int, default=8, help="training prompts")
    col.add_argument("--val-prompts", type=int, default=2, help="validation prompts")
    col.add_argument("--max-new-tokens", type=int, default=128)
    col.add_argument("--shard", default="0/1", help="i/n: this collector takes every n-th shard from i")
    col.add_argument("--model", default=None, help="bundled alias, local folder or hub id")
    col.add_argument("--source", action="append", default=None, help="prompt source (repeatable): gsm_symbolic, gsm8k, needle")
    col.add_argument("--decisions", type=int, default=4, help="decision steps sampled per prompt")
    col.add_argument("--horizon", type=int, default=32, help="label horizon H in decode steps")
    col.add_argument("--prompts-per-shard", type=int, default=4)
    col.add_argument("--batch-size", type=int, default=4, help="prompts decoded together (each row as alone)")
    col.add_argument("--policy", default="full",
                     help="acting policy: full (full-cache traces) or an evicting policy (traces under eviction)")
    col.add_argument("--budget", default="0.25,0.5",
                     help="with an evicting --policy: B[,B...] tokens or fractions; each prompt takes one (seeded)")
    col.add_argument("--scorer", default=None, help="exported scorer for --policy learned")
    col.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="acting policy hyperparameter")
    col.add_argument("--seed", type=int, default=0)
    col.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads")

    mrg = sub.add_parser("merge", help="rebuild a trace manifest after n collectors ran with --shard i/n")
    mrg.add_argument("dir")

    rec = sub.add_parser("recurrence", help="token importance recurrence table + PNG, from collected traces or "
                                            "from live full-cache decodes (--source)")
    rec.add_argument("dir", nargs="?", default=None, help="trace directory (or give --source)")
    rec.add_argument("--png", default=None, help="plot path (default: DIR/recurrence.png, or OUT/recurrence.png)")
    rec.add_argument("--source", default=None,
                     help="decode prompts of this source live instead of reading traces (e.g. chain)")
    rec.add_argument("--prompts", type=int, default=4, help="with --source: held-out (test split) prompts")
    rec.add_argument("--max-new-tokens", type=int, default=2048, help="with --source: cap per prompt (stops at EOS)")
    rec.add_argument("--model", default=None, help="with --source: bundled alias, local folder or hub id")
    rec.add_argument("--seed", type=int, default=0, help="with --source: data seed")
    rec.add_argument("--out", default=".", help="with --source: folder for recurrence.png and mri.png")
    rec.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads")

    dia = sub.add_parser("diagnose-chain", help="where a policy loses on the chain task: the problems the full cache "
                                                 "got right and the policy wrong, and the full cache's attention at "
                                                 "those answers that fell on tokens the policy had evicted")
    dia.add_argument("--policy", required=True, metavar="ITEM[,ITEM...]",
                     help="evicting policies, each NAME[:key=value]... (the full cache's runs are shared by all)")
    dia.add_argument("--budget", required=True, help="one budget: tokens (e.g. 512) or a fraction of the final length")
    dia.add_argument("--model", default=None, help="bundled alias, local folder or hub id (default: SmolLM2-135M)")
    dia.add_argument("--limit", type=int, default=4, help="held-out chain prompts (test split)")
    dia.add_argument("--prefill-policy", default=None, metavar="ITEM",
                     help="compresses a prompt over the budget at the prefill (e.g. snapkv)")
    dia.add_argument("--scorer", default=None, help="exported scorer for --policy learned")
    dia.add_argument("--max-new-tokens", type=int, default=None, help="cap per decode (default: the chain task's)")
    dia.add_argument("--batch-size", type=int, default=1, help="prompts whose free runs decode together")
    dia.add_argument("--slack", type=int, default=0, help="dead slots before a compaction (same kept tokens)")
    dia.add_argument("--all-lost", action="store_true", help="every lost problem of a prompt, not only the first")
    dia.add_argument("--top", type=int, default=5, help="evicted lines (and tokens per line) listed per problem")
    dia.add_argument("--out", default=None, metavar="PATH",
                     help="JSON file (default: runs/diagnose-chain/<policy>-<budget>.json)")
    dia.add_argument("--seed", type=int, default=0, help="data seed")
    dia.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads")

    cmp = sub.add_parser("compare", help="paired intervals of every policy to a baseline across finished evaluations "
                                         "of the same prompts (no decode)")
    cmp.add_argument("paths", nargs="+", metavar="PATH",
                     help="an evaluation's output directory (or its finished/), or a results.json; PATH@TAG labels "
                          "its policies LABEL@TAG (one policy under two setups, e.g. two prefill policies)")
    cmp.add_argument("--baseline", required=True, help="policy label to pair against, as the tables name it")
    cmp.add_argument("--metric", default=None, help="comma-separated metrics to show (default: all)")
    cmp.add_argument("--json", default=None, metavar="PATH", help="also write the pairs as JSON")
    cmp.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    return parser


def _kept(out: str) -> str:
    """What a trace directory holds now, for the interrupt message."""
    from pathlib import Path

    path = Path(out) / "manifest.json"
    if not path.is_file():
        return f"no shard was finished, nothing kept in {out}"
    manifest = json.loads(path.read_text())
    return f"{len(manifest['shards'])}/{manifest['n_shards_planned']} shards are finished and kept in {out}"


def cmd_collect(args) -> int:
    from learnkv.model import DEFAULT_MODEL
    from learnkv.policies.params import parse_params
    from learnkv.traces.collect import CollectConfig, collect

    set_threads(args.threads)
    params = parse_params(args.param)
    if args.scorer is not None:
        params["scorer"] = args.scorer
    cfg = CollectConfig(
        model=args.model or DEFAULT_MODEL,
        sources=tuple(args.source or ("gsm_symbolic",)),
        prompts=args.prompts,
        val_prompts=args.val_prompts,
        max_new_tokens=args.max_new_tokens,
        decisions_per_prompt=args.decisions,
        horizon=args.horizon,
        prompts_per_shard=args.prompts_per_shard,
        seed=args.seed,
        batch_size=args.batch_size,
        policy=args.policy,
        policy_params=params,
        budgets=tuple(x.strip() for x in args.budget.split(",")) if args.policy != "full" else (0.25, 0.5),
    )
    try:
        with Interruptible() as interrupt:
            manifest, stats = collect(args.out, cfg, shard=shard_of(args.shard), progress=True)
    except KeyboardInterrupt:
        print(f"\n{interrupt.how}: {_kept(args.out)}; the shard in progress was discarded. Rerun the same command to "
              "resume.", file=sys.stderr)
        return interrupt.code
    for line in stats.problems:
        print(f"note: {line}", file=sys.stderr)
    if stats.removed_temps:
        print(f"note: removed {len(stats.removed_temps)} temporary file(s) an interrupted collector left: "
              f"{', '.join(stats.removed_temps)}", file=sys.stderr)
    print(stats.line())
    state = "complete" if manifest["complete"] else f"{len(manifest['shards'])}/{manifest['n_shards_planned']} shards"
    print(f"manifest: {args.out}/manifest.json ({state})")
    return 0


def cmd_generate(args) -> None:
    import torch

    from learnkv.decode import generate
    from learnkv.model import DEFAULT_MODEL, load_model
    from learnkv.policies.params import parse_params, parse_policy
    from learnkv.settings import Eviction, parse_number, resolve_budget

    set_threads(args.threads)
    torch.manual_seed(args.seed)
    # ---------------------------------------------- everything that needs no model is checked before it loads
    params = parse_params(args.param)
    if args.scorer is not None:
        params["scorer"] = args.scorer
    if args.allocation_floor is not None:
        params["allocation_floor"] = args.allocation_floor
    prefill, prefill_params = parse_policy(args.prefill_policy) if args.prefill_policy else (None, {})
    eviction = Eviction(args.policy, params, args.budget, args.granularity, args.block_size, args.slack, prefill,
                        prefill_params, allocation=args.allocation)
    policy = eviction.make()
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.slack < 0:
        raise ValueError(f"--slack must be >= 0 dead slots, got {args.slack}")
    if args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    largest = None
    if policy.evicts:
        if args.budget is None:
            raise ValueError(f"policy {policy.name!r} needs --budget (tokens, e.g. 64, or a fraction, e.g. 0.25)")
        tokens = resolve_budget(args.budget, 1)
        # a token count is checked against the policy's windows (and its scorer) now; a fraction's count depends on
        # the prompt's length, so only what does not depend on the budget is checked now: at the largest budget
        largest = tokens if isinstance(parse_number(args.budget), int) else 1 << 30
    eviction.check(largest, prefill_option="--prefill-policy")
    if args.scorer is not None:  # the model it was trained for, by name (its shape is checked once it loads)
        from learnkv.scorer.artifact import check_binding, read_artifact_manifest

        check_binding(read_artifact_manifest(args.scorer), args.scorer, model=args.model or DEFAULT_MODEL)
    model, tokenizer = load_model(args.model or DEFAULT_MODEL)
    result = generate(
        model,
        tokenizer,
        args.prompt,
        eviction,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        chat=not args.no_chat,
        special_tokens=args.special_tokens,
        progress=sys.stderr.isatty(),
    )
    for text in result.texts:
        print(text)
    print(json.dumps(result.summary()))


def cmd_recurrence(args) -> None:
    if (args.dir is None) == (args.source is None):
        raise ValueError("recurrence takes a trace directory or --source SOURCE (a live decode), not both")
    if args.dir is not None:
        from learnkv.traces.recurrence import report

        table, png = report(args.dir, args.png)
        print(table)
        print(f"plot: {png}")
        return
    from pathlib import Path

    from learnkv.model import DEFAULT_MODEL, load_model
    from learnkv.prompts import load_prompts
    from learnkv.traces.recurrence import live_report, observe_recurrence

    if args.prompts < 1 or args.max_new_tokens < 2:
        raise ValueError("--prompts must be >= 1 and --max-new-tokens >= 2")
    prompts = load_prompts(args.source, args.prompts, seed=args.seed, split="test")  # fails fast on a bad source
    set_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(args.model or DEFAULT_MODEL)
    from learnkv.decode import encode_prompts

    # a chain prompt starts the reply as the chain task does (`learnkv.chains.ChainProblem.reply_prefix`)
    inputs = [encode_prompts(tokenizer, p.text, reply_prefixes=[p.meta.get("response_prefix")])[0] for p in prompts]
    runs = observe_recurrence(model, tokenizer, inputs, args.max_new_tokens, progress=sys.stderr.isatty())
    for p, run in zip(prompts, runs):
        print(f"{p.id}: {run['generated']} generated tokens", flush=True)
    text, png, mri = live_report(runs, args.png or out / "recurrence.png", out / "mri.png")
    print(text)
    print(f"plots: {png} {mri}")


def cmd_compare(args) -> None:
    from learnkv.eval.compare import compare
    from learnkv.eval.report import paired_table

    pairs, notes = compare(args.paths, args.baseline, seed=args.seed)
    for line in notes:
        print(f"note: {line}", file=sys.stderr)
    if not pairs:
        raise ValueError(f"no policy could be paired with {args.baseline!r} (see the notes above): nothing to show")
    metrics = [m.strip() for m in args.metric.split(",")] if args.metric else None
    unknown = sorted(set(metrics or ()) - {p["metric"] for p in pairs})
    if unknown:
        raise ValueError(f"--metric {', '.join(unknown)}: not paired here; metrics: "
                         f"{', '.join(dict.fromkeys(p['metric'] for p in pairs))}")
    print(paired_table(pairs, metrics), end="")
    if args.json:
        from pathlib import Path

        from learnkv.atomic import write_text_atomic

        write_text_atomic(Path(args.json), json.dumps(pairs, indent=1) + "\n")


def cmd_diagnose_chain(args) -> int | None:
    import re
    import shutil
    from pathlib import Path

    from learnkv.atomic import write_text_atomic
    from learnkv.eval import build_spec
    from learnkv.eval.diagnose import diagnose, table
    from learnkv.eval.run import split_list
    from learnkv.model import DEFAULT_MODEL, load_model
    from learnkv.policies import POLICIES
    from learnkv.policies.params import parse_policy

    # ---------------------------------------------- everything that needs no model is checked before it loads
    for item in split_list(args.policy, "policy"):
        name, _ = parse_policy(item)
        if name in POLICIES and not POLICIES[name].evicts:
            raise ValueError(f"--policy {item}: it never evicts, so it loses nothing to diagnose")
    if len(split_list(args.budget, "budget")) != 1:
        raise ValueError(f"--budget takes one budget, got {args.budget!r}")
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    options = {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}
    spec = build_spec(f"full,{args.policy}", args.budget, "chain", scorer=args.scorer, limit=args.limit,
                      seed=args.seed, prefill_policy=args.prefill_policy, batch_size=args.batch_size,
                      slack=args.slack, accuracy_only=True, **options)
    out = Path(args.out or f"runs/diagnose-chain/{re.sub(r'[^A-Za-z0-9_.=-]', '_', args.policy)}-{args.budget}.json")
    model_name = args.model or DEFAULT_MODEL
    set_threads(args.threads)
    model, tokenizer = load_model(model_name)
    state = out.with_name(out.stem + ".partial")  # finished batches: a killed run resumes (`diagnose`)
    if state.is_dir():
        print(f"note: resuming from {state}: its finished batches are read back, not decoded", file=sys.stderr)
    try:
        with Interruptible() as interrupt:
            results = diagnose(model, tokenizer, spec, all_lost=args.all_lost, top=args.top, state_dir=state,
                               model_name=model_name, progress=True)
    except KeyboardInterrupt:
        kept = len(list(state.glob("diagnosed-*.json")))
        print(f"\n{interrupt.how}: {kept} finished batch(es) kept in {state}; the batch in progress starts over "
              "(its full-cache reference, once decoded, is kept). Rerun the same command to resume.", file=sys.stderr)
        return interrupt.code
    for result in results:
        result["config"]["model"] = model_name
        print(table(result))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps({"results": results}, indent=1) + "\n")
    shutil.rmtree(state)  # the JSON holds every batch now
    print(f"json: {out}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "policies":
            from learnkv.policies import POLICIES

            print("\n".join(POLICIES))
        elif args.command == "generate":
            cmd_generate(args)
        elif args.command == "collect":
            return cmd_collect(args)
        elif args.command == "merge":
            from learnkv.traces.collect import merge

            manifest, problems = merge(args.dir)
            for line in problems:
                print(f"warning: {line}", file=sys.stderr)
            rows = sum(s["rows"] for s in manifest["shards"])
            print(f"{args.dir}/manifest.json: {len(manifest['shards'])}/{manifest['n_shards_planned']} shards, {rows} rows"
                  + ("" if manifest["complete"] else " (incomplete: run the missing collectors)"))
        elif args.command == "recurrence":
            cmd_recurrence(args)
        elif args.command == "compare":
            cmd_compare(args)
        elif args.command == "diagnose-chain":
            return cmd_diagnose_chain(args) or 0
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
