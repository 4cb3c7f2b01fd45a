"""How many of a chain prompt's graded problem statements fit in a budget at all (exploratory, no decode).

    python bench/chain_room.py --records docs/results/chain-accuracy-qwen-learned/partial.jsonl \
        --model qwen2.5-coder-0.5b-instruct --policy learned --budget 0.25

For each prompt of the records' first finished batch at that policy and budget: the prompt's length, the budget in
tokens the run resolved, the tokens of its four facts and of the statements of its graded problems ("Problem k: ..."
lines after the given ones), and how many of those statements fit, in order, beside the facts and ``--reserve`` slots
for the work in progress (sinks, recent window, the problem being solved), with the full cache's and the policy's
per-problem accuracy from the same records. A room count, not a bound on accuracy: a solved problem's statement can
be evicted later to make room, and a model may answer without its statement.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learnkv.eval import make_task  # noqa: E402
from learnkv.model import BUNDLED  # noqa: E402

_PROBLEM = re.compile(r"^Problem (\d+): .*$", re.M)
_FACT = re.compile(r"^Fact [A-H]: .*$", re.M)


def statements_that_fit(prompt: str, given: int, budget: int, reserve: int, count) -> dict:
    """The facts' and graded statements' token counts (``count(text)``) of a chain prompt's problem list (the text
    before the reply), and how many graded statements fit in order beside the facts and ``reserve`` slots."""
    graded = [count(m.group(0) + "\n") for m in _PROBLEM.finditer(prompt) if int(m.group(1)) > given]
    facts = sum(count(line + "\n") for line in _FACT.findall(prompt))
    room, fit = budget - facts - reserve, 0
    for tokens in graded:
        if tokens > room:
            break
        room, fit = room - tokens, fit + 1
    return {"facts": facts, "statements": sum(graded), "graded": len(graded), "fit": fit}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", required=True, help="an evaluation's partial.jsonl (chain task, accuracy-only)")
    p.add_argument("--model", required=True, help="bundled alias (its tokenizer only is loaded)")
    p.add_argument("--policy", required=True)
    p.add_argument("--budget", type=float, required=True)
    p.add_argument("--reserve", type=int, default=64, help="slots kept for the work in progress (default 64)")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer  # transformers (~1.3 s) only once the options are valid

    tok = AutoTokenizer.from_pretrained(str(BUNDLED[args.model]()))
    entries = [json.loads(line) for line in Path(args.records).read_text().splitlines()[1:]]
    run = next(e for e in entries if e["policy"] == args.policy and e["budget"] == args.budget)
    full = next(e for e in entries if e["policy"] == "full" and e["ids"] == run["ids"])
    samples = {s.id: s for s in make_task("chain").load(tok, 64, 0)}  # the grid's held-out prompts come first
    count = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    shares = []
    for pid, cost, m, f in zip(run["ids"], run["costs"], run["metrics"], full["metrics"]):
        s = samples[pid]
        text = tok.decode(s.input_ids[0])
        room = statements_that_fit(text, s.meta["given"], cost["budget"], args.reserve, count)
        shares.append(room["fit"] / room["graded"])
        print(f"{pid}: prompt {s.input_ids.shape[1]}, budget {cost['budget']}, facts {room['facts']}, graded "
              f"statements {room['statements']} tokens for {room['graded']} problems, {room['fit']} fit "
              f"({shares[-1]:.2f}); accuracy full {f['problem_accuracy']:.3f}, "
              f"{args.policy} {m['problem_accuracy']:.3f}")
    print(f"{len(shares)} prompts: median share of graded statements that fit {statistics.median(shares):.2f} "
          f"(min {min(shares):.2f}, max {max(shares):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
