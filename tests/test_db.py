"""The tuning database: schema and migrations, trial and winner bookkeeping, version filters,
read-only opening, and two processes writing one file at once."""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import sqlite_utils

from flashgen.kernels.bwd_render import bwd_kernel_hash
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.hardware import INTERPRETER, DeviceInfo
from flashgen.kernels.problem import Problem
from flashgen.kernels.render import _templates, kernel_hash
from flashgen.kernels.resources import data_dir
from flashgen.kernels.variant import Variant
from flashgen.store.current import LEGACY, family_hash, row_is_current
from flashgen.store.db import SCHEMA_VERSION, TuningDB, default_db_path, migrations
from flashgen.store.keys import TuningKey, Versions, seq_bucket
from flashgen.store.slim import check_current, slim
from flashgen.tune.timing import Timing

H100 = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448)
VERSIONS = Versions("3.6.0", "2.11.0+cu130")
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


@pytest.mark.parametrize(("n", "bucket"), [
    (1, 1), (2, 2), (3, 3), (4, 4), (5, 6), (7, 8), (17, 24), (25, 32), (197, 256),
    (257, 384), (384, 384), (385, 512), (577, 768), (1000, 1024), (1024, 1024), (1025, 1536),
    (1537, 2048), (16384, 16384)])
def test_seq_bucket_steps_by_at_most_one_and_a_half(n: int, bucket: int) -> None:
    assert seq_bucket(n) == bucket


def test_the_runtime_buckets_lengths_as_the_keys_do() -> None:
    # Exported packages carry the runtime's copy of the rule: a row keyed by one rule and
    # looked up by the other would never be exact.
    from flashgen.runtime.table import bucket

    assert all(bucket(n) == seq_bucket(n) for n in range(1, 5000))
    assert {seq_bucket(n) for n in range(2049, 4097)} == {3072, 4096}


def test_seq_bucket_rejects_non_positive() -> None:
    with pytest.raises(ValueError):
        seq_bucket(0)


def test_key_buckets_q_and_k_separately_and_ignores_batch_and_heads() -> None:
    key = key_of(Problem(1, 32, 8, 100, 3500, 128))
    assert (key.seq_q_bucket, key.seq_k_bucket, key.gqa) == (128, 4096, 4)
    assert key_of(Problem(7, 64, 16, 120, 3100, 128)).id == key.id
    assert key_of(Problem(1, 32, 8, 100, 3000, 128)).id != key.id  # Nk bucket 3072
    assert key_of(Problem(1, 32, 8, 100, 3500, 128, causal=True)).id != key.id
    assert key_of(Problem(1, 32, 32, 100, 3500, 128)).id != key.id
    assert key_of(versions=replace(VERSIONS, triton="3.5.0")).id != key_of().id


def test_key_columns_round_trip() -> None:
    key = key_of()
    assert TuningKey.from_columns(key.to_columns()) == key
    assert key.mode == "fwd" and key.device_key == H100.key and key.capability == "9.0"


def test_modified_keys_add_their_modifiers_and_plain_ids_stay_as_they_were() -> None:
    plain = key_of()
    # The id of a plain key is its fields before modifier keys existed, in order.
    assert plain.id == "|".join(str(int(v) if isinstance(v, bool) else v) for v in (
        "fwd", H100.key, H100.name, "9.0", 132, "3.6.0", "2.11.0+cu130", "bf16", True, 128, 4,
        1024, 1024))
    assert "modifiers" not in plain.to_columns()
    window = key_of(PROBLEM.with_(window=True))
    assert window.modifiers == "w" and window.id == plain.id + "|w"
    packed = key_of(PROBLEM.with_(varlen=True, sinks=True, softcap=True, mix=4))
    assert packed.modifiers == "ksv4"
    assert key_of(PROBLEM.with_(varlen=True)).modifiers == "v1"
    for key in (window, packed):
        assert TuningKey.from_columns(key.to_columns()) == key
    with pytest.raises(ValueError, match="mix"):
        PROBLEM.with_(mix=4)  # not varlen
    with pytest.raises(ValueError, match="power of two"):
        PROBLEM.with_(varlen=True, mix=3)
    assert PROBLEM.with_(window=True).to_dict().keys() - PROBLEM.to_dict().keys() == {"window"}


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


def test_windowed_and_packed_tflops_from_before_the_visible_pair_count_are_dropped(
        tmp_path: Path) -> None:
    # Counted over dense pairs, they would outrank every trial timed since.
    path = tmp_path / "old.db"
    old = sqlite_utils.Database(path)
    migrations.apply(old, stop_before="m012_visible_pair_tflops")
    key = key_of()
    for modifiers in ("", "w", "kv2", "k"):
        old["trials"].insert({"key_id": key.id + modifiers, **key.to_columns(),
                              "modifiers": modifiers, "problem_json": "{}",
                              "variant_json": "{}", "status": "ok", "median_ms": 1.0,
                              "tflops": 900.0, "created_at": "2026-01-01"})
    old.close()
    with TuningDB(path) as db:
        kept = {r["modifiers"]: r["tflops"] for r in db.db["trials"].rows}
    assert kept == {"": 900.0, "w": None, "kv2": None, "k": 900.0}


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


def test_winners_of_other_triton_or_retired_kernels_are_never_served(db: TuningDB) -> None:
    current = key_of()
    for versions in (VERSIONS, replace(VERSIONS, triton="3.5.0")):
        key = key_of(versions=versions)
        record_ok(db, key, Variant(block_m=64), 1.0)
        db.update_winner(key)
    other_gpu = key_of(device=INTERPRETER)
    record_ok(db, other_gpu, Variant(block_m=64), 1.0)
    db.update_winner(other_gpu)
    retired = key_of(PROBLEM.with_(causal=False))  # as the re-keying migration leaves one
    record_ok(db, retired, Variant(block_m=64), 1.0, PROBLEM.with_(causal=False))
    db.update_winner(retired)
    with db.db.conn:
        db.db.execute("UPDATE winners SET kernel_hash = 'retired:abc' WHERE key_id = ?",
                      [retired.id])
    served = db.load_winners(H100.key, VERSIONS.triton)
    assert [w.key for w in served] == [current]
    assert row_is_current(served[0]) and served[0].kernel_hash == kernel_hash(Variant(), PROBLEM)
    assert db.load_winners(H100.key, "3.5.0")[0].key.triton_version == "3.5.0"
    assert db.load_winners("no such gpu", VERSIONS.triton) == []
    assert len(db.all_winners()) == 4


def test_winners_prefer_the_running_torch(db: TuningDB) -> None:
    """A bucket tuned under several torch versions serves the running torch's row, even
    where another is newer; a bucket without one serves its newest row."""
    running = Versions.current().torch
    other = PROBLEM.with_(causal=not PROBLEM.causal)
    rows = ((PROBLEM, "2.10.0", 32, "2026-01-03"), (PROBLEM, running, 64, "2026-01-01"),
            (PROBLEM, "2.12.0", 128, "2026-01-02"),
            (other, "2.10.0", 32, "2026-01-03"), (other, "2.12.0", 128, "2026-01-02"))
    for problem, torch_version, block_m, day in rows:
        key = key_of(problem, versions=replace(VERSIONS, torch=torch_version))
        record_ok(db, key, Variant(block_m=block_m), 1.0, problem)
        db.update_winner(key)
        with db.db.conn:
            db.db.execute("UPDATE winners SET updated_at = ? WHERE key_id = ?",
                          [f"{day}T00:00:00.000+00:00", key.id])
    args = (H100.key, VERSIONS.triton)
    served = {w.key.causal: w.variant.block_m for w in db.load_winners(*args)}
    assert served == {PROBLEM.causal: 64, other.causal: 32}  # one per bucket
    only = db.load_winners(*args, torch_version="2.12.0")
    assert [w.variant.block_m for w in only] == [128, 128]


def test_load_winners_defaults_to_installed_versions(db: TuningDB) -> None:
    key = TuningKey.for_problem(PROBLEM, H100)
    record_ok(db, key, Variant(), 1.0)
    db.update_winner(key)
    assert [w.key for w in db.load_winners(H100.key)] == [key]


def _change_kernel(db: TuningDB, table: str, where: str, args: list) -> None:
    """Store another kernel hash on rows, as if a template edit had changed their kernel."""
    with db.db.conn:
        db.db.execute(f"UPDATE {table} SET kernel_hash = 'edited' WHERE {where}", args)


def test_rows_of_a_changed_kernel_are_measured_again_and_never_win(db: TuningDB) -> None:
    key = key_of()
    fast, slow = Variant(block_m=128), Variant(block_m=64)
    fast_id = record_ok(db, key, fast, 1.0)
    record_ok(db, key, slow, 2.0)
    assert db.update_winner(key).variant == fast
    assert db.trials(key)[0].kernel_hash == kernel_hash(fast, PROBLEM)
    _change_kernel(db, "trials", "id = ?", [fast_id])
    assert set(db.measured(key, PROBLEM)) == {slow.to_json()}  # fast is measured again
    assert db.update_winner(key).variant == slow
    record_ok(db, key, fast, 1.0)  # measured again on today's kernel: it wins again
    assert db.update_winner(key).variant == fast
    # A pruned trial ran nothing, so it has no kernel hash.
    db.record_trial(key, PROBLEM, Variant(block_m=256), "pruned", reason="too big")
    assert db.trials(key)[-1].kernel_hash is None


# ---- runs ------------------------------------------------------------------------------


def test_a_run_records_its_provenance_and_what_it_wrote(db: TuningDB) -> None:
    db.start_run("r1", H100, command="flashgen tune --preset fa-bench")
    (running,) = db.runs()
    assert (running.status, running.ended_at, running.gpu_name) == ("running", None, H100.name)
    assert running.triton_version == Versions.current().triton and running.flashgen_version
    key = key_of()
    for block_m in (64, 128):
        db.record_trial(key, PROBLEM, Variant(block_m=block_m), "ok", timing=timing(1.0),
                        tflops=float(block_m), run_id="r1")
    db.record_trial(key, PROBLEM, Variant(block_m=16), "ok", timing=timing(1.0), tflops=1.0,
                    run_id="other")
    db.update_winner(key)
    done = db.finish_run("r1", "interrupted")
    assert (done.status, done.trials, done.winners) == ("interrupted", 2, 1)
    assert done.ended_at >= done.started_at and db.runs() == [done]


def test_a_runs_command_line_keeps_no_storage_password(
        db: TuningDB, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run stores its command line in the file, which `show --runs` prints and which may
    be shipped: `--storage postgresql+psycopg://user:password@host/db` kept the password."""
    monkeypatch.setattr(sys, "argv", [
        "flashgen", "tune", "--storage", "postgresql+psycopg://fg:s3cr@t@db.host:5432/fg",
        "--campaign", "c", "--storage=mysql://u:pw@h/x", "--db", "a.db"])
    db.start_run("r1", H100)
    (run,) = db.runs()
    assert "s3cr" not in run.command and "pw" not in run.command
    assert run.command == ("flashgen tune --storage 'postgresql+psycopg://fg:***@db.host:5432/fg'"
                           " --campaign c '--storage=mysql://u:***@h/x' --db a.db")


# ---- re-keying by kernel hash (migration m006) -----------------------------------------


def _stored_before_m009(variant: Variant | BwdVariant) -> str:
    """A variant's JSON under the knob names it had before m009_knob_names."""
    old = {new: name for name, new in type(variant).renamed.items()}
    return json.dumps({old.get(k, k): v for k, v in variant.to_dict().items()}, sort_keys=True)


def _old_row(mode: str, template_hash: str, variant: Variant | BwdVariant,
             problem: Problem = PROBLEM, **extra: object) -> dict[str, object]:
    """A trial row as the schema before m006 stored it: the template hash in the key."""
    key = TuningKey.for_problem(problem, H100, mode, VERSIONS)
    return {"key_id": f"{key.id}|{template_hash}", **key.to_columns(),
            "template_hash": template_hash, **problem.to_dict(),
            "problem_json": json.dumps(problem.to_dict(), sort_keys=True),
            "variant_json": _stored_before_m009(variant), "status": "ok", "median_ms": 1.0,
            "p20_ms": 1.0, "p80_ms": 1.0, "reps": 10, "tflops": 1.0,
            "created_at": "2026-01-01", **extra}


def _old_database(path: Path) -> dict[str, int]:
    """A file at schema m005 with current and stale rows of both modes; trial ids by name."""
    now = {mode: family_hash(_templates(), mode) for mode in ("fwd", "bwd")}
    old = sqlite_utils.Database(path)
    migrations.apply(old, stop_before="m006_kernel_hash")
    full = PROBLEM.with_(causal=False)
    rows = {
        "current": _old_row("fwd", now["fwd"], Variant(block_m=128)),
        "stale": _old_row("fwd", "0123456789abcdef", Variant(block_m=32)),
        "pruned": _old_row("fwd", now["fwd"], Variant(block_m=16), status="pruned"),
        "bwd": _old_row("bwd", now["bwd"], BwdVariant(32, 64, 4, 2)),
        "bwd_stale": _old_row("bwd", "fedcba9876543210", BwdVariant(), full),
    }
    ids = {name: int(old["trials"].insert(row).last_pk) for name, row in rows.items()}
    winner_columns = set(old["winners"].columns_dict)
    for name, updated in (("current", "2026-01-01"), ("stale", "2026-02-01"), ("bwd", "x"),
                          ("bwd_stale", "x")):  # "stale" is the newer row of current's bucket
        row = {c: v for c, v in rows[name].items() if c in winner_columns}
        old["winners"].insert({**row, "trial_id": ids[name], "updated_at": updated})
    old.close()
    return ids


def test_migration_rekeys_current_rows_and_retires_stale_ones(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    ids = _old_database(path)
    with TuningDB(path) as db:
        assert db.schema_version == SCHEMA_VERSION
        assert "template_hash" not in db.db["trials"].columns_dict
        hashes = {r.id: r.kernel_hash for r in db.trials()}
        assert hashes[ids["current"]] == kernel_hash(Variant(block_m=128), PROBLEM)
        assert hashes[ids["stale"]] == "retired:0123456789abcdef"
        assert hashes[ids["pruned"]] is None
        assert hashes[ids["bwd"]] == bwd_kernel_hash(BwdVariant(32, 64, 4, 2), PROBLEM)
        key = key_of()
        (winner,) = db.load_winners(H100.key, VERSIONS.triton)
        # The current row keeps the bucket although the stale one is newer; ids match TuningKey.
        assert (winner.key, winner.variant, db.winner(key)) == (key, Variant(block_m=128),
                                                                winner)
        assert set(db.measured(key, PROBLEM)) == {Variant(block_m=128).to_json()}
        (bwd,) = db.load_winners(H100.key, VERSIONS.triton, mode="bwd")
        assert bwd.variant == BwdVariant(32, 64, 4, 2) and row_is_current(bwd)
        assert len(db.all_winners()) == 3  # the retired backward row stays, never served
        assert [w.kernel_hash for w in db.all_winners()].count("retired:fedcba9876543210") == 1


def test_an_unmigrated_file_read_only_is_judged_as_the_migration_would(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    _old_database(path)
    with TuningDB.open_readonly(path) as ro:
        current = {w.variant: row_is_current(w) for w in ro.all_winners()}
        assert all(w.kernel_hash.startswith(LEGACY) for w in ro.all_winners())
    assert current == {Variant(block_m=128): True, Variant(block_m=32): False,
                       BwdVariant(32, 64, 4, 2): True, BwdVariant(): False}


def test_m009_renames_stored_knobs_and_keeps_every_row_current(tmp_path: Path) -> None:
    path = tmp_path / "m008.db"
    old = sqlite_utils.Database(path)
    migrations.apply(old, stop_before="m009_knob_names")
    fwd, bwd = Variant("fa2", 64, 64, 4, 2, programs_per_sm=2), BwdVariant(32, 128, 4, 3)
    keys = {}
    for mode, variant, hashed in (("fwd", fwd, kernel_hash), ("bwd", bwd, bwd_kernel_hash)):
        keys[mode] = key = TuningKey.for_problem(PROBLEM, H100, mode, VERSIONS)
        row = {"key_id": key.id, **key.to_columns(), **PROBLEM.to_dict(),
               "problem_json": json.dumps(PROBLEM.to_dict(), sort_keys=True),
               "variant_json": _stored_before_m009(variant),
               "block_m": 32 if mode == "bwd" else 64, "block_n": 128 if mode == "bwd" else 64,
               "status": "ok", "median_ms": 1.0, "p20_ms": 1.0, "p80_ms": 1.0, "reps": 10,
               "kernel_hash": hashed(variant, PROBLEM), "created_at": "x"}
        trial_id = old["trials"].insert(row).last_pk
        winner = {c: v for c, v in row.items() if c in old["winners"].columns_dict}
        old["winners"].insert({**winner, "trial_id": trial_id, "updated_at": "x"})
    old["claims"].insert({"key_id": keys["bwd"].id, "problem_json": row["problem_json"],
                          "variant_json": _stored_before_m009(bwd), "owner": "o", "host": "h",
                          "pid": 1, "claimed_at": 0.0})
    old.close()
    with TuningDB(path) as db:
        assert db.schema_version == SCHEMA_VERSION
        winners = {w.key.mode: w for w in db.all_winners()}
        assert (winners["fwd"].variant, winners["bwd"].variant) == (fwd, bwd)
        assert all(row_is_current(w) for w in winners.values())
        assert set(db.measured(keys["bwd"], PROBLEM)) == {bwd.to_json()}
        columns = "block_m, block_n, block_owned, block_streamed"
        assert {r["mode"]: tuple(r.values())[1:] for r in db.db.query(
            f"SELECT mode, {columns} FROM trials")} == {"fwd": (64, 64, None, None),
                                                        "bwd": (None, None, 128, 32)}
        assert [r["variant_json"] for r in db.db["claims"].rows] == [bwd.to_json()]


def test_m011_gives_m010_rows_empty_modifiers_and_keeps_their_ids(tmp_path: Path) -> None:
    path = tmp_path / "m010.db"
    old = sqlite_utils.Database(path)
    migrations.apply(old, stop_before="m011_modifier_keys")
    key, variant = key_of(), Variant("fa2", 64, 64, 4, 2)
    row = {"key_id": key.id, **key.to_columns(), **PROBLEM.to_dict(),
           "problem_json": json.dumps(PROBLEM.to_dict(), sort_keys=True),
           "variant_json": variant.to_json(), "status": "ok", "median_ms": 1.0,
           "p20_ms": 1.0, "p80_ms": 1.0, "reps": 10, "tflops": 1.0,
           "kernel_hash": kernel_hash(variant, PROBLEM), "created_at": "x"}
    trial_id = old["trials"].insert(row).last_pk
    winner = {c: v for c, v in row.items() if c in old["winners"].columns_dict}
    old["winners"].insert({**winner, "trial_id": trial_id, "updated_at": "x"})
    old.close()
    with TuningDB(path) as db:
        assert db.schema_version == SCHEMA_VERSION
        assert [r["modifiers"] for r in db.db.query("SELECT modifiers FROM trials")] == [""]
        (found,) = db.all_winners()
        assert found.key == key and found.key.id == key.id
        # A modified key of the same bucket is a row of its own beside it.
        window = key_of(PROBLEM.with_(window=True))
        problem = PROBLEM.with_(window=True)
        db.record_trial(window, problem, variant, "ok", timing=timing(2.0), tflops=2.0,
                        kernel_hash=kernel_hash(variant, problem))
        db.update_winner(window)
        assert {w.key.id for w in db.all_winners()} == {key.id, window.id}


LADDER_PROBLEMS = {"odd": Problem(256, 16, 16, 257, 257, 64),
                   "even": Problem(32, 16, 16, 512, 512, 64)}


def _m013_file(path: Path) -> None:
    """A file of the power-of-two rule: an N257 and an N512 trial in the (512, 512) key,
    the N257 one its winner."""
    old = sqlite_utils.Database(path)
    migrations.apply(old, stop_before="m014_length_ladder")
    variant = Variant("fa2", 64, 64, 4, 2)
    for name, problem in LADDER_PROBLEMS.items():
        key = key_of(problem)
        columns = {**key.to_columns(), "seq_q_bucket": 512, "seq_k_bucket": 512}
        key_id = "|".join(str(columns[c]) for c in TuningKey.__dataclass_fields__
                          if c in columns)
        row = {"key_id": key_id, **columns, **problem.to_dict(),
               "problem_json": json.dumps(problem.to_dict(), sort_keys=True),
               "variant_json": variant.to_json(), "status": "ok", "median_ms": 1.0,
               "p20_ms": 1.0, "p80_ms": 1.0, "reps": 10, "tflops": 1.0,
               "kernel_hash": kernel_hash(variant, problem), "created_at": "x"}
        trial_id = old["trials"].insert(row).last_pk
        if name == "odd":
            winner = {c: v for c, v in row.items() if c in old["winners"].columns_dict}
            old["winners"].insert({**winner, "trial_id": trial_id, "updated_at": "x"})
    old.close()


def test_m014_moves_rows_tuned_in_a_new_bucket_and_keeps_the_others(tmp_path: Path) -> None:
    # Keyed by powers of two, N257 and N512 were one bucket; a file of that rule gets each
    # row's bucket from its tuned lengths, and the ids TuningKey gives today.
    path = tmp_path / "m013.db"
    _m013_file(path)
    problems = LADDER_PROBLEMS
    with TuningDB(path) as db:
        assert db.schema_version == SCHEMA_VERSION
        keys = {name: key_of(problem) for name, problem in problems.items()}
        assert keys["odd"].seq_q_bucket == 384 and keys["even"].seq_q_bucket == 512
        assert sorted((r["key_id"], r["seq_q_bucket"], r["seq_k_bucket"]) for r in db.db.query(
            "SELECT key_id, seq_q_bucket, seq_k_bucket FROM trials")) == sorted(
                (k.id, k.seq_q_bucket, k.seq_k_bucket) for k in keys.values())
        # The N257 winner moved to its own key, and the N512 key it left got the best of
        # its own trials as its winner, as a tune would have chosen it.
        assert sorted((w.key.seq_q_bucket, w.problem.seq_q) for w in db.all_winners()) == [
            (384, 257), (512, 512)]
    with TuningDB(path) as again:  # once: a later open finds nothing to do
        assert len(again.all_winners()) == 2


def test_dispatch_reads_a_file_before_m014_as_the_migration_would_key_it(
        tmp_path: Path) -> None:
    # Dispatch opens files read only and never migrates them: its entries take their length
    # buckets from the lengths their rows were tuned at, so an unmigrated file serves as a
    # migrated one does.
    from flashgen.store.table import device_table

    path = tmp_path / "m013.db"
    _m013_file(path)
    (found,) = device_table([path], H100)["fwd"]
    assert (found["seq_q_bucket"], found["seq_k_bucket"]) == (384, 384)
    assert "|512|512] trial" in found["source"]  # the row, as the file keys it
    applied = sqlite3.connect(path).execute("SELECT name FROM _sqlite_migrations").fetchall()
    assert ("m013_run_process",) in applied and ("m014_length_ladder",) not in applied


# ---- read-only -------------------------------------------------------------------------


def test_open_readonly_reads_and_never_writes(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    with TuningDB(path) as db:
        key = key_of()
        record_ok(db, key, Variant(), 1.0)
        db.update_winner(key)
    with TuningDB.open_readonly(path) as ro:
        assert len(ro.load_winners(H100.key, VERSIONS.triton)) == 1
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


# ---- the shipped database and the slim step --------------------------------------------


def test_shipped_database_is_small_and_every_winner_is_current() -> None:
    # A template edit that changes a shipped kernel must come with a re-tune of its rows,
    # or dispatch passes them over; prose edits keep them (tests/test_kernel_hash.py).
    path = Path(str(data_dir("tuning_db") / "flashgen.db"))
    assert path.stat().st_size <= 2 * 1024 * 1024
    assert check_current(path) == []
    with TuningDB.open_readonly(path) as db:
        winners, runs = db.all_winners(), db.runs()
        # Each winner's own trial, and a nondeterministic (atomic dQ) winner's fastest
        # deterministic alternate, no more.
        atomic = sum(1 for w in winners if not getattr(w.variant, "deterministic", True))
        assert db.db["trials"].count == len(winners) + atomic
    assert {w.key.gpu_name for w in winners} == {r.gpu_name for r in runs}


def test_slim_keeps_current_winners_their_trials_and_provenance(tmp_path: Path) -> None:
    path = tmp_path / "user.db"
    with TuningDB(path) as db:
        db.start_run("r1", H100, command="flashgen tune")
        for causal in (True, False):
            problem, key = PROBLEM.with_(causal=causal), key_of(PROBLEM.with_(causal=causal))
            for block_m in (32, 64, 128):
                db.record_trial(key, problem, Variant(block_m=block_m), "ok",
                                timing=timing(1.0), tflops=float(block_m), run_id="r1")
            db.record_baseline(H100.key, problem, "cudnn", timing(2.0), VERSIONS.torch)
            db.record_baseline(H100.key, problem, "cudnn", timing(1.5), VERSIONS.torch)
            db.update_winner(key)
        db.finish_run("r1", "ok")
        record_ok(db, key_of(device=INTERPRETER), Variant(), 1.0)  # a row of no recorded run
        db.update_winner(key_of(device=INTERPRETER))
        _change_kernel(db, "winners", "causal = 0 and device_key = ?", [H100.key])
    before = path.read_bytes()
    with pytest.raises(ValueError, match="in_place"):
        slim(path, path, provenance="x")
    report = slim(path, tmp_path / "out.db", provenance="earlier runs")
    assert path.read_bytes() == before  # the source is only read
    assert (report.winners, report.trials, report.baselines, report.stale_winners) == (2, 2,
                                                                                       0, 1)
    out = tmp_path / "out.db"
    assert check_current(out) == []
    with TuningDB.open_readonly(out) as db:
        assert db.db.journal_mode == "delete"
        assert [w.variant for w in db.load_winners(H100.key, VERSIONS.triton)] == [
            Variant(block_m=128)]
        # No baselines table rows: each winner keeps its problem's latest SDPA time.
        assert db.baseline(H100.key, VERSIONS.torch, PROBLEM) is None
        assert [(w.sdpa_backend, w.sdpa_ms) for w in db.load_winners(H100.key)] == [
            ("cudnn", 1.5)]
    with TuningDB(out) as db:  # choosing again (merge_db --rechoose) keeps that time
        assert db.update_winner(key_of(PROBLEM)).sdpa_ms == 1.5
        runs = {r.id: r for r in db.runs()}
    assert runs["r1"].command == "flashgen tune"
    earlier = runs[f"earlier:{INTERPRETER.key}"]
    assert (earlier.command, earlier.trials, earlier.winners) == ("earlier runs", 1, 1)
    with pytest.raises(FileExistsError):
        slim(path, out, provenance="x")
    slim(path, in_place=True, provenance="x")
    assert check_current(path) == [] and path.stat().st_size < len(before)


def test_merge_rechoose_makes_the_fastest_current_trial_of_all_files_the_winner(
        tmp_path: Path) -> None:
    """scripts/merge_db.py keeps the first file's winner of a key both files tuned; with
    `rechoose` the key's winner is its fastest correct current trial over both files, as
    `update_winner` chooses, and a stale faster trial does not win."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "merge_db", Path(__file__).resolve().parent.parent / "scripts" / "merge_db.py")
    assert spec is not None and spec.loader is not None
    merge_db = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge_db)
    key = key_of()
    first, second = tmp_path / "first.db", tmp_path / "second.db"
    with TuningDB(first) as db:
        record_ok(db, key, Variant(block_m=64), 2.0)
        db.update_winner(key)
    with TuningDB(second) as db:
        record_ok(db, key, Variant(block_m=128), 1.0)
        record_ok(db, key, Variant(block_m=32), 0.5)  # faster, but its kernel is not current
        _change_kernel(db, "trials", "block_m = 32", [])
        db.update_winner(key)
    for again, winner in ((False, 64), (True, 128)):
        out = tmp_path / f"merged-{again}.db"
        merge_db.merge(first, [second], out)
        if again:
            assert merge_db.rechoose(out) == 1
        with TuningDB.open_readonly(out) as db:
            assert db.winner(key).variant == Variant(block_m=winner)
