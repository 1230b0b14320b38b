"""The import graph of edgellm/: exits 1 on an import that points up a floor, an import cycle, or a module
imported by string. Issue 20's "layers that read top-down" and issue 43's "no cycle of concepts", checked.

Floors, bottom up (LAYERS): the ground (errors, compat, jsonsafe, wire, phases, gguf_split, the package
itself); engine/ and media/; api/ (the service core and the dialects); what runs on the service or the
engine without the node (fleet, batch, infer, synth, offline); the node (runtime/, ratio1/, pull/); the
command line. A module imports its own floor or those below.

Every `import edgellm...` counts, at module level or inside a function (a lazy import is still a
dependency), and so do imports under `if TYPE_CHECKING:`: they never run, but a concept that points up
or round in a cycle through them still does. `importlib.import_module` / `__import__` in edgellm/ is refused:
an import the graph cannot see.

    python tools/check_imports.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {
    "engine": 1, "media": 1,
    "api": 2,
    "fleet": 3, "batch": 3, "infer": 3, "synth": 3, "offline": 3,
    "runtime": 4, "ratio1": 4, "pull": 4,
    "cli": 5, "cli_infer": 5, "cli_batch": 5, "cli_serve": 5, "__main__": 5,
}  # fmt: skip


def floor(module: str) -> int:
    """A module's floor: its top-level package or module under edgellm/ (0: the ground, the package)."""
    parts = module.split(".")
    return LAYERS.get(parts[1], 0) if len(parts) > 1 else 0


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
        deps: set[str | None] = set()
        for node in ast.walk(tree):
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


def by_string(mods: dict[str, Path]) -> list[str]:
    """Modules that import by name at run time (the graph cannot see those imports)."""
    found = []
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "__import__"):
                found.append(f"{name}:{node.lineno}")
    return found


def main() -> int:
    mods = modules()
    edges = graph(mods)
    upward = [f"{name} -> {dep}" for name in sorted(edges) for dep in sorted(edges[name]) if floor(dep) > floor(name)]
    loops = cycles(edges)
    strings = by_string(mods)
    problems = (
        [f"upward import: {line}" for line in upward]
        + [f"import cycle (TYPE_CHECKING included): {' <-> '.join(c)}" for c in loops]
        + [f"import by string: {where}" for where in strings]
    )
    for line in problems:
        print(line)
    print(
        f"{len(edges)} modules: {len(upward)} upward imports, {len(loops)} cycles (TYPE_CHECKING included), "
        f"{len(strings)} imports by string"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
