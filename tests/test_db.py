"""The tuning database: schema and migrations, trial and winner bookkeeping, version filters,
read-only opening, and two processes writing one file at once."""

from __future__ import annotations

import multiprocessing
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest
import sqlite_utils

from flashgen.kernels.hardware import INTERPRETER, DeviceInfo
from flashgen.kernels.problem import Problem
from flashgen.kernels.variant import Variant
from flashgen.store.db import SCHEMA_VERSION, TuningDB, default_db_path, migrations
from flashgen.store.keys import TuningKey, Versions, seq_bucket
from flashgen.tune.timing import Timing

H100 = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448)
VERSIONS = Versions("3.6.0", "2.11.0+cu130", "abc123")
PROBLEM = Problem(2, 8, 2, 1000, 1000, 128, "bf16", True)


def key_of(problem: Problem = PROBLEM, device: DeviceInfo = H100,
           versions: Versions = VERSIONS) -> TuningKey:
    return TuningKey.for_problem(problem, device, versions=versions)


def timing(ms: float) -> Timing:
    return Timing(ms, ms * 0.98, ms * 1.02, 50)


def record_ok(db: TuningDB, key: TuningKey, variant: Variant, ms: float,
              problem: Problem = PROBLEM) -> int:
    return db.record_trial(key, problem, variant, "ok", timing=timing(ms),
                           tflops=problem.flops() / ms / 1e9, error=1e-3, bound=1e-2)


@pytest.fixture
def db(tmp_path: Path) -> TuningDB:
    with TuningDB(tmp_path / "tuning.db") as database:
        yield database


# ---- key -------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "bucket"), [(1, 1), (2, 2), (3, 4), (17, 32), (1000, 1024),
                                           (1024, 1024), (1025, 2048), (16384, 16384)])
def test_seq_bucket_is_next_power_of_two(n: int, bucket: int) -> None:
    assert seq_bucket(n) == bucket


def test_seq_bucket_rejects_non_positive() -> None:
    with pytest.raises(ValueError):
        seq_bucket(0)


def test_key_buckets_q_and_k_separately_and_ignores_batch_and_heads() -> None:
    key = key_of(Problem(1, 32, 8, 100, 3000, 128))
    assert (key.seq_q_bucket, key.seq_k_bucket, key.gqa) == (128, 4096, 4)
    assert key_of(Problem(7, 64, 16, 120, 2500, 128)).id == key.id
    assert key_of(Problem(1, 32, 8, 100, 3000, 128, causal=True)).id != key.id
    assert key_of(Problem(1, 32, 32, 100, 3000, 128)).id != key.id
    assert key_of(versions=replace(VERSIONS, template_hash="other")).id != key_of().id


def test_key_columns_round_trip() -> None:
    key = key_of()
    assert TuningKey.from_columns(key.to_columns()) == key
    assert key.mode == "fwd" and key.device_key == H100.key and key.capability == "9.0"


def test_default_path_follows_environment(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    monkeypatch.setenv("FLASHGEN_DB", str(tmp_path / "x.db"))
    assert default_db_path() == tmp_path / "x.db"
    monkeypatch.delenv("FLASHGEN_DB")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_db_path() == tmp_path / "flashgen" / "tuning.db"


# ---- schema ----------------------------------------------------------------------------


def test_fresh_file_is_fully_migrated_in_wal_mode(db: TuningDB) -> None:
    assert db.schema_version == SCHEMA_VERSION
    assert db.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert db.db.journal_mode == "wal"
    assert {"trials", "winners", "baselines", "_sqlite_migrations"} <= set(db.db.table_names())
    assert db.db["trials"].columns_dict["mode"] is str


def test_reopening_applies_nothing_twice(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    TuningDB(path).close()
    with TuningDB(path) as again:
        assert again.schema_version == SCHEMA_VERSION
        assert again.db["_sqlite_migrations"].count == SCHEMA_VERSION


def test_older_file_is_migrated_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    old = sqlite_utils.Database(path)
    migrations.apply(old, stop_before="m002_winners")
    assert old.table_names() == ["_sqlite_migrations", "trials"]
    key = key_of()
    old["trials"].insert({"key_id": key.id, **key.to_columns(), "problem_json": "{}",
                          "variant_json": "{}", "status": "pruned",
                          "created_at": "2026-01-01"})
    old.close()
    with TuningDB(path) as db:
        assert db.schema_version == SCHEMA_VERSION
        assert db.db["trials"].count == 1
        assert db.db["winners"].exists()


# ---- trials and winners ----------------------------------------------------------------


def test_trials_round_trip_and_resume_set(db: TuningDB) -> None:
    key = key_of()
    a, b, c = Variant(block_m=64), Variant(block_m=128), Variant(block_m=32)
    record_ok(db, key, a, 2.0)
    db.record_trial(key, PROBLEM, b, "failed", reason="OutOfResources: shared memory")
    db.record_trial(key, PROBLEM, c, "pruned", reason="too big")
    record_ok(db, key, a, 1.5)  # measured again: the latest row counts
    rows = db.trials(key)
    assert [r.status for r in rows] == ["ok", "failed", "pruned", "ok"]
    assert rows[1].reason.startswith("OutOfResources") and rows[1].timing is None
    assert rows[0].timing == timing(2.0) and rows[0].problem == PROBLEM
    measured = db.measured(key, PROBLEM)
    assert set(measured) == {a.to_json(), b.to_json()}  # pruned points are not "measured"
    assert measured[a.to_json()].timing.median_ms == 1.5
    assert db.measured(key, PROBLEM.with_(seq_q=999, seq_k=999)) == {}
    assert db.trials(key_of(Problem(1, 2, 1, 16, 16, 64))) == []


def test_unsteady_gpu_timings_are_measured_again_on_resume(db: TuningDB) -> None:
    # A median whose repeats spread past UNSTEADY_SPREAD is not trusted: a resumed run
    # measures that variant again, unless a steady row of it exists.
    key = key_of()
    a, b = Variant(block_m=64), Variant(block_m=128)
    unsteady = Timing(0.219, 0.200, 0.244, 50)  # seen on an H100, 2026-11-24
    for variant in (a, b):
        db.record_trial(key, PROBLEM, variant, "ok", timing=unsteady, tflops=1.0)
    record_ok(db, key, b, 0.118)
    assert set(db.measured(key, PROBLEM)) == {b.to_json()}
    # The interpreter's timings say nothing about speed: its rows are never re-measured.
    cpu = key_of(device=INTERPRETER)
    db.record_trial(cpu, PROBLEM, a, "ok", timing=unsteady, tflops=1.0)
    assert set(db.measured(cpu, PROBLEM)) == {a.to_json()}


def test_record_trial_rejects_unknown_status(db: TuningDB) -> None:
    with pytest.raises(ValueError):
        db.record_trial(key_of(), PROBLEM, Variant(), "great")  # type: ignore[arg-type]


def test_winner_is_fastest_correct_trial_and_carries_sdpa(db: TuningDB) -> None:
    key = key_of()
    assert db.update_winner(key) is None  # nothing ok yet
    db.record_trial(key, PROBLEM, Variant(block_n=16), "failed", reason="wrong answer",
                    tflops=1e9)  # a failed row never wins, whatever it claims
    record_ok(db, key, Variant(block_m=64), 2.0)
    fast = Variant(block_m=128, num_warps=8)
    trial_id = record_ok(db, key, fast, 1.0)
    record_ok(db, key, Variant(block_m=32), 3.0)
    db.record_baseline(H100.key, PROBLEM, "cudnn", timing(1.5), VERSIONS.torch)
    winner = db.update_winner(key)
    assert winner is not None
    assert (winner.variant, winner.trial_id, winner.median_ms) == (fast, trial_id, 1.0)
    assert winner.sdpa_backend == "cudnn" and winner.speedup == pytest.approx(1.5)
    assert db.winner(key) == winner
    assert db.winner(key_of(Problem(1, 2, 1, 16, 16, 64))) is None
    record_ok(db, key, Variant(block_m=128, block_n=128), 0.5)
    assert db.update_winner(key).variant == Variant(block_m=128, block_n=128)
    assert db.db["winners"].count == 1  # one row per key, updated in place


def test_winners_of_other_triton_or_templates_are_never_served(db: TuningDB) -> None:
    current = key_of()
    for versions in (VERSIONS, replace(VERSIONS, triton="3.5.0"),
                     replace(VERSIONS, template_hash="old")):
        key = key_of(versions=versions)
        record_ok(db, key, Variant(block_m=64), 1.0)
        db.update_winner(key)
    other_gpu = key_of(device=INTERPRETER)
    record_ok(db, other_gpu, Variant(block_m=64), 1.0)
    db.update_winner(other_gpu)
    served = db.load_winners(H100.key, VERSIONS.triton, VERSIONS.template_hash)
    assert [w.key for w in served] == [current]
    assert db.load_winners(H100.key, "3.5.0", "abc123")[0].key.triton_version == "3.5.0"
    assert db.load_winners("no such gpu", VERSIONS.triton, VERSIONS.template_hash) == []
    assert len(db.all_winners()) == 4


def test_winners_prefer_the_running_torch(db: TuningDB) -> None:
    for torch_version, variant in (("2.10.0", Variant(block_m=32)),
                                   (VERSIONS.torch, Variant(block_m=64)),
                                   ("2.12.0", Variant(block_m=128))):
        key = key_of(versions=replace(VERSIONS, torch=torch_version))
        record_ok(db, key, variant, 1.0)
        db.update_winner(key)
    args = (H100.key, VERSIONS.triton, VERSIONS.template_hash)
    any_torch = db.load_winners(*args)
    assert len(any_torch) == 1  # one per bucket
    only = db.load_winners(*args, torch_version="2.10.0")
    assert [w.variant.block_m for w in only] == [32]


def test_load_winners_defaults_to_installed_versions(db: TuningDB) -> None:
    key = TuningKey.for_problem(PROBLEM, H100)
    record_ok(db, key, Variant(), 1.0)
    db.update_winner(key)
    assert [w.key for w in db.load_winners(H100.key)] == [key]


# ---- read-only -------------------------------------------------------------------------


def test_open_readonly_reads_and_never_writes(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    with TuningDB(path) as db:
        key = key_of()
        record_ok(db, key, Variant(), 1.0)
        db.update_winner(key)
    with TuningDB.open_readonly(path) as ro:
        assert len(ro.load_winners(H100.key, VERSIONS.triton, VERSIONS.template_hash)) == 1
        with pytest.raises(sqlite3.OperationalError):
            ro.record_trial(key, PROBLEM, Variant(), "pruned")
    with pytest.raises(FileNotFoundError):
        TuningDB.open_readonly(tmp_path / "missing.db")


def test_open_readonly_on_a_file_without_tables_reads_nothing(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    sqlite3.connect(path).execute("CREATE TABLE other (x)").connection.close()
    with TuningDB.open_readonly(path) as ro:
        assert ro.load_winners(H100.key) == [] and ro.all_winners() == []


# ---- concurrency -----------------------------------------------------------------------

ROWS_PER_WRITER = 60


def _writer(path: str, worker: int) -> None:
    with TuningDB(path) as db:
        key = key_of()
        for i in range(ROWS_PER_WRITER):
            variant = Variant(block_m=(16, 32, 64, 128)[i % 4], num_stages=1 + worker)
            record_ok(db, key, variant, 1.0 + i + worker / 10)
            if i % 10 == 0:
                db.update_winner(key)


def test_two_processes_writing_one_file_lose_nothing(tmp_path: Path) -> None:
    # Both start on a file that does not exist yet, so they also race through creation,
    # WAL switch-over and migrations.
    path = str(tmp_path / "shared.db")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, w)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    with TuningDB(path) as db:
        assert db.db["trials"].count == 2 * ROWS_PER_WRITER
        assert db.schema_version == SCHEMA_VERSION
        assert db.db["_sqlite_migrations"].count == SCHEMA_VERSION
        assert db.update_winner(key_of()).median_ms == 1.0


def test_shipped_winners_are_keyed_by_the_current_templates() -> None:
    # A template edit re-keys results: the shipped database must be re-tuned or carried over
    # (scripts/carry_rows.py) in the same change, or dispatch silently stops serving it.
    from flashgen.kernels.render import template_hash
    from flashgen.kernels.resources import data_dir

    path = Path(str(data_dir("tuning_db") / "flashgen.db"))
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        hashes = {mode: {h for (h,) in conn.execute(
            "SELECT DISTINCT template_hash FROM winners WHERE mode = ?", (mode,))}
            for mode in ("fwd", "bwd")}
    assert hashes["fwd"] == {template_hash("fwd")}
    assert hashes["bwd"] == {template_hash("bwd")}
