"""Who may import whom: the layers of docs/architecture.md, checked on the source.

Every import of a tqueue module, at module level or inside a function, is resolved to the part of
the package it lands in; a part may import only the parts of lower layers and itself. Roles
(controller, storage, client) never import each other, and nothing but the command line, the
demos and the bridges themselves imports a bridge. Inside the controller the same holds for its
sub-packages (its floor plan): the model imports nothing of the rest, planning only the model,
the parts the model and planning, and the server all of them.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import tqueue

ROOT = pathlib.Path(tqueue.__file__).parent

BASE = {"errors", "_env", "_extras", "config", "_memory", "_tasks", "_threads", "_api", "_meta"}
LAYERS: dict[str, set[str]] = {
    # part: the parts it may import (besides itself)
    **{b: BASE for b in BASE},
    "wire": BASE,
    "transport": BASE | {"wire"},
    "controller": BASE | {"wire", "transport"},
    "storage": BASE | {"wire", "transport"},
    "client": BASE | {"wire", "transport"},
    "launch": BASE | {"wire", "transport", "controller", "storage", "client"},
    "bridges": BASE | {"wire", "transport", "client", "launch", "bridges"},
    "__init__": BASE | {"wire", "client", "launch"},
    "demos": BASE | {"wire", "client", "launch", "bridges"},
    "cli": BASE | {"wire", "client", "launch", "demos", "bridges", "controller", "storage"},
    "__main__": {"cli"},
    "ray": {"launch"},
}


def _part(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_modules(source: str, rel: pathlib.PurePath) -> set[tuple[tuple[str, ...], int]]:
    """(dotted name as parts, line) for every tqueue module imported by ``source``, the module
    at ``rel`` inside the package."""
    package = ["tqueue", *rel.parts[:-1]]  # the package the module sits in
    found = set()
    for node in ast.walk(ast.parse(source, str(rel))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from .. import wire`` names submodules: each alias may be a part
            names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            bits = tuple(name.split("."))
            if bits[0] == "tqueue" and len(bits) > 1:
                found.add((bits[1:], node.lineno))
    return found


def _imported_parts(source: str, rel: pathlib.PurePath) -> set[tuple[str, int]]:
    """(part, line) for every tqueue module imported by ``source``, the module at ``rel``
    inside the package."""
    return {(bits[0], line) for bits, line in _imported_modules(source, rel)}


MODULES = sorted(p for p in ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_imports_follow_the_layers(path: pathlib.Path) -> None:
    part = _part(path)
    assert part in LAYERS, f"{path.relative_to(ROOT)}: part {part!r} has no place in the layers"
    allowed = LAYERS[part] | {part}
    wrong = sorted(f"line {line}: imports tqueue.{p}" for p, line in _imported_parts(path.read_text(), path.relative_to(ROOT)) if p not in allowed)
    assert not wrong, f"{path.relative_to(ROOT)} ({part}) " + "; ".join(wrong)


@pytest.mark.parametrize(
    ("source", "part"),
    [
        ("from ..client import Client\n", "client"),
        ("from .. import storage\n", "storage"),
        ("def f():\n    import tqueue.client._async\n", "client"),
        ("from tqueue.launch import LocalCluster\n", "launch"),
    ],
    ids=["relative", "submodule-alias", "lazy-absolute", "absolute"],
)
def test_the_checker_sees_a_wrong_import(source: str, part: str) -> None:
    """A controller module importing a role or the launcher is caught (the checker can fail)."""
    rel = pathlib.PurePath("controller", "_probe.py")
    assert part in {p for p, _ in _imported_parts(source, rel)}
    assert part not in LAYERS["controller"]


# the controller's floor plan (docs/architecture.md): sub-package -> what it may import of the
# controller besides itself; a module at the package's top is the package's face
CONTROLLER = ROOT / "controller"
CONTROLLER_LAYERS: dict[str, set[str]] = {
    "model": set(),
    "planning": {"model"},
    "parts": {"model", "planning"},
    "server": {"model", "planning", "parts"},
    "__init__": {"server"},
    "_policies": {"planning"},  # the policy interface where docs/api.md points
}
CONTROLLER_MODULES = sorted(CONTROLLER.rglob("*.py"))


def _controller_part(rel: pathlib.PurePath) -> str:
    """The sub-package of the controller module at ``rel`` (relative to the controller)."""
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


@pytest.mark.parametrize("path", CONTROLLER_MODULES, ids=[str(p.relative_to(CONTROLLER)) for p in CONTROLLER_MODULES])
def test_the_controller_keeps_its_floor_plan(path: pathlib.Path) -> None:
    part = _controller_part(path.relative_to(CONTROLLER))
    assert part in CONTROLLER_LAYERS, f"controller/{path.relative_to(CONTROLLER)}: {part!r} has no place in the floor plan"
    allowed = CONTROLLER_LAYERS[part] | {part}
    wrong = sorted(
        f"line {line}: imports tqueue.{'.'.join(bits)}"
        for bits, line in _imported_modules(path.read_text(), path.relative_to(ROOT))
        if bits[0] == "controller" and len(bits) > 1 and _controller_part(pathlib.PurePath(*bits[1:])) not in allowed
    )
    assert not wrong, f"controller/{path.relative_to(CONTROLLER)} ({part}) " + "; ".join(wrong)


@pytest.mark.parametrize(
    ("source", "part"),
    [
        ("from ..parts._reads import Reads\n", "parts"),
        ("from ..server import _controller\n", "server"),
        ("def f():\n    from tqueue.controller.planning._rounds import RoundBook\n", "planning"),
    ],
    ids=["relative", "submodule-alias", "lazy-absolute"],
)
def test_the_checker_sees_a_model_module_reaching_up(source: str, part: str) -> None:
    """A model module importing a part, the server or planning is caught."""
    rel = pathlib.PurePath("controller", "model", "_probe.py")
    imported = {_controller_part(pathlib.PurePath(*bits[1:])) for bits, _ in _imported_modules(source, rel) if bits[0] == "controller"}
    assert part in imported
    assert part not in CONTROLLER_LAYERS["model"]


def _sibling_imports(path: pathlib.Path) -> set[str]:
    """The modules of its own package that the module at ``path`` imports: at module level, in
    a function (a circle hidden in a function is still a circle) or for type checking only
    (one module describing its caller is a circle a reader must hold in mind too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found |= {a.name for a in node.names}
    return found - {"__init__"}


PACKAGES = sorted(p.parent for p in ROOT.rglob("__init__.py") if p.parent != ROOT)


@pytest.mark.parametrize("package", PACKAGES, ids=[str(p.relative_to(ROOT)) for p in PACKAGES])
def test_no_import_circle_inside_a_package(package: pathlib.Path) -> None:
    graph = {p.stem: _sibling_imports(p) for p in package.glob("*.py") if p.stem != "__init__"}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            circle = path[path.index(module):] + [module]
            raise AssertionError(f"{package.name}: import circle {' -> '.join(circle)}")
        if module in done or module not in graph:
            return
        for other in sorted(graph[module]):
            visit(other, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
