"""Bad inputs to the public calls (issue 28, items 1, 8, 9): a damaged or foreign tuning
database never breaks `flashgen.attention`, bf16 under the CPU interpreter is refused instead
of returning garbage, and bad `scale`/`causal` values get a named error, not a Triton crash
or a silent NaN. CPU tests, through the Triton interpreter (tests/conftest.py)."""

from __future__ import annotations

import math
import os
import sqlite3
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen.kernels.fwd_space import default_variant
from flashgen.kernels.hardware import INTERPRETER
from flashgen.kernels.problem import Problem
from flashgen.runtime import dispatch
from flashgen.store import guard
from flashgen.store.db import TuningDB
from flashgen.store.keys import TuningKey
from flashgen.store.table import shipped_db_path
from flashgen.tune.timing import Timing

pytestmark = pytest.mark.interpreter

PROBLEM = Problem(1, 2, 2, 16, 16, 16, "fp32", False)


def inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Tiny q, k, v on the CPU, small enough for the interpreter."""
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 16, 16, generator=gen).to(dtype) for _ in range(3))


def expected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(),
                                                            v.double()).float()


# ---- item 1: damaged and foreign databases ------------------------------------------------


def flashgen_db(path: Path) -> Path:
    """A flashgen database holding one interpreter winner of PROBLEM."""
    with TuningDB(path) as db:
        key = TuningKey.for_problem(PROBLEM, INTERPRETER, "fwd")
        db.record_trial(key, PROBLEM, default_variant(PROBLEM, INTERPRETER), "ok",
                        timing=Timing(1.0, 0.9, 1.1, 5), tflops=1.0)
        db.update_winner(key)
    return path


def random_bytes(path: Path) -> Path:
    path.write_bytes(os.urandom(8192))
    return path


def truncated(path: Path) -> Path:
    data = flashgen_db(path).read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def other_programs_tables(path: Path) -> Path:
    """Another application's file with tables named like flashgen's."""
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE trials (id INTEGER PRIMARY KEY, score REAL)")
    conn.execute("CREATE TABLE winners (name TEXT)")
    conn.commit()
    conn.close()
    return path


def foreign_application_id(path: Path) -> Path:
    """Another application's file that says so in its header, with a flashgen-like table."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA application_id = 1234")
    conn.execute("CREATE TABLE winners (device_key TEXT, mode TEXT, triton_version TEXT)")
    conn.commit()
    conn.close()
    return path


def newer_and_incompatible(path: Path) -> Path:
    """A flashgen file of a newer schema that this flashgen cannot read."""
    flashgen_db(path)
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO _sqlite_migrations (migration_set, name, applied_at) "
                 f"VALUES ('{guard.MIGRATION_SET}', 'm999_from_the_future', '')")
    conn.execute("ALTER TABLE winners RENAME COLUMN device_key TO device")
    conn.commit()
    conn.close()
    return path


@pytest.fixture
def locked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A flashgen file another program holds an exclusive lock on (no wait for it)."""
    monkeypatch.setenv(guard.BUSY_TIMEOUT_ENV, "0")
    path = flashgen_db(tmp_path / "locked.db")
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = DELETE")
    conn.execute("BEGIN EXCLUSIVE")
    yield path
    conn.execute("ROLLBACK")
    conn.close()


BAD_FILES: dict[str, Callable[[Path], Path]] = {
    "random bytes": random_bytes, "truncated": truncated,
    "another program's tables": other_programs_tables,
    "foreign application id": foreign_application_id,
    "newer schema": newer_and_incompatible,
}


def attention_warns_once(path: Path, call: Callable[[], torch.Tensor]) -> None:
    """Two calls give the right answer and, between them, one warning naming `path`."""
    q, k, v = inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            out = call()
            torch.testing.assert_close(out, expected(q, k, v), atol=1e-4, rtol=1e-4)
    named = [w for w in caught if str(path) in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in caught]
    assert "Going on without it" in str(named[0].message)


@pytest.mark.parametrize("how", BAD_FILES)
def test_bad_database_in_db_list_warns_once_and_attention_works(tmp_path: Path,
                                                                how: str) -> None:
    path = BAD_FILES[how](tmp_path / "bad.db")
    d = flashgen.Dispatcher(db=[path, shipped_db_path()])
    attention_warns_once(path, lambda: flashgen.attention(*inputs(), dispatcher=d))


@pytest.mark.parametrize("how", BAD_FILES)
def test_bad_default_database_warns_once_and_attention_works(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    path = BAD_FILES[how](tmp_path / "tuning.db")
    monkeypatch.setenv("FLASHGEN_DB", str(path))
    monkeypatch.setattr(dispatch, "_default", None)  # a fresh default dispatcher
    attention_warns_once(path, lambda: flashgen.attention(*inputs()))


def test_locked_database_warns_once_and_attention_works(locked: Path) -> None:
    d = flashgen.Dispatcher(db=[locked, shipped_db_path()])
    attention_warns_once(locked, lambda: flashgen.attention(*inputs(), dispatcher=d))


def test_good_database_serves_its_winner_without_a_warning(tmp_path: Path) -> None:
    path = flashgen_db(tmp_path / "good.db")
    d = flashgen.Dispatcher(db=[path, shipped_db_path()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choice = flashgen.explain(*inputs(), dispatcher=d)
    assert str(path) in (choice.source or ""), choice


# ---- item 8: bf16 under the interpreter -----------------------------------------------------


def test_bf16_on_the_interpreter_is_refused() -> None:
    q, k, v = inputs(torch.bfloat16)
    for call in (lambda: flashgen.attention(q, k, v),
                 lambda: flashgen.scaled_dot_product_attention(q, k, v),
                 lambda: flashgen.explain(q, k, v)):
        with pytest.raises(TypeError, match=r"bf16.*GPU.*float16"):
            call()


def test_another_device_is_named_with_both_ways_to_run() -> None:
    """A tensor on a device flashgen has no kernels for (meta, here): the error names it and
    both ways that do run, the GPU and the CPU under the interpreter (it said GPU only)."""
    q = torch.empty(1, 2, 32, 16, device="meta")
    with pytest.raises(ValueError, match=r"unsupported device meta.*CUDA GPU.*TRITON_INTERPRET"):
        flashgen.attention(q, q, q)


# ---- item 9: scale and causal ---------------------------------------------------------------


@pytest.mark.parametrize(("scale", "error", "needle"), [
    ("a", TypeError, "scale must be"), (True, TypeError, "scale must be"),
    (math.nan, ValueError, "finite"), (math.inf, ValueError, "finite"),
    (-math.inf, ValueError, "finite"), (0.0, ValueError, "nonzero"), (0, ValueError, "nonzero"),
    (-0.01, ValueError, "positive"), (-1, ValueError, "positive"),
])
def test_bad_scale_is_a_named_error(scale: object, error: type[Exception], needle: str) -> None:
    q, k, v = inputs()
    with pytest.raises(error, match=needle):
        flashgen.attention(q, k, v, scale=scale)  # type: ignore[arg-type]
    with pytest.raises(error, match=needle):
        flashgen.scaled_dot_product_attention(q, k, v, scale=scale)  # type: ignore[arg-type]


def test_negative_scale_is_refused_by_every_call() -> None:
    """A negative scale turned the kernels' running max into a min (NaN rows); every public
    call names it instead."""
    q, k, v = inputs()
    seqlens = torch.full((q.shape[0],), k.shape[2], dtype=torch.int32)
    cu = torch.tensor([0, q.shape[2]], dtype=torch.int32)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    for call in (lambda: flashgen.attention(q, k, v, causal=True, scale=-0.5),
                 lambda: flashgen.attention_with_kvcache(q[:, :, :1], k, v, seqlens, scale=-0.5),
                 lambda: flashgen.attention_varlen(*packed, cu, cu, q.shape[2], q.shape[2],
                                                   scale=-0.5)):
        with pytest.raises(ValueError, match="positive"):
            call()


def test_zero_heads_is_a_named_error() -> None:
    q, k, v = inputs()
    with pytest.raises(ValueError, match="no heads"):
        flashgen.attention(q, k[:, :0], v[:, :0])
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    cu = torch.tensor([0, q.shape[2]], dtype=torch.int32)
    with pytest.raises(ValueError, match="no heads"):
        flashgen.attention_varlen(packed[0][:, :0], packed[1][:, :0], packed[2][:, :0], cu, cu,
                                  q.shape[2], q.shape[2])


@pytest.mark.parametrize("causal", ["yes", 1, None, torch.tensor(True)])
def test_non_bool_causal_is_a_type_error(causal: object) -> None:
    q, k, v = inputs()
    for call in (lambda: flashgen.attention(q, k, v, causal=causal),  # type: ignore[arg-type]
                 lambda: flashgen.scaled_dot_product_attention(
                     q, k, v, is_causal=causal),  # type: ignore[arg-type]
                 lambda: flashgen.explain(q, k, v, causal=causal)):  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="causal must be a bool"):
            call()


def test_good_scales_still_run() -> None:
    q, k, v = inputs()
    for scale in (0.5, 2, 0.125):
        want = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), scale=float(scale)).float()
        torch.testing.assert_close(flashgen.attention(q, k, v, scale=scale), want,
                                   atol=1e-4, rtol=1e-4)


def test_interpreter_set_after_triton_was_imported_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_INTERPRET=1 set after something imported triton leaves Triton's helpers built
    for the GPU, and every kernel failed deep inside the interpreter; now a named error."""
    import types

    from flashgen.runtime.inputs import check_runnable

    class JITFunction:  # what triton.language.standard's helpers are without the interpreter
        pass

    fake = types.ModuleType("triton.language.standard")
    fake.zeros_like = JITFunction()  # type: ignore[attr-defined]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(__import__("sys").modules, "triton.language.standard", fake)
    with pytest.raises(ValueError, match="after triton had been imported"):
        check_runnable(torch.device("cpu"), torch.float32)
