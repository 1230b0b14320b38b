"""The import graph of edgellm/: exits 1 on an import cycle, or on batch/, fleet/, infer/ or synth/ importing
the runtime (directly or through another module). Issue 20's "layers that read top-down", checked.

Every `import edgellm...` counts, at module level or inside a function (a lazy import is still a
dependency); imports under `if TYPE_CHECKING:` do not (they never run).

    python tools/check_imports.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOWER_LAYERS = ("batch", "fleet", "infer", "synth")


def modules() -> dict[str, Path]:
    found = {}
    for path in (ROOT / "edgellm").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found[name] = path
    return found


def graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    def owner(name: str) -> str | None:  # the module an imported name lives in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        deps: set[str | None] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                deps.update(owner(a.name) for a in node.names if a.name.startswith("edgellm"))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("edgellm"):
                deps.update(owner(f"{node.module}.{a.name}") for a in node.names)
        edges[name] = {d for d in deps if d and d != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
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
                    found.append(sorted(component))
    return found


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in edges.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def main() -> int:
    edges = graph(modules())
    problems = [f"import cycle: {' <-> '.join(c)}" for c in cycles(edges)]
    for name in sorted(edges):
        if name.split(".")[1:2] and name.split(".")[1] in LOWER_LAYERS:
            runtime = sorted(d for d in reachable(edges, name) if d.startswith("edgellm.runtime"))
            if runtime:
                problems.append(f"{name} reaches the runtime: {', '.join(runtime)}")
    for line in problems:
        print(line)
    print(f"{len(edges)} modules: {'no cycles, no layer breach' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
