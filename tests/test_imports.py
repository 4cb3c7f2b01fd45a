"""Imports point one way. `lint-imports` (CI, contracts in pyproject.toml) checks the layers, imports inside functions
included; this checks that no import cycle is left among learnkv's modules, counting imports inside
functions, and that every import inside a function says why it is there (to keep an optional dependency optional or
a start quick, never to hide a cycle).

A reason is a comment on the import's line, a comment line right above the first import of its function, or, for a
module whose functions all import lazily for one reason, a module-level line ``# imports inside functions: REASON``.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("learnkv",)
MODULE_REASON = "# imports inside functions:"


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _target(name: str, modules) -> str | None:
    """The module of ours that ``name`` (a dotted module or module.attribute) resolves to, or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules):
    """(imported module of ours, line, inside a function) for every import statement of ``module``. ``import a.b``
    and ``from a import b`` (b a module) count as importing a.b; ``from a import f`` as importing a."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            target = _target(name, modules)
            if target is not None and target != module:
                yield target, node.lineno, id(node) in in_function


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {t for t, _, _ in _imports(m, p, modules)} for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_counts_imports_inside_functions(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("import learnkv.fields\n\n\ndef f():\n    from learnkv.decode import generate\n    return generate\n")
    modules = {**_modules(), "learnkv.probe": source}
    assert sorted(_imports("learnkv.probe", source, modules)) == [("learnkv.decode", 5, True), ("learnkv.fields", 1, False)]
    # and on the real tree: the command line imports every subcommand's module inside its function only
    assert "learnkv.traces.collect" in import_graph()["learnkv.__main__"]


def test_no_import_cycle_among_learnkv_modules():
    found = cycles(import_graph())
    assert not found, "import cycles (imports inside functions counted): " + "; ".join(" <-> ".join(c) for c in found)


def _function_imports_without_reason():
    missing = []
    for module, path in _modules().items():
        lines = path.read_text().splitlines()
        if any(line.startswith(MODULE_REASON) and line[len(MODULE_REASON):].strip() for line in lines):
            continue
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                if "#" in lines[node.end_lineno - 1] or "#" in lines[node.lineno - 1]:
                    continue
                # a comment line right above the function's first import gives the reason for all of its imports
                first = min(n.lineno for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
                if first >= 2 and lines[first - 2].strip().startswith("#"):
                    continue
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return missing


def test_every_import_inside_a_function_says_why():
    missing = _function_imports_without_reason()
    assert not missing, f"imports inside functions without a reason ({len(missing)}): {', '.join(missing)}"


def test_the_readme_layer_table_is_the_contract():
    """README "How it works" lists the layers top to bottom as pyproject.toml's layers contract does."""
    import re

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    assert contract["type"] == "layers"
    layer_of = {m.strip(): i for i, layer in enumerate(contract["layers"]) for m in re.split(r"[|:]", layer)}
    how = (ROOT / "README.md").read_text().split("## How it works", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in how.splitlines() if line.startswith("| ") and "`" in line]
    seen = []
    for row in rows:
        cells = row.split("|")[2]
        for path in re.findall(r"`([^`]+)`", cells):
            name = path.removesuffix("/").removesuffix(".py").replace("/", ".")
            if name in layer_of:
                seen.append((layer_of[name], name))
    assert len(seen) == len(layer_of), sorted(set(layer_of) - {n for _, n in seen})
    assert [i for i, _ in seen] == sorted(i for i, _ in seen), seen
