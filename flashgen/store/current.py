"""Whether a stored row still describes a kernel that flashgen renders.

Every trial and winner stores `kernel_hash`, the hash of the normalised kernels its variant
rendered to when it ran (`ModeSpace.kernel_hash`). A row is current while that equals the
hash of its variant rendered now, so a template edit retires exactly the rows whose kernel it
changed, and an edit of comments, docstrings or blank lines retires none. Some stored values
never match: None (a pruned row ran nothing) and `RETIRED` + the old template hash (rows the
re-keying migration found keyed to other template text). A file that has not had that
migration (opened read-only) gives its rows `LEGACY` + their template hash: current when
that is the hash of today's templates, as the migration would decide.

The check renders the row's kernels, so it is made once per process per row and variant
(`row_is_current` is cached), when a row is first used, never for a whole table at load.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from typing import Any, Protocol

import jinja2
from jinja2 import meta

from flashgen.kernels.modes import AnyVariant, space_of
from flashgen.kernels.problem import Problem
from flashgen.kernels.render import _templates

#: Marks a row whose kernel is unknown and never current; the old template hash follows.
RETIRED = "retired:"
#: Marks a row read from an unmigrated file; its family template hash follows.
LEGACY = "template:"


class _Key(Protocol):
    mode: str


class StoredRow(Protocol):
    """What the check reads of a `TrialRow` (variant: a knob dict) or a `WinnerRow`."""

    @property
    def key(self) -> _Key: ...
    @property
    def variant(self) -> AnyVariant | dict[str, Any]: ...
    @property
    def problem(self) -> Problem: ...
    @property
    def kernel_hash(self) -> str | None: ...


def kernel_hash_now(mode: str, variant: AnyVariant, problem: Problem) -> str | None:
    """The kernel hash of `variant` on `problem` rendered now; None where today's templates
    cannot render it (a variant whose knobs name no kernel)."""
    try:
        return space_of(mode).kernel_hash(variant, problem)
    except (jinja2.TemplateError, ValueError):
        return None


@functools.lru_cache(maxsize=65536)
def hash_is_current(mode: str, variant: AnyVariant, problem: Problem,
                    stored: str | None) -> bool:
    """Whether `stored` is the kernel hash of `variant` on `problem` rendered now."""
    if stored is None or stored.startswith(RETIRED):
        return False
    if stored.startswith(LEGACY):
        return stored[len(LEGACY):] == _family_hash_now(mode)
    return stored == kernel_hash_now(mode, variant, problem)


def row_is_current(row: StoredRow) -> bool:
    """Whether `row`'s kernel is the one its variant renders to now (cached per process)."""
    variant = row.variant
    if isinstance(variant, dict):
        try:
            variant = space_of(row.key.mode).variant_type.from_dict(variant)
        except (TypeError, ValueError):  # knobs this flashgen lacks: not its kernel
            return False
    return hash_is_current(row.key.mode, variant, row.problem, row.kernel_hash)


# ---- the family template hash that keyed rows before kernel hashes -----------------------


@functools.cache
def _family_hash_now(mode: str) -> str:
    return family_hash(_templates(), mode)


def family_templates(templates: Mapping[str, str], mode: str) -> list[str]:
    """The templates `mode`'s kernels were keyed by: its `attn_<mode>_*` kernels and every
    fragment they include, directly or through another fragment."""
    env = jinja2.Environment()
    todo = [name for name in templates if name.startswith(f"attn_{mode}_")]
    family: set[str] = set()
    while todo:
        name = todo.pop()
        if name in family or name not in templates:
            continue
        family.add(name)
        todo += [n for n in meta.find_referenced_templates(env.parse(templates[name])) if n]
    return sorted(family)


def family_hash(templates: Mapping[str, str], mode: str) -> str:
    """The template hash that rows of `mode` were keyed by when `templates` were the text:
    what the re-keying migration compares a row's stored one with."""
    digest = hashlib.sha256()
    for name in family_templates(templates, mode):
        digest.update(f"{name}\0{templates[name]}\0".encode())
    return digest.hexdigest()[:16]
