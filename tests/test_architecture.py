"""The package's structure, read from its source with ``ast`` (nothing is imported):

* dependencies point one way: no import cycle among the package's modules, counting every
  import (module level, inside functions, under ``TYPE_CHECKING``);
* each module keeps its underscore names to itself: no module imports another module's
  underscore names, reads ``x._name`` of anything but ``self``, ``cls`` or ``super()``, or
  uses on ``self`` an underscore name only a base class in another module defines (tests
  may; the package may not);
* rooms stay small: ``task.py`` is under 300 lines, and no function is over 50 lines.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

PACKAGE = "celery_redislock"
SOURCE = Path(__file__).resolve().parent.parent / PACKAGE
TASK_MODULE_LINES = 300
FUNCTION_LINES = 50


@cache
def modules() -> dict[str, ast.Module]:
    """Every module of the package by dotted name (``celery_redislock`` for ``__init__.py``)."""
    found = {}
    for path in sorted(SOURCE.rglob("*.py")):
        parts = path.relative_to(SOURCE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), filename=str(path))
    return found


def is_package(name: str) -> bool:
    return (SOURCE.parent / name.replace(".", "/") / "__init__.py").exists()


def imported_from(module: str, node: ast.ImportFrom) -> str:
    """The absolute name of the module a ``from ... import`` reads."""
    if not node.level:
        return node.module or ""
    base = module if is_package(module) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def imports(module: str) -> Iterator[tuple[str, str | None, int]]:
    """(imported module, name taken from it or None, line) for every import in ``module``
    that reads one of the package's modules."""
    known = modules()
    for node in ast.walk(known[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = imported_from(module, node)
            if source not in known:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in known:
                    yield submodule, None, node.lineno
                else:
                    yield source, alias.name, node.lineno


def dependencies() -> dict[str, set[str]]:
    return {module: {target for target, _, _ in imports(module) if target != module} for module in modules()}


def cycle_through(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A shortest import path from ``start`` back to itself, or None."""
    paths = {target: [start, target] for target in sorted(graph[start])}
    seen = set(paths)
    while paths:
        if start in paths:
            return paths[start]
        following: dict[str, list[str]] = {}
        for node, path in paths.items():
            for target in sorted(graph[node]):
                if target not in seen or target == start:
                    seen.add(target)
                    following.setdefault(target, [*path, target])
        paths = following
    return None


def as_ring(path: list[str]) -> str:
    """A cycle written from its smallest module, so each cycle reads the same way once."""
    ring = path[:-1]
    start = ring.index(min(ring))
    ring = ring[start:] + ring[:start]
    return " -> ".join([*ring, ring[0]])


def test_no_import_cycle_among_the_package_modules() -> None:
    graph = dependencies()
    cycles = sorted({as_ring(path) for module in graph if (path := cycle_through(module, graph))})
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_object(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object whose underscore names a method may use."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def defined_here(module: str) -> set[str]:
    """The underscore names ``module`` itself gives its objects: methods and class attributes
    of its classes, names it assigns on ``self``/``cls``, and ``__slots__`` entries."""
    names: set[str] = set()
    for node in ast.walk(modules()[module]):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(item.name)
                targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                names.update(target.id for target in targets if isinstance(target, ast.Name))
                if isinstance(item, ast.Assign) and any(
                    isinstance(target, ast.Name) and target.id == "__slots__" for target in item.targets
                ):
                    names.update(
                        element.value
                        for element in ast.walk(item.value)
                        if isinstance(element, ast.Constant) and isinstance(element.value, str)
                    )
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and own_object(node.value):
            names.add(node.attr)
    return {name for name in names if private(name)}


def reaches_into(module: str) -> Iterator[str]:
    for target, name, line in imports(module):
        if name is not None and private(name) and target != module:
            yield f"{module}:{line} imports {name} from {target}"
    own = defined_here(module)
    for node in ast.walk(modules()[module]):
        if not isinstance(node, ast.Attribute) or not private(node.attr):
            continue
        if not own_object(node.value):
            yield f"{module}:{node.lineno} reads {ast.unparse(node)}"
        elif node.attr not in own:  # a base class's underscore name, from another module
            yield f"{module}:{node.lineno} uses {ast.unparse(node)}, defined in another module"


def test_no_module_uses_another_modules_underscore_names() -> None:
    found = [problem for module in modules() for problem in reaches_into(module)]
    assert not found, "underscore names used from outside their owner:\n" + "\n".join(found)


def test_the_task_module_is_under_300_lines() -> None:
    lines = len((SOURCE / "task.py").read_text().splitlines())
    assert lines < TASK_MODULE_LINES, f"{PACKAGE}.task has {lines} lines (must be under {TASK_MODULE_LINES})"


def functions(module: str) -> Iterator[tuple[str, int]]:
    """(qualified name, lines) of every function and method in ``module``, nested ones too."""

    def walk(node: ast.AST, scope: str) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{scope}{child.name}"
                yield name, (child.end_lineno or child.lineno) - child.lineno + 1
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{scope}{child.name}.")
            else:
                yield from walk(child, scope)

    yield from walk(modules()[module], f"{module}.")


def test_no_function_is_over_50_lines() -> None:
    long = [
        f"{name} has {lines} lines"
        for module in modules()
        for name, lines in functions(module)
        if lines > FUNCTION_LINES
    ]
    assert not long, f"functions over {FUNCTION_LINES} lines:\n" + "\n".join(long)
