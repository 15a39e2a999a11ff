"""The package's imports flow one way: every import goes down the layer order (docs/architecture.md), strings that
name a package module count as imports, no import circle between modules, no `_private` name taken across modules,
and no module imports through a path or a string but the kernel registry (and the peers' loader of built extensions).

Read from the source with `ast` (nothing is imported), so it holds for code paths a CPU never runs.
"""

from __future__ import annotations

import ast
import re
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


# ---------------------------------------------------------------- layers

# Lowest first; a module may import its own layer and those below. The package root (re-exports, lazily) is on top.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("formats", ("formats", "host_math", "arguments", "heads", "widths", "envs", "logs", "dcp", "timing", "reference",
                 "synthetic")),
    ("planning", ("planning",)),
    ("kernels", ("kernels", "convert")),
    ("backends", ("backends",)),
    ("selection", ("selection",)),
    ("core", ("core",)),
    ("serving", ("serving",)),
    ("vllm", ("vllm_glue", "vllm_backend")),
    ("cli", ("__main__", "cli_types", "tune", "bench")),
)
# the only modules that may import through a string or load a module from a file, and what they may call for it
THROUGH_STRINGS = {f"{NAME}.backends.registry": {"import_module"},
                   f"{NAME}.bench.peers": {"spec_from_file_location", "module_from_spec"}}
DYNAMIC = {"import_module", "__import__", "spec_from_file_location", "module_from_spec", "exec_module"}
STRING_MODULE = re.compile(rf"^{NAME}(\.\w+)+(:\w+)?$")


def layer_of(module: str) -> int:
    """The index in LAYERS of a package module (the package root: above every layer)."""
    parts = module.split(".")
    if len(parts) == 1:
        return len(LAYERS)
    for i, (_, heads) in enumerate(LAYERS):
        if parts[1] in heads:
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS: give it one (and a line in docs/architecture.md)")


def string_imports(module: str, tree: ast.AST, modules: set[str]) -> set[str]:
    """Package modules a string constant names ("pkg.mod:Class", "pkg.mod.Class"): imports made through a string."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and STRING_MODULE.match(node.value):
            path = node.value.split(":")[0].split(".")
            for n in range(len(path), 1, -1):
                if ".".join(path[:n]) in modules:
                    found.add(".".join(path[:n]))
                    break
    return found - {module}


def dynamic_imports(tree: ast.AST) -> set[str]:
    """Names of the dynamic-import calls a module makes, and whether it edits sys.path ("sys.path")."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in DYNAMIC:
                found.add(name)
        if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys"):
            found.add("sys.path")
    return found


def layer_violations(sources: dict[str, str], packages: set[str] = frozenset()) -> list[str]:
    """Every import (statement or string) of a package module from a higher layer, and every dynamic import outside
    THROUGH_STRINGS. sources: module -> source text; packages: the modules that are a package's __init__."""
    modules = set(sources)
    found = []
    for module, text in sorted(sources.items()):
        tree = ast.parse(text)
        edges: set[tuple[str, str]] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges |= {(a.name, "import") for a in node.names if a.name.split(".")[0] == NAME}
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, node, module in packages)
                if target.split(".")[0] != NAME:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in modules:
                        edges.add((sub, "import"))
                    elif not (target == NAME and alias.name == "__version__"):  # the version: any layer reads it
                        edges.add((target, "import"))
        edges |= {(t, "string") for t in string_imports(module, tree, modules)}
        for target, how in sorted(edges):
            if target in modules and target != module and layer_of(target) > layer_of(module):
                found.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                             f"({'the package root' if layer_of(target) == len(LAYERS) else LAYERS[layer_of(target)][0]})"
                             f"{' through a string' if how == 'string' else ''}: up the layer order")
        allowed = THROUGH_STRINGS.get(module, set())
        for call in sorted(dynamic_imports(tree) - allowed - {"exec_module"} if allowed else dynamic_imports(tree)):
            found.append(f"{module} imports through a path or a string ({call})")
    return found


def test_imports_go_down_the_layers() -> None:
    paths = _modules()
    sources = {m: p.read_text() for m, p in paths.items()}
    problems = layer_violations(sources, {m for m, p in paths.items() if p.name == "__init__.py"})
    assert not problems, "\n".join(problems)


def test_every_layer_is_in_the_map() -> None:
    """docs/architecture.md names every layer of LAYERS."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    for name, heads in LAYERS:
        for head in heads:
            assert f"`{head}" in text, f"docs/architecture.md does not name {head} (layer {name})"


def test_the_layer_check_can_fail() -> None:
    ok = {f"{NAME}.formats": "X = 1\n", f"{NAME}.core": f"from {NAME}.formats import X\n"}
    assert layer_violations(ok) == []
    up = {**ok, f"{NAME}.formats": f"from {NAME} import core\n"}
    assert layer_violations(up) == [f"{NAME}.formats (formats) imports {NAME}.core (core): up the layer order"]
    by_string = {**ok, f"{NAME}.formats": f"WHERE = '{NAME}.core:FlashInferCore'\n"}
    assert layer_violations(by_string) == [
        f"{NAME}.formats (formats) imports {NAME}.core (core) through a string: up the layer order"]
    dynamic = {**ok, f"{NAME}.core": "import sys\nfrom importlib import import_module\nsys.path.insert(0, 'x')\n"
                                      "m = import_module('peer')\n"}
    assert layer_violations(dynamic) == [f"{NAME}.core imports through a path or a string (import_module)",
                                         f"{NAME}.core imports through a path or a string (sys.path)"]
