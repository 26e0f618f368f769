"""Guards on the shape of the package, read from the source without importing it: no import circle, no
module imports from a layer above its own (docs/architecture.md §8), the library never imports the tooling
(`rlbus_tools`: benchmarks, chaos rigs, the simulator, local service launchers), and every exception class is
defined in `rlbus.errors` (docs/architecture.md §9.3).

Imports are every ``import`` statement in a module, function-level ones included (a deferred import is
still a dependency); only those under ``if TYPE_CHECKING:`` are left out, as they never run.
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rlbus"
TOOLS = ROOT / "tools" / "rlbus_tools"

#: Exception classes that may live outside `rlbus.errors`, each with why no caller can ever see it.
PRIVATE_EXCEPTIONS = {
    # Raised by OpenAIJudge._post and caught by OpenAIJudge.complete to run the next attempt; once the
    # retries are spent, complete raises JudgeUnavailable. It never leaves the class.
    "rlbus.rewards.judge.backends._Retry",
}


#: The layers of the package, lowest first (docs/architecture.md §8): a module imports modules of its
#: own layer and of the layers below, never of a layer above. Names are the top-level packages and modules of
#: rlbus ("rlbus" is the package's own __init__).
LAYERS: list[set[str]] = [
    {"rlbus", "errors", "aio"},
    {"schemas", "metrics", "exposure"},
    {"blobs", "sandbox"},
    {"bus", "state"},
    {"config", "observe", "registry"},
    {"models"},
    {"weights"},
    {"engines"},
    {"envs", "rl"},
    {"rewards", "taskgen"},
    {"training"},
    {"producers", "consumers"},
    {"wiring"},
    {"serve"},
    {"launch", "security"},
    {"demo", "demo_view", "generate", "__main__", "cli"},
]

#: Imports that reach a layer above, (importer, imported), each with why it stays.
UPWARD_IMPORTS = {
    # ModelSource.chat builds the model's chat format on first use, each kind its own (and the policy's
    # known_context the byte format). The format belongs with the environments (it parses actions and tool
    # calls) and needs the model's tokenizer, so the import is deferred to the method; a model is built and
    # used without it.
    ("rlbus.models.policy_source", "rlbus.envs.chat"),
    ("rlbus.models.hf_source", "rlbus.envs.chat"),
    # The GGUF converter checks the converted directory's chat format before it caches it (a conversion that
    # would give a model without a usable end-of-turn is never written); deferred to that check.
    ("rlbus.models.gguf", "rlbus.envs.chat"),
}


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int


CORPUS = PACKAGE / "data"


def _modules() -> dict[str, Path]:
    """Every module of the library and of the tooling, by dotted name."""
    modules = {}
    for package in (PACKAGE, TOOLS):
        for path in sorted(package.rglob("*.py")):
            if CORPUS in path.parents:
                continue  # task-corpus data: third-party test files, not rlbus code
            parts = path.relative_to(package.parent).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_tool(module: str) -> bool:
    return module == "rlbus_tools" or module.startswith("rlbus_tools.")


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in MODULES.items()}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under ``node``, except the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from _statements(other)
            continue
        yield child
        yield from _statements(child)


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def _imports(module: str) -> Iterator[Import]:
    for node in _statements(TREES[module]):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # `from pkg import sub` takes a submodule: it depends on pkg's __init__ only for names that are not one
            origin = _absolute(module, node)
            names = [f"{origin}.{alias.name}" for alias in node.names]
            targets = [*([origin] if any(name not in MODULES for name in names) else []), *names]
        else:
            continue
        for target in targets:
            if target in MODULES and target != module:  # a package importing its submodules names itself
                yield Import(module, target, node.lineno)


GRAPH = {module: list(_imports(module)) for module in MODULES}


def _cycles() -> list[list[Import]]:
    """One shortest import circle through each strongly connected group of modules (Tarjan, then BFS)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for edge in GRAPH[module]:
            if edge.target not in index:
                visit(edge.target)
                low[module] = min(low[module], low[edge.target])
            elif edge.target in stack:
                low[module] = min(low[module], index[edge.target])
        if low[module] == index[module]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(group)

    for module in GRAPH:
        if module not in index:
            visit(module)

    cycles = []
    for group in groups:
        start = min(group)
        paths: dict[str, list[Import]] = {start: []}
        frontier = [start]
        while frontier and not any(e.target == start for m in frontier for e in GRAPH[m]):
            reached = []
            for module in frontier:
                for edge in GRAPH[module]:
                    if edge.target in group and edge.target not in paths:
                        paths[edge.target] = [*paths[module], edge]
                        reached.append(edge.target)
            frontier = reached
        last = next(e for m in frontier for e in GRAPH[m] if e.target == start)
        cycles.append([*paths[last.source], last])
    return cycles


def _show(cycle: list[Import]) -> str:
    hops = [f"{edge.source} (line {edge.line})" for edge in cycle]
    return " -> ".join([*hops, cycle[0].source])


def test_no_import_cycle() -> None:
    cycles = [_show(cycle) for cycle in _cycles()]
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_the_guard_sees_function_level_imports_and_skips_type_checking_ones() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
        "def f():\n    import c\n"
    )
    names = [alias.name for node in _statements(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert names == ["b", "c"]


def _layer_name(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_module_imports_a_layer_above_its_own() -> None:
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    library = [module for module in MODULES if not _is_tool(module)]
    unplaced = sorted({_layer_name(module) for module in library} - layer.keys())
    assert not unplaced, f"give these a layer in LAYERS and in docs/architecture.md §8: {unplaced}"
    upward = [
        edge for module in library for edge in GRAPH[module]
        if not _is_tool(edge.target) and layer[_layer_name(edge.target)] > layer[_layer_name(edge.source)]
    ]
    offenders = [
        f"{edge.source} (line {edge.line}, layer {_layer_name(edge.source)}) imports {edge.target}"
        for edge in upward if (edge.source, edge.target) not in UPWARD_IMPORTS
    ]
    assert not offenders, "imports from a higher layer:\n" + "\n".join(offenders)
    stale = UPWARD_IMPORTS - {(edge.source, edge.target) for edge in upward}
    assert not stale, f"no longer imported, drop from UPWARD_IMPORTS: {sorted(stale)}"


def test_the_library_never_imports_the_tooling() -> None:
    """`rlbus` is what a worker installs; `rlbus_tools` (tools/) imports it, never the other way round. Commands
    of the tooling reach `rlbus` through the ``rlbus.cli`` entry points (`rlbus.cli.app.plugins`)."""
    assert any(_is_tool(m) for m in MODULES) and any(not _is_tool(m) for m in MODULES)  # the guard sees both
    offenders = [
        f"{edge.source} (line {edge.line}) imports {edge.target}"
        for module, edges in GRAPH.items() if not _is_tool(module)
        for edge in edges if _is_tool(edge.target)
    ]
    assert not offenders, "\n".join(offenders)


def test_nothing_outside_the_benchmarks_imports_them() -> None:
    offenders = [
        f"{edge.source} (line {edge.line}) imports {edge.target}"
        for module, edges in GRAPH.items()
        # the GPU check runs benchmarks (make gpu-check): it is one, in all but its name
        if not module.startswith(("rlbus_tools.bench", "rlbus_tools.cli.bench", "rlbus_tools.gpu_check"))
        for edge in edges
        if edge.target.startswith("rlbus_tools.bench")
    ]
    assert not offenders, "\n".join(offenders)


def _exception_classes() -> list[tuple[str, ast.ClassDef]]:
    """Classes defined in rlbus that derive from BaseException, resolved by base-class name."""
    known = {name for name, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    classes = [
        (module, node) for module, tree in TREES.items() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
    ]

    def base_names(node: ast.ClassDef) -> set[str]:
        names = set()
        for base in node.bases:
            if isinstance(base, ast.Name):
                names.add(base.id)
            elif isinstance(base, ast.Attribute):  # aiohttp.ClientError, web.HTTPException …
                names.add(base.attr)
        return names

    found: dict[int, tuple[str, ast.ClassDef]] = {}
    while True:
        new = {
            id(node): (module, node)
            for module, node in classes
            if id(node) not in found
            and any(name in known or name.endswith(("Error", "Exception")) for name in base_names(node))
        }
        if not new:
            return list(found.values())
        found |= new
        known |= {node.name for _, node in new.values()}


def test_every_exception_is_defined_in_rlbus_errors() -> None:
    classes = _exception_classes()
    assert {"RlbusError", "ConfigError", "ClaimMissing"} <= {node.name for _, node in classes}  # the guard works
    outside = [
        f"{module}.{node.name} ({MODULES[module].relative_to(ROOT)}:{node.lineno})"
        for module, node in classes
        if module != "rlbus.errors" and f"{module}.{node.name}" not in PRIVATE_EXCEPTIONS
    ]
    assert not outside, "define these in rlbus/errors.py:\n" + "\n".join(sorted(outside))
