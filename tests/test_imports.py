"""Imports point one way. `lint-imports` (CI, contracts in pyproject.toml) checks the layers; this checks that no
import cycle is left among learnkv's and kernels' modules, counting imports inside functions (an import inside a
function is there to keep an optional dependency optional or a command line fast to start, not to hide a cycle).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("learnkv", "kernels")


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


def test_the_graph_counts_imports_inside_functions():
    graph = import_graph()
    # learnkv.eval.run imports the checkpoint module inside `evaluate` only if that is where it is imported; either
    # way the edge is there, and so is every module-level one
    assert "learnkv.decode" in graph["learnkv.eval.run"] and "learnkv.eval.checkpoint" in graph["learnkv.eval.run"]
    assert "learnkv.scorer.artifact" in graph["learnkv.policies.learned"]


def test_no_import_cycle_among_learnkv_modules():
    found = cycles(import_graph())
    assert not found, "import cycles (imports inside functions counted): " + "; ".join(" <-> ".join(c) for c in found)
