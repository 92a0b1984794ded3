"""Deterministic backward: under `torch.use_deterministic_algorithms(True)` dispatch serves only
backward entries whose gradients are bitwise equal run to run (the separate dQ kernel), from
flashgen's tables and exported ones alike; an explicit atomic `bwd_variant=` is a named error;
`tune --deterministic` searches only deterministic variants. CPU tests run the interpreter on
tiny shapes; the `gpu` ones check bitwise-equal gradients at real sizes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import flashgen
import flashgen.runtime.dispatch as dispatch
from flashgen.cli import app
from flashgen.export.package import build_table
from flashgen.export.rows import select_winners
from flashgen.kernels.bwd_space import all_bwd_points, default_bwd_variant
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.hardware import INTERPRETER, DeviceInfo
from flashgen.runtime.backward import why_nondeterministic
from flashgen.store.db import TuningDB
from flashgen.store.keys import TuningKey, Versions
from flashgen.store.table import DETERMINISTIC_ROLE
from flashgen.tune.check import make_inputs
from flashgen.tune.grads import compare_grads
from flashgen.tune.search import TuneOptions, tune_problem
from flashgen.tune.timing import Timing

P64 = flashgen.Problem(1, 2, 1, 64, 64, 32, "fp32", True)
ATOMIC = BwdVariant(32, 32, 2, 1, "atomic")  # the key's winner: the fastest trial
SEPARATE = BwdVariant(16, 32, 2, 1, "separate")  # its fastest deterministic trial
SLOWER = BwdVariant(32, 32, 2, 1, "separate")  # deterministic, but slower
H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 232448)


@pytest.fixture
def deterministic() -> Iterator[None]:
    """Deterministic algorithms on for the test, and the caller's setting back after it."""
    was, warn_only = (torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def _store(path: Path, problem: flashgen.Problem, rows: list[tuple[BwdVariant, float]],
           device: DeviceInfo = INTERPRETER) -> None:
    """`rows` (variant, TFLOP/s) as ok backward trials of `problem`'s key, and its winner."""
    with TuningDB(path) as db:
        key = TuningKey.for_problem(problem, device, "bwd")
        for variant, tflops in rows:
            ms = 1.0 / tflops
            db.record_trial(key, problem, variant, "ok", timing=Timing(ms, ms, ms, 5),
                            tflops=tflops)
        db.update_winner(key)


def _mixed(tmp_path: Path) -> Path:
    db = tmp_path / "t.db"
    _store(db, P64, [(SLOWER, 1.0), (ATOMIC, 3.0), (SEPARATE, 2.0)])
    return db


def test_the_runtime_and_the_variant_agree_on_determinism() -> None:
    # The runtime reads plain dicts (exports carry no BwdVariant): both rules must agree.
    for v in all_bwd_points():
        assert (why_nondeterministic({"variant": v.to_dict()}) is None) == v.deterministic
    assert v.deterministic == (v.dq_mode == "separate")
    # An entry whose twin (what runs on inputs TMA cannot address) is atomic is not either.
    assert why_nondeterministic({"variant": SEPARATE.to_dict(), "twin": ATOMIC.to_dict()})


@pytest.mark.interpreter
def test_deterministic_mode_serves_the_fastest_deterministic_trial(
        tmp_path: Path, deterministic: None) -> None:
    d = flashgen.Dispatcher(_mixed(tmp_path))
    choice = d.choose_bwd(P64, INTERPRETER)
    assert (choice.variant, choice.how) == (SEPARATE, "exact")
    assert DETERMINISTIC_ROLE in choice.reason and "atomic" in choice.reason
    assert DETERMINISTIC_ROLE in choice.source
    # Off: the winner, atomic.
    torch.use_deterministic_algorithms(False)
    assert d.choose_bwd(P64, INTERPRETER).variant == ATOMIC
    # The forward is deterministic in every variant: its choice does not change.
    assert d.choose(P64, INTERPRETER).how == "fallback"


@pytest.mark.interpreter
def test_with_no_deterministic_trial_the_default_serves(tmp_path: Path,
                                                        deterministic: None) -> None:
    db = tmp_path / "t.db"
    _store(db, P64, [(ATOMIC, 3.0)])
    choice = flashgen.Dispatcher(db).choose_bwd(P64, INTERPRETER)
    assert choice.how == "fallback" and "deterministic algorithms are on" in choice.reason
    assert choice.variant == default_bwd_variant(P64, INTERPRETER)


@pytest.mark.interpreter
def test_toggling_mid_process_is_honoured_and_gradients_stay_right(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deterministic: None) -> None:
    monkeypatch.setattr(dispatch, "_default", flashgen.Dispatcher(_mixed(tmp_path)))
    ran: list[BwdVariant] = []
    real = dispatch.prepare_backward

    def recording(entry: dict, *args: object) -> object:
        ran.append(BwdVariant.from_dict(entry["variant"]))
        return real(entry, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(dispatch, "prepare_backward", recording)
    q, k, v = make_inputs(1, 2, 1, 40, 64, 32, torch.float32, seed=5)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    runs = []
    for on in (True, False, True):  # the same shape each time: the plan cache must not hide it
        torch.use_deterministic_algorithms(on)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        flashgen.attention(*leaves, causal=True).backward(do)
        runs.append(tuple(t.grad for t in leaves))
    assert ran == [SEPARATE, ATOMIC]  # the third call reused the first one's plan
    for grads in runs[:2]:
        result = compare_grads(grads, q, k, v, do, causal=True)  # type: ignore[arg-type]
        assert result.ok, result.reason
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[2], strict=True))


@pytest.mark.interpreter
def test_an_explicit_atomic_variant_is_refused_in_deterministic_mode(
        tmp_path: Path, deterministic: None) -> None:
    d = flashgen.Dispatcher(tmp_path / "none.db")
    q, k, v = make_inputs(1, 2, 1, 64, 64, 32, torch.float32)
    with pytest.raises(RuntimeError, match=r"does not have a deterministic implementation.*"
                                           r"dq_mode 'atomic'"):
        d.explain(q, k, v, causal=True, bwd_variant=ATOMIC)
    assert d.explain(q, k, v, causal=True, bwd_variant=SEPARATE).backward.variant == SEPARATE
    torch.use_deterministic_algorithms(True, warn_only=True)  # as torch's ops: a warning
    with pytest.warns(UserWarning, match="does not have a deterministic implementation"):
        picked = d.explain(q, k, v, causal=True, bwd_variant=ATOMIC)
    assert picked.backward.variant == ATOMIC
    torch.use_deterministic_algorithms(False)
    assert d.explain(q, k, v, causal=True, bwd_variant=ATOMIC).backward.variant == ATOMIC


def test_the_export_table_carries_the_deterministic_alternate(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    p = P64.with_(dtype="bf16", seq_q=256, seq_k=256)
    _store(db, p, [(SLOWER, 1.0), (ATOMIC, 3.0), (SEPARATE, 2.0)], device=H200)
    table, _ = build_table(select_winners([db]))
    entries = table["gpus"]["NVIDIA H200"]["bwd"]
    assert [(e["variant"], e.get("role")) for e in entries] == [
        (ATOMIC.to_dict(), None), (SEPARATE.to_dict(), DETERMINISTIC_ROLE)]
    assert entries[1]["kernels"] and entries[1]["need"]
    json.dumps(table)  # table.json holds it as written


@pytest.mark.interpreter
def test_an_exported_package_serves_the_alternate_in_deterministic_mode(
        tmp_path: Path, deterministic: None) -> None:
    import importlib
    import sys

    _mixed(tmp_path)
    exported = CliRunner().invoke(app, ["export", "--db", str(tmp_path / "t.db"), "--out",
                                        str(tmp_path), "--name", "fgk_det"])
    assert exported.exit_code == 0, exported.output
    sys.path.insert(0, str(tmp_path))
    try:
        package = importlib.import_module("fgk_det")
    finally:
        sys.path.remove(str(tmp_path))
    q, k, v = make_inputs(1, 2, 1, 64, 64, 32, torch.float32)
    served = package.explain(q, k, v, causal=True).backward
    assert served.variant == SEPARATE.to_dict() and DETERMINISTIC_ROLE in served.reason
    torch.use_deterministic_algorithms(False)
    assert package.explain(q, k, v, causal=True).backward.variant == ATOMIC.to_dict()


def test_show_says_whether_a_winner_is_deterministic(tmp_path: Path) -> None:
    db = _mixed(tmp_path)
    _store(db, P64.with_(causal=False), [(SEPARATE, 1.0)])
    shown = CliRunner().invoke(app, ["show", "--db", str(db), "--json"])
    assert shown.exit_code == 0, shown.output
    rows = json.loads(shown.output)
    assert sorted((r["variant"]["dq_mode"], r["deterministic"]) for r in rows) == [
        ("atomic", False), ("separate", True)]


def test_slim_keeps_the_deterministic_alternate(tmp_path: Path) -> None:
    from flashgen.store.slim import slim

    report = slim(_mixed(tmp_path), tmp_path / "slim.db", provenance="test")
    assert (report.winners, report.trials) == (1, 2)  # the slower separate trial is cut
    with TuningDB.open_readonly(tmp_path / "slim.db") as db:
        (winner,) = db.all_winners()
        alternate = db.fastest_deterministic(winner)
    assert winner.variant == ATOMIC and alternate is not None and alternate.variant == SEPARATE


def test_tuning_deterministic_measures_only_deterministic_variants(tmp_path: Path) -> None:
    """A fake bench (the selection logic alone): an atomic row stored earlier is neither
    resumed into the run's best nor measured again; every point measured is separate."""

    class Bench:
        def __init__(self) -> None:
            self.measured: list[BwdVariant] = []

        def compile(self, variants: list[BwdVariant]) -> dict:
            return {}

        def measure(self, variant: BwdVariant) -> object:
            from flashgen.tune.fwd_bench import Measurement

            self.measured.append(variant)
            ms = 1.0 if variant.dq_mode == "atomic" else 2.0 + variant.block_owned / 1000
            return Measurement("ok", timing=Timing(ms, ms, ms, 5), tflops=1 / ms)

        def baseline(self) -> None:
            return None

    p = flashgen.Problem(1, 2, 1, 64, 64, 32)
    versions = Versions("3.6.0", "2.13.0")
    bench = Bench()
    with TuningDB(tmp_path / "t.db") as db:
        key = TuningKey.for_problem(p, INTERPRETER, "bwd", versions)
        db.record_trial(key, p, ATOMIC, "ok", timing=Timing(0.5, 0.5, 0.5, 5), tflops=2.0)
        result = tune_problem(p, bench, db, INTERPRETER,  # type: ignore[arg-type]
                              TuneOptions("bwd", trials=6, deterministic=True),
                              versions=versions)
        assert result.measured == 6 and result.resumed == 0
        assert bench.measured and all(v.deterministic for v in bench.measured)
        assert result.best is not None and result.best.deterministic
        # The key's winner is still its fastest row; the table follows it with the best
        # deterministic one.
        assert result.winner is not None and result.winner.variant == ATOMIC
        alternate = db.fastest_deterministic(result.winner)
        assert alternate is not None and alternate.variant == result.best


@pytest.mark.interpreter
def test_tune_deterministic_on_the_cli_records_only_separate_variants(tmp_path: Path) -> None:
    help_text = CliRunner().invoke(app, ["tune", "--help"]).output
    assert "--deterministic" in help_text and "forward is deterministic" in help_text
    db = tmp_path / "t.db"
    result = CliRunner().invoke(app, [
        "tune", "--device", "cpu", "--mode", "bwd", "--deterministic", "--dtype", "fp32",
        "--shape", "1,2,1,16,16,16", "--trials", "3", "--db", str(db)])
    assert result.exit_code == 0, result.output
    with TuningDB(db) as database:
        rows = database.trials()
    assert any(r.status == "ok" for r in rows)
    assert {r.variant["dq_mode"] for r in rows} == {"separate"}


# ---- on the GPU: bitwise-equal gradients ------------------------------------------------------

GPU_SHAPES = [  # B, Hq, Hkv, N, D
    (2, 8, 8, 1024, 64), (2, 8, 8, 1024, 128), (2, 8, 2, 1024, 128)]


def _grads_twice(d: flashgen.Dispatcher, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 do: torch.Tensor, bwd_variant: BwdVariant | None = None
                 ) -> list[tuple[torch.Tensor, ...]]:
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = flashgen.attention(*leaves, causal=True, bwd_variant=bwd_variant, dispatcher=d)
    return [torch.autograd.grad(out, leaves, do, retain_graph=True) for _ in range(2)]


@pytest.mark.gpu
@pytest.mark.parametrize(("b", "hq", "hkv", "n", "dim"), GPU_SHAPES)
def test_gpu_deterministic_gradients_are_bitwise_equal(
        tmp_path: Path, deterministic: None, b: int, hq: int, hkv: int, n: int,
        dim: int) -> None:
    """Served from a database whose winner is atomic: deterministic mode runs its
    deterministic trial, twice with bitwise-equal dq, dk, dv, and both are right."""
    from flashgen.kernels.hardware import device_info

    dev = device_info(torch.device("cuda"))
    p = flashgen.Problem(b, hq, hkv, n, n, dim, "bf16", True)
    db = tmp_path / "t.db"
    separate = default_bwd_variant(p, dev, fa3=False)
    _store(db, p, [(BwdVariant(64, 128, 8, 2, "atomic"), 3.0), (separate, 2.0)], device=dev)
    d = flashgen.Dispatcher(db)
    q, k, v = make_inputs(b, hq, hkv, n, n, dim, torch.bfloat16, seed=0, device="cuda")
    do = torch.randn_like(q)
    chosen = flashgen.explain(q, k, v, causal=True, dispatcher=d).backward
    assert chosen is not None and chosen.variant == separate and chosen.variant.deterministic
    first, second = _grads_twice(d, q, k, v, do)
    for name, a, c in zip(("dq", "dk", "dv"), first, second, strict=True):
        assert torch.equal(a, c), f"{name} differs between two deterministic runs"
    torch.use_deterministic_algorithms(False)  # the reference's matmuls need cuBLAS freely
    assert compare_grads(first, q, k, v, do, causal=True).ok  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize(("b", "hq", "hkv", "n", "dim"), GPU_SHAPES)
def test_gpu_every_portfolio_variant_is_bitwise_deterministic(
        deterministic: None, b: int, hq: int, hkv: int, n: int, dim: int) -> None:
    """The shipped dispatch and, on Hopper, every deterministic portfolio variant (Gluon
    kernels included) give bitwise-equal gradients twice; an atomic one is refused."""
    from flashgen.kernels.bwd_space import bwd_portfolio
    from flashgen.kernels.hardware import device_info

    dev = device_info(torch.device("cuda"))
    p = flashgen.Problem(b, hq, hkv, n, n, dim, "bf16", True)
    d = flashgen.Dispatcher()
    q, k, v = make_inputs(b, hq, hkv, n, n, dim, torch.bfloat16, seed=1, device="cuda")
    do = torch.randn_like(q)
    served = flashgen.explain(q, k, v, causal=True, dispatcher=d).backward
    assert served is not None and served.variant.deterministic
    for variant in [None, *bwd_portfolio(p, dev)]:
        if variant is not None and not variant.deterministic:
            with pytest.raises(RuntimeError, match="deterministic"):
                _grads_twice(d, q, k, v, do, variant)
            continue
        first, second = _grads_twice(d, q, k, v, do, variant)
        for name, a, c in zip(("dq", "dk", "dv"), first, second, strict=True):
            assert torch.equal(a, c), f"{variant or served.variant}: {name} differs"
