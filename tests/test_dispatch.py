"""Tuned dispatch on the CPU: lookup, buckets, fallback, explain, precedence, torch.compile."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen.kernels.hardware import INTERPRETER, DeviceInfo
from flashgen.store.db import TuningDB
from flashgen.store.keys import TuningKey, Versions
from flashgen.tune.check import compare, make_inputs
from flashgen.tune.timing import Timing

pytestmark = pytest.mark.interpreter


def _store(
    path: Path,
    problem: flashgen.Problem,
    variant: flashgen.Variant,
    versions: Versions | None = None,
    tflops: float = 1.0,
) -> None:
    with TuningDB(path) as db:
        key = TuningKey.for_problem(problem, INTERPRETER, versions=versions)
        db.record_trial(key, problem, variant, "ok", timing=Timing(1.0, 0.9, 1.1, 5), tflops=tflops)
        db.update_winner(key)


P64 = flashgen.Problem(1, 2, 1, 64, 64, 32, "fp32", True)
WINNER = flashgen.Variant("fa1", 32, 16, 2, 1)


def test_exact_hit_runs_the_winner(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    _store(db, P64, WINNER)
    d = flashgen.Dispatcher(db)
    q, k, v = make_inputs(1, 2, 1, 50, 60, 32, torch.float32, seed=1)  # buckets (64, 64)
    choice = d.explain(q, k, v, causal=True)
    assert (choice.variant, choice.how) == (WINNER, "exact")
    assert str(db) in choice.source and "trial" in choice.source
    out = flashgen.attention(q, k, v, causal=True, dispatcher=d)
    assert compare(out, q, k, v, causal=True).ok


def test_nearest_bucket_if_valid_else_fallback(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    _store(db, P64, WINNER)
    d = flashgen.Dispatcher(db)
    q, k, v = make_inputs(1, 2, 1, 100, 120, 32, torch.float32)  # buckets (128, 128)
    choice = d.explain(q, k, v, causal=True)
    assert (choice.variant, choice.how) == (WINNER, "nearest")
    # block_m 32 is longer than 9 queries need: the tuned variant is invalid, so the default.
    q, k, v = make_inputs(1, 2, 1, 9, 9, 32, torch.float32)
    choice = d.explain(q, k, v, causal=True)
    assert choice.how == "fallback" and "block_m 32" in choice.reason
    assert choice.variant == flashgen.default_variant(
        flashgen.Problem.from_tensors(q, k, v, True), INTERPRETER
    )
    # Another family (not causal) has nothing tuned.
    q, k, v = make_inputs(1, 2, 1, 64, 64, 32, torch.float32)
    assert d.explain(q, k, v, causal=False).how == "fallback"


def test_whole_heads_winner_is_passed_over_for_a_small_batch(tmp_path: Path) -> None:
    # A head_units winner tuned at 1024 heads keeps its 132 programs busy; at 8 heads it
    # would keep 8 busy where pairs keep 16, so dispatch takes the next valid winner.
    hopper = DeviceInfo("H-test", (9, 0), 132, 232448)
    big = flashgen.Problem(32, 32, 32, 512, 512, 64, "fp16", True)
    heads = flashgen.Variant("fa3", 128, 128, 4, 3, programs_per_sm=1, head_units=True)
    pairs = flashgen.Variant("fa3", 128, 128, 4, 3, programs_per_sm=1)
    db = tmp_path / "t.db"
    with TuningDB(db) as store:
        for problem, variant in ((big, heads), (big.with_(seq_q=1024, seq_k=1024), pairs)):
            key = TuningKey.for_problem(problem, hopper)
            store.record_trial(key, problem, variant, "ok", timing=Timing(1.0, 0.9, 1.1, 5),
                               tflops=1.0)
            store.update_winner(key)
    d = flashgen.Dispatcher(db)
    assert (d.choose(big, hopper).variant, d.choose(big, hopper).how) == (heads, "exact")
    small = d.choose(big.with_(batch=1, heads_q=8, heads_kv=8), hopper)
    assert (small.variant, small.how) == (pairs, "nearest")


def test_stale_versions_are_never_served(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    _store(db, P64, WINNER, Versions("0.0.1", "2.0"))
    q, k, v = make_inputs(1, 2, 1, 64, 64, 32, torch.float32)
    assert flashgen.Dispatcher(db).explain(q, k, v, causal=True).how == "fallback"


def test_user_database_takes_precedence(tmp_path: Path) -> None:
    user, shipped = tmp_path / "user.db", tmp_path / "shipped.db"
    _store(shipped, P64, flashgen.Variant("fa2", 16, 16, 2, 1))
    _store(user, P64, WINNER)
    q, k, v = make_inputs(1, 2, 1, 64, 64, 32, torch.float32)
    assert flashgen.Dispatcher([user, shipped]).explain(q, k, v, causal=True).variant == WINNER
    only_shipped = flashgen.Dispatcher([tmp_path / "missing.db", shipped])
    assert only_shipped.explain(q, k, v, causal=True).source.startswith(str(shipped))


def test_a_row_whose_kernel_changed_gives_way_and_is_checked_once(tmp_path: Path) -> None:
    # `kernel_is_current` is asked once per row, when it is first considered; a stale row
    # gives way to the next one of its bucket (here the shipped database's).
    user, shipped = tmp_path / "user.db", tmp_path / "shipped.db"
    other = flashgen.Variant("fa2", 16, 16, 2, 1)
    _store(shipped, P64, other)
    _store(user, P64, WINNER)
    asked: list[str] = []

    class Checking(flashgen.Dispatcher):
        def kernel_is_current(self, mode: str, entry: object) -> str | None:
            asked.append(entry["source"])  # type: ignore[index]
            stale = entry["variant"] == WINNER.to_dict()  # type: ignore[index]
            return "its kernel has changed since it was tuned" if stale else None

    d = Checking([user, shipped])
    for n in (64, 50, 49):
        q, k, v = make_inputs(1, 2, 1, n, n, 32, torch.float32)
        choice = d.explain(q, k, v, causal=True)
        assert (choice.variant, choice.how) == (other, "exact")
        assert choice.source.startswith(str(shipped))
    assert [a.split(" ")[0] for a in asked] == [str(user), str(shipped)]


def test_explain_names_the_file_of_each_stale_row_and_fits_80_columns(tmp_path: Path) -> None:
    # Stale in both databases: each passed-over row says which file it is in, so the user
    # knows which one to re-tune; and the text, long as it is, is folded at 80 columns.
    user, shipped = tmp_path / "user.db", tmp_path / "shipped.db"
    _store(shipped, P64, WINNER)
    _store(user, P64, WINNER)

    class Stale(flashgen.Dispatcher):
        def kernel_is_current(self, mode: str, entry: object) -> str | None:
            return "its kernel has changed since it was tuned (re-tune)"

    q, k, v = make_inputs(1, 2, 1, 64, 64, 32, torch.float32)
    choice = Stale([user, shipped]).explain(q, k, v, causal=True)
    assert choice.how == "fallback"
    assert "Nk64 of user.db: its kernel" in choice.reason
    assert "Nk64 of shipped.db: its kernel" in choice.reason
    text = str(choice)
    assert max(map(len, text.splitlines())) <= 80
    assert " ".join(text.split()) == " ".join(
        f"{choice.variant} ({choice.how}): {choice.reason} backward: {choice.backward}".split())


def test_reload_serves_winners_tuned_after_the_first_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The default dispatcher reads the databases at its first call; a winner stored later
    # (another process tuning) is served once `flashgen.reload()` has dropped its tables.
    db = tmp_path / "live.db"
    monkeypatch.setenv("FLASHGEN_DB", str(db))
    q, k, v = make_inputs(1, 2, 1, 64, 64, 32, torch.float32)
    flashgen.reload()
    try:
        assert flashgen.explain(q, k, v, causal=True).how == "fallback"
        _store(db, P64, WINNER)
        assert flashgen.explain(q, k, v, causal=True).how == "fallback"  # read once
        flashgen.reload()
        found = flashgen.explain(q, k, v, causal=True)
        assert (found.variant, found.how) == (WINNER, "exact")
        assert found.source is not None and found.source.startswith(str(db))
    finally:
        monkeypatch.undo()
        flashgen.reload()  # later tests get a dispatcher of the suite's own databases


def test_no_entries_logs_one_suggestion(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = flashgen.Dispatcher(tmp_path / "none.db")
    q, k, v = make_inputs(1, 1, 1, 16, 16, 16, torch.float32)
    with caplog.at_level(logging.WARNING, logger="flashgen"):
        d.explain(q, k, v)
        d.explain(q, k, v, causal=True)
    assert sum("flashgen tune" in r.message for r in caplog.records) == 1


class _Unbuildable:
    """A kernel Triton cannot build here: its launch fails as a compile error does."""

    def __getitem__(self, grid: object) -> object:
        def launch(*args: object, **kwargs: object) -> None:
            raise RuntimeError("PassManager::run failed")

        return launch


def test_a_kernel_that_fails_to_compile_gives_way_to_the_portable_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A chosen kernel (a winner, or an untuned GPU's default) that does not compile must not
    fail the call: the portable default runs, with one warning. Explicit variants raise."""
    import flashgen.serve as serve

    db = tmp_path / "t.db"
    _store(db, P64, WINNER)
    real = serve.load_kernel
    monkeypatch.setattr(serve, "load_kernel",
                        lambda v, p: _Unbuildable() if v == WINNER else real(v, p))
    d = flashgen.Dispatcher(db)
    with caplog.at_level(logging.WARNING, logger="flashgen"):
        for n in (64, 64, 50):  # the same shape again, then another length of the kernel
            q, k, v = make_inputs(1, 2, 1, n, n, 32, torch.float32, seed=n)
            out, _ = d.forward(q, k, v, causal=True)
            assert compare(out, q, k, v, causal=True).ok
    warnings = [r.message for r in caplog.records if "failed" in r.message]
    assert len(warnings) == 1, warnings
    portable = flashgen.default_variant(P64, INTERPRETER, fa3=False)
    assert str(WINNER) in warnings[0] and f"portable default {portable}" in warnings[0]
    assert "PassManager::run failed" in warnings[0]
    assert d.explain(q, k, v, causal=True).how == "fallback"  # explain says what runs
    with pytest.raises(RuntimeError, match="PassManager"):
        d.forward(q, k, v, causal=True, variant=WINNER)


def test_the_tune_hint_fits_the_device(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The untuned-device hint once said `--gpu 0 --preset fa-bench` on the CPU interpreter
    too, which fails there: it names `--device cpu` and the call's own shape on the
    interpreter, a GPU index on a GPU."""
    problem = flashgen.Problem(1, 2, 1, 16, 24, 16, "fp32", True)
    with caplog.at_level(logging.WARNING, logger="flashgen"):
        flashgen.Dispatcher(tmp_path / "none.db").choose(problem, INTERPRETER)
        flashgen.Dispatcher(tmp_path / "none.db").choose(
            problem, DeviceInfo("A-test", (8, 0), 108, 166912))
    cpu, gpu = (r.message for r in caplog.records)
    assert ("`flashgen tune --device cpu --shape 1,2,1,16,24,16 --dtype fp32 --causal yes "
            "--mode both`") in cpu
    assert "--gpu" not in cpu and "--preset" not in cpu
    assert "flashgen tune --gpu 0 --shape 1,2,1,16,24,16" in gpu and "--device cpu" not in gpu
    # The command on a line of its own, to be copied whole; the prose lines fit 80 columns
    # (the places and the command may not, and are not folded).
    for message in (cpu, gpu):
        lines = message.splitlines()
        assert [line for line in lines if line.strip().startswith("`flashgen tune")]
        assert all(len(line) <= 80 for line in lines if "`" not in line and "/" not in line)


def test_lookup_reads_sqlite_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "t.db"
    _store(db, P64, WINNER)
    d = flashgen.Dispatcher(db)
    q, k, v = make_inputs(1, 2, 1, 64, 64, 32, torch.float32)
    flashgen.attention(q, k, v, causal=True, dispatcher=d)

    def no_sql(*a: object, **kw: object) -> None:
        raise AssertionError("SQL on the call path")

    monkeypatch.setattr(TuningDB, "open_readonly", no_sql)
    q2, k2, v2 = make_inputs(1, 2, 1, 40, 40, 32, torch.float32)  # new shape, same device
    flashgen.attention(q2, k2, v2, causal=True, dispatcher=d)
    assert d.explain(q2, k2, v2, causal=True).variant == WINNER


def test_explicit_variant_is_reported() -> None:
    q, k, v = make_inputs(1, 1, 1, 16, 16, 16, torch.float32)
    choice = flashgen.explain(q, k, v, variant=flashgen.Variant("fa2", 16, 16, 2, 1))
    assert choice.how == "explicit"


def test_torch_compile_fullgraph() -> None:
    q, k, v = make_inputs(1, 2, 1, 33, 33, 32, torch.float32, seed=2)

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flashgen.attention(q * 1.0, k, v, causal=True) + 0.0

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    assert compare(out, q, k, v, causal=True).ok
    explained = torch._dynamo.explain(f)(q, k, v)
    assert explained.graph_break_count == 0


def test_torch_compile_takes_explicit_variants_as_their_fields() -> None:
    """Under torch.compile an explicit variant reaches the op as its class name and fields'
    values (torch 2.11's tracer refused a frozen dataclass handed to a constant function):
    the variant runs, a variant of the wrong kind is the eager call's TypeError, and every
    variant class's `__match_args__` (what the tracer reads) names all of its fields."""
    import dataclasses

    from flashgen import BwdVariant, DecodeVariant, Variant

    for cls in (Variant, BwdVariant, DecodeVariant):
        assert cls.__match_args__ == tuple(f.name for f in dataclasses.fields(cls)), cls
    q, k, v = make_inputs(1, 2, 1, 33, 33, 32, torch.float32, seed=2)
    pinned = Variant("fa2", 16, 16, 2, 1)

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flashgen.attention(q, k, v, causal=True, variant=pinned) + 0.0

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(out, flashgen.attention(q, k, v, causal=True, variant=pinned))

    def wrong(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flashgen.attention(q, k, v, variant=BwdVariant())  # type: ignore[arg-type]

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"variant must be a flashgen\.Variant, got BwdVariant"):
        torch.compile(wrong, fullgraph=True, backend="aot_eager")(q, k, v)


def test_sdpa_drop_in_matches_torch() -> None:
    q, k, v = make_inputs(2, 4, 2, 24, 24, 16, torch.float32, seed=4)
    ours = flashgen.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"attn_mask": torch.ones(8, 8, dtype=torch.bool)}, "attn_mask"),
        ({"dropout_p": 0.1}, "dropout_p"),
        ({"enable_gqa": False}, "enable_gqa"),
    ],
)
def test_sdpa_refuses_what_it_cannot_do(kwargs: dict, match: str) -> None:
    q, k, v = make_inputs(1, 2, 1, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match=match):
        flashgen.scaled_dot_product_attention(q, k, v, **kwargs)


def test_sdpa_refuses_top_left_causal_with_unequal_lengths() -> None:
    q, k, v = make_inputs(1, 2, 2, 8, 12, 16, torch.float32)
    with pytest.raises(ValueError, match="is_causal"):
        flashgen.scaled_dot_product_attention(q, k, v, is_causal=True)
