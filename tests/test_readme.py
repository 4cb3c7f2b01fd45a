"""The README's two commands are exactly what CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_has_two_commands_and_ci_runs_them():
    commands = readme_commands()
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in commands:
        assert command in ci, f"CI does not run the README command: {command}"


def test_readme_mentions_every_policy():
    from learnkv import POLICIES

    text = (ROOT / "README.md").read_text()
    for name in POLICIES:
        assert f"`{name}`" in text
