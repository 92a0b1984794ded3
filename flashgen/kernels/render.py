"""Template -> Triton source -> loaded kernel, each step cached by content hash.

Rendering is deterministic: the same variant and problem give byte-identical source. The
source is written to a file named by its hash and imported from there (Triton's JIT reads a
kernel's source back with `inspect`, which needs a real file), so every distinct kernel is
rendered and compiled once per process, and Triton's own disk cache serves later processes.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import jinja2
from jinja2 import meta

from flashgen.kernels.problem import Problem
from flashgen.kernels.resources import data_dir
from flashgen.kernels.variant import Variant


def _template_files() -> dict[str, str]:
    root = data_dir("templates")
    return {
        entry.name: entry.read_text(encoding="utf-8")
        for entry in root.iterdir()
        if entry.name.endswith(".jinja")
    }


@functools.cache
def _templates() -> dict[str, str]:
    return _template_files()


#: Tuning modes whose kernels come from `attn_<mode>_*.py.jinja` templates.
TEMPLATE_FAMILIES: tuple[str, ...] = ("fwd", "bwd")


def family_templates(templates: Mapping[str, str], mode: str) -> list[str]:
    """The templates `mode`'s kernels are made of: its `attn_<mode>_*` kernels and every
    fragment they include, directly or through another fragment. A fragment included by both
    families belongs to both, so editing it invalidates both families' results."""
    if mode not in TEMPLATE_FAMILIES:
        raise ValueError(f"unknown template family {mode!r}; use one of {TEMPLATE_FAMILIES}")
    env = jinja2.Environment()
    todo = [name for name in templates if name.startswith(f"attn_{mode}_")]
    family: set[str] = set()
    while todo:
        name = todo.pop()
        if name in family or name not in templates:
            continue
        family.add(name)
        # Only literal include names can be followed; the templates use nothing else.
        todo += [n for n in meta.find_referenced_templates(env.parse(templates[name])) if n]
    return sorted(family)


def family_hash(templates: Mapping[str, str], mode: str) -> str:
    """Hash of the names and texts of `mode`'s templates (see `family_templates`)."""
    digest = hashlib.sha256()
    for name in family_templates(templates, mode):
        digest.update(name.encode())
        digest.update(b"\0")
        digest.update(templates[name].encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


@functools.cache
def template_hash(mode: str = "fwd") -> str:
    """Hash of the text of `mode`'s templates ("fwd" or "bwd"): a stored tuning result is only
    valid for this exact text. Per family, so editing a backward template keeps the forward
    winners, and the other way round."""
    return family_hash(_templates(), mode)


def _make_environment(lookup: Callable[[str], str | None]) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(lookup),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


@functools.cache
def _environment() -> jinja2.Environment:
    return _make_environment(lambda name: _templates().get(name))


def render_with(templates: Mapping[str, str], variant: Variant, problem: Problem) -> str:
    """What `render` gives with other template texts (say an earlier revision's): lets a
    tool check that a template change leaves a stored variant's kernel byte-identical."""
    env = _make_environment(templates.get)
    return env.get_template(template_name(variant)).render(**render_context(variant, problem))


def template_name(variant: Variant) -> str:
    # fa3 on a persistent grid is its own kernel (its own tile loop and barriers), not a flag.
    grid = "_persistent" if variant.loop_order == "fa3" and variant.persistent else ""
    return f"attn_fwd_{variant.loop_order}{grid}.py.jinja"


def render_context(variant: Variant, problem: Problem) -> dict[str, Any]:
    """Everything a forward template may depend on. Sequence lengths and batch are not here:
    they are runtime arguments, so one compiled kernel serves every length."""
    return {
        "variant": variant,
        "head_dim": problem.head_dim,
        "block_d": problem.padded_head_dim,
        "pad_d": problem.padded_head_dim != problem.head_dim,
        "causal": problem.causal,
        # fp32 inputs get true fp32 products: tf32 would lose ~3 decimal digits.
        "dot_precision": "ieee" if problem.dtype == "fp32" else "tf32",
    }


@functools.lru_cache(maxsize=4096)
def _render(name: str, context: tuple[tuple[str, Any], ...]) -> str:
    return _environment().get_template(name).render(**dict(context))


def render(variant: Variant, problem: Problem) -> str:
    """The Triton source of `variant` for `problem` (cached on what the template reads)."""
    context = tuple(sorted(render_context(variant, problem).items()))
    return _render(template_name(variant), context)


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:20]


def cache_dir() -> Path:
    """Where rendered sources are written: the kernels/ folder of $FLASHGEN_CACHE_DIR, else
    of $XDG_CACHE_HOME/flashgen (~/.cache/flashgen by default, as for the user database).
    Read at each call, so tests and tools can point it elsewhere at any time."""
    env = os.environ.get("FLASHGEN_CACHE_DIR")
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    base = Path(env).expanduser() if env else Path(cache) / "flashgen"
    return base / "kernels"


@functools.lru_cache(maxsize=4096)
def _load_module(digest: str, source: str) -> ModuleType:
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"fg_{digest}.py"
    if not path.exists() or path.read_text(encoding="utf-8") != source:
        # Write then rename, so a concurrent process never imports a half-written file.
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(f"flashgen_kernels.fg_{digest}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_kernel(variant: Variant, problem: Problem) -> Any:
    """The Triton JIT function for `variant` on `problem` (compiled lazily by Triton at launch)."""
    source = render(variant, problem)
    return _load_module(source_hash(source), source).attn_fwd
