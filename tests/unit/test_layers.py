"""The layering contracts of the source tree, checked by reading its imports.

What import-linter's ``forbidden`` contracts would say, with the project's folder
mapping (``operator/`` is ``ringwright.operator``) that import-linter cannot follow:

- the operator's plan step does no I/O: nothing it imports, however indirectly, reaches
  the Kubernetes client, kopf, an HTTP library, sockets, subprocesses or the apply step;
- the runtime never imports the operator or kopf;
- the operator never imports torch;
- the world contract imports neither side's frameworks;
- inside a package, imports are relative (one import style).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = {
    "ringwright.operator": REPO / "operator",
    "ringwright.runtime": REPO / "runtime",
    "ringwright.devcluster": REPO / "devcluster",
    "ringwright": REPO / "src" / "ringwright",
}
COMPONENTS = ("ringwright.operator", "ringwright.runtime", "ringwright.devcluster")
IO_MODULES = ("kubernetes", "kopf", "httpx", "urllib3", "requests", "socket", "subprocess",
              "ringwright.kube", "ringwright.operator.apply", "ringwright.operator.observe.cache")


def _files() -> dict[str, Path]:
    """Every module of the package, by its dotted name."""
    found: dict[str, Path] = {}
    for root, folder in sorted(ROOTS.items(), key=lambda kv: -len(kv[0])):
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            name = ".".join([root, *rel])
            found.setdefault(name, path)
    return found


MODULES = _files()


def _imports(name: str) -> Iterator[tuple[str, int, int]]:
    """(absolute module, relative level, line) of every import in a module."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, 0, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            yield target, node.level, node.lineno
            for alias in node.names:  # `from pkg import module`
                if f"{target}.{alias.name}" in MODULES:
                    yield f"{target}.{alias.name}", node.level, node.lineno


@cache
def _closure(name: str) -> frozenset[str]:
    """Every module a module imports, following the project's own modules."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        for target, _, _ in _imports(current):
            if target in seen:
                continue
            seen.add(target)
            if target in MODULES:
                todo.append(target)
    return frozenset(seen)


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _component(module: str) -> str:
    for c in COMPONENTS:
        if _within(module, (c,)):
            return c
    return "ringwright"


def _modules_under(prefix: str) -> list[str]:
    return sorted(m for m in MODULES if _within(m, (prefix,)))


@pytest.mark.parametrize("module", _modules_under("ringwright.operator.plan"))
def test_the_plan_step_does_no_io(module: str) -> None:
    reached = sorted(m for m in _closure(module) if _within(m, IO_MODULES))
    assert not reached, f"{module} reaches {reached}: the plan step must stay pure"


@pytest.mark.parametrize("module", _modules_under("ringwright.runtime"))
def test_the_runtime_never_imports_the_operator(module: str) -> None:
    reached = sorted(m for m in _closure(module) if _within(m, ("ringwright.operator", "kopf")))
    assert not reached, f"{module} reaches {reached}"


@pytest.mark.parametrize("module", _modules_under("ringwright.operator"))
def test_the_operator_never_imports_torch(module: str) -> None:
    reached = sorted(m for m in _closure(module) if _within(m, ("torch", "horovod")))
    assert not reached, f"{module} reaches {reached}"


def test_the_world_contract_imports_neither_side() -> None:
    forbidden = ("torch", "kopf", "kubernetes", "ringwright.operator", "ringwright.runtime")
    reached = sorted(m for m in _closure("ringwright.world") if _within(m, forbidden))
    assert not reached, f"ringwright.world reaches {reached}"


def test_imports_inside_a_package_are_relative() -> None:
    absolute = [
        f"{MODULES[m].relative_to(REPO)}:{line} imports {target}"
        for m in MODULES
        for target, level, line in _imports(m)
        if level == 0 and target.startswith("ringwright") and _component(target) == _component(m)
        and _component(m) != "ringwright"
    ]
    assert not absolute, "use a relative import:\n" + "\n".join(absolute)


def test_the_contracts_see_the_whole_tree() -> None:
    # A contract over an empty set of modules would pass for nothing.
    assert len(_modules_under("ringwright.operator.plan")) >= 20
    assert len(_modules_under("ringwright.runtime")) >= 50
    assert "ringwright.kube" in _closure("ringwright.operator.apply.executor")
