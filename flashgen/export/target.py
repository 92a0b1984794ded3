"""Where an export goes: OUT/NAME, checked before anything is built.

An export replaces only an earlier export (`--force`): a folder holding flashgen's table
(the Python package) or manifest (the AOT format), or an empty one. Anything else at that
path is the user's and is left alone, as is a symbolic link (whatever it points to)."""

from __future__ import annotations

import importlib.util
import json
import keyword
from pathlib import Path

#: The files that mark a folder as an export, with the field each one carries.
_MARKS = (("table.json", "flashgen_version"), ("manifest.json", "flashgen_version"))


def check_name(name: str, what: str) -> None:
    """`name` must be an ASCII identifier (a package to import, a C prefix): torch.library
    takes an ASCII op namespace only, so "Ünï" exported but did not import."""
    if not (name.isascii() and name.isidentifier()) or keyword.iskeyword(name):
        raise ValueError(f"{what} {name!r} is not an ASCII Python identifier")


def check_not_shadowing(name: str, target: Path) -> None:
    """A package named as an installed module (torch's sympy, say) hides it from whoever
    puts the export folder on the path first; an earlier export of the name (at `target`
    or elsewhere on the path) is not such a module."""
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    origin = None if found is None else (found.origin or next(
        iter(found.submodule_search_locations or []), None))
    if origin is None:
        return
    home = Path(origin).resolve()
    if home.is_relative_to(target.resolve()) or (home.name == "__init__.py"
                                                 and is_export(home.parent)):
        return
    raise ValueError(f"package name {name!r} would shadow the installed module {name!r} "
                     f"({origin}) for whoever imports it; pick another")


def is_export(folder: Path) -> bool:
    """Whether `folder` is an earlier flashgen export (or empty: nothing of the user's)."""
    if not any(folder.iterdir()):
        return True
    for mark, field in _MARKS:
        try:
            data = json.loads((folder / mark).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and field in data:
            return True
    return False


def check_target(target: Path, force: bool) -> None:
    """Raise FileExistsError unless an export may be written at `target`: nothing there, or
    an earlier export with `force`."""
    if target.is_symlink():
        raise FileExistsError(f"{target} is a symbolic link; an export never replaces one: "
                              "remove it, or pick another --out or --name")
    if not target.exists():
        return
    if not target.is_dir():
        raise FileExistsError(f"{target} is a file, not an export; remove it, or pick another "
                              "--out or --name")
    if not force:
        raise FileExistsError(f"{target} exists; pass --force to replace it")
    if not is_export(target):
        raise FileExistsError(f"{target} is not a flashgen export (no table.json or "
                              "manifest.json of one); --force replaces only an earlier "
                              "export: remove it yourself, or pick another --out or --name")
