"""The layout DESIGN.md states: subpackages by pipeline step, imports pointing down only.

Read from the source with `ast`, so the rules hold for every module, imported or not.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "flashgen"

#: Layer -> the flashgen layers it may import (itself and `version` always allowed). Bottom to
#: top: kernels -> runtime and store -> serve -> tune -> bench, export -> integrations, cli.
MAY_IMPORT: dict[str, set[str]] = {
    "version": set(),
    "kernels": set(),
    "runtime": set(),  # copied verbatim into exports: no flashgen import at all
    "store": {"kernels"},
    "serve": {"kernels", "runtime", "store"},  # plugs flashgen's data and rules into the runtime
    "tune": {"kernels", "runtime", "store", "serve"},
    "bench": {"kernels", "runtime", "store", "serve", "tune"},
    "export": {"kernels", "runtime", "store", "serve", "tune"},
    "integrations": {"flashgen"},  # the public API, as a user calls it
}
#: Third-party packages the runtime may import (it runs where only these are installed).
RUNTIME_THIRD_PARTY = {"torch", "triton"}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _layer(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in `path`; relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ["flashgen", *path.relative_to(PACKAGE).parts[:-1]]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            if name == "flashgen":  # `from flashgen import x`: x is the module or layer
                found += [(f"flashgen.{alias.name}", node.lineno) for alias in node.names]
            else:
                found.append((name, node.lineno))
    return found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: Path) -> None:
    layer = _layer(path)
    if layer not in MAY_IMPORT:
        return  # the top: cli, __init__, __main__ may import any layer
    allowed = MAY_IMPORT[layer] | {layer} | ({"version"} if layer != "runtime" else set())
    for name, line in _imports(path):
        parts = name.split(".")
        if parts[0] == "flashgen":
            target = parts[1] if len(parts) > 1 else "flashgen"
            assert target in allowed, f"{path.name}:{line} ({layer}) imports {name}"
        elif layer == "runtime":
            top = parts[0]
            assert top in RUNTIME_THIRD_PARTY or top in sys.stdlib_module_names or top == "", (
                f"{path.name}:{line}: the runtime imports {name}; it may use only torch, "
                "triton and the standard library"
            )


def test_no_module_names_differ_only_by_a_suffix() -> None:
    """`bench`/`benchmark`, `space`/`spaces`: such pairs split one job in two."""
    names = {p.stem for p in _modules() if not p.stem.startswith("__")}
    names |= {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    clashes = sorted((a, b) for a in names for b in names if a != b and b.startswith(a))
    assert not clashes, f"module names differing only by a suffix: {clashes}"
