"""The `flashgen` command: help text everywhere, argument errors, and the whole pipeline
(tune -> database -> show) on the CPU interpreter in a fresh process."""

from __future__ import annotations

import csv
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
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.fwd_space import default_variant
from flashgen.kernels.hardware import CPU_INTERPRETER, INTERPRETER, DeviceInfo
from flashgen.kernels.problem import Problem
from flashgen.kernels.variant import Variant
from flashgen.store.db import TuningDB
from flashgen.store.keys import TuningKey, Versions
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
    (["tune", "--device", "cpu", "--shape", "1,2,1,8,8,16", "--dtype", "bf16"], "needs a GPU"),
    (["bench", "--device", "cpu", "--shape", "1,2,1,8,8,16", "--dtype", "bf16"], "needs a GPU"),
    (["tune", "--device", "cpu", "--shape", "1,2,1,8,8,16", "--varlen", "100"],
     "only 8 tokens"),
    (["tune", "--device", "cpu", "--shape", "1,2,1,8,8,16", "--page-size", "16"],
     "--page-size is for --mode decode"),
    (["bench", "--device", "cpu", "--shape", "1,2,1,8,8,16", "--page-size", "16"],
     "--page-size is for --mode decode"),
    (["show", "--db", "/dev/null"], "/dev/null is not a file"),
    (["show", "--runs", "--current"], "--runs lists runs"),
    (["tune", "--device", "cpu", "--shape", "1,2,1,8,8,16", "--timeout", "0"],
     "--timeout must be more than 0"),
    (["tune", "--device", "cpu", "--shape", "1,2,1,8,8,16", "--gpu", "1"],
     "--device cpu runs the Triton interpreter"),
])
def test_bad_arguments_are_explained(args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in result.output


def test_path_options_expand_the_home_folder(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`--db=~/x.db` reaches the command unexpanded by the shell: flashgen expands it, where
    it made a folder named `~` in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["show", "--db=~/x.db"])
    assert str(tmp_path / "home" / "x.db") in result.output
    assert not (tmp_path / "~").exists()


def test_show_without_a_database_says_so(tmp_path: Path) -> None:
    result = runner.invoke(app, ["show", "--db", str(tmp_path / "none.db")])
    assert result.exit_code == 2 and "no tuning database" in result.output


def test_show_names_another_programs_database(tmp_path: Path) -> None:
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE users (id INTEGER)")
    before = other.read_bytes()
    result = runner.invoke(app, ["show", "--db", str(other)])
    assert result.exit_code == 1 and "another program's SQLite database" in result.output
    assert other.read_bytes() == before


def _one_winner(db: TuningDB) -> None:
    """One trial of a tiny problem and its winner, as a tune records them."""
    problem = Problem(1, 2, 1, 32, 32, 16)
    key = TuningKey.for_problem(problem, INTERPRETER, "fwd")
    db.record_trial(key, problem, default_variant(problem, INTERPRETER), "ok",
                    timing=Timing(1.0, 0.9, 1.1, 5), tflops=1.0)
    db.update_winner(key)


def test_show_leaves_the_database_untouched(tmp_path: Path) -> None:
    """`show` lists a file it may not write (the database shipped in the package, journaled
    DELETE): it used to open it read-write, which switched it to WAL and rewrote its header."""
    db_path = tmp_path / "shipped.db"
    with TuningDB(db_path) as db:
        _one_winner(db)
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


def test_reading_a_tuned_file_leaves_nothing_beside_it(tmp_path: Path) -> None:
    """A file flashgen wrote (in WAL mode while open), then read by `show` and `export`: no
    -wal or -shm file appears beside it. A read-only reader of a WAL-mode file creates both
    and cannot remove them, so the last writer leaves the file in rollback-journal mode."""
    db_path = tmp_path / "t.db"
    with TuningDB(db_path) as db:
        _one_winner(db)
        assert db.db.journal_mode == "wal"
    assert runner.invoke(app, ["show", "--db", str(db_path), "--json"]).exit_code == 0
    assert runner.invoke(app, ["export", "--db", str(db_path), "--out",
                               str(tmp_path / "pkg")]).exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["t.db"]


def test_a_writer_closing_leaves_wal_mode_to_the_others_still_open(tmp_path: Path) -> None:
    """Two tuners on one file: the first to close cannot leave WAL mode while the second
    is open (SQLite refuses at once) and the second still writes; the last one does."""
    db_path = tmp_path / "t.db"
    problem = Problem(1, 2, 1, 32, 32, 16)
    key = TuningKey.for_problem(problem, INTERPRETER, "fwd")
    first, second = TuningDB(db_path), TuningDB(db_path)
    first.close()
    assert second.db.journal_mode == "wal"
    second.record_trial(key, problem, default_variant(problem, INTERPRETER), "ok",
                        timing=Timing(1.0, 0.9, 1.1, 5), tflops=1.0)
    second.close()
    with TuningDB.open_readonly(db_path) as db:
        assert db.db.journal_mode == "delete"
        assert db.db.execute("SELECT count(*) FROM trials").fetchone()[0] == 1


def _flashgen(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flashgen.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_tune_with_no_trials_says_nothing_was_measured(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FLASHGEN_CACHE_DIR"] = str(tmp_path / "cache")
    result = _flashgen("tune", "--device", "cpu", "--shape", "1,2,1,16,16,16", "--trials",
                       "0", "--db", str(tmp_path / "t.db"), env=env)
    assert result.returncode == 0, result.stderr
    assert "none measured" in result.stdout and "none passed" not in result.stdout


@pytest.mark.interpreter
def test_tune_then_show_on_the_cpu_interpreter(tmp_path: Path) -> None:
    db_path = tmp_path / "tuning.db"
    # No TRITON_INTERPRET in the environment: `--device cpu` must set it itself.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FLASHGEN_CACHE_DIR"] = str(tmp_path / "cache")
    env["COLUMNS"] = "80"
    tuned = _flashgen("tune", "--device", "cpu", "--shape", "1,2,1,32,32,16", "--trials", "4",
                      "--seed", "1", "--db", str(db_path), env=env)
    assert tuned.returncode == 0, tuned.stderr + tuned.stdout
    assert "fp16 f D16 g2 32 B1 H2" in tuned.stdout  # the problem's short label
    assert "fwd fp16 f D16 g2 32 B1 H2" in tuned.stderr  # and in the progress line
    assert all(len(line) <= 80 for line in tuned.stdout.splitlines())
    assert "…" not in tuned.stdout
    wide = _flashgen("tune", "--device", "cpu", "--shape", "1,2,1,32,32,16", "--trials", "0",
                     "--seed", "1", "--db", str(db_path), "--wide", env=env)
    assert wide.returncode == 0, wide.stderr
    assert "(cpu)" in wide.stdout  # the wide SDPA column names the CPU baseline

    with TuningDB(db_path) as db:
        rows = db.trials()
        measured = [r for r in rows if r.status != "pruned"]
        assert len(measured) == 4
        assert all(r.status == "ok" and r.error <= r.bound for r in measured)
        assert all(r.key.gpu_name == CPU_INTERPRETER and r.key.mode == "fwd" for r in rows)

    shown = _flashgen("show", "--json", env={**env, "FLASHGEN_DB": str(db_path)})
    assert shown.returncode == 0, shown.stderr
    winners = [w for w in json.loads(shown.stdout) if w["source"] == "user"]
    assert len(winners) == 1 and winners[0]["db"] == str(db_path)
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
    # The summary: a table per mode.
    assert "flashgen tune: forward" in tuned.stdout and "flashgen tune: backward" in tuned.stdout

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
    assert "cpu-interpreter · sm00 · forward" in table.stdout
    assert "cpu-interpreter · sm00 · backward" in table.stdout
    assert table.stdout.count("fp16 f D16 g2 32 ") == 2

    # The run recorded itself: provenance, in a table that fits 80 columns however wide.
    runs = _flashgen("show", "--runs", "--db", str(db_path), env=env)
    assert runs.returncode == 0, runs.stderr
    assert "cpu-interpreter" in runs.stdout and " trials" in runs.stdout
    # (The first line names the database file: a path is printed whole, however long.)
    assert max(map(len, runs.stdout.splitlines()[1:])) <= 80
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

    monkeypatch.setattr("flashgen.tune.search.tune_problem", stop)
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


# ---- a new user's first commands, and tables at 80 columns ------------------------------


def test_version() -> None:
    import importlib.metadata

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"flashgen {importlib.metadata.version('flashgen')}"


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["tune", "--help"],
                                  ["show", "--help"], ["bench", "--help"]])
def test_help_and_version_do_not_import_torch(args: list[str]) -> None:
    """`flashgen --help` took 4 s, importing torch before anything else; the imports run
    inside the commands now. -X importtime lists every module the process imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "flashgen.cli", *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert "typer" in imported  # the listing works
    assert not imported & {"torch", "triton", "optuna", "numpy"}


def _winner(db: TuningDB, key: TuningKey, problem: Problem, variant: Any,
            tflops: float = 1.0) -> None:
    db.record_trial(key, problem, variant, "ok", timing=Timing(1.0, 0.9, 1.1, 5), tflops=tflops)
    db.update_winner(key)


def test_show_without_db_lists_the_shipped_winners_and_says_where_each_is_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new user has no database: `show` failed with "no tuning database". It lists what
    dispatch reads, the user database and the shipped one, each row with its database; a
    shipped row whose bucket the user database holds too is marked shadowed."""
    from flashgen.store.table import shipped_db_path

    with TuningDB.open_readonly(shipped_db_path()) as shipped:
        stored = shipped.all_winners()
    assert stored, "the package ships winners"
    fresh = runner.invoke(app, ["show", "--json"])
    assert fresh.exit_code == 0, fresh.output
    rows = json.loads(fresh.stdout)
    assert len(rows) == len(stored)
    assert {(r["source"], r["db"]) for r in rows} == {("shipped", str(shipped_db_path()))}
    assert "no user database" in fresh.stderr

    user = tmp_path / "user.db"
    monkeypatch.setenv("FLASHGEN_DB", str(user))
    first = stored[0]
    with TuningDB(user) as db:
        _winner(db, first.key, first.problem, first.variant, tflops=2.0 * first.tflops)
    rows = json.loads(runner.invoke(app, ["show", "--json"]).stdout)
    assert [r["source"] for r in rows].count("user") == 1
    assert rows[0]["source"] == "user" and rows[0]["db"] == str(user)
    # Dispatch serves the user's row of that bucket: the shipped one is shadowed (where the
    # installed Triton and templates make the rows current at all).
    shadowed = [r for r in rows if r["shadowed"]]
    assert [TuningKey.from_columns(r) for r in shadowed] == (
        [first.key] if rows[0]["current"] else [])
    table = runner.invoke(app, ["show"], env={"COLUMNS": "80"})
    assert table.exit_code == 0, table.output
    assert f"user: {user}" in table.stdout and f"shipped: {shipped_db_path()}" in table.stdout
    assert "user · " in table.stdout and "shipped · " in table.stdout


def test_db_option_is_the_same_on_every_command() -> None:
    """`bench` read only $FLASHGEN_DB; tune, show, bench and export take one --db."""
    options = {}
    for name in ("tune", "show", "bench", "export"):
        found = [p for p in commands()[name].params if "--db" in p.opts]
        assert len(found) == 1, f"{name} has no --db"
        p = found[0]
        options[name] = (tuple(p.opts), p.help, p.default, p.metavar, p.envvar)
    assert len(set(options.values())) == 1, options
    assert "$FLASHGEN_DB" in options["bench"][1]


@pytest.mark.interpreter
def test_bench_dispatches_from_its_db(tmp_path: Path) -> None:
    """`bench --db FILE` serves flashgen's kernels from FILE (then the shipped database)."""
    problem = Problem(1, 2, 1, 32, 32, 16, "fp16", False)
    winner = Variant("fa1", 32, 16, 2, 1)
    db_path = tmp_path / "t.db"
    with TuningDB(db_path) as db:
        _winner(db, TuningKey.for_problem(problem, INTERPRETER, "fwd"), problem, winner)
    args = ["bench", "--device", "cpu", "--shape", "1,2,1,32,32,16", "--causal", "no",
            "--competitors", "flashgen", "--out", str(tmp_path / "out"), "--no-plot"]
    missing = runner.invoke(app, [*args, "--db", str(tmp_path / "none.db")])
    assert missing.exit_code == 2 and "no tuning database" in missing.output
    result = runner.invoke(app, [*args, "--db", str(db_path)])
    assert result.exit_code == 0, result.output
    with (tmp_path / "out" / "bench.csv").open() as f:
        (record,) = list(csv.DictReader(f))
    assert record["note"].startswith(f"fwd {winner} (exact)"), record["note"]


@pytest.mark.interpreter
def test_bench_decode_on_the_cpu_and_what_it_refuses(tmp_path: Path) -> None:
    """`bench --mode decode` through the CLI: flashgen and SDPA's math backend by default on
    the interpreter, a `timer` column in its CSV; options it cannot honour are refused."""
    args = ["bench", "--mode", "decode", "--device", "cpu", "--shape", "1,4,1,1,24,16",
            "--page-size", "0", "--out", str(tmp_path / "out")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    with (tmp_path / "out" / "decode.csv").open() as f:
        records = list(csv.DictReader(f))
    assert [(r["competitor"], r["status"], r["timer"]) for r in records] == [
        ("flashgen", "ok", "cpu"), ("sdpa-math", "ok", "cpu")]
    only = runner.invoke(app, [*args, "--competitors", "flashgen", "--csv",
                               str(tmp_path / "one.csv")])
    assert only.exit_code == 0, only.output
    assert len((tmp_path / "one.csv").read_text().splitlines()) == 2
    for extra, words in [(["--window", "4"], "drop --window"), (["--varlen", "2"], "drop"),
                         (["--competitors", "sdpa-efficient"], "takes competitors among"),
                         (["--dtype", "fp8"], "fp8 is forward only")]:
        refused = runner.invoke(app, [*args, *extra])
        assert refused.exit_code == 2 and words in refused.output, (extra, refused.output)
    mixed = runner.invoke(app, ["bench", "--mode", "fwd,decode", "--device", "cpu",
                                "--shape", "1,4,1,1,24,16"])
    assert mixed.exit_code == 2 and "decode runs alone" in mixed.output
    upper = [a if a != "decode" else " DECODE" for a in args]  # as parse_modes reads modes
    assert runner.invoke(app, [*upper, "--competitors", "flashgen"]).exit_code == 0


def _lines_fit(text: str, rows: int) -> None:
    """Every line within 80 columns, no cell cut short ("…"), and `rows` data rows, one line
    each (a wrapped row would add lines): all lines but titles, headers and rules."""
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    assert "…" not in text, text
    body = [line for line in lines if line.strip()
            and not line.strip().startswith(("flashgen tune:", "db · ", "user · ", "shipped · "))
            and not line.startswith(("kind ", "problem ")) and set(line.strip()) != {"─"}]
    assert len(body) == rows, text


def _render(tables: list[Any]) -> str:
    import io

    from rich.console import Console

    console = Console(width=80, file=io.StringIO(), record=True)
    for table in tables:
        console.print(table)
    return console.export_text()


HOPPER = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448)
#: Long labels and winners of real presets: llama3-70b's GQA at 512 keys, a backward with the
#: Gluon dQ kernel on its own tile, the three-consumer fa3 kernel, and a CPU run's tiny TFLOP/s.
LONG_ROWS: list[tuple[Problem, str, Any, float]] = [
    (Problem(32, 64, 8, 512, 512, 128, "bf16", True), "fwd",
     Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True), 612.3),
    (Problem(1, 32, 32, 16384, 16384, 64, "fp16", False), "fwd",
     Variant("fa3", 192, 128, 4, 3, programs_per_sm=1, pingpong=True), 655.55),
    (Problem(32, 64, 8, 512, 2048, 128, "bf16", True), "bwd",
     BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=128), 312.25),
    (Problem(1, 2, 1, 32, 48, 16, "fp32", False), "bwd", BwdVariant(32, 16, 2, 1, "atomic"),
     1.234e-05),
    # The longest portfolio name: both switches on (short in the narrow table)
    (Problem(16, 64, 8, 1024, 4096, 128, "bf16", True), "bwd",
     BwdVariant(64, 128, 4, 2, fa3="both", fused_delta=True, smem_stats=True), 401.5),
]


def test_tune_tables_fit_80_columns() -> None:
    from flashgen.tune.baseline import Baseline
    from flashgen.tune.report import results_tables
    from flashgen.tune.search import TuneResult

    results = [TuneResult(p, TuningKey.for_problem(p, HOPPER, mode), 50, best=v, best_ms=0.8125,
                          best_tflops=tflops, measured=50, failed=3, pruned=1200, resumed=2,
                          seconds=123.4, baseline=Baseline("cudnn", Timing(0.9, 0.9, 0.9, 5)))
               for p, mode, v, tflops in LONG_ROWS]
    results.append(TuneResult(LONG_ROWS[0][0], results[0].key, 50, measured=4,
                              failed=4))  # nothing passed
    text = _render(results_tables(results))
    _lines_fit(text, len(results))
    for expected in ("bf16 c D128 g8 512 B32 H64", "fp16 f D64 16k B1 H32",
                     "bf16 c D128 g8 512/2k B32 H64", "fa3 m192 n128 w4 s3 p1 pp",
                     "own128x32 w4 s3 fa3-dq dq-x128", "atomic own16x32 w2 s1",
                     "own128x64 s2 fa3 +delta +stats",
                     "612", "656",
                     "312", "1.2e-05", "1.11x", "none passed"):
        assert expected in text, (expected, text)


def test_tune_progress_line_fits_80_columns() -> None:
    import io

    from rich.console import Console
    from rich.progress import Progress

    from flashgen.kernels.presets import problem_label
    from flashgen.tune.report import progress_columns

    console = Console(width=80, file=io.StringIO(), record=True)
    progress = Progress(*progress_columns(), console=console, auto_refresh=False)
    for problem, mode, _, _ in LONG_ROWS:
        task = progress.add_task(f"{mode} {problem_label(problem)}", total=50, best="-",
                                 last="failed: PassManager::run failed")
        progress.update(task, completed=37, best="1.2e-05 TFLOP/s")
    console.print(progress.get_renderable())
    lines = [line for line in console.export_text().splitlines() if line.strip()]
    assert len(lines) == len(LONG_ROWS)  # one line a task, dtype and mask included
    for line, (problem, mode, _, _) in zip(lines, LONG_ROWS, strict=True):
        assert len(line) <= 80 and line.startswith(f"{mode} {problem_label(problem)} ")
        assert "37/50" in line and "best 1.2e-05 TFLOP/s" in line


def test_show_tables_fit_80_columns(tmp_path: Path) -> None:
    """Rows from two GPUs, both modes, a stale row (other templates): at COLUMNS=80 each
    row is one line with nothing cut."""
    db_path = tmp_path / "t.db"
    h200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 232448)
    with TuningDB(db_path) as db:
        for device in (HOPPER, h200):
            for p, mode, v, tflops in LONG_ROWS:
                _winner(db, TuningKey.for_problem(p, device, mode), p, v, tflops)
        p, mode, v, tflops = LONG_ROWS[1]
        old = Versions("3.0.0", "2.4.0")
        _winner(db, TuningKey.for_problem(p.with_(causal=True), HOPPER, mode, old), p, v, 1.5)
    result = runner.invoke(app, ["show", "--db", str(db_path)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    text = result.stdout.split("\n", 1)[1]  # after the line naming the database
    # The rows, one line each, and the two lines of the stale note's legend under its table.
    _lines_fit(text, 2 * len(LONG_ROWS) + 1 + 2)
    assert "db · NVIDIA H100 80GB HBM3 · sm90 · forward" in text and "  stale\n" in text
    assert "stale: not served (tuned with other Triton or torch versions" in text
    assert text.count("stale: not served") == 1  # only under the table that has one
    assert "own128x32 w4 s3 fa3-dq dq-x128" in text and "1.2e-05" in text
    wide = runner.invoke(app, ["show", "--db", str(db_path), "--wide"], env={"COLUMNS": "80"})
    assert "B32 Hq64 Hkv8 Nq512 Nk2048" in wide.stdout and "…" not in wide.stdout


# ---- labels of modified, decode and fp8 problems ----------------------------------------

#: Long labels of the newer kinds: a modified packed backward and a modified fp8 forward
#: over 1000 TFLOP/s (`_new_kind_descriptions` adds a paged decode).
NEW_KIND_ROWS: list[tuple[Problem, str, float]] = [
    (Problem(8, 32, 4, 512, 2048, 128, "bf16", True, window=True, softcap=True, sinks=True,
             varlen=True, mix=4), "bwd", 312.0),
    (Problem(16, 128, 8, 16384, 131072, 256, "fp8", True, window=True, softcap=True,
             sinks=True), "fwd", 1234.4),
]


def _new_kind_descriptions() -> list[tuple[str, float]]:
    from flashgen.kernels.presets import problem_label
    from flashgen.kernels.problem import DecodeProblem

    decode = DecodeProblem(64, 64, 8, 1, 32768, 128, "bf16", True, page_size=16)
    return [(f"{mode} {problem_label(p)}", tflops) for p, mode, tflops in NEW_KIND_ROWS] + [
        (f"decode {problem_label(decode)}", 12.3)]


@pytest.mark.parametrize("wide", [False, True])
def test_progress_lines_of_long_labels_keep_their_counts_at_80_columns(wide: bool) -> None:
    """Labels of modified, decode and fp8 problems run to 40 characters: rich used to squeeze
    every column alike, cutting the counts and the time ("99/…", "0:00…")."""
    import io

    from rich.console import Console
    from rich.progress import Progress

    from flashgen.tune.report import progress_columns, tflops_text

    described = _new_kind_descriptions()
    console = Console(width=80, file=io.StringIO(), record=True)
    longest = max(len(d) for d, _ in described)
    progress = Progress(*progress_columns(wide, longest, 80), console=console,
                        auto_refresh=False)
    for description, tflops in described:
        task = progress.add_task(description, total=100, best=f"{tflops_text(tflops)} TFLOP/s",
                                 last="fa2 m128 n64 w8 s3 nosplit p1: failed (wrong answer)")
        progress.update(task, completed=99)
    console.print(progress.get_renderable())
    lines = [line for line in console.export_text().splitlines() if line.strip()]
    assert len(lines) == len(described), lines  # one line a task
    for line, (description, tflops) in zip(lines, described, strict=True):
        assert len(line) <= 80 and line.startswith(f"{description} "), line
        assert "99/100" in line and f"best {tflops_text(tflops)} TFLOP/s" in line, line
        assert "0:00:00" in line, line
    assert "1.23e+03" not in console.export_text() and tflops_text(1234.4) == "1234"


def test_tables_of_modified_and_decode_problems_explain_their_letters() -> None:
    """'... B8 H32 wksv4' and 'mods:wv16' meant nothing without the code: a caption
    spells out the letters the rows use, within 80 columns."""
    from flashgen.kernels.problem import DecodeProblem
    from flashgen.store.db import WinnerRow
    from flashgen.tune.report import Listed, results_tables, winners_tables
    from flashgen.tune.search import TuneResult

    results = [TuneResult(p, TuningKey.for_problem(p, HOPPER, mode), 50, best=None,
                          best_tflops=tflops) for p, mode, tflops in NEW_KIND_ROWS]
    decode = DecodeProblem(64, 64, 8, 1, 32768, 128, "bf16", True, page_size=16)
    results.append(TuneResult(decode, TuningKey.for_problem(decode, HOPPER, "decode"), 50))
    text = _render(results_tables(results))
    assert all(len(line) <= 80 for line in text.splitlines()), text
    for words in ("w window", "k softcap", "s sinks", "vN varlen", "pN pages of N keys"):
        assert words in text, (words, text)
    plain = _render(results_tables([TuneResult(LONG_ROWS[0][0], TuningKey.for_problem(
        LONG_ROWS[0][0], HOPPER, "fwd"), 50)]))
    assert "window" not in plain  # no legend where no row needs one
    p, mode, _ = NEW_KIND_ROWS[1]
    row = WinnerRow(TuningKey.for_problem(p, HOPPER, mode), default_variant(p, HOPPER), p,
                    1, 1.0, 1234.4, None, None, "2026-01-01")
    shown = _render(winners_tables([Listed(row, "db", Path("t.db"), True)]))
    assert "mods:wks" in shown and "w window; k softcap; s sinks" in shown, shown
    assert "varlen" not in shown  # only the letters that occur
    from flashgen.cli import LABELS_HELP

    assert "k softcap" in LABELS_HELP and "mods:" in LABELS_HELP and "bhN" in LABELS_HELP


@pytest.mark.parametrize(("args", "message"), [
    (["--preset", "llama3-8b-decode"], "'llama3-8b-decode' is a decode preset: add --mode decode"),
    (["--preset", "llama3-8b", "--mode", "decode"], "'llama3-8b' is not a decode preset"),
])
def test_a_preset_of_the_other_mode_is_named_as_such(args: list[str], message: str,
                                                     tmp_path: Path) -> None:
    """A decode preset under the default --mode fwd was reported 'unknown', with a list that
    leaves it out: the user hunted for a typo."""
    result = runner.invoke(app, ["tune", "--device", "cpu", "--db", str(tmp_path / "t.db"),
                                 *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "unknown" not in result.output


def test_fp8_hints_tune_the_forward_and_its_bench_asks_no_backward(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`flashgen bench --dtype fp8` logged 'Run `flashgen tune ... --dtype fp8 --mode bwd`',
    a command `tune` refuses: fp8 has no backward."""
    import torch

    from flashgen.bench.competitors import _flashgen
    from flashgen.kernels.presets import tune_command
    from flashgen.serve import Dispatcher

    fp8 = Problem(1, 2, 1, 32, 32, 32, "fp8", False)
    assert tune_command(INTERPRETER, fp8, "both").endswith("--mode fwd")
    assert tune_command(INTERPRETER, fp8.with_(dtype="fp16"), "bwd").endswith("--mode bwd")

    def refuse(*args: object) -> None:
        raise AssertionError("fp8 asked for a backward variant")

    monkeypatch.setattr(Dispatcher, "choose_bwd", refuse)
    prepared = _flashgen(fp8, torch.device("cpu"), Dispatcher([tmp_path / "none.db"]))
    assert "no backward (fp8)" in prepared.note


def test_a_problem_where_nothing_passed_says_why() -> None:
    """The table said 'none passed' and nothing else; the reasons were only in the database
    (fp8 on the CPU interpreter fails every variant this way)."""
    from flashgen.tune.report import none_passed_notes
    from flashgen.tune.search import Outcome, TuneResult

    fp8 = Problem(1, 2, 1, 32, 32, 32, "fp8", False)
    result = TuneResult(fp8, TuningKey.for_problem(fp8, INTERPRETER, "fwd"), 2, failed=2,
                        outcomes={"a": Outcome("failed", reason="wrong answer: max error 0.14"),
                                  "b": Outcome("failed", reason="wrong answer: max error 0.14")})
    passed = TuneResult(fp8, result.key, 2, best=default_variant(fp8, HOPPER), failed=1)
    notes = none_passed_notes([result, passed], interpreter=True)
    assert notes[0] == ("note: fwd fp8 f D32 g2 32 B1 H2: no variant passed (2 failed); "
                        "most often: wrong answer: max error 0.14")
    assert len(notes) == 2 and "interpreter rounds to e4m3" in notes[1]
    assert len(none_passed_notes([result])) == 1  # the interpreter's note on it alone


def test_pull_from_a_missing_journal_is_an_error_and_creates_nothing(tmp_path: Path) -> None:
    """Opening a journal creates it, so a mistyped path pulled '0 trial(s)' and left an
    empty file behind."""
    journal = tmp_path / "studies.log"
    result = runner.invoke(app, ["pull", "--storage", str(journal), "--db",
                                 str(tmp_path / "t.db")])
    assert result.exit_code == 2 and "journal file does not exist" in result.output
    assert not journal.exists() and not (tmp_path / "t.db").exists()


def test_decode_winners_fit_80_columns() -> None:
    """A decode winner's label drops the family its table names and shortens the fused
    combine, so the widest decode rows fit 80 columns uncut."""
    from flashgen.kernels.decode_variant import DecodeVariant
    from flashgen.tune.report import legend, variant_label

    fused = DecodeVariant(16, 32, 0, 2, 1, fused_combine=True)
    assert variant_label(fused) == "m16 n32 xauto w2 s1 +f"
    assert variant_label(fused, wide=True) == str(fused)
    assert "+f combine fused" in legend([], decode=True)


@pytest.mark.interpreter
def test_tune_logs_plain_progress_lines_off_a_terminal(tmp_path: Path) -> None:
    """Where stderr is no terminal (a batch job's log), rich drew the progress bars only when
    they stopped; tune now logs a plain line when a problem is done."""
    result = runner.invoke(app, ["tune", "--device", "cpu", "--shape", "1,2,1,32,32,16",
                                 "--trials", "2", "--db", str(tmp_path / "t.db")])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if ": done, " in x)
    assert line.startswith("fwd fp16 f D16") and "2 measured" in line and "TFLOP/s" in line


def test_a_path_through_a_file_is_one_error_line(tmp_path: Path) -> None:
    """`--db results.db/x.db` or `--out bench.csv/sub`: one line naming the path, not a
    traceback; bench says so before it measures anything."""
    blocker = tmp_path / "file.db"
    blocker.write_text("")
    db = tmp_path / "t.db"
    with TuningDB(db) as database:
        key = TuningKey.for_problem(Problem(1, 2, 1, 32, 32, 16), INTERPRETER)
        database.record_trial(key, Problem(1, 2, 1, 32, 32, 16), Variant("fa2", 32, 32, 2, 1),
                              "ok", timing=Timing(1.0, 0.9, 1.1, 5), tflops=1.0)
        database.update_winner(key)
    for args in (["tune", "--device", "cpu", "--shape", "1,2,1,32,32,16", "--trials", "1",
                  "--db", str(blocker / "x.db")],
                 ["bench", "--device", "cpu", "--shape", "1,2,1,32,32,16", "--out",
                  str(blocker / "sub")],
                 ["export", "--db", str(db), "--out", str(blocker / "sub")]):
        result = runner.invoke(app, args)
        assert result.exit_code == 1, (args, result.output)
        lines = result.output.strip().splitlines()
        assert lines[-1].startswith("error: cannot") and str(blocker) in lines[-1], lines
        assert "benchmarking" not in result.output


def test_show_runs_names_a_run_that_died_without_a_word(tmp_path: Path) -> None:
    """A run killed with SIGKILL stays marked running; `show --runs` says it died (its
    process on this host is gone) and counts the trials it wrote; a live run stays running."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    db = tmp_path / "t.db"
    with TuningDB(db) as database:
        database.start_run("gone", INTERPRETER)
        database.start_run("live", INTERPRETER)
        database.db["runs"].update("gone", {"pid": dead.pid})
        key = TuningKey.for_problem(Problem(1, 2, 1, 32, 32, 16), INTERPRETER)
        database.record_trial(key, Problem(1, 2, 1, 32, 32, 16), Variant("fa2", 32, 32, 2, 1),
                              "ok", timing=Timing(1.0, 0.9, 1.1, 5), tflops=1.0, run_id="gone")
        runs = {r.id: r for r in database.runs()}
    assert runs["gone"].died and runs["gone"].trials == 1
    assert not runs["live"].died and runs["live"].status == "running"
    result = runner.invoke(app, ["show", "--runs", "--db", str(db)])
    assert result.exit_code == 0 and "died" in result.output and "running" in result.output
    empty = tmp_path / "e.db"
    with TuningDB(empty):
        pass
    assert "no runs recorded" in runner.invoke(app, ["show", "--runs", "--db", str(empty)]).output


def test_flashgens_warnings_print_as_note_lines(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A command prints flashgen's own warnings as `note:` lines, like its other notes, not
    in Python's format with a file, line and source line."""
    with TuningDB(tmp_path / "t.db"):
        pass
    monkeypatch.setenv("FLASHGEN_BUSY_TIMEOUT", "soon-ish")  # warned once per value
    result = runner.invoke(app, ["show", "--db", str(tmp_path / "t.db")])
    assert "note: FLASHGEN_BUSY_TIMEOUT='soon-ish' is not a number" in result.output
    assert "RuntimeWarning" not in result.output and "guard.py" not in result.output


# ---- explain: what a database serves, asked from any machine ------------------------------


def test_explain_says_what_each_gpu_of_a_database_runs_without_that_gpu(
        tmp_path: Path) -> None:
    """`flashgen explain` answers as `flashgen.explain` would on each GPU the database has
    winners for (here an H100 and an H200, read on the CPU machine): the exact winner where
    the bucket is tuned, the nearest or the default elsewhere, the backward too."""
    db_path = tmp_path / "t.db"
    h200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 232448)
    fwd_problem, fwd_mode, fwd_variant, _ = LONG_ROWS[0]
    bwd_problem, _, bwd_variant, _ = LONG_ROWS[4]
    with TuningDB(db_path) as db:
        _winner(db, TuningKey.for_problem(fwd_problem, HOPPER, fwd_mode), fwd_problem,
                fwd_variant, 612.3)
        _winner(db, TuningKey.for_problem(bwd_problem, h200, "bwd"), bwd_problem, bwd_variant)
    shape = "32,64,8,512,512,128"
    result = runner.invoke(app, ["explain", "--shape", shape, "--causal", "yes", "--db",
                                 str(db_path)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    h100, h200_text = result.stdout.split("NVIDIA H200 · ")
    assert h100.startswith("NVIDIA H100 80GB HBM3 · sm90 · bf16 c D128 g8 512 B32 H64\n")
    assert "fa3 m128 n128 w4 s2 p1 pp (exact): tuned winner for this bucket" in h100
    assert "backward: " in h100 and "(fallback): nothing tuned (bwd)" in " ".join(h100.split())
    # The H200 has no forward winner but a backward one in another bucket: nearest.
    assert "(fallback): nothing tuned (fwd)" in " ".join(h200_text.split())
    assert "backward: bwd-separate own128x64 w4 s2 fa3 fused-delta smem-stats (nearest)" in (
        h200_text)
    # Where a pass runs another bucket's row or a default, the command that tunes it rows
    # of its own, whole on its line (to be copied), as the row lines are.
    tune = f"  flashgen tune --shape {shape} --dtype bf16 --causal yes --mode"
    assert f"for rows of its own:\n{tune} bwd\n" in h100
    assert f"for rows of its own:\n{tune} both\n" in h200_text
    assert all(len(line) <= 80 for line in result.stdout.splitlines()
               if not line.startswith(("  from: ", "  flashgen tune ")))
    only = runner.invoke(app, ["explain", "--shape", shape, "--causal", "yes", "--db",
                               str(db_path), "--gpu-name", "h200"])
    assert only.exit_code == 0 and "H100" not in only.stdout and "H200" in only.stdout
    decode = runner.invoke(app, ["explain", "--shape", "8,32,8,1,8192,128", "--db",
                                 str(db_path), "--gpu-name", "H100", "--causal", "yes"])
    assert decode.exit_code == 0 and "the decode family: 1 queries" in decode.stdout


def test_explain_with_modifiers_finds_the_rows_tuned_with_them(tmp_path: Path) -> None:
    db_path = tmp_path / "t.db"
    plain, mode, variant, tflops = LONG_ROWS[0]
    capped = plain.with_(softcap=True)
    one_tile = Variant("fa3", 128, 64, 4, 3)
    with TuningDB(db_path) as db:
        _winner(db, TuningKey.for_problem(plain, HOPPER, mode), plain, variant, tflops)
        _winner(db, TuningKey.for_problem(capped, HOPPER, mode), capped, one_tile, 500.0)
    args = ["explain", "--shape", "32,64,8,512,512,128", "--causal", "yes", "--db",
            str(db_path)]
    with_cap = runner.invoke(app, [*args, "--softcap", "30"])
    assert with_cap.exit_code == 0, with_cap.output
    assert with_cap.stdout.splitlines()[0].endswith("B32 H64 k")
    assert f"{one_tile} (exact): tuned winner with modifiers 'k'" in with_cap.stdout
    without = runner.invoke(app, args)
    assert f"{variant} (exact): tuned winner for this bucket" in without.stdout
    # The backward is untuned: the hint tunes it with the modifiers asked about.
    assert with_cap.stdout.endswith("--causal yes --mode bwd --softcap 30\n\n")
    assert "--softcap" not in without.stdout
    bad = runner.invoke(app, [*args, "--softcap", "-1"])
    assert bad.exit_code == 2 and "softcap" in bad.output


def test_explain_mode_decode_says_what_the_kv_cache_call_runs(tmp_path: Path) -> None:
    from flashgen.kernels.decode_variant import DecodeVariant
    from flashgen.kernels.problem import DecodeProblem

    db_path = tmp_path / "t.db"
    paged = DecodeProblem(8, 32, 8, 1, 8192, 128, "bf16", True, page_size=16)
    tuned = DecodeVariant(16, 32, 8, 1, 3)
    with TuningDB(db_path) as db:
        _winner(db, TuningKey.for_problem(paged, HOPPER, "decode"), paged, tuned, 3.0)
    result = runner.invoke(app, ["explain", "--mode", "decode", "--shape", "8,32,8,1,8192,128",
                                 "--page-size", "0,16", "--causal", "yes", "--db",
                                 str(db_path)])
    assert result.exit_code == 0, result.output
    contig, pages = result.stdout.split("\n\n")[:2]
    assert contig.startswith("NVIDIA H100 80GB HBM3 · sm90 · bf16 c D128 g4 1/8k B8 H32 contig")
    assert "(fallback)" in contig  # nothing tuned for a contiguous cache
    assert pages.splitlines()[0].endswith(" p16")
    assert f"{tuned} (exact)" in pages
    bad = runner.invoke(app, ["explain", "--mode", "prefill", "--shape", "1,1,1,16,16,16",
                              "--db", str(db_path)])
    assert bad.exit_code == 2 and "--mode is attention or decode" in bad.output
    for command in ("explain", "tune"):  # one rule for both: decode problems are plain
        windowed = runner.invoke(app, [command, "--mode", "decode", "--shape",
                                       "8,32,8,1,8192,128", "--window", "64,0", "--db",
                                       str(db_path)])
        assert windowed.exit_code == 2
        assert "--mode decode takes plain decode problems" in windowed.output


def test_explain_names_the_gpus_there_are_when_none_matches(tmp_path: Path) -> None:
    db_path = tmp_path / "t.db"
    problem, mode, variant, tflops = LONG_ROWS[0]
    with TuningDB(db_path) as db:
        _winner(db, TuningKey.for_problem(problem, HOPPER, mode), problem, variant, tflops)
    none = runner.invoke(app, ["explain", "--shape", "1,1,1,16,16,16", "--db", str(db_path),
                               "--gpu-name", "a100"])
    assert none.exit_code == 2
    assert "no GPU named like 'a100' has winners" in none.output
    assert "(GPUs there: NVIDIA H100 80GB HBM3)" in none.output
    bare = runner.invoke(app, ["explain", "--db", str(db_path)])
    assert bare.exit_code == 2 and "name the problems" in bare.output
    missing = runner.invoke(app, ["explain", "--shape", "1,1,1,16,16,16", "--db",
                                  str(tmp_path / "none.db")])
    assert missing.exit_code == 2 and "no tuning database at" in missing.output
