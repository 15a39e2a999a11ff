"""The package's imports flow one way: no import circle between its modules, no `_private` name taken across modules.

Read from the source with `ast` (nothing is imported), so it holds for code paths a CPU never runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_kimi_dsa"
NAME = PACKAGE.name


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(modules: dict[str, Path]) -> dict[str, set[tuple[str, str | None]]]:
    """module -> {(imported module, name or None)} for every import of a package module, at any depth in the file."""
    found: dict[str, set[tuple[str, str | None]]] = {}
    for module, path in modules.items():
        edges: set[tuple[str, str | None]] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {(a.name, None) for a in node.names if a.name.split(".")[0] == NAME}
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, node, path.name == "__init__.py")
                if target.split(".")[0] != NAME:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    edges.add((sub, None) if sub in modules else (target, alias.name))
        found[module] = edges
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, edges in imports_of(modules).items():
        for target, _ in edges:
            if target in modules and target != module:
                graph[module].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (a list of modules, first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_circle() -> None:
    graph = _graph()
    # A package's __init__ re-exporting its children is not a circle through the child.
    for module in graph:
        graph[module] = {t for t in graph[module] if not (module.startswith(t + ".") and _modules()[t].name == "__init__.py")}
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(modules: dict[str, Path]) -> list[str]:
    """`from m import _x` and `alias._x` (alias bound to another package module) in every module."""
    found = [
        f"{module} imports {target}.{name}"
        for module, edges in imports_of(modules).items()
        for target, name in edges
        if name is not None and _private(name) and target != module
    ]
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules and a.asname:
                        aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, node, path.name == "__init__.py")
                for a in node.names:
                    if f"{target}.{a.name}" in modules:
                        aliases[a.asname or a.name] = f"{target}.{a.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and _private(node.attr) and aliases[node.value.id] != module):
                found.append(f"{module} uses {aliases[node.value.id]}.{node.attr} (line {node.lineno})")
    return sorted(set(found))


def test_no_private_name_crosses_a_module() -> None:
    crossings = private_uses(_modules())
    assert not crossings, "\n".join(crossings)


def test_the_checks_can_fail() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
