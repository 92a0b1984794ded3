"""Where the package data lives: inside the installed package, or at the top of a source tree.

An install (editable or not) maps `templates/` and `tuning_db/` to `flashgen.templates` and
`flashgen.tuning_db`. Running from a checkout with only PYTHONPATH set (as on the GPU machine)
has no such mapping, so the folders beside the `flashgen/` package are used instead.
"""

from __future__ import annotations

import importlib.resources
from importlib.resources.abc import Traversable
from pathlib import Path

_SOURCE_ROOT = Path(__file__).resolve().parents[2]


def data_dir(name: str) -> Traversable:
    """The folder `name` ("templates" or "tuning_db") of package data. A checkout (its
    pyproject.toml beside the package) reads its own folders, even where an editable install
    of another checkout maps `flashgen.<name>` elsewhere (git worktrees sharing one venv)."""
    if (_SOURCE_ROOT / "pyproject.toml").is_file() and (_SOURCE_ROOT / name).is_dir():
        return _SOURCE_ROOT / name
    try:
        return importlib.resources.files(f"flashgen.{name}")
    except ImportError:
        return _SOURCE_ROOT / name
