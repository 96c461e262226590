"""The package's imports run one way: no cycle, and no module imports one of a higher layer.

Every import counts, at module level or inside a function, except those under `if TYPE_CHECKING:`
(they never run). The layers are the README's architecture diagram, lowest first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import flashlm

PACKAGE = Path(flashlm.__file__).parent
LAYERS = [
    {"errors", "_version", "_utils", "_native", "_measurements", "registry", "arch", "activations", "data"},
    {"store", "cache", "ops", "endor", "predictors"},
    {"engine"},
    {"methods"},
    {"config"},
    {"patching"},
    {"integrations"},
    {"eval", "sim", "workflows", "training"},
    {"cli"},
    {"__init__"},
]
"""Top-level modules and subpackages by layer: a module may import its own layer and those below."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The flashlm modules `path` imports (the longest known prefix of each imported name)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imports_of(path, modules) for path in paths}


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for index, layer in enumerate(LAYERS):
        if top in layer:
            return index
    raise AssertionError(
        f"{module} is in no layer of LAYERS: add it to this test and to the README's diagram."
    )


def test_graph_sees_imports_inside_functions() -> None:
    graph = import_graph()
    # a function-level import (the CLI imports its commands' modules when they run)
    assert "flashlm.workflows.calibrate" in graph["flashlm.cli.main"]
    assert graph["flashlm.engine.runtime"] >= {"flashlm.cache", "flashlm.store"}


def test_no_import_cycle() -> None:
    graph = import_graph()
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> None:
        if module in visiting:
            cycle = [*visiting[visiting.index(module) :], module]
            pytest.fail(f"Import cycle: {' -> '.join(cycle)}")
        if module in done:
            return
        visiting.append(module)
        for target in sorted(graph[module]):
            visit(target)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_imports_run_down_the_layers() -> None:
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "Imports from a lower layer to a higher one:\n" + "\n".join(upward)
