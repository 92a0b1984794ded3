"""The `flashgen` command: help text everywhere, argument errors, and the whole pipeline
(tune -> database -> show) on the CPU interpreter in a fresh process."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from flashgen.cli import app
from flashgen.kernels.fwd_space import default_variant
from flashgen.kernels.hardware import CPU_INTERPRETER, INTERPRETER
from flashgen.kernels.problem import Problem
from flashgen.store.db import TuningDB
from flashgen.store.keys import TuningKey
from flashgen.tune.timing import Timing

runner = CliRunner()


def commands() -> dict[str, Any]:
    # Typer ships its own copy of click, so look at the objects, not at click's classes.
    return dict(typer.main.get_command(app).commands)


def test_every_command_and_option_has_help() -> None:
    group = typer.main.get_command(app)
    assert group.help
    cmds = commands()
    assert {"tune", "show", "presets"} <= set(cmds)
    for name, cmd in cmds.items():
        assert cmd.help and cmd.help.strip(), f"command {name} has no help"
        for param in cmd.params:
            if param.param_type_name == "option":
                assert param.help and param.help.strip(), f"{name} {param.opts} has no help"


@pytest.mark.parametrize("args", [["--help"], ["tune", "--help"], ["show", "--help"],
                                  ["presets", "--help"]])
def test_help_works(args: list[str]) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def test_top_level_help_lists_the_commands() -> None:
    out = runner.invoke(app, ["--help"]).output
    for name in ("tune", "show", "presets"):
        assert name in out


def test_presets_are_listed() -> None:
    result = runner.invoke(app, ["presets"])
    assert result.exit_code == 0
    for name in ("fa-bench", "llama3-8b", "llama3-70b", "mistral-7b"):
        assert name in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["tune", "--device", "cpu"], "--shape or --preset"),
    (["tune", "--device", "cpu", "--shape", "1,2,3"], "B,Hq,Hkv,Nq,Nk,D"),
    (["tune", "--device", "cpu", "--preset", "nope"], "unknown preset"),
    (["tune", "--device", "cpu", "--shape", "1,2,1,8,8,16", "--causal", "sometimes"],
     "--causal"),
    (["tune", "--device", "tpu", "--shape", "1,2,1,8,8,16"], "--device"),
])
def test_bad_arguments_are_explained(args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in result.output


def test_show_without_a_database_says_so(tmp_path: Path) -> None:
    result = runner.invoke(app, ["show", "--db", str(tmp_path / "none.db")])
    assert result.exit_code == 2 and "no tuning database" in result.output


def test_show_leaves_the_database_untouched(tmp_path: Path) -> None:
    """`show` lists a file it may not write (the database shipped in the package, journaled
    DELETE): it used to open it read-write, which switched it to WAL and rewrote its header."""
    db_path = tmp_path / "shipped.db"
    problem = Problem(1, 2, 1, 32, 32, 16)
    with TuningDB(db_path) as db:
        key = TuningKey.for_problem(problem, INTERPRETER, "fwd")
        db.record_trial(key, problem, default_variant(problem, INTERPRETER), "ok",
                        timing=Timing(1.0, 0.9, 1.1, 5), tflops=1.0)
        db.update_winner(key)
    with sqlite3.connect(db_path) as conn:
        conn.execute("PRAGMA journal_mode=DELETE")
    before = db_path.read_bytes()
    db_path.chmod(0o444)
    try:
        result = runner.invoke(app, ["show", "--db", str(db_path), "--json"])
    finally:
        db_path.chmod(0o644)
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.output)) == 1
    assert db_path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shipped.db"]  # no -wal, no -shm


def _flashgen(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flashgen.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.interpreter
def test_tune_then_show_on_the_cpu_interpreter(tmp_path: Path) -> None:
    db_path = tmp_path / "tuning.db"
    # No TRITON_INTERPRET in the environment: `--device cpu` must set it itself.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FLASHGEN_CACHE_DIR"] = str(tmp_path / "cache")
    env["COLUMNS"] = "200"
    tuned = _flashgen("tune", "--device", "cpu", "--shape", "1,2,1,32,32,16", "--trials", "4",
                      "--seed", "1", "--db", str(db_path), env=env)
    assert tuned.returncode == 0, tuned.stderr + tuned.stdout
    assert "B1 Hq2 Hkv1 Nq32 Nk32 D16 fp16 full" in tuned.stdout
    assert "(cpu)" in tuned.stdout  # the SDPA column has the CPU baseline

    with TuningDB(db_path) as db:
        rows = db.trials()
        measured = [r for r in rows if r.status != "pruned"]
        assert len(measured) == 4
        assert all(r.status == "ok" and r.error <= r.bound for r in measured)
        assert all(r.key.gpu_name == CPU_INTERPRETER and r.key.mode == "fwd" for r in rows)

    shown = _flashgen("show", "--json", env={**env, "FLASHGEN_DB": str(db_path)})
    assert shown.returncode == 0, shown.stderr
    winners = json.loads(shown.stdout)
    assert len(winners) == 1
    w = winners[0]
    assert (w["gpu_name"], w["head_dim"], w["gqa"], w["seq_q_bucket"]) == (
        CPU_INTERPRETER, 16, 2, 32)
    assert w["current"] is True and w["tflops"] > 0 and w["sdpa_backend"] == "cpu"
    assert w["variant"]["loop_order"] in ("fa1", "fa2")

    table = _flashgen("show", "--db", str(db_path), env=env)
    assert table.returncode == 0 and "cpu-interpreter" in table.stdout

    # A second run resumes: the four measured variants are not measured again.
    again = _flashgen("tune", "--device", "cpu", "--shape", "1,2,1,32,32,16", "--trials", "1",
                      "--seed", "1", "--db", str(db_path), env=env)
    assert again.returncode == 0, again.stderr
    with TuningDB(db_path) as db:
        assert len([r for r in db.trials() if r.status != "pruned"]) == 5


@pytest.mark.interpreter
def test_tune_both_modes_then_show_lists_fwd_and_bwd(tmp_path: Path) -> None:
    db_path = tmp_path / "tuning.db"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FLASHGEN_CACHE_DIR"] = str(tmp_path / "cache")
    env["COLUMNS"] = "200"
    tuned = _flashgen("tune", "--device", "cpu", "--mode", "both", "--shape", "1,2,1,32,32,16",
                      "--trials", "3", "--db", str(db_path), env=env)
    assert tuned.returncode == 0, tuned.stderr + tuned.stdout
    assert " fwd " in tuned.stdout and " bwd " in tuned.stdout  # the summary's mode column

    with TuningDB(db_path) as db:
        measured = [r for r in db.trials() if r.status != "pruned"]
        assert sorted(r.key.mode for r in measured) == ["bwd"] * 3 + ["fwd"] * 3
        assert all(r.status == "ok" and r.error <= r.bound for r in measured)
        written = len(db.trials())

    shown = _flashgen("show", "--json", "--db", str(db_path), env=env)
    assert shown.returncode == 0, shown.stderr
    winners = {w["mode"]: w for w in json.loads(shown.stdout)}
    assert set(winners) == {"fwd", "bwd"}
    assert all(w["current"] and w["tflops"] > 0 for w in winners.values())
    assert winners["bwd"]["variant"]["dq_mode"] in ("separate", "atomic")
    assert winners["fwd"]["kernel_hash"] != winners["bwd"]["kernel_hash"]

    table = _flashgen("show", "--db", str(db_path), env=env)
    assert "bwd fp16 full D16" in table.stdout and "fwd fp16 full D16" in table.stdout

    # The run recorded itself: provenance, in a table that fits 80 columns however wide.
    runs = _flashgen("show", "--runs", "--db", str(db_path), env=env)
    assert runs.returncode == 0, runs.stderr
    assert "cpu-interpreter" in runs.stdout and " trials" in runs.stdout
    assert max(map(len, runs.stdout.splitlines())) <= 80
    (run,) = json.loads(_flashgen("show", "--runs", "--json", "--db", str(db_path),
                                  env=env).stdout)
    assert (run["status"], run["winners"], run["trials"]) == ("ok", 2, written)
    assert run["ended_at"] and "tune --device cpu --mode both" in run["command"]


@pytest.mark.parametrize(("error", "status"), [(KeyboardInterrupt, "interrupted"),
                                               (RuntimeError, "failed")])
def test_a_run_that_stops_early_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        error: type[BaseException], status: str) -> None:
    def stop(*args: object, **kwargs: object) -> None:
        raise error("stopped")

    monkeypatch.setattr("flashgen.tune.tuner.tune_problem", stop)
    db_path = tmp_path / "t.db"
    runner.invoke(app, ["tune", "--device", "cpu", "--shape", "1,2,1,8,8,16", "--trials", "1",
                        "--db", str(db_path)])
    with TuningDB.open_readonly(db_path) as db:
        (run,) = db.runs()
    assert (run.status, run.trials, run.winners) == (status, 0, 0) and run.ended_at


def test_unknown_mode_is_explained() -> None:
    result = runner.invoke(app, ["tune", "--device", "cpu", "--shape", "1,2,1,8,8,16",
                                 "--mode", "sideways"])
    assert result.exit_code == 2 and "--mode" in result.output
