"""A tuning database cut down to its winners: what the package ships in `tuning_db/`.

A user's own database keeps every trial (history, and what a resumed run skips). The shipped
one only has to serve dispatch and say where its rows came from, so `slim` keeps the winners
whose kernel is current, the trial each came from (and, for a winner that is not
deterministic, its key's fastest deterministic trial, which dispatch serves under
`torch.use_deterministic_algorithms`) and the file's provenance (`runs`), and nothing else.
SDPA baselines are left out: each winner row carries its problem's SDPA time already. The
source file is only read: the result goes to another path, or replaces the source only when
asked (`in_place`).
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path

from flashgen.store.current import row_is_current
from flashgen.store.db import TuningDB


@dataclass(frozen=True)
class SlimReport:
    """What `slim` wrote: sizes in bytes and the rows kept (winners left out as stale)."""

    source_bytes: int
    out_bytes: int
    winners: int
    trials: int
    baselines: int
    runs: int
    stale_winners: int


def _copy(source: Path, target: Path) -> None:
    """`source` copied by SQLite's backup API: consistent even while another process writes
    it, and with whatever its WAL file holds."""
    src = sqlite3.connect(f"{source.resolve().as_uri()}?mode=ro", uri=True)
    dst = sqlite3.connect(target)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()


def _cut(db: TuningDB, provenance: str) -> int:
    """Delete all but the current winners, their trials and runs; give each GPU
    whose kept trials no run row describes a row saying where they came from (`provenance`),
    spanning its trials' times in the source. Returns how many winners were stale."""
    conn = db.db.conn
    spans = {key: (first, last) for key, first, last in conn.execute(
        "SELECT device_key, min(created_at), max(created_at) FROM trials GROUP BY device_key")}
    stale = [w.key.id for w in db.all_winners() if not row_is_current(w)]
    conn.executemany("DELETE FROM winners WHERE key_id = ?", [(k,) for k in stale])
    alternates = [a.trial_id for a in map(db.fastest_deterministic, db.all_winners())
                  if a is not None]
    conn.execute("DELETE FROM trials WHERE id NOT IN (SELECT trial_id FROM winners) AND id "
                 f"NOT IN ({', '.join('?' * len(alternates))})", alternates)
    conn.execute("DELETE FROM baselines")  # the winners' sdpa_backend and sdpa_ms keep them
    conn.execute("DELETE FROM runs WHERE id NOT IN (SELECT run_id FROM trials "
                 "WHERE run_id IS NOT NULL)")
    undescribed = conn.execute(
        "SELECT w.gpu_name, w.device_key, group_concat(DISTINCT w.triton_version), "
        "group_concat(DISTINCT w.torch_version), count(DISTINCT t.id), count(*) "
        "FROM winners w JOIN trials t "
        "ON t.id = w.trial_id WHERE t.run_id IS NULL OR t.run_id NOT IN (SELECT id FROM runs) "
        "GROUP BY w.device_key").fetchall()
    for gpu, device_key, triton, torch, trials, winners in undescribed:
        first, last = spans[device_key]
        db.db["runs"].insert({
            "id": f"earlier:{device_key}", "status": "ok", "started_at": first,
            "ended_at": last, "gpu_name": gpu, "device_key": device_key,
            "triton_version": triton, "torch_version": torch, "flashgen_version": None,
            "command": provenance, "trials": trials, "winners": winners,
        })
    return len(stale)


def slim(source: Path, out: Path | None = None, *, provenance: str,
         in_place: bool = False, force: bool = False) -> SlimReport:
    """Write `source` cut down to its current winners (see the module docstring) to `out`,
    or over `source` itself with `in_place`. The copy is migrated to the current schema (so
    its rows are re-keyed by kernel hash), vacuumed and left in rollback-journal mode, so a
    read-only install reads it without a WAL file. `provenance` describes, in the runs row
    of each GPU, the runs that tuned rows the file has no run row for. In place, no other
    process may have the file open: its WAL files are removed with the old file."""
    source = Path(source)
    if not source.is_file():
        raise FileNotFoundError(f"no tuning database at {source}")
    if in_place == (out is not None):
        raise ValueError("give an output path or in_place=True (not both)")
    target = source if out is None else Path(out)
    if not in_place and target.resolve() == source.resolve():
        raise ValueError(f"{target} is the source; pass in_place=True to replace it")
    if not in_place and target.exists() and not force:
        raise FileExistsError(f"{target} exists; pass force=True to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        _copy(source, tmp)
        os.chmod(tmp, source.stat().st_mode & 0o777)  # not mkstemp's owner-only mode
        with TuningDB(tmp) as db:
            with db._write():
                stale = _cut(db, provenance)
            db.db.execute("PRAGMA journal_mode = DELETE")
            db.db.execute("VACUUM")
            counts = {t: db.db[t].count for t in ("winners", "trials", "baselines", "runs")}
        for suffix in ("-wal", "-shm"):
            Path(f"{tmp}{suffix}").unlink(missing_ok=True)
        source_bytes = source.stat().st_size
        os.replace(tmp, target)
        if in_place:  # the old file's WAL (already copied) must not meet the new one
            for suffix in ("-wal", "-shm"):
                Path(f"{target}{suffix}").unlink(missing_ok=True)
    finally:
        tmp.unlink(missing_ok=True)
    return SlimReport(source_bytes, target.stat().st_size, counts["winners"], counts["trials"],
                      counts["baselines"], counts["runs"], stale)


def check_current(path: Path) -> list[str]:
    """Every winner of `path` whose kernel is not the one its variant renders to now, by key
    id (empty: all current). Read only."""
    with TuningDB.open_readonly(path) as db:
        return [w.key.id for w in db.all_winners() if not row_is_current(w)]
