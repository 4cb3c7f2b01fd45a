"""The README's two commands are exactly what CI runs; the README stays a user's page and its links land; the study
pages in docs/ keep a command beside their numbers."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the study pages the README's results moved to (issue 41): each holds the tables of one study and their commands
STUDIES = ["decode-regime", "prefill-regime", "ablations", "long-chain", "chain-accuracy", "float-rounding", "batching",
           "recurrence", "training"]


def readme_commands():
    block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
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

    text = README.read_text()
    for name in POLICIES:
        assert f"`{name}`" in text


def test_readme_is_a_users_page():
    lines = README.read_text().splitlines()
    assert len(lines) < 300, f"README has {len(lines)} lines; results and diagnostics belong in docs/"
    headings = [l for l in lines if l.startswith("## ")]
    for h in ("## Policies", "## Python", "## Model support", "## How it works", "## Training a scorer",
              "## Evaluating policies", "## Serving (vLLM)"):
        assert h in headings, h
    model_support = README.read_text().split("## Model support", 1)[1].split("\n## ", 1)[0]
    assert "docs/architectures.md" in model_support


def _section(text: str, heading: str) -> str:
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def test_how_it_works_covers_every_package_in_the_data_path():
    how = _section(README.read_text(), "## How it works")
    pkg = ROOT / "learnkv"
    parts = [f"learnkv/{p.name}/" for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    parts += [f"learnkv/{p.name}" for p in pkg.glob("*.py") if p.name != "__init__.py"]
    missing = [p for p in parts if p not in how]  # every module and subpackage is placed in a layer
    assert not missing, f"How it works does not place: {missing}"
    assert "kernels/" in how


def _links(path: Path):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if not re.match(r"[a-z]+://", target):
            yield target


def test_readme_and_docs_links_resolve():
    pages = [README] + sorted((ROOT / "docs").glob("*.md"))
    broken = [f"{p.relative_to(ROOT)} -> {t}" for p in pages for t in _links(p) if not (p.parent / t).exists()]
    assert not broken, broken


def test_every_study_page_has_its_commands_and_is_linked():
    readme = README.read_text()
    for name in STUDIES:
        page = ROOT / "docs" / f"{name}.md"
        text = page.read_text()
        commands = re.findall(r"```bash\n(.*?)```", text, re.S) + re.findall(r"`([^`]*python[^`]*)`", text)
        assert any("python" in c for c in commands), f"{page.name} shows no command"
        assert f"docs/{name}.md" in readme, f"the README does not link {page.name}"
