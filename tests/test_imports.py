"""The house rules of imports (DESIGN.md, "Architecture"), read from the source of every module.

Every ``import`` of every module counts: at module level, inside functions (lazy imports) and
under ``TYPE_CHECKING``. Two rules:

- a private module (``iobundle.X._y``, or anything below it) is imported only from inside ``X``:
  another part goes through ``X``'s public face (a module named in a string, as lazy imports and
  tables of lazy names spell them, is imported too); nor does a part read another part's private
  attributes (``bundle._store`` in ``travel``);
- the parts of the package (``iobundle.<name>``: ``schema``, ``calls``, ``capture``, ``replay``,
  ``observer``, ``cli``, ...; the facade ``iobundle/__init__.py`` is a part of its own) import
  each other without a cycle, and so do its modules: no two modules import each other, directly
  or through others.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).parents[1] / "iobundle"
FACADE = "iobundle"


def _module_name(path: Path, root: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(name: str, root: Path) -> bool:
    return (root.parent.joinpath(*name.split(".")) / "__init__.py").is_file()


def _exists(name: str, root: Path) -> bool:
    path = root.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _modules(root: Path) -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(root.rglob("*.py")):
        yield _module_name(path, root), ast.parse(path.read_text("utf-8"), str(path))


def imports(root: Path) -> Iterator[tuple[str, str, int]]:
    """Yield ``(importer, imported module, line)`` for every import of ``root``'s package, inside functions too.

    A string that is the name of one of the package's modules (``lazy_module("pkg.a")``, the values of a
    table of lazy names) is an import as well: the name is imported by string when first used.
    """
    dotted = re.compile(rf"{re.escape(root.name)}(\.\w+)+")
    for importer, tree in _modules(root):
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and dotted.fullmatch(node.value):
                if _exists(node.value, root):
                    yield importer, node.value, node.lineno
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield importer, alias.name, node.lineno
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    # ``from pkg import sub`` imports the module ``pkg.sub`` when it is one.
                    full = f"{node.module}.{alias.name}"
                    yield importer, full if _exists(full, root) else node.module, node.lineno


def _owner_of_private(module: str) -> str | None:
    """The package inside which ``module`` may be imported, when one of its components is private."""
    parts = module.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def private_import_violations(root: Path) -> list[str]:
    found = []
    for importer, module, line in imports(root):
        if not module.startswith(root.name + "."):
            continue
        owner = _owner_of_private(module)
        importer_package = importer if _is_package(importer, root) else importer.rsplit(".", 1)[0]
        if owner is not None and not (importer_package + ".").startswith(owner + "."):
            found.append(f"{importer} (line {line}) imports {module}: import it from {owner}'s public face instead")
    return found


def part_of(module: str, root: Path) -> str:
    parts = module.split(".")
    return FACADE if len(parts) == 1 else f"{root.name}.{parts[1]}"


FOREIGN = {"_version", "_data"}  # torch.Tensor._version; optimum-quanto's packed tensors' _data


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def private_attribute_violations(root: Path) -> list[str]:
    """``x._name`` read in one part where only another part defines ``_name`` (an attribute, method or function).

    What a part defines: its functions, classes and methods, the names and ``self._x`` attributes it
    assigns, and the private names it spells in strings (``__slots__``, ``setattr``). ``self._x`` and
    ``cls._x`` are not counted, nor the attributes of other libraries' objects in ``FOREIGN``.
    """
    modules = list(_modules(root))
    defined: dict[str, set[str]] = {}
    for module, tree in modules:
        names = defined.setdefault(part_of(module, root), set())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)
    found = []
    for module, tree in modules:
        part = part_of(module, root)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)) or node.attr in defined[part] | FOREIGN:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            owners = sorted(p for p, names in defined.items() if node.attr in names)
            if owners:
                found.append(f"{module} (line {node.lineno}) reads .{node.attr} of {owners[0]}: use its public face")
    return found


def part_graph(root: Path) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for importer, module, _ in imports(root):
        if module == root.name or module.startswith(root.name + "."):
            a, b = part_of(importer, root), part_of(module, root)
            graph.setdefault(a, set())
            if a != b:
                graph[a].add(b)
    return graph


def module_graph(root: Path) -> dict[str, set[str]]:
    """Which modules of ``root``'s package each module imports (a package stands for its ``__init__.py``)."""
    graph: dict[str, set[str]] = {}
    for importer, module, _ in imports(root):
        graph.setdefault(importer, set())
        if (module == root.name or module.startswith(root.name + ".")) and module != importer:
            graph[importer].add(module)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """Return one cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_private_import_across_packages() -> None:
    assert private_import_violations(PACKAGE_ROOT) == []


def test_no_private_attribute_across_parts() -> None:
    assert private_attribute_violations(PACKAGE_ROOT) == []


def test_no_cycle_between_parts() -> None:
    graph = part_graph(PACKAGE_ROOT)
    assert {"iobundle.schema", "iobundle.calls", "iobundle.capture", "iobundle.replay", "iobundle.observer"} <= set(
        graph
    )
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_no_cycle_between_modules() -> None:
    graph = module_graph(PACKAGE_ROOT)
    assert {"iobundle.replay", "iobundle.replay.infer", "iobundle.cli._main"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.parametrize(
    ("part", "never_imports"),
    [
        ("iobundle.schema", {"iobundle.calls", "iobundle.capture", "iobundle.replay", "iobundle.observer"}),
        ("iobundle.calls", {"iobundle.capture", "iobundle.replay", "iobundle.observer"}),
        ("iobundle.capture", {"iobundle.replay", "iobundle.observer"}),
        ("iobundle.replay", {"iobundle.capture", "iobundle.observer"}),
    ],
)
def test_imports_point_down(part: str, never_imports: set[str]) -> None:
    assert part_graph(PACKAGE_ROOT)[part] & never_imports == set()


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, "utf-8")
    return root


def test_checks_catch_a_private_import_and_a_cycle(tmp_path: Path) -> None:
    """The rules above can fail: a lazy private import and a lazy cycle in a throwaway package are found."""
    root = _write_package(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "a/__init__.py": "from pkg.a._impl import f\n",
            "a/_impl.py": "def f():\n    from pkg.b import g\n    return g\n",
            "b/__init__.py": "",
            "b/_impl.py": "def g():\n    from pkg.a._impl import f\n    return f\n",
        },
    )
    assert private_import_violations(root) == [
        "pkg.b._impl (line 2) imports pkg.a._impl: import it from pkg.a's public face instead"
    ]
    assert find_cycle(part_graph(root)) == ["pkg.a", "pkg.b", "pkg.a"]


def test_checks_catch_a_string_import_and_a_private_attribute(tmp_path: Path) -> None:
    """A name forwarded by string up the layers, and a private attribute of another part's object, are found."""
    root = _write_package(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "a/__init__.py": "_LAZY = {'g': 'pkg.b'}\n",
            "a/_impl.py": "class Store:\n    def __init__(self):\n        self._root = 1\n",
            "b/__init__.py": "from pkg.a import Store\n",
            "b/_use.py": "def root(store):\n    return store._root, store.__class__\n",
        },
    )
    assert find_cycle(part_graph(root)) == ["pkg.a", "pkg.b", "pkg.a"]
    assert private_attribute_violations(root) == ["pkg.b._use (line 2) reads ._root of pkg.a: use its public face"]


def _room(module: str) -> str:
    parts = module.split(".")
    return (
        ".".join(parts[:3])
        if len(parts) > 2 and parts[1] == "replay" and not parts[2].startswith("_")
        else ".".join(parts[:2])
    )


@pytest.mark.parametrize(
    ("room", "never_imports"),
    [
        ("iobundle.replay.infer", {"iobundle.replay", "iobundle.replay.check", "iobundle.replay.export"}),
        ("iobundle.replay.check", {"iobundle.replay", "iobundle.replay.export"}),
        ("iobundle.replay.export", {"iobundle.replay"}),
        ("iobundle.replay", {"iobundle.travel"}),
    ],
)
def test_replay_rooms_import_one_way(room: str, never_imports: set[str]) -> None:
    """replay (Bundle) -> export -> check -> infer, and travel on top of replay."""
    graph = module_graph(PACKAGE_ROOT)
    found = {_room(b) for a, imported in graph.items() if _room(a) == room for b in imported}
    assert room in {_room(m) for m in graph}
    assert found & never_imports == set()


def test_module_check_catches_a_cycle_inside_one_part(tmp_path: Path) -> None:
    """Three modules of one part that import each other in a ring, one of them lazily, are a cycle."""
    root = _write_package(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "a/__init__.py": "",
            "a/_one.py": "from pkg.a._two import f\n",
            "a/_two.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a._three import g\n",
            "a/_three.py": "def g():\n    from pkg.a import _one\n    return _one\n",
        },
    )
    assert find_cycle(part_graph(root)) is None
    assert find_cycle(module_graph(root)) == ["pkg.a._one", "pkg.a._two", "pkg.a._three", "pkg.a._one"]
