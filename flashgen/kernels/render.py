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
import io
import os
import tempfile
import tokenize
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import jinja2

from flashgen.kernels.problem import FP8_BLOCK, Problem
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


def normalised(source: str) -> str:
    """`source` without comments, docstrings (any statement that is a bare string literal),
    trailing blanks and blank lines: what a kernel hash covers, so an edit of a template's
    prose keeps the rows of every kernel it renders. Found by Python's tokenizer, so a `#`
    or a quote inside a string is left alone; from text it cannot tokenize, only blank lines
    and trailing blanks are cut. The same on Python 3.10 to 3.13."""
    lines = io.StringIO(source).readlines()  # the tokenizer's lines: split at "\n" only
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        tokens = []
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    offset = lambda pos: starts[pos[0] - 1] + pos[1]
    cuts: list[tuple[int, int]] = []
    statement: list[tokenize.TokenInfo] = []
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            cuts.append((offset(tok.start), offset(tok.end)))
        elif tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if statement and all(t.type == tokenize.STRING for t in statement):
                cuts.append((offset(statement[0].start), offset(statement[-1].end)))
            statement = []
        elif tok.type not in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
            statement.append(tok)
    kept, at = [], 0
    for begin, end in sorted(cuts):
        kept.append(source[at:begin])
        at = end
    kept.append(source[at:])
    return "".join(f"{line.rstrip()}\n" for line in "".join(kept).split("\n") if line.strip())


def _part_digest(role: str, source: str) -> str:
    return hashlib.sha256(f"{role}\0{normalised(source)}".encode()).hexdigest()


def sources_hash(sources: Iterable[tuple[str, str]]) -> str:
    """The kernel hash of (role, source) pairs: the kernels a variant launches, by role."""
    parts = "".join(_part_digest(role, source) for role, source in sources)
    return hashlib.sha256(parts.encode()).hexdigest()[:16]


Context = tuple[tuple[str, Any], ...]


@functools.lru_cache(maxsize=8192)
def _rendered_digest(role: str, name: str, context: Context) -> str:
    return _part_digest(role, _render(name, context))


def rendered_hash(parts: Iterable[tuple[str, str, Context]]) -> str:
    """`sources_hash` of the kernels that (role, template name, sorted render context) parts
    render to; each kernel is rendered and normalised once per process."""
    digests = "".join(_rendered_digest(*part) for part in parts)
    return hashlib.sha256(digests.encode()).hexdigest()[:16]


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


def environment_for(templates: Mapping[str, str]) -> jinja2.Environment:
    """An environment rendering from `templates` (name -> text), kept per set of texts:
    a fresh environment compiles every template it loads again, which made the tools and
    tests that render other template texts spend most of their time in Jinja's compiler."""
    return _environment_of(tuple(sorted(templates.items())))


@functools.lru_cache(maxsize=16)
def _environment_of(texts: tuple[tuple[str, str], ...]) -> jinja2.Environment:
    return _make_environment(dict(texts).get)


def render_with(templates: Mapping[str, str], variant: Variant, problem: Problem,
                overrides: Mapping[str, Any] | None = None) -> str:
    """What `render` gives with other template texts (say an earlier revision's): lets a
    tool or test see which kernel (so which rows' kernel hashes) a template change alters.
    `overrides` replace entries of the render context, so an A/B can render a structure
    choice both ways (`mufu_split=False`: the capped kernels' exp2 all on MUFU)."""
    env = environment_for(templates)
    context = {**render_context(variant, problem), **(overrides or {})}
    return env.get_template(template_name(variant)).render(**context)


def template_name(variant: Variant) -> str:
    # fa3 on a persistent grid is its own kernel (its own tile loop and barriers), not a flag.
    grid = "_persistent" if variant.loop_order == "fa3" and variant.programs_per_sm else ""
    return f"attn_fwd_{variant.loop_order}{grid}.py.jinja"


def splits_head_dim(problem: Problem) -> bool:
    """Whether the fa3 kernels (forward and backward) issue their products over the 256
    tile's first 192 columns only, not TMA's zero fill: head dims 129-192, not packed."""
    return 128 < problem.head_dim <= 192 and not problem.varlen


def render_context(variant: Variant, problem: Problem) -> dict[str, Any]:
    """Everything a forward template may depend on. Sequence lengths and batch are not here:
    they are runtime arguments, so one compiled kernel serves every length."""
    return {
        "variant": variant,
        "head_dim": problem.head_dim,
        "block_d": problem.padded_head_dim,
        "pad_d": problem.padded_head_dim != problem.head_dim,
        # fa3 on head dims 129-192 (16-bit, not packed): the products cover the 256 tile's
        # first 192 columns, not the zero-filled rest (the persistent kernel where O leaves
        # through Q's buffer, `o_through_q`).
        "split_d": (variant.loop_order == "fa3" and problem.dtype in ("fp16", "bf16")
                    and splits_head_dim(problem)),
        "causal": problem.causal,
        # fp32 inputs get true fp32 products: tf32 would lose ~3 decimal digits.
        "dot_precision": "ieee" if problem.dtype == "fp32" else "tf32",
        # fa3 with softcap, 16-bit inputs: half of each score tile's exp2 on the FMA pipes
        # (_fa3_softmax.py.jinja). Off: on an H100 it cost 8% more than exp2 all on MUFU
        # (the capped loop is not bound by the special-function unit there); kept for A/Bs
        # through `render_with` overrides (docs/varlen-and-modifiers.md).
        "mufu_split": False,
        # fa3 with softcap, 16-bit inputs: the cap's scales folded into tanh's argument and
        # the softmax's FMA, one multiply a score instead of three (+6-12% capped).
        "cap_fold": problem.softcap and problem.dtype in ("fp16", "bf16"),
        # fp8 on the persistent fa3 kernel: P V reads P from registers, K's rows arriving
        # permuted (a 5-D descriptor) so that turning the scores into that operand moves no
        # data between threads; the launcher asks the kernel (`K_ROW_GROUPS`). Off: 0-5% slower
        # than P through shared memory at the winning points on an H200, 1-10% with ping-pong
        # (docs/fp8.md); kept for A/Bs through `render_with` overrides.
        "p_regs": False,
        # The persistent fa3 kernel above D128 (one Q buffer) stages O in Q's buffer and
        # loads the next tile's Q once O has left. Off: O leaves from registers (the launcher
        # passes O's pointer, `O_POINTER`) and Q is refilled after the last P V; 3-16% slower
        # on an H100 at N512-4k (docs/fa3-hopper.md), kept for A/Bs.
        "o_through_q": True,
        # The persistent fa3 kernel on packed sequences stages O in Q's buffer and stores it
        # 16 bytes a lane (whole rows a warp) under its per-row mask. Off: the masked store
        # straight from the accumulator's registers (4 bytes a lane); kept for A/Bs.
        "o_staged_varlen": True,
        # The same staged store in the one-tile fa3 kernel's packed path (O through Q's
        # buffer): +3-6% on an H100 (docs/varlen-and-modifiers.md). Off: the register store,
        # kept for A/Bs (`scripts/ab_varlen.py`).
        "o_staged_one_tile": True,
        **modifier_context(problem),
    }


def modifier_context(problem: Problem) -> dict[str, Any]:
    """The modifiers as structure: flags, and the runtime arguments each adds to the helper
    signatures (empty without them, so kernels without modifiers render as before)."""
    step = ("WIN_LEFT, WIN_RIGHT," if problem.window else "") + (
        "CAP_SCALE, SOFTCAP," if problem.softcap else "")
    tile = ("WIN_LEFT, WIN_RIGHT," if problem.window else "") + (
        "SOFTCAP," if problem.softcap else "") + ("SINKS," if problem.sinks else "")
    fp8 = problem.dtype == "fp8"
    if fp8:  # the descales, (B, H, blocks) each, after every modifier's arguments
        tile += ("DQ, DK, DV, stride_dqb, stride_dqh, stride_dqn, stride_dkb, stride_dkh, "
                 "stride_dkn, stride_dvb, stride_dvh, stride_dvn,")
    return {
        "window": problem.window,
        "softcap": problem.softcap,
        "sinks": problem.sinks,
        "varlen": problem.varlen,
        "step_mods": f" {step}" if step else "",
        "tile_mods": f" {tile}" if tile else "",
        "fp8": fp8,
        "fp8_range": " dq, dk_base, dv_base, stride_dkn, stride_dvn," if fp8 else "",
        "fp8_step": " QK_DESCALE, V_DESCALE," if fp8 else "",
        # fa3's consumers: fp8's O and P buffers and descale rows; varlen's O rows
        "fa3_consume": (" o_smem, p_smem, dq_base, dk_base, dv_base, stride_dqn, stride_dkn,"
                        " stride_dvn," if fp8 else " o_base, stride_on," if problem.varlen
                        else ""),
        "quant_block": FP8_BLOCK,
    }


@functools.lru_cache(maxsize=4096)
def _render(name: str, context: Context) -> str:
    return _environment().get_template(name).render(**dict(context))


def render(variant: Variant, problem: Problem) -> str:
    """The Triton source of `variant` for `problem` (cached on what the template reads)."""
    context = tuple(sorted(render_context(variant, problem).items()))
    return _render(template_name(variant), context)


def kernel_hash(variant: Variant, problem: Problem) -> str:
    """The code part of a forward row's key: the hash of `variant`'s kernel for `problem`,
    normalised. It depends on the problem only through what the template reads (dtype, head
    dim, mask), so one hash serves every length and batch of a key.

    The pointer twin (`Variant.pointer_twin`) is left out: it runs only on inputs TMA cannot
    address, while the row's check and timing are of the variant's own kernel; an edit of the
    fa2 template must not retire fa3 rows whose kernel did not change."""
    context = tuple(sorted(render_context(variant, problem).items()))
    return rendered_hash([("fwd", template_name(variant), context)])


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


class CacheDirError(OSError):
    """The folder rendered kernels are written to cannot be used (not a folder, not
    writable, full). No variant's fault: the tuner stops on it rather than store a failed
    trial. An OSError whose message names the folder and `FLASHGEN_CACHE_DIR`, so commands
    end in that one `error:` line (`one_line`, read by `store.guard.explain`)."""

    one_line = True


@functools.lru_cache(maxsize=4096)
def _load_module(digest: str, source: str) -> ModuleType:
    directory = cache_dir()
    path = directory / f"fg_{digest}.py"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text(encoding="utf-8") != source:
            # Write then rename, so a concurrent process never imports a half-written file.
            fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(source)
            os.replace(tmp, path)
    except OSError as exc:  # the place is at fault, not the kernel: say so, and where
        raise CacheDirError(
            f"cannot write kernels to {directory} ({exc.strerror or exc}); set "
            f"FLASHGEN_CACHE_DIR to a folder you can write") from exc
    spec = importlib.util.spec_from_file_location(f"flashgen_kernels.fg_{digest}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_kernel(variant: Variant, problem: Problem) -> Any:
    """The Triton JIT function for `variant` on `problem` (compiled lazily by Triton at launch)."""
    source = render(variant, problem)
    return _load_module(source_hash(source), source).attn_fwd
