"""Rows keyed by the kernel they ran: the normalised kernel hash, what a template edit does to
stored rows (prose keeps them all, a code change retires exactly the rows it changed), and
dispatch passing over a row whose kernel changed."""

from __future__ import annotations

import ast
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from flashgen.kernels import bwd_render, decode_render, render
from flashgen.kernels.bwd_space import bwd_portfolio, bwd_search_space, default_bwd_variant
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.decode_space import decode_search_space, default_decode_variant
from flashgen.kernels.decode_variant import DecodeVariant
from flashgen.kernels.fwd_space import default_variant, portfolio, search_space
from flashgen.kernels.hardware import INTERPRETER, DeviceInfo
from flashgen.kernels.modes import AnyVariant
from flashgen.kernels.problem import DecodeProblem, Problem
from flashgen.kernels.resources import data_dir
from flashgen.kernels.variant import Variant
from flashgen.serve import Dispatcher
from flashgen.store import current
from flashgen.store.db import TuningDB
from flashgen.store.keys import TuningKey
from flashgen.store.table import shipped_db_path
from flashgen.tune.timing import Timing

HOPPER = DeviceInfo("H-test", (9, 0), 132, 232448)
#: Problems whose variants reach every template branch the knobs and the problem pick:
#: Gluon (fa3) kernels need fp16/bf16 and D 64 or 128; fp32 and an unpadded D take others.
PROBLEMS = (Problem(2, 8, 2, 1024, 1024, 64, "bf16", True),
            Problem(2, 8, 8, 1024, 1024, 128, "fp16", False),
            Problem(1, 2, 1, 256, 256, 40, "fp32", True),
            Problem(1, 4, 2, 512, 512, 256, "bf16", True))
#: The decode family's branches: paged or contiguous, padded D or not, fp32 or 16-bit.
DECODE_PROBLEMS = (DecodeProblem(2, 8, 2, 1, 1024, 64, "bf16", True, page_size=16),
                   DecodeProblem(1, 2, 1, 3, 256, 40, "fp32", False))


def test_normalised_drops_comments_docstrings_and_blank_lines_only() -> None:
    source = ('"""Module."""\n# note\nimport x  # why\n\n\ndef f(a,\n      b):  # c\n'
              '    """Doc\n    more."""\n    s = "# kept" \'and kept\'\n    \'bare\'\n'
              '    return (a +\n            b)\n')
    assert render.normalised(source) == ('import x\ndef f(a,\n      b):\n'
                                         '    s = "# kept" \'and kept\'\n'
                                         '    return (a +\n            b)\n')
    assert render.normalised("x = 1\n") != render.normalised("x = 2\n")
    assert render.normalised("x = (\n") == "x = (\n"  # untokenizable: blank lines only


def _with_prose(text: str) -> str:
    """`text` (a template) with a comment and blank lines before every decorator, a
    docstring, a comment and a blank line opening every function body, and a comment, a
    docstring and blank lines at the end: prose only, placed where Python allows it."""
    out: list[str] = []
    in_signature = False
    for line in text.splitlines(keepends=True):
        if line.startswith("@"):
            out.append("# An added comment.\n\n")
        out.append(line)
        if line.startswith("def "):
            in_signature = True
        if in_signature and line.rstrip().endswith(":"):
            out.append('    """An added docstring."""\n    # An added comment.\n\n')
            in_signature = False
    return "".join(out) + '\n# An added comment.\n\n"""An added docstring."""\n\n'


def _prose_copy(tmp_path: Path) -> dict[str, str]:
    """A temporary copy of templates/ with prose added to every template file, read back."""
    copy = tmp_path / "templates"
    shutil.copytree(Path(str(data_dir("templates"))), copy)
    texts = {}
    for path in sorted(copy.glob("*.jinja")):
        path.write_text(_with_prose(path.read_text(encoding="utf-8")), encoding="utf-8")
        texts[path.name] = path.read_text(encoding="utf-8")
    return texts


def _cases() -> Iterator[tuple[AnyVariant, Problem]]:
    """A spread of each family's variants on each problem: every `step`-th point of the
    search space, the portfolio and the default (the space is too big to render whole)."""
    for p in PROBLEMS:
        fwd = search_space(p, HOPPER)[::40] + portfolio(p, HOPPER)
        bwd = bwd_search_space(p, HOPPER)[::8] + bwd_portfolio(p, HOPPER)
        for v in dict.fromkeys([*fwd, default_variant(p, HOPPER), *bwd,
                                default_bwd_variant(p, HOPPER)]):
            yield v, p
    for p in DECODE_PROBLEMS:
        for v in dict.fromkeys([*decode_search_space(p, HOPPER)[::50],
                                default_decode_variant(p, HOPPER)]):
            yield v, p


def _sources(texts: Mapping[str, str], v: AnyVariant, p: Problem) -> list[tuple[str, str]]:
    if isinstance(v, Variant):
        return [("fwd", render.render_with(texts, v, p))]
    if isinstance(v, DecodeVariant):
        return [(r, decode_render.render_decode_with(texts, r, v, p))
                for r in decode_render.decode_roles(v)]
    return [(r, bwd_render.render_bwd_with(texts, r, v, p)) for r in bwd_render.bwd_roles(v)]


def test_prose_added_to_every_template_keeps_every_kernel_hash(tmp_path: Path) -> None:
    texts = _prose_copy(tmp_path)
    seen: set[str] = set()
    cases = list(_cases())
    for v, p in cases:
        edited = _sources(texts, v, p)
        for role, source in edited:
            ast.parse(source)  # the prose lands where Python allows it
            seen.add(render.template_name(v) if role == "fwd"
                     else decode_render.decode_template_name(role)  # type: ignore[arg-type]
                     if isinstance(v, DecodeVariant)
                     else bwd_render.bwd_template_name(role, v, p))  # type: ignore[arg-type]
        assert [s for _, s in edited] != [s for _, s in _sources(render._templates(), v, p)]
        kernel = (render.kernel_hash if isinstance(v, Variant)
                  else decode_render.decode_kernel_hash if isinstance(v, DecodeVariant)
                  else bwd_render.bwd_kernel_hash)
        assert render.sources_hash(edited) == kernel(v, p), (v, p)  # type: ignore[arg-type]
    kernels = {n for n in render._templates() if n.startswith("attn_")}
    assert seen == kernels, kernels - seen  # every kernel template was rendered


@pytest.fixture
def templates_as(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """Make flashgen render from other template texts, as if templates/ held them: every
    cache that keeps a rendering or a verdict is emptied before and after."""

    def clear() -> None:
        for cached in (render._environment, render._render, render._rendered_digest,
                       current.hash_is_current, bwd_render.load_bwd_kernel):
            cached.cache_clear()

    def use(texts: Mapping[str, str]) -> None:
        clear()
        monkeypatch.setattr(render, "_templates", lambda: dict(texts))

    yield use
    monkeypatch.undo()
    clear()


def test_prose_added_to_every_template_keeps_every_shipped_row_current(
        tmp_path: Path, templates_as) -> None:
    with TuningDB.open_readonly(shipped_db_path()) as db:
        winners = db.all_winners()
    assert winners and all(current.row_is_current(w) for w in winners)
    templates_as(_prose_copy(tmp_path))
    assert all(current.row_is_current(w) for w in winners)


def _store(path: Path, problem: Problem, variant: AnyVariant, tflops: float = 1.0,
           mode: str = "fwd") -> TuningKey:
    with TuningDB(path) as db:
        key = TuningKey.for_problem(problem, INTERPRETER, mode)
        db.record_trial(key, problem, variant, "ok", timing=Timing(1.0, 1.0, 1.0, 5),
                        tflops=tflops)
        db.update_winner(key)
    return key


P = Problem(1, 2, 1, 64, 64, 32, "fp32", True)
TMA = Variant("fa2", 32, 32, 2, 1, use_tma=True)


def _edit_tma_branch(texts: dict[str, str]) -> dict[str, str]:
    """`texts` with a code change in the fa2 template's use_tma branch only."""
    fa2 = texts["attn_fwd_fa2.py.jinja"]
    edited = fa2.replace("    k_base = 0\n    v_base = 0\n", "    k_base = 0\n    v_base = 0 + 0\n")
    assert edited != fa2
    return {**texts, "attn_fwd_fa2.py.jinja": edited}


def test_a_code_edit_retires_exactly_the_rows_whose_kernel_it_changed(
        tmp_path: Path, templates_as) -> None:
    db = tmp_path / "t.db"
    rows = {  # one bucket each, and in the first a slower variant the edit keeps
        TMA: P, Variant("fa2", 32, 32, 2, 1): P.with_(seq_q=128, seq_k=128),
        Variant("fa1", 32, 16, 2, 1): P.with_(seq_q=256, seq_k=256),
        Variant("fa3", 64, 64, 4, 2): P.with_(seq_q=512, seq_k=512, dtype="bf16"),
    }
    for variant, problem in rows.items():
        _store(db, problem, variant, tflops=2.0)
    plain = Variant("fa2", 16, 16, 2, 1)
    key = _store(db, P, plain)
    _store(db, P, BwdVariant(32, 32, 2, 1), mode="bwd")
    edited = _edit_tma_branch(dict(render._templates()))
    changed = {v for v, p in rows.items() if render.render_with(edited, v, p)
               != render.render(v, p)}
    assert changed == {TMA}  # only fa2 use_tma kernels read that branch
    templates_as(edited)
    # Dispatch passes over the changed winner (to the nearest valid bucket), and says why.
    choice = Dispatcher(db).choose(P, INTERPRETER)
    assert (choice.variant, choice.how) == (Variant("fa2", 32, 32, 2, 1), "nearest")
    with TuningDB(db) as store:
        verdict = {w.variant: current.row_is_current(w) for w in store.all_winners()}
        assert verdict == {**{v: v not in changed for v in rows},
                           BwdVariant(32, 32, 2, 1): True}
        # The bucket's best row whose kernel is unchanged wins; TMA is to measure again.
        assert store.update_winner(key).variant == plain
        assert set(store.measured(key, P)) == {plain.to_json()}
    assert Dispatcher(db).choose(P, INTERPRETER).variant == plain


def test_a_row_whose_kernel_changed_gives_way_to_the_next_database(
        tmp_path: Path, templates_as) -> None:
    user, shipped = tmp_path / "user.db", tmp_path / "shipped.db"
    _store(shipped, P, Variant("fa2", 32, 32, 2, 1))
    _store(user, P, TMA)
    assert Dispatcher([user, shipped]).choose(P, INTERPRETER).variant == TMA
    templates_as(_edit_tma_branch(dict(render._templates())))
    choice = Dispatcher([user, shipped]).choose(P, INTERPRETER)
    assert (choice.variant, choice.how) == (Variant("fa2", 32, 32, 2, 1), "exact")
    assert choice.source.startswith(str(shipped))


def test_other_template_texts_compile_once_per_set() -> None:
    """Rendering from other texts (A/B tools, these tests) keeps one environment per set of
    texts, so each template compiles once; a changed text gets its own."""
    texts = dict(render._templates())
    assert render.environment_for(texts) is render.environment_for(dict(texts))
    edited = {**texts, "attn_fwd_fa1.py.jinja": texts["attn_fwd_fa1.py.jinja"] + "\n# edit\n"}
    other = render.environment_for(edited)
    assert other is not render.environment_for(texts)
    assert other.loader is not None
    assert "# edit" in other.loader.get_source(other, "attn_fwd_fa1.py.jinja")[0]
