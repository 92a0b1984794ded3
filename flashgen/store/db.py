"""The tuning database: every trial, the winner of every key, and SDPA baselines, in SQLite.

The file is plain SQLite (open it with `sqlite3` or `sqlite-utils`), managed through
sqlite-utils. Contract of `TuningDB`:

* One instance per thread: a connection is not shared between threads. Any number of
  processes may open the same file; it runs in WAL mode with a busy timeout, and every write
  is one `BEGIN IMMEDIATE` transaction, so concurrent tuners queue instead of failing and
  lose nothing. The last writer to close it switches it back to a rollback journal, so that
  readers leave no -wal and -shm files beside it.
* The schema is versioned by named, transactional migrations (sqlite-utils `Migrations`,
  recorded in `_sqlite_migrations`); opening a file applies the pending ones. `PRAGMA
  user_version` mirrors the count for tools that only speak SQL.
* Reads never raise on a miss: an unknown key gives None or an empty list.
* Winners are only served for the caller's Triton version; rows of other versions stay in the
  file as history but never come back from `load_winners`. Each trial and winner stores the
  hash of the kernel it ran (`kernel_hash`); only current rows (`current.row_is_current`)
  are resumed from or win, and dispatch checks a winner when it first uses it.
* Each `flashgen tune` records itself in `runs`: GPU, versions, command line, start and end,
  its status and how many trials and winners it wrote (the file's provenance).
* Opening for writing refuses, before touching the file, another program's SQLite file and
  one a newer flashgen wrote (`guard.check_writable`); flashgen's files carry its
  `PRAGMA application_id`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shlex
import socket
import sqlite3
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import sqlite_utils
from sqlite_utils.migrations import Migrations

from flashgen.kernels.hardware import CPU_INTERPRETER, DeviceInfo
from flashgen.kernels.modes import AnyVariant, space_of
from flashgen.kernels.problem import Problem
from flashgen.kernels.render import _templates
from flashgen.store.current import LEGACY, RETIRED, family_hash, kernel_hash_now, row_is_current
from flashgen.store.guard import (
    NewerDatabase,
    StoreError,
    busy_timeout_s,
    check_ours,
    check_writable,
    mark,
    read_only_connection,
)
from flashgen.store.keys import KEY_COLUMNS, TuningKey, Versions, package_version
from flashgen.store.measurement import Timing

Status = Literal["ok", "failed", "pruned"]
STATUSES: tuple[str, ...] = ("ok", "failed", "pruned")
#: How a run ended: still "running" if its process died without a word.
RunStatus = Literal["running", "ok", "interrupted", "failed", "pulled"]

#: Knobs that get a column of their own for SQL queries; every knob is also in variant_json,
#: so knobs added later are stored before a migration gives them a column.
#: A knob that its mode's variant lacks (loop_order of a backward row, dq_mode of a forward
#: one) stays NULL.
VARIANT_COLUMNS: tuple[str, ...] = ("loop_order", "block_m", "block_n", "num_warps",
                                    "num_stages", "split_mask", "warp_specialize", "dq_mode",
                                    "block_owned", "block_streamed")
PROBLEM_COLUMNS: tuple[str, ...] = ("batch", "heads_q", "heads_kv", "seq_q", "seq_k")

#: Seconds a writer waits for another process's transaction before giving up
#: ($FLASHGEN_BUSY_TIMEOUT overrides it, see `guard.busy_timeout_s`).
BUSY_TIMEOUT_S = 60.0

migrations = Migrations("flashgen")


def knobs_now(mode: str, variant_json: str) -> dict[str, Any]:
    """A stored variant's knobs under today's names: a file read without migrating (read-only,
    or a migration before m009 reading rows) may hold names renamed since."""
    renamed = space_of(mode).variant_type.renamed
    return {renamed.get(k, k): v for k, v in json.loads(variant_json).items()}


def _variant_now(mode: str, variant_json: str) -> AnyVariant:
    return space_of(mode).variant_type.from_dict(knobs_now(mode, variant_json))

# Column sets as the first migrations created them. Migrations are history: a later change
# is a new migration, never an edit of these.
_KEY_SCHEMA: dict[str, type] = {
    "key_id": str, "mode": str, "device_key": str, "gpu_name": str, "capability": str,
    "sm_count": int, "triton_version": str, "torch_version": str, "template_hash": str,
    "dtype": str, "causal": int, "head_dim": int, "gqa": int, "seq_q_bucket": int,
    "seq_k_bucket": int,
}
_PROBLEM_SCHEMA: dict[str, type] = {c: int for c in PROBLEM_COLUMNS} | {"problem_json": str}
_VARIANT_SCHEMA: dict[str, type] = {
    "variant_json": str, "loop_order": str, "block_m": int, "block_n": int, "num_warps": int,
    "num_stages": int,
}


@migrations()
def m001_trials(db: sqlite_utils.Database) -> None:
    """Every trial the tuner ran: its key, exact problem, variant, outcome and timings."""
    db["trials"].create(
        {"id": int, **_KEY_SCHEMA, **_PROBLEM_SCHEMA, **_VARIANT_SCHEMA,
         "status": str, "reason": str, "median_ms": float, "p20_ms": float, "p80_ms": float,
         "reps": int, "tflops": float, "error": float, "bound": float, "seed": int,
         "run_id": str, "created_at": str},
        pk="id", not_null={"key_id", "problem_json", "variant_json", "status", "created_at"},
    )
    db["trials"].create_index(["key_id", "problem_json"])
    db["trials"].create_index(["key_id", "status"])


@migrations()
def m002_winners(db: sqlite_utils.Database) -> None:
    """The fastest correct variant of every key, with the SDPA baseline of its problem."""
    db["winners"].create(
        {**_KEY_SCHEMA, **_PROBLEM_SCHEMA, **_VARIANT_SCHEMA,
         "trial_id": int, "median_ms": float, "tflops": float, "sdpa_backend": str,
         "sdpa_ms": float, "updated_at": str},
        pk="key_id", not_null={"problem_json", "variant_json", "trial_id", "updated_at"},
        foreign_keys=[("trial_id", "trials", "id")],
    )
    db["winners"].create_index(["device_key", "triton_version", "template_hash", "mode"])


@migrations()
def m003_baselines(db: sqlite_utils.Database) -> None:
    """torch SDPA's best time per device, torch version and exact problem."""
    db["baselines"].create(
        {"id": int, "device_key": str, "torch_version": str, **_PROBLEM_SCHEMA,
         "dtype": str, "causal": int, "backend": str, "median_ms": float, "p20_ms": float,
         "p80_ms": float, "reps": int, "created_at": str},
        pk="id",
    )
    db["baselines"].create_index(["device_key", "torch_version", "problem_json"])


@migrations()
def m004_variant_flags(db: sqlite_utils.Database) -> None:
    """Columns for the fa2 knobs split_mask and warp_specialize (0/1; null in older rows,
    whose variant_json predates them)."""
    for table in ("trials", "winners"):
        for column in ("split_mask", "warp_specialize"):
            db[table].add_column(column, int)


@migrations()
def m005_backward(db: sqlite_utils.Database) -> None:
    """Backward tuning (mode 'bwd'): a column for the BwdVariant knob dq_mode, and the mode
    of each SDPA baseline, since a backward winner is compared with SDPA's backward. Older
    baselines were all forward timings."""
    for table in ("trials", "winners"):
        db[table].add_column("dq_mode", str)
    db["baselines"].add_column("mode", str)
    db.execute("UPDATE baselines SET mode = 'fwd'")


#: The key's columns from m006 on, in the order its id joins them (`TuningKey.id`).
_M006_KEY = tuple(c for c in _KEY_SCHEMA if c not in ("key_id", "template_hash"))


@migrations()
def m006_kernel_hash(db: sqlite_utils.Database) -> None:
    """The code part of a key becomes the hash of the kernel a row ran (`kernel_hash`, a
    column of each row) instead of its template family's text (`template_hash`, a part of
    the key). A row keyed to today's family text gets its variant's hash rendered now (the
    same text renders the same kernel); any other gets RETIRED + its old hash, which never
    matches; a pruned row ran nothing and gets NULL. Key ids lose the template hash, so
    winners of one bucket under several texts meet: the current one stays, else the newest
    (trials keep every row)."""
    now = {mode: family_hash(_templates(), mode) for mode in ("fwd", "bwd")}

    def rekey(row: dict[str, Any]) -> tuple[str, str | None]:
        key_id = "|".join(str(row[c]) for c in _M006_KEY)
        if row["template_hash"] != now.get(row["mode"]):
            return key_id, RETIRED + str(row["template_hash"])
        if row.get("status") == "pruned":
            return key_id, None
        try:
            variant = _variant_now(row["mode"], row["variant_json"])
        except (TypeError, ValueError):
            return key_id, RETIRED + str(row["template_hash"])
        problem = Problem.from_dict(json.loads(row["problem_json"]))
        return key_id, kernel_hash_now(row["mode"], variant, problem)

    db.execute("DROP INDEX IF EXISTS idx_winners_device_key_triton_version_template_hash_mode")
    for table in ("trials", "winners"):
        db[table].add_column("kernel_hash", str)
    read = ", ".join((*_M006_KEY, "template_hash", "variant_json", "problem_json"))
    db.conn.executemany("UPDATE trials SET key_id = ?, kernel_hash = ? WHERE id = ?", [
        (*rekey(row), row["id"]) for row in db.query(f"SELECT id, status, {read} FROM trials")])
    kept: dict[str, tuple[tuple[bool, str], str, str | None]] = {}
    for row in list(db.query(f"SELECT key_id, updated_at, {read} FROM winners")):
        key_id, kernel = rekey(row)
        rank = (kernel is not None and not kernel.startswith(RETIRED), row["updated_at"])
        held = kept.get(key_id)
        if held is not None and held[0] >= rank:
            db.execute("DELETE FROM winners WHERE key_id = ?", [row["key_id"]])
            continue
        if held is not None:
            db.execute("DELETE FROM winners WHERE key_id = ?", [held[1]])
        kept[key_id] = (rank, row["key_id"], kernel)
    db.conn.executemany("UPDATE winners SET key_id = ?, kernel_hash = ? WHERE key_id = ?",
                        [(key_id, kernel, old) for key_id, (_, old, kernel) in kept.items()])
    for table in ("trials", "winners"):
        db[table].transform(drop={"template_hash"})
    db["winners"].create_index(["device_key", "triton_version", "mode"])


@migrations()
def m007_runs(db: sqlite_utils.Database) -> None:
    """The file's provenance: one row per `flashgen tune` run (see `TuningDB.start_run`)."""
    db["runs"].create(
        {"id": str, "status": str, "started_at": str, "ended_at": str, "gpu_name": str,
         "device_key": str, "triton_version": str, "torch_version": str,
         "flashgen_version": str, "command": str, "trials": int, "winners": int},
        pk="id", not_null={"status", "started_at"},
    )
    db["trials"].create_index(["run_id"])


@migrations()
def m008_claims(db: sqlite_utils.Database) -> None:
    """Variants a tuner is measuring right now, one row each, so that tuners of one key
    running at once never measure a variant twice (`store.claims`). A row lives only while
    its measurement runs; one a killed tuner left behind goes stale and is taken over."""
    db["claims"].create(
        {"key_id": str, "problem_json": str, "variant_json": str, "owner": str, "host": str,
         "pid": int, "claimed_at": float},
        pk=("key_id", "problem_json", "variant_json"),
    )


@migrations()
def m009_knob_names(db: sqlite_utils.Database) -> None:
    """Knobs renamed so that each name means one thing (`Variant.renamed`,
    `BwdVariant.renamed`): the forward's `persistent` is `programs_per_sm`; the backward's
    `block_m`/`block_n`, which swapped meaning between its dK/dV and dQ kernels, are
    `block_streamed`/`block_owned`, with columns of their own (a backward row's block_m and
    block_n columns become NULL). Kernel hashes stay: the kernels are the same."""
    for table in ("trials", "winners"):
        db[table].add_column("block_owned", int)
        db[table].add_column("block_streamed", int)
        db.execute(f"UPDATE {table} SET block_owned = block_n, block_streamed = block_m, "
                   "block_m = NULL, block_n = NULL WHERE mode = 'bwd'")
    renamed = {m: space_of(m).variant_type.renamed for m in ("fwd", "bwd")}

    def now(mode: str, text: str) -> str | None:
        if not renamed.get(mode, {}).keys() & json.loads(text).keys():
            return None
        return json.dumps(knobs_now(mode, text), sort_keys=True)

    for table, pk in (("trials", "id"), ("winners", "key_id")):
        rows = db.query(f"SELECT {pk}, mode, variant_json FROM {table}")
        db.conn.executemany(f"UPDATE {table} SET variant_json = ? WHERE {pk} = ?", [
            (text, row[pk]) for row in list(rows)
            if (text := now(row["mode"], row["variant_json"])) is not None])
    # A claim's key id starts with its mode (`TuningKey.id`).
    claims = list(db.query("SELECT rowid, key_id, variant_json FROM claims"))
    db.conn.executemany("UPDATE claims SET variant_json = ? WHERE rowid = ?", [
        (text, row["rowid"]) for row in claims
        if (text := now(row["key_id"].split("|")[0], row["variant_json"])) is not None])


@migrations()
def m010_decode_keys(db: sqlite_utils.Database) -> None:
    """Decode tuning (mode 'decode'): its keys add the cache's page size and the batch x Hkv
    bucket (`TuningKey.DECODE_ONLY`); other modes' rows hold 0 there."""
    for table in ("trials", "winners"):
        for column in ("page_size", "bh_bucket"):
            db[table].add_column(column, int, not_null_default=0)


@migrations()
def m011_modifier_keys(db: sqlite_utils.Database) -> None:
    """Tuning modified and packed problems: their keys add the modifiers
    (`TuningKey.modifiers`, such as "w" or "v4"); plain rows hold "" there and keep their
    ids."""
    for table in ("trials", "winners"):
        db[table].add_column("modifiers", str, not_null_default="")


@migrations()
def m012_visible_pair_tflops(db: sqlite_utils.Database) -> None:
    """TFLOP/s of windowed and packed problems count only the visible (query, key) pairs
    since this schema; rows recorded before counted dense pairs (up to ~2x more). Their
    TFLOP/s are dropped, so no re-tune ranks an old trial above a new one by a larger count
    (`update_winner` ranks by TFLOP/s); their times stay, and `flashgen tune --remeasure`
    ranks their variants again."""
    for table in ("trials", "winners"):
        db.execute(f"UPDATE {table} SET tflops = NULL "
                   "WHERE modifiers LIKE '%w%' OR modifiers LIKE '%v%'")


@migrations()
def m013_run_process(db: sqlite_utils.Database) -> None:
    """The host and process id of each run, so that `flashgen show --runs` can tell a run
    that died without a word (SIGKILL, a crash) from one still going."""
    if db["runs"].exists():
        db["runs"].add_column("host", str)
        db["runs"].add_column("pid", int)


#: A decode key's columns after the lengths (m010), in the order its id joins them.
_DECODE_KEY = ("page_size", "bh_bucket")


def _ladder_bucket(n: int) -> int:
    """m014's length bucket (`keys.seq_bucket` when it was written): the step of 1, 2, 3,
    4, 6, 8, 12, ... at or above n."""
    top = 1 << (n - 1).bit_length()
    return top // 4 * 3 if top >= 4 and n <= top // 4 * 3 else top


@migrations()
def m014_length_ladder(db: sqlite_utils.Database) -> None:
    """Sequence lengths are bucketed by a ladder of 1.5x steps (`keys.seq_bucket`), not by
    powers of two: a row tuned at a length in the lower part of a power-of-two bucket (257
    to 384 of (256, 512]) moves to its own bucket, its id with it. Decode's batch x Hkv
    bucket stays a power of two. Two winners cannot meet (each old bucket splits into new
    ones); a row whose id is not its columns' (not flashgen's writing), or whose new id a
    winner holds, is left as it is. A key left without its winner gets one from its own
    trials when `TuningDB` opens the file. A claim names no lengths: one held under the old
    rule goes stale and is taken over."""
    assert _M006_KEY[-2:] == ("seq_q_bucket", "seq_k_bucket")

    def key_id(row: dict[str, Any], q: int, k: int) -> str:
        parts = [*(row[c] for c in _M006_KEY[:-2]), q, k]
        if row["mode"] == "decode":
            parts += [row[c] for c in _DECODE_KEY]
        if row["modifiers"]:
            parts.append(row["modifiers"])
        return "|".join(str(v) for v in parts)

    read = ", ".join((*_M006_KEY, *_DECODE_KEY, "modifiers", "seq_q", "seq_k"))
    for table, pk in (("trials", "id"), ("winners", "key_id")):
        rows = list(db.query(f"SELECT {pk} AS pk, key_id AS id, {read} FROM {table}"))
        held = {row["id"] for row in rows}
        moves = []
        for row in rows:
            if not (isinstance(row["seq_q"], int) and isinstance(row["seq_k"], int)
                    and row["seq_q"] > 0 and row["seq_k"] > 0):
                continue
            q, k = _ladder_bucket(row["seq_q"]), _ladder_bucket(row["seq_k"])
            new = key_id(row, q, k)
            if new == row["id"] or row["id"] != key_id(row, row["seq_q_bucket"],
                                                       row["seq_k_bucket"]):
                continue
            if table == "winners" and new in held:
                continue
            held.add(new)
            moves.append((new, q, k, row["pk"]))
        db.conn.executemany(f"UPDATE {table} SET key_id = ?, seq_q_bucket = ?, "
                            f"seq_k_bucket = ? WHERE {pk} = ?", moves)


#: The number of migrations above; a test checks that a fresh file reaches it.
SCHEMA_VERSION = 14


def _migration_names() -> list[str]:
    """The names of the migrations this flashgen knows; a file with others is newer."""
    return [m.name for m in migrations._migrations]


def default_db_path() -> Path:
    """$FLASHGEN_DB, else $XDG_CACHE_HOME/flashgen/tuning.db (~/.cache by default)."""
    env = os.environ.get("FLASHGEN_DB")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "flashgen" / "tuning.db"


def _refuse_folder(path: Path) -> None:
    """A folder given as the database ($FLASHGEN_DB or --db) is named as one: SQLite's own
    error read as a missing file or an unwritable folder."""
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "a folder, not a database file", str(path))


#: The password of a URL's user (`scheme://user:password@host`), up to its last "@".
_PASSWORD = re.compile(r"(://[^:/@\s]*:)\S*@")


def without_password(text: str) -> str:
    """`text` with any URL's password masked: a run's command line is stored in the file
    (`--storage postgresql+psycopg://user:password@host/db`), which is shown and shipped."""
    return _PASSWORD.sub(r"\1***@", text)


def now_stamp() -> str:
    """The time rows are stamped with (UTC, milliseconds): `created_at`, a run's times."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _problem_json(problem: Problem) -> str:
    return json.dumps(problem.to_dict(), sort_keys=True)


@dataclass(frozen=True)
class TrialRow:
    """One stored trial. `variant` is the raw knob dict: it may hold knobs this code lacks."""

    id: int
    key: TuningKey  # key.mode says whether `variant` holds Variant or BwdVariant knobs
    problem: Problem
    variant: dict[str, Any]
    status: Status
    reason: str
    timing: Timing | None
    tflops: float | None
    error: float | None
    bound: float | None
    created_at: str
    kernel_hash: str | None = None  # of the kernel it ran; None for a pruned row

    @property
    def variant_json(self) -> str:
        return json.dumps(self.variant, sort_keys=True)


@dataclass(frozen=True)
class WinnerRow:
    """The fastest correct variant stored for one key, and the problem it was timed on.
    `variant` is a `Variant` for key.mode 'fwd' and a `BwdVariant` for 'bwd'."""

    key: TuningKey
    variant: AnyVariant
    problem: Problem
    trial_id: int
    median_ms: float
    tflops: float | None  # None: a windowed or packed row from before m012
    sdpa_backend: str | None
    sdpa_ms: float | None
    updated_at: str
    kernel_hash: str | None = None  # of the kernel its trial ran (see `current`)

    @property
    def speedup(self) -> float | None:
        """How many times faster than the best SDPA backend on the same problem."""
        return self.sdpa_ms / self.median_ms if self.sdpa_ms else None

    def to_dict(self) -> dict[str, Any]:
        return {**self.key.to_columns(), "causal": self.key.causal,
                "variant": self.variant.to_dict(), "problem": self.problem.to_dict(),
                "trial_id": self.trial_id, "median_ms": self.median_ms,
                "tflops": self.tflops, "sdpa_backend": self.sdpa_backend,
                "sdpa_ms": self.sdpa_ms, "speedup": self.speedup,
                "updated_at": self.updated_at, "kernel_hash": self.kernel_hash}


def process_alive(pid: int) -> bool:
    """Whether a process of this id exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, another user's
        return True
    return True


def gone_here(host: str | None, pid: int | None) -> bool:
    """Whether process `pid` of `host` is known to have ended: `host` is this one and no
    such process exists. Another host's processes cannot be asked (their marks expire)."""
    return pid is not None and host == socket.gethostname() and not process_alive(pid)


@dataclass(frozen=True)
class RunRow:
    """One run that wrote to the file: where, with what, by which command, and what it left."""

    id: str
    status: str  # a RunStatus
    started_at: str
    ended_at: str | None
    gpu_name: str | None
    device_key: str | None
    triton_version: str | None
    torch_version: str | None
    flashgen_version: str | None
    command: str | None
    trials: int | None
    winners: int | None
    host: str | None = None  # None: a run recorded before m013
    pid: int | None = None

    @classmethod
    def from_columns(cls, row: dict[str, Any]) -> RunRow:
        return cls(**{f.name: row.get(f.name) for f in fields(cls)})

    @property
    def died(self) -> bool:
        """Still marked running, though its process, on this host, is gone: it ended
        without a word (SIGKILL, a crash). Runs of other hosts cannot be asked."""
        return self.status == "running" and gone_here(self.host, self.pid)


def settles(row: TrialRow) -> bool:
    """Whether stored trial `row` (ok or failed) settles its variant, so that a resumed or
    concurrent tuner does not measure it again: not a GPU's ok row whose repeats were
    unsteady (its median is not trusted), nor a row of a kernel its variant no longer renders
    to (a template edit since: it timed another kernel)."""
    on_gpu = not row.key.device_key.startswith(CPU_INTERPRETER)
    unsteady = (on_gpu and row.status == "ok" and row.timing is not None
                and row.timing.unsteady)
    return not unsteady and row_is_current(row)


class TuningDB:
    """The tuning database at `path` (default: `default_db_path()`); see the module contract."""

    #: Opened by `open_readonly`: nothing is written through it, its journal mode neither.
    _read_only = False

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_db_path()
        _refuse_folder(self.path)
        wait = busy_timeout_s(BUSY_TIMEOUT_S)
        # Before anything can change the file: another program's, or a newer flashgen's.
        check_writable(self.path, _migration_names(), SCHEMA_VERSION, wait)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # `timeout` is SQLite's busy timeout: a writer waits that long for the lock.
        conn = sqlite3.connect(str(self.path), timeout=wait)
        self.db = sqlite_utils.Database(conn)
        try:
            self._enable_wal()
            with self._write():
                ladder = any(m.name == "m014_length_ladder" for m in migrations.pending(self.db))
                held = self._winner_ids() if ladder else set()
                migrations.apply(self.db)
                mark(self.db.conn)
                self.db.execute(f"PRAGMA user_version = {len(migrations.applied(self.db))}")
            # m014 moves a winner tuned at a length of a new bucket out of its old key; the
            # key it leaves gets one from its own trials, as a tune would have chosen it.
            for key_id in sorted(held - self._winner_ids()):
                row = next(self.db["trials"].rows_where("key_id = ?", [key_id], limit=1), None)
                key = None if row is None else TuningKey.from_columns(row)
                if key is not None and key.id == key_id:
                    self.update_winner(key)
        except BaseException:
            conn.close()  # a failed open keeps no handle (nor lock) on the file
            raise

    def _winner_ids(self) -> set[str]:
        """The key ids the winners table holds (none before it exists)."""
        if not self.db["winners"].exists():
            return set()
        return {row["key_id"] for row in self.db.query("SELECT key_id FROM winners")}

    def _enable_wal(self) -> None:
        """Switch the file to WAL mode, retrying while another process holds it.

        Why: changing the journal mode can fail at once with "database is locked" rather
        than wait out the busy timeout, and two processes opening a new file race through
        it (seen in CI: one of two writers in the concurrency test died here)."""
        deadline = time.monotonic() + busy_timeout_s(BUSY_TIMEOUT_S)
        delay = 0.01
        while True:
            try:
                self.db.enable_wal()
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    @classmethod
    def open_readonly(cls, path: str | Path, busy_s: float = BUSY_TIMEOUT_S) -> TuningDB:
        """Open an existing file for reading only: no migrations, no journal-mode change, and
        nothing is created, so it works on a database installed in a read-only place (the
        one shipped in the package). An older file simply lacks newer columns; the winner
        queries use those of the first schema. Writes raise sqlite3.OperationalError.
        `busy_s`: how long a read waits out another process's write lock."""
        self = cls.__new__(cls)
        self.path = Path(path)
        self._read_only = True
        _refuse_folder(self.path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no tuning database at {self.path}")
        self.db = sqlite_utils.Database(
            read_only_connection(self.path, busy_timeout_s(busy_s)))
        return self

    @classmethod
    def open_ours(cls, path: str | Path) -> TuningDB:
        """`open_readonly` for a reader that lists or serves flashgen's rows (`show`,
        `export`, `bench --db`): another program's SQLite file raises `ForeignDatabase`,
        where it would read as a database with no winners."""
        self = cls.open_readonly(path)
        try:
            check_ours(self.db.conn, self.path)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if not self._read_only:
            self._leave_wal()
        self.db.close()

    def _leave_wal(self) -> None:
        """Back to a rollback journal if no other connection has the file open.

        Why: a reader (`show`, `export`, `bench`, dispatch) of a file left in WAL mode
        creates its -wal and -shm files beside it and, read-only, cannot remove them. With
        another connection open SQLite refuses at once (no wait: busy timeout 0), and the
        file stays in WAL mode for the writers still at work; the next writer switches it
        back (`_enable_wal`)."""
        conn = self.db.conn
        with contextlib.suppress(sqlite3.Error):
            conn.execute("PRAGMA busy_timeout = 0")
            conn.execute("PRAGMA journal_mode = DELETE").fetchone()

    def __enter__(self) -> TuningDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _write(self) -> Iterator[None]:
        """One write transaction that takes the write lock up front, waiting its turn.

        A deferred BEGIN would take it at the first write instead; if another process wrote
        in between, SQLite cannot wait (the read snapshot is stale) and fails with BUSY.
        """
        conn = self.db.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    @property
    def schema_version(self) -> int:
        """How many migrations this file has had (SCHEMA_VERSION when fully migrated)."""
        return len(migrations.applied(self.db))

    # ---- trials ------------------------------------------------------------------------

    def record_trial(
        self, key: TuningKey, problem: Problem, variant: AnyVariant, status: Status, *,
        reason: str = "", timing: Timing | None = None, tflops: float | None = None,
        error: float | None = None, bound: float | None = None, seed: int | None = None,
        run_id: str | None = None, kernel_hash: str | None = None, once: bool = False,
        created_at: str | None = None,
    ) -> int:
        """Store one trial and return its id. `kernel_hash`: of the kernel that ran (default:
        `variant`'s rendered now; a pruned trial ran none and stores NULL). `once`: store
        nothing (and return the stored row's id) where this variant already has a row of this
        status for this key and problem; checked inside the write, so tuners running at once
        cannot both find it missing. `created_at`: when it was measured, for a row copied
        from elsewhere (`flashgen pull`); default now."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        wanted = space_of(key.mode).variant_type
        if not isinstance(variant, wanted):
            raise TypeError(f"a {key.mode} trial needs a {wanted.__name__}, "
                            f"got {type(variant).__name__}")
        knobs = variant.to_dict()
        if kernel_hash is None and status != "pruned":
            kernel_hash = kernel_hash_now(key.mode, variant, problem)
        row: dict[str, Any] = {
            "key_id": key.id, **key.to_columns(),
            **{c: getattr(problem, c) for c in PROBLEM_COLUMNS},
            "problem_json": _problem_json(problem),
            "variant_json": variant.to_json(),
            **{c: knobs.get(c) for c in VARIANT_COLUMNS},
            "status": status, "reason": reason,
            "median_ms": timing.median_ms if timing else None,
            "p20_ms": timing.p20_ms if timing else None,
            "p80_ms": timing.p80_ms if timing else None,
            "reps": timing.reps if timing else None,
            "tflops": tflops, "error": error, "bound": bound, "seed": seed, "run_id": run_id,
            "created_at": created_at or now_stamp(), "kernel_hash": kernel_hash,
        }
        with self._write():
            if once:
                held = list(self.db["trials"].rows_where(
                    "key_id = ? and problem_json = ? and variant_json = ? and status = ?",
                    [key.id, row["problem_json"], row["variant_json"], status], limit=1))
                if held:
                    return int(held[0]["id"])
            return int(self.db["trials"].insert(row).last_pk)

    def trials(self, key: TuningKey | None = None,
               problem: Problem | None = None) -> list[TrialRow]:
        """Stored trials, oldest first, optionally only those of `key` (and `problem`)."""
        where, args = [], []
        if key is not None:
            where.append("key_id = ?")
            args.append(key.id)
        if problem is not None:
            where.append("problem_json = ?")
            args.append(_problem_json(problem))
        rows = self.db["trials"].rows_where(" and ".join(where) or None, args, order_by="id")
        return [_trial_row(r) for r in rows]

    def measured(self, key: TuningKey, problem: Problem) -> dict[str, TrialRow]:
        """The latest ok-or-failed trial of each variant (by variant JSON) of `problem` under
        `key`: what a resumed run must not measure again. Pruned rows are left out: validity
        is recomputed for free. So are a GPU's ok rows whose repeats were unsteady (spread
        past `measurement.UNSTEADY_SPREAD`): their median is not to be trusted, so a resumed run
        measures the variant again unless a steady row of it exists (the old row stays, as history;
        the winner is the best ok row either way). And rows whose kernel is no longer the one
        their variant renders to (`current.row_is_current`): a template edit retired them."""
        latest: dict[str, TrialRow] = {}
        for row in self.trials(key, problem):
            if row.status != "pruned" and settles(row):
                latest[row.variant_json] = row
        return latest

    # ---- runs --------------------------------------------------------------------------

    def start_run(self, run_id: str, device: DeviceInfo, command: str | None = None) -> None:
        """Record that run `run_id` (the `run_id` of its trials) starts tuning on `device`;
        `command` defaults to this process's command line."""
        versions = Versions.current()
        row = {
            "id": run_id, "status": "running", "started_at": now_stamp(), "gpu_name": device.name,
            "device_key": device.key, "triton_version": versions.triton,
            "torch_version": versions.torch, "flashgen_version": package_version("flashgen"),
            "command": command if command is not None else shlex.join(
                ["flashgen", *map(without_password, sys.argv[1:])]),
            "host": socket.gethostname(), "pid": os.getpid(),
        }
        with self._write():
            self.db["runs"].insert(row)

    def finish_run(self, run_id: str, status: RunStatus) -> RunRow:
        """Record how run `run_id` ended, and count the trials it wrote and the winners whose
        trial is one of them."""
        with self._write():
            self.db["runs"].update(run_id, {"status": status, "ended_at": now_stamp(),
                                            **self._run_counts(run_id)})
        return RunRow.from_columns(self.db["runs"].get(run_id))

    def _run_counts(self, run_id: str) -> dict[str, int]:
        """The trials run `run_id` wrote, and the winners whose trial is one of them."""
        trials = self.db.execute("SELECT count(*) FROM trials WHERE run_id = ?",
                                 [run_id]).fetchone()[0]
        winners = self.db.execute(
            "SELECT count(*) FROM winners WHERE trial_id IN "
            "(SELECT id FROM trials WHERE run_id = ?)", [run_id]).fetchone()[0]
        return {"trials": trials, "winners": winners}

    def record_pulled_run(self, run_id: str, key: TuningKey, flashgen_version: str,
                          started_at: str, ended_at: str, command: str) -> None:
        """Record run `run_id` of another host, whose trials `flashgen pull` copied in
        (status "pulled"; its times are those of its first and last copied trial), so the
        gathered file keeps its provenance; a run the file records already keeps its row,
        and its counts are brought up to date."""
        with self._write():
            held = self.db["runs"].exists() and list(self.db["runs"].rows_where(
                "id = ?", [run_id], limit=1))
            if not held:
                self.db["runs"].insert({
                    "id": run_id, "status": "pulled", "started_at": started_at,
                    "ended_at": ended_at, "gpu_name": key.gpu_name,
                    "device_key": key.device_key, "triton_version": key.triton_version,
                    "torch_version": key.torch_version, "flashgen_version": flashgen_version,
                    "command": without_password(command)})
            elif held[0]["status"] != "pulled":
                return  # this file's own run (a worker's --db pulled into): its row stands
            self.db["runs"].update(run_id, self._run_counts(run_id))

    def runs(self) -> list[RunRow]:
        """Every recorded run, oldest first (none in a file older than the runs table)."""
        if not self.db["runs"].exists():
            return []
        runs = [RunRow.from_columns(r) for r in self.db["runs"].rows_where(
            order_by="started_at, id")]
        # A run still marked running has no counts yet: those it has written so far.
        return [replace(r, trials=self.db.execute(
            "SELECT count(*) FROM trials WHERE run_id = ?", [r.id]).fetchone()[0])
                if r.status == "running" else r for r in runs]

    # ---- baselines ---------------------------------------------------------------------

    def record_baseline(self, device_key: str, problem: Problem, backend: str,
                        timing: Timing, torch_version: str | None = None,
                        mode: str = "fwd") -> None:
        """Store a torch SDPA timing of `problem` on `device_key`: of its forward, or with
        `mode="bwd"` of its backward."""
        row = {
            "mode": mode, "device_key": device_key,
            "torch_version": torch_version or Versions.current().torch,
            **{c: getattr(problem, c) for c in PROBLEM_COLUMNS},
            "problem_json": _problem_json(problem), "dtype": problem.dtype,
            "causal": int(problem.causal), "backend": backend,
            "median_ms": timing.median_ms, "p20_ms": timing.p20_ms, "p80_ms": timing.p80_ms,
            "reps": timing.reps, "created_at": now_stamp(),
        }
        with self._write():
            self.db["baselines"].insert(row)

    def baseline(self, device_key: str, torch_version: str, problem: Problem,
                 mode: str = "fwd") -> tuple[str, float] | None:
        """(backend, median ms) of the latest SDPA timing of `problem`'s `mode` pass, or None."""
        rows = list(self.db["baselines"].rows_where(
            "mode = ? and device_key = ? and torch_version = ? and problem_json = ?",
            [mode, device_key, torch_version, _problem_json(problem)], order_by="id desc",
            limit=1))
        return (rows[0]["backend"], rows[0]["median_ms"]) if rows else None

    # ---- winners -----------------------------------------------------------------------

    def update_winner(self, key: TuningKey) -> WinnerRow | None:
        """Make the highest-TFLOP/s correct trial of `key` whose kernel is current its winner
        (None: no such trial; a stale winner row then stays, never served).

        TFLOP/s rather than milliseconds, because one key covers several exact problems
        (a bucket of lengths, any batch and head count) and only throughput compares them.
        Read and write happen in one transaction, so concurrent tuners of one key agree.
        """
        with self._write():
            ranked = list(self.db["trials"].rows_where(  # read out: a write follows
                "key_id = ? and status = 'ok' and tflops is not null", [key.id],
                order_by="tflops desc, id"))
            trial = next((t for t in ranked if row_is_current(_trial_row(t))), None)
            if trial is None:
                return None
            problem = Problem.from_dict(json.loads(trial["problem_json"]))
            sdpa = self.baseline(key.device_key, key.torch_version, problem, key.mode)
            if sdpa is None:  # a slim file has no baselines: the old row's, if same problem
                sdpa = next((
                    (w["sdpa_backend"], w["sdpa_ms"]) for w in self.db["winners"].rows_where(
                        "key_id = ? and problem_json = ? and sdpa_ms is not null",
                        [key.id, trial["problem_json"]])), None)
            row = {
                "key_id": key.id, **key.to_columns(),
                **{c: trial[c] for c in (*PROBLEM_COLUMNS, "problem_json", "variant_json",
                                         *VARIANT_COLUMNS)},
                "trial_id": trial["id"], "median_ms": trial["median_ms"],
                "tflops": trial["tflops"], "sdpa_backend": sdpa[0] if sdpa else None,
                "sdpa_ms": sdpa[1] if sdpa else None, "updated_at": now_stamp(),
                "kernel_hash": trial["kernel_hash"],
            }
            self.db["winners"].upsert(row, pk="key_id")
        return _winner_row(row)

    def fastest_deterministic(self, winner: WinnerRow) -> WinnerRow | None:
        """For a winner that is not deterministic (`ModeSpace.deterministic`: an atomic-dQ
        backward), its key's fastest current correct trial that is, as a row of the same
        shape (None: the winner is deterministic, or the key has no such trial). What
        dispatch serves for the bucket under `torch.use_deterministic_algorithms(True)`."""
        key = winner.key
        space = space_of(key.mode)
        if space.deterministic(winner.variant):
            return None
        ranked = self.db["trials"].rows_where(
            "key_id = ? and status = 'ok' and tflops is not null", [key.id],
            order_by="tflops desc, id")
        for trial in ranked:
            try:
                variant = _variant_now(key.mode, trial["variant_json"])
            except (TypeError, ValueError):
                continue  # knobs this flashgen lacks: not a kernel it renders
            if not space.deterministic(variant) or not row_is_current(_trial_row(trial)):
                continue
            problem = Problem.from_dict(json.loads(trial["problem_json"]))
            sdpa = self.baseline(key.device_key, key.torch_version, problem, key.mode)
            return WinnerRow(
                key=key, variant=variant, problem=problem, trial_id=trial["id"],
                median_ms=trial["median_ms"], tflops=trial["tflops"],
                sdpa_backend=sdpa[0] if sdpa else None, sdpa_ms=sdpa[1] if sdpa else None,
                updated_at=winner.updated_at, kernel_hash=_kernel_hash(trial))
        return None

    def winner(self, key: TuningKey) -> WinnerRow | None:
        """The winner stored under exactly `key`, or None."""
        rows = list(self.db["winners"].rows_where("key_id = ?", [key.id]))
        return _winner_row(rows[0]) if rows else None

    def load_winners(
        self, device_key: str, triton_version: str | None = None, *, mode: str = "fwd",
        torch_version: str | None = None,
    ) -> list[WinnerRow]:
        """`mode`'s winners usable on `device_key` (a `DeviceInfo.key`) with this Triton.

        `triton_version` defaults to the running one. `torch_version=None` accepts any torch
        (the kernels are Triton's; torch only launches them); where the same bucket was tuned
        under several torch versions, the row of the running torch wins, then the newest row.
        Rows the re-keying migration retired are left out; whether another row's kernel is
        still current is for its user to check (`current.row_is_current`) when it first uses
        it, since that renders the kernel.
        """
        current = Versions.current()
        if not self.db["winners"].exists():
            return []
        has_hash = "kernel_hash" in self.db["winners"].columns_dict  # else an older file
        rows = self.db["winners"].rows_where(
            "device_key = ? and triton_version = ? and mode = ?"
            + (" and torch_version = ?" if torch_version else "")
            + (" and (kernel_hash is null or kernel_hash not like 'retired:%')"
               if has_hash else ""),
            [device_key, triton_version or current.triton, mode]
            + ([torch_version] if torch_version else []),
        )
        chosen: dict[tuple[Any, ...], WinnerRow] = {}
        for row in rows:
            winner = _winner_row(row, strict=False, where=self.path)
            if winner is None:
                continue
            bucket = tuple(row.get(c) for c in KEY_COLUMNS if c != "torch_version")
            held = chosen.get(bucket)
            if held is None or _prefer(winner, held, current.torch):
                chosen[bucket] = winner
        return sorted(chosen.values(), key=lambda w: w.key.id)

    def all_winners(self) -> list[WinnerRow]:
        """Every winner row of every version (for `flashgen show`)."""
        if not self.db["winners"].exists():
            return []
        rows = self.db["winners"].rows_where(order_by="device_key, dtype, causal, head_dim, "
                                             "gqa, seq_q_bucket, seq_k_bucket")
        try:
            return [w for w in (_winner_row(r, strict=False, where=self.path) for r in rows)
                    if w is not None]
        except KeyError as exc:  # a column this flashgen reads is gone: a traceback in show
            why = "damaged, or written by another program"
            try:
                check_writable(self.path, _migration_names(), SCHEMA_VERSION, 0.0)
            except NewerDatabase:
                why = "written by a newer flashgen: upgrade flashgen to read it"
            except sqlite3.DatabaseError:
                pass  # not ours, or unreadable: the default says so
            raise StoreError(f"{self.path} has no winners column {exc} that this flashgen "
                             f"reads: {why}") from None


def _prefer(new: WinnerRow, held: WinnerRow, torch_now: str) -> bool:
    rank = lambda w: (w.key.torch_version == torch_now, w.updated_at)
    return rank(new) > rank(held)


def _trial_row(row: dict[str, Any]) -> TrialRow:
    timing = None
    if row["median_ms"] is not None:
        timing = Timing(row["median_ms"], row["p20_ms"], row["p80_ms"], row["reps"])
    return TrialRow(
        id=row["id"], key=TuningKey.from_columns(row),
        problem=Problem.from_dict(json.loads(row["problem_json"])),
        variant=knobs_now(row["mode"], row["variant_json"]), status=row["status"],
        reason=row["reason"] or "", timing=timing, tflops=row["tflops"], error=row["error"],
        bound=row["bound"], created_at=row["created_at"], kernel_hash=_kernel_hash(row),
    )


def _kernel_hash(row: dict[str, Any]) -> str | None:
    """A row's stored kernel hash; for a row of a file not yet re-keyed (read-only), LEGACY
    and its template hash, so `current` decides as the migration would."""
    if "kernel_hash" in row:
        return row["kernel_hash"]
    return LEGACY + row["template_hash"] if row.get("template_hash") else None


def _winner_row(row: dict[str, Any], strict: bool = True,
                where: Path | None = None) -> WinnerRow | None:
    try:
        variant = _variant_now(row["mode"], row["variant_json"])
    except (TypeError, ValueError) as exc:
        # A row written by a newer flashgen with knobs this one lacks; its kernel is not
        # one this flashgen renders, so it is never served, but `show` must not crash on it.
        if strict:
            raise
        source = f" of {where}" if where else ""
        warnings.warn(f"skipping winner {row['key_id']}{source} (written by a newer "
                      f"flashgen?): {exc}", stacklevel=3)
        return None
    return WinnerRow(
        key=TuningKey.from_columns(row), variant=variant,
        problem=Problem.from_dict(json.loads(row["problem_json"])),
        trial_id=row["trial_id"], median_ms=row["median_ms"], tflops=row["tflops"],
        sdpa_backend=row["sdpa_backend"], sdpa_ms=row["sdpa_ms"], updated_at=row["updated_at"],
        kernel_hash=_kernel_hash(row),
    )
