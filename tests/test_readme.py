"""The README's two commands are exactly what CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


MAIN_JOB = " && .venv/bin/python train.py"


def test_readme_has_two_commands_and_ci_runs_them():
    setup_and_run, tests = readme_commands()
    assert setup_and_run.endswith(MAIN_JOB), "README command 1 must end with the main job"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert setup_and_run[: -len(MAIN_JOB)] in ci, "CI does not run the README's set-up"
    assert tests in ci, "CI does not run the README's test command"


def test_readme_mentions_every_policy():
    from learnkv import POLICIES

    text = (ROOT / "README.md").read_text()
    for name in POLICIES:
        assert f"`{name}`" in text
