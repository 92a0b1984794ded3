"""Bad and foreign database files, full disks, locks, read-only places, Ctrl-C, and tuners
that would store or measure a variant twice: each ends in a clear message or a clean stop,
and no file that is not flashgen's is changed. CPU only; no kernel runs (fake benches)."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

from flashgen.cli import app
from flashgen.kernels.fwd_space import default_variant, search_space, why_invalid
from flashgen.kernels.hardware import INTERPRETER
from flashgen.kernels.presets import problem_label
from flashgen.kernels.problem import Problem
from flashgen.kernels.variant import Variant
from flashgen.store import claims, guard
from flashgen.store.db import TuningDB
from flashgen.store.keys import TuningKey, Versions
from flashgen.tune.baseline import Baseline
from flashgen.tune.fwd_bench import Measurement
from flashgen.tune.search import TuneOptions, knob_choices, tune_problem
from flashgen.tune.timing import Timing

runner = CliRunner()
PROBLEM = Problem(1, 2, 1, 32, 32, 16)
SHAPE = "1,2,1,32,32,16"
TUNE = ["tune", "--device", "cpu", "--shape", SHAPE, "--trials", "6"]
VERSIONS = Versions("3.6.0", "2.13.0")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ms_of(variant: Variant) -> float:
    """A made-up, deterministic time per variant."""
    return 1.0 + zlib.crc32(variant.to_json().encode()) % 1000 / 1000


class Bench:
    """Times variants without running them; raises KeyboardInterrupt at measurement number
    `interrupt_at` (as Ctrl-C would), and sleeps `delay` seconds per measurement so that
    tuners running at once overlap."""

    def __init__(self, interrupt_at: int | None = None, delay: float = 0.0,
                 terminate: bool = False) -> None:
        self.interrupt_at, self.delay, self.terminate = interrupt_at, delay, terminate
        self.measured: list[Variant] = []

    def compile(self, variants: Sequence[Variant]) -> dict[Variant, str]:
        return {}

    def measure(self, variant: Variant) -> Measurement:
        if len(self.measured) + 1 == self.interrupt_at:
            if self.terminate:  # as `timeout` or a batch scheduler stops a run
                os.kill(os.getpid(), signal.SIGTERM)  # the handler must raise out of here
                raise AssertionError("SIGTERM did not interrupt the tune")
            raise KeyboardInterrupt
        self.measured.append(variant)
        time.sleep(self.delay)
        ms = ms_of(variant)
        return Measurement("ok", timing=Timing(ms, ms, ms, 3), tflops=1 / ms, error=0.0,
                           bound=1.0)

    def baseline(self) -> Baseline | None:
        return None


class Benches:
    """Stands in for `flashgen.tune.workers.make_bench`: a `Bench` for each problem, all kept."""

    def __init__(self) -> None:
        self.made: list[Bench] = []
        self.interrupt_at: int | None = None
        self.terminate = False

    def __call__(self, *args: object, **kwargs: object) -> Bench:
        self.made.append(Bench(interrupt_at=self.interrupt_at, terminate=self.terminate))
        return self.made[-1]


@pytest.fixture
def fake_bench(monkeypatch: pytest.MonkeyPatch) -> Benches:
    """`flashgen tune` with `Bench`es: no kernel is compiled or run."""
    benches = Benches()
    monkeypatch.setattr("flashgen.tune.workers.make_bench", benches)
    return benches


def flashgen_db(path: Path, *, winner: bool = True) -> Path:
    """A flashgen database holding one interpreter winner of PROBLEM."""
    with TuningDB(path) as db:
        if winner:
            key = TuningKey.for_problem(PROBLEM, INTERPRETER, "fwd")
            db.record_trial(key, PROBLEM, default_variant(PROBLEM, INTERPRETER), "ok",
                            timing=Timing(1.0, 0.9, 1.1, 5), tflops=1.0)
            db.update_winner(key)
    return path


def assert_one_error_line(result: object, *needles: str) -> str:
    """The command failed, and its last line, the only `error: ...` one, holds every
    needle (progress lines may come before it; a traceback may not)."""
    exit_code, output = result.exit_code, result.output  # type: ignore[attr-defined]
    assert exit_code not in (0, None), output
    assert "Traceback" not in output, output
    lines = output.strip().splitlines()
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], output
    for needle in needles:
        assert needle in lines[-1], output
    return lines[-1]


# ---- 2: files of other programs ---------------------------------------------------------


def other_programs_db(path: Path) -> Path:
    """Another application's SQLite file, with tables named like flashgen's."""
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE trials (id INTEGER PRIMARY KEY, score REAL)")
    conn.execute("CREATE TABLE winners (name TEXT)")
    conn.execute("INSERT INTO trials (score) VALUES (0.5)")
    conn.commit()
    conn.close()
    return path


def test_tune_refuses_another_programs_database_and_leaves_it_as_it_was(
        tmp_path: Path, fake_bench: Benches) -> None:
    path = other_programs_db(tmp_path / "app.db")
    before = digest(path)
    result = runner.invoke(app, [*TUNE, "--db", str(path)])
    assert_one_error_line(result, str(path), "another program", "--db")
    assert digest(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]  # no -wal, no -shm
    with pytest.raises(guard.ForeignDatabase):
        TuningDB(path)
    assert digest(path) == before and fake_bench.made == []


@pytest.mark.parametrize("command", [["show"], ["export", "--out", "pkg"]])
def test_reading_another_programs_database_gives_one_error_line(
        tmp_path: Path, command: list[str]) -> None:
    """Readers name the file as another program's (export once said "no current winners"
    for a file without flashgen's tables) and ask for a tuning database, not a new file."""
    path = other_programs_db(tmp_path / "app.db")
    before = digest(path)
    result = runner.invoke(app, [*command, "--db", str(path)])
    assert_one_error_line(result, str(path), "another program's SQLite database",
                          "a flashgen tuning database")
    assert digest(path) == before


def test_flashgen_marks_its_files_and_adopts_older_unmarked_ones(tmp_path: Path) -> None:
    path = flashgen_db(tmp_path / "t.db", winner=False)
    app_id = "PRAGMA application_id"
    with sqlite3.connect(path) as conn:
        assert conn.execute(app_id).fetchone()[0] == guard.APPLICATION_ID
        conn.execute(f"{app_id} = 0")  # as a file written before the mark existed
    with TuningDB(path) as db:  # known by its flashgen migrations, marked on this write
        assert db.db.execute(app_id).fetchone()[0] == guard.APPLICATION_ID
    empty = tmp_path / "empty.db"
    empty.touch()  # an empty file is nobody's: flashgen may make it its own
    with TuningDB(empty) as db:
        assert db.db.execute(app_id).fetchone()[0] == guard.APPLICATION_ID


# ---- 3: one line for each known error ---------------------------------------------------


def corrupt(path: Path, how: str) -> Path:
    if how == "random bytes":
        path.write_bytes(os.urandom(8192))
    else:  # a truncated file: its header promises pages that are gone
        flashgen_db(path)
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    return path


@pytest.mark.parametrize(("how", "needle"), [("random bytes", "not a SQLite database"),
                                             ("truncated", "malformed")])
@pytest.mark.parametrize("command", [TUNE, ["show"], ["export", "--out", "pkg"]])
def test_bad_files_give_one_error_line(tmp_path: Path, fake_bench: Benches, how: str,
                                       needle: str, command: list[str]) -> None:
    path = corrupt(tmp_path / "bad.db", how)
    before = digest(path)
    result = runner.invoke(app, [*command, "--db", str(path)])
    assert_one_error_line(result, str(path), needle)
    assert digest(path) == before


@pytest.mark.parametrize("command", [TUNE, ["show"], ["export", "--out", "pkg"]])
def test_a_folder_named_as_the_database_is_called_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]) -> None:
    """$FLASHGEN_DB naming a folder: SQLite's error read as a missing file or an unwritable
    folder, and `show` and `export` passed over it as if no database were there."""
    folder = tmp_path / "dbs"
    folder.mkdir()
    monkeypatch.setenv("FLASHGEN_DB", str(folder))
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, command)
    assert_one_error_line(result, str(folder), "is a folder")


def test_an_unusable_busy_timeout_is_warned_of_not_ignored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """$FLASHGEN_BUSY_TIMEOUT set to no number of seconds: the default wait, with a warning
    naming the value (it was silently ignored)."""
    monkeypatch.setattr(guard, "_WARNED", set())
    for bad in ("abc", "-5", "nan"):
        monkeypatch.setenv(guard.BUSY_TIMEOUT_ENV, bad)
        with pytest.warns(RuntimeWarning, match=f"FLASHGEN_BUSY_TIMEOUT='{bad}'"):
            assert guard.busy_timeout_s(60.0) == 60.0
    monkeypatch.setenv(guard.BUSY_TIMEOUT_ENV, "2.5")
    assert guard.busy_timeout_s(60.0) == 2.5


def test_a_full_disk_gives_one_error_line(tmp_path: Path, fake_bench: Benches,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = flashgen_db(tmp_path / "t.db", winner=False)
    opened = TuningDB.__init__

    def no_room_to_grow(self: TuningDB, *args: object, **kwargs: object) -> None:
        opened(self, *args, **kwargs)
        pages = self.db.execute("PRAGMA page_count").fetchone()[0]
        self.db.execute(f"PRAGMA max_page_count = {pages}")  # SQLite's own "disk full"

    monkeypatch.setattr(TuningDB, "__init__", no_room_to_grow)
    result = runner.invoke(app, [*TUNE, "--trials", "200", "--db", str(path)])
    assert_one_error_line(result, str(path), "database or disk is full", "free some space")


def test_an_unusable_kernel_folder_stops_the_tune_and_stores_no_trial(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel folder that is a file: one error line naming it, and no trial stored. The
    place failed, not the variant; stored as a failed trial, that variant (the default) was
    never measured again once the folder was mended."""
    from flashgen import serve
    from flashgen.kernels import render

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(blocker))
    # A kernel this test process loaded earlier is not written again, nor one whose launcher
    # it prepared (the same problem tuned by another test): forget them all, so the tune's
    # first kernel goes to the folder (pytest-xdist workers run other tests first).
    for cached in (render._load_module, serve._forward, serve._backward, serve._decode):
        cached.cache_clear()
    path = tmp_path / "t.db"
    result = runner.invoke(app, [*TUNE, "--trials", "1", "--db", str(path)])
    assert_one_error_line(result, str(blocker), "FLASHGEN_CACHE_DIR")
    with TuningDB.open_readonly(path) as db:
        assert db.db.execute("SELECT count(*) FROM trials").fetchone()[0] == 0


def test_a_lock_held_too_long_gives_one_error_line(tmp_path: Path, fake_bench: Benches,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = flashgen_db(tmp_path / "t.db")
    monkeypatch.setenv(guard.BUSY_TIMEOUT_ENV, "0.3")
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another program holds the write lock
    try:
        started = time.monotonic()
        result = runner.invoke(app, [*TUNE, "--db", str(path)])
        waited = time.monotonic() - started
        # show reads past a WAL writer; a rollback-journal file's exclusive lock blocks it
        shown = runner.invoke(app, ["show", "--json", "--db", str(path)])
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert_one_error_line(result, str(path), "is locked", "0.3 s", guard.BUSY_TIMEOUT_ENV)
    assert 0.3 <= waited < 20
    assert shown.exit_code == 0 and len(json.loads(shown.output)) == 1

    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode = DELETE")
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        shown = runner.invoke(app, ["show", "--db", str(path)])
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert_one_error_line(shown, str(path), "is locked")


def unprivileged() -> list[str]:
    """A command prefix under which file permissions hold. Root ignores them, so as root
    the command runs through setpriv without the capabilities that override them."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    prefix = [setpriv or "setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]
    if setpriv is None or subprocess.run([*prefix, "true"]).returncode != 0:
        why = "running as root without a working setpriv: permissions never apply"
        if os.environ.get("CI"):  # CI must run these, not skip them unseen
            pytest.fail(why)
        pytest.skip(why)
    return prefix


def run_flashgen(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "COLUMNS": "200"}
    return subprocess.run([*unprivileged(), sys.executable, "-m", "flashgen.cli", *args],
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("case", "needle"), [
    ("read-only file", "read-only"),
    ("read-only folder", "read-only"),
    ("missing folder under a read-only one", "permission denied"),
    ("export into a read-only folder", "permission denied"),
])
def test_read_only_places_give_one_error_line(tmp_path: Path, case: str, needle: str) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    path = flashgen_db(folder / "t.db")
    command = [*TUNE, "--db", str(path)]
    if case == "read-only file":
        path.chmod(0o444)
    elif case == "missing folder under a read-only one":
        command = [*TUNE, "--db", str(folder / "new" / "t.db")]
    elif case == "export into a read-only folder":
        command = ["export", "--db", str(path), "--out", str(folder / "pkg")]
    if case != "read-only file":
        folder.chmod(0o555)
    try:
        before = digest(path)
        done = run_flashgen(*command)
    finally:
        folder.chmod(0o755)
        path.chmod(0o644)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and needle in line, done.stderr
    assert digest(path) == before


# ---- 4: Ctrl-C ----------------------------------------------------------------------------


def test_ctrl_c_exits_130_and_reports_the_interrupted_problem(
        tmp_path: Path, fake_bench: Benches) -> None:
    path = tmp_path / "t.db"
    fake_bench.interrupt_at = 4
    result = runner.invoke(app, [*TUNE, "--trials", "10", "--db", str(path)])
    assert result.exit_code == 130, result.output
    (bench,) = fake_bench.made
    assert len(bench.measured) == 3
    best = min(bench.measured, key=ms_of)
    said = " ".join(result.output.split())  # as one line, however the console wrapped it
    # The problem as the tables beside it label it.
    assert f"interrupted: fwd {problem_label(PROBLEM)}: best so far {best}" in said
    with TuningDB(path) as db:
        assert len([r for r in db.trials() if r.status == "ok"]) == 3
        key = TuningKey.for_problem(PROBLEM, INTERPRETER, "fwd")
        assert db.winner(key).variant == best


def test_sigterm_stops_a_tune_as_ctrl_c_does(tmp_path: Path, fake_bench: Benches) -> None:
    """`timeout` and batch schedulers stop a run with SIGTERM: the tune reports the problem
    it stopped, closes its run row as interrupted and exits 130, as on Ctrl-C, and the
    process's own SIGTERM handling is back afterwards."""
    class Unhandled(Exception):
        pass

    def unhandled(signum: int, frame: object) -> None:
        raise Unhandled  # the command did not take SIGTERM over: fail, don't kill pytest

    path = tmp_path / "t.db"
    fake_bench.interrupt_at, fake_bench.terminate = 4, True
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        result = runner.invoke(app, [*TUNE, "--trials", "10", "--db", str(path)])
        assert signal.getsignal(signal.SIGTERM) is unhandled
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.exit_code == 130, (result.output, result.exception)
    (bench,) = fake_bench.made
    said = " ".join(result.output.split())
    assert f"interrupted: fwd {problem_label(PROBLEM)}: best so far" in said
    with TuningDB(path) as db:
        assert len([r for r in db.trials() if r.status == "ok"]) == 3 == len(bench.measured)
        assert [r.status for r in db.runs()] == ["interrupted"]


# ---- 5: reading a WAL-mode file where its -shm cannot be made ----------------------------


def killed_tune_copy(tmp_path: Path) -> Path:
    """The database of a tune killed before it checkpointed, copied with its -wal file but
    without its -shm file: the winner is only in the -wal file."""
    live = tmp_path / "live"
    live.mkdir()
    copy = tmp_path / "copy"
    copy.mkdir()
    db = TuningDB(live / "t.db")
    db.db.execute("PRAGMA wal_autocheckpoint = 0")
    key = TuningKey.for_problem(PROBLEM, INTERPRETER, "fwd")
    db.record_trial(key, PROBLEM, default_variant(PROBLEM, INTERPRETER), "ok",
                    timing=Timing(1.0, 0.9, 1.1, 5), tflops=1.0)
    db.update_winner(key)
    for name in ("t.db", "t.db-wal"):
        shutil.copyfile(live / name, copy / name)
    db.close()
    return copy / "t.db"


def test_show_reads_the_wal_of_a_file_in_a_read_only_folder(tmp_path: Path) -> None:
    path = killed_tune_copy(tmp_path)
    path.parent.chmod(0o555)
    try:
        shown = run_flashgen("show", "--json", "--db", str(path))
    finally:
        path.parent.chmod(0o755)
    assert shown.returncode == 0, shown.stderr
    assert len(json.loads(shown.stdout)) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["t.db", "t.db-wal"]


def test_dispatch_waits_seconds_not_a_minute_for_a_lock_and_names_it_as_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first `attention` call waited the writers' full minute behind another process's
    write lock, then advised moving or deleting a file that was only locked."""
    from flashgen.store import table

    path = flashgen_db(tmp_path / "t.db")
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode = DELETE")  # a lock that blocks readers too
    monkeypatch.delenv(guard.BUSY_TIMEOUT_ENV, raising=False)
    monkeypatch.setattr(table, "DISPATCH_BUSY_TIMEOUT_S", 0.3)
    monkeypatch.setattr(table, "_warned", set())
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        started = time.monotonic()
        with pytest.warns(table.DatabaseWarning, match="is locked by another process") as got:
            locked = table.device_table([path], INTERPRETER)
        waited = time.monotonic() - started
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert 0.3 <= waited < 10 and not locked["fwd"]
    assert "move" not in str(got[0].message) and "flashgen.reload()" in str(got[0].message)
    # explain's fallback names the file that was not read, not only "nothing tuned".
    (unread,) = locked["unread"]
    assert unread.startswith(f"{path} (") and "locked" in unread
    from flashgen.runtime.table import Table
    from flashgen.serve import shape_of

    _, how, why = Table(locked, "cpu-interpreter", 1).lookup("fwd", shape_of(PROBLEM),
                                                             lambda e: None)
    assert how == "fallback" and why.endswith(f"; not read: {unread}")
    again = table.device_table([path], INTERPRETER)
    assert len(again["fwd"]) == 1 and "unread" not in again  # read once unlocked


def test_a_database_in_a_folder_that_cannot_be_entered_is_warned_of_not_raised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Path.is_file raises on EACCES: every `attention` call raised PermissionError."""
    from flashgen.store import table

    path = tmp_path / "closed" / "user.db"
    real = Path.is_file

    def denied(self: Path) -> bool:
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "is_file", denied)
    monkeypatch.setattr(table, "_warned", set())
    with pytest.warns(table.DatabaseWarning, match="Permission denied"):
        found = table.device_table([path], INTERPRETER)
    assert not found["fwd"]


@pytest.mark.parametrize("newer", [True, False])
def test_show_names_a_file_whose_winners_lack_a_column(tmp_path: Path, newer: bool) -> None:
    """A newer flashgen's file with a renamed column gave `show` a KeyError traceback."""
    path = flashgen_db(tmp_path / "t.db")
    with sqlite3.connect(path) as conn:
        if newer:
            conn.execute("INSERT INTO _sqlite_migrations(migration_set, name, applied_at) "
                         "VALUES ('flashgen', 'm999_future', 'later')")
        conn.execute("ALTER TABLE winners RENAME COLUMN triton_version TO triton")
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    shown = runner.invoke(app, ["show", "--db", str(path)])
    assert_one_error_line(shown, str(path), "no winners column 'triton_version'",
                          "upgrade flashgen" if newer else "damaged")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


_KILLED_MID_WRITE = """
import os, sqlite3, sys
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("PRAGMA journal_mode = DELETE")
c.execute("PRAGMA cache_size = 1")
c.execute("BEGIN")
c.execute("UPDATE winners SET block_m = 16")
c.execute("UPDATE trials SET reason = hex(randomblob(3000))")  # the cache spills to the file
os._exit(0)  # killed: uncommitted pages in the file, the originals in its -journal
"""


def test_a_write_killed_midway_is_read_as_committed_and_rolled_back_by_the_next_writer(
        tmp_path: Path) -> None:
    """A hot rollback journal: readers fell back to an immutable read of the file as it
    stood (`show` listed a winner never committed), and `tune` blamed permissions."""
    path = flashgen_db(tmp_path / "t.db")
    with TuningDB.open_readonly(path) as db:
        (committed,) = db.all_winners()
    subprocess.run([sys.executable, "-c", _KILLED_MID_WRITE, str(path)], check=True)
    journal = path.with_name(path.name + "-journal")
    assert journal.stat().st_size > 0
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    with TuningDB.open_readonly(path) as db:  # show, export, dispatch
        (read,) = db.all_winners()
    assert read.variant == committed.variant
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before and journal.exists()
    with TuningDB(path) as db:  # a writer (tune) is let in, and rolls the write back
        (read,) = db.all_winners()
    assert read.variant == committed.variant
    assert not journal.exists() or journal.stat().st_size == 0


def test_a_file_that_cannot_be_read_is_not_blamed_on_its_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = flashgen_db(tmp_path / "t.db")
    exc = sqlite3.OperationalError("unable to open database file")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: (
        False if (str(p), mode) == (str(path), os.R_OK) else real(p, mode)))
    assert "cannot be read here (its permissions)" in guard.explain(exc, path, 1.0)
    missing = tmp_path / "gone" / "t.db"  # the folder is the trouble here
    assert "its folder is missing or not writable" in guard.explain(exc, missing, 1.0)


def test_a_winner_with_a_knob_unknown_here_is_skipped_naming_its_file(tmp_path: Path) -> None:
    path = flashgen_db(tmp_path / "t.db")
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE winners SET variant_json = "
                     "json_set(variant_json, '$.future_knob', 3)")
    with pytest.warns(UserWarning, match="skipping winner") as got, \
            TuningDB.open_readonly(path) as db:
        assert db.all_winners() == []
    text = str(got[0].message)
    assert f"of {path} (written by a newer flashgen?)" in text and "future_knob" in text


@pytest.mark.parametrize("kind", ["fifo", "dangling link", "missing"])
def test_a_database_path_that_is_no_file_is_warned_of_unless_missing(
        tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """$FLASHGEN_DB at /dev/null, a pipe or a link to nothing was skipped without a word
    (a missing file is the user database not written yet: skipped quietly)."""
    from flashgen.store import table

    path = tmp_path / "user.db"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dangling link":
        path.symlink_to(tmp_path / "nowhere.db")
    monkeypatch.setattr(table, "_warned", set())
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert not table.device_table([path], INTERPRETER)["fwd"]
    said = [str(w.message) for w in got if issubclass(w.category, table.DatabaseWarning)]
    if kind == "missing":
        assert said == []
    else:
        (text,) = said
        assert str(path) in text and "not a regular file" in text


def test_an_unreadable_wal_is_named_not_skipped(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = killed_tune_copy(tmp_path)

    copyfile = shutil.copyfile

    def denied(src: Path, dst: Path) -> None:
        if str(src).endswith("-wal"):
            raise PermissionError(13, "Permission denied", str(src))
        copyfile(src, dst)

    monkeypatch.setattr(shutil, "copyfile", denied)
    with pytest.raises(guard.StoreError, match=r"t\.db-wal, which cannot be read"):
        guard.open_without_shm(path)
    monkeypatch.undo()
    conn = guard.open_without_shm(path)  # what open_readonly falls back to
    try:
        assert conn.execute("SELECT count(*) FROM winners").fetchone()[0] == 1
    finally:
        conn.close()


# ---- 6: files a newer flashgen wrote ------------------------------------------------------


@pytest.mark.parametrize("newer", ["migration", "user_version"])
def test_a_newer_schema_is_read_but_never_written(tmp_path: Path, fake_bench: Benches,
                                                  newer: str) -> None:
    path = flashgen_db(tmp_path / "t.db")
    with sqlite3.connect(path) as conn:
        if newer == "migration":
            conn.execute("INSERT INTO _sqlite_migrations (migration_set, name, applied_at) "
                         "VALUES ('flashgen', 'm999_from_the_future', '')")
        else:
            conn.execute("PRAGMA user_version = 999")
    before = digest(path)
    with pytest.raises(guard.NewerDatabase, match="newer flashgen"):
        TuningDB(path)
    result = runner.invoke(app, [*TUNE, "--db", str(path)])
    assert_one_error_line(result, str(path), "newer flashgen")
    assert digest(path) == before and fake_bench.made == []
    shown = runner.invoke(app, ["show", "--json", "--db", str(path)])
    assert shown.exit_code == 0 and len(json.loads(shown.output)) == 1


# ---- 7: nothing measured or stored twice ----------------------------------------------------


def duplicate_groups(path: Path) -> list[tuple[str, int]]:
    with sqlite3.connect(path) as conn:
        return conn.execute(
            "SELECT variant_json, count(*) FROM trials GROUP BY key_id, problem_json, "
            "variant_json HAVING count(*) > 1").fetchall()


def test_a_resumed_run_stores_no_row_twice(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run asks the same invalid variants first, as a resumed run's sampler often does
    (which ones it asks varies from run to run; here it must not)."""
    path = tmp_path / "t.db"
    problem = Problem(1, 2, 1, 256, 256, 64)  # big enough for tiles the rules prune
    knobs = knob_choices(search_space(problem, INTERPRETER))
    grid = (Variant(**dict(zip(knobs, values, strict=True)))
            for values in itertools.product(*knobs.values()))
    invalid = [v for v in grid if why_invalid(v, problem, INTERPRETER)][:5]
    create_study = optuna.create_study

    def asking_invalid_first(*args: object, **kwargs: object) -> optuna.Study:
        study = create_study(*args, **kwargs)  # type: ignore[arg-type]
        for variant in invalid:
            study.enqueue_trial(variant.to_dict())
        return study

    monkeypatch.setattr(optuna, "create_study", asking_invalid_first)
    for _ in range(2):
        with TuningDB(path) as db:
            tune_problem(problem, Bench(), db, INTERPRETER, TuneOptions(trials=6, seed=1),
                         versions=VERSIONS)
    with TuningDB(path) as db:
        pruned = {r.variant_json for r in db.trials() if r.status == "pruned"}
    assert {v.to_json() for v in invalid} <= pruned
    assert duplicate_groups(path) == []


def test_tuners_running_at_once_never_measure_a_variant_twice(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    TuningDB(path).close()
    problem = Problem(1, 2, 1, 256, 256, 64)
    benches = [Bench(delay=0.02), Bench(delay=0.02)]
    errors: list[BaseException] = []

    def tuner(bench: Bench) -> None:
        try:
            with TuningDB(path) as db:
                tune_problem(problem, bench, db, INTERPRETER,
                             TuneOptions(trials=8, seed=0), versions=VERSIONS)
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=tuner, args=(b,)) for b in benches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert errors == []
    first, second = (set(b.measured) for b in benches)
    assert len(first) == len(second) == 8 and not first & second
    assert duplicate_groups(path) == []
    with TuningDB(path) as db:
        assert db.db["claims"].count == 0  # every mark released


def test_a_stale_claim_is_taken_over(tmp_path: Path) -> None:
    with TuningDB(tmp_path / "t.db") as db:
        key = TuningKey.for_problem(PROBLEM, INTERPRETER, "fwd", VERSIONS)
        variant = search_space(PROBLEM, INTERPRETER)[0]
        assert claims.claim(db, key, PROBLEM, variant, "a").ours
        assert not claims.claim(db, key, PROBLEM, variant, "b").ours  # "a" is alive
        with db._write():
            db.db.execute("UPDATE claims SET pid = 2147483647")  # its process is gone
        assert claims.claim(db, key, PROBLEM, variant, "b").ours
        db.record_trial(key, PROBLEM, variant, "failed", reason="boom")
        taken = claims.claim(db, key, PROBLEM, variant, "c")
        assert taken.row is not None and taken.row.status == "failed"


def test_a_row_of_an_edited_kernel_settles_no_claim(tmp_path: Path) -> None:
    """A trial stored for a kernel its variant no longer renders to (a template edit since)
    timed another kernel: the variant is measured again, as `TuningDB.measured` says."""
    with TuningDB(tmp_path / "t.db") as db:
        key = TuningKey.for_problem(PROBLEM, INTERPRETER, "fwd", VERSIONS)
        variant = search_space(PROBLEM, INTERPRETER)[0]
        db.record_trial(key, PROBLEM, variant, "ok", timing=Timing(1.0, 0.9, 1.1, 10),
                        kernel_hash="0" * 16)
        assert variant.to_json() not in db.measured(key, PROBLEM)
        assert claims.claim(db, key, PROBLEM, variant, "a").ours
        db.record_trial(key, PROBLEM, variant, "ok", timing=Timing(2.0, 1.9, 2.1, 10))
        taken = claims.claim(db, key, PROBLEM, variant, "b")
        assert taken.row is not None and taken.row.timing.median_ms == 2.0
