"""One stored result per variant: what the tuner asks before it measures or stores one.

Why: a resumed run stored its pruned rows again (validity is recomputed on every run, and
nothing looked for the old row), and tuners of one problem running at once with the same
seed measured the same variants, each knowing only what was stored when it started. So:

* `stored_trial` is the row that makes measuring (or storing) a variant again pointless;
* `claim` looks for that row and, if there is none, marks the variant as being measured by
  this run, in one write transaction, so two tuners cannot both find it free;
* `release` drops a run's marks once its rows are stored (or it stops).

A mark whose process is gone (same host) or that is older than `CLAIM_TTL_S` (a measurement
takes seconds) is stale and taken over, so a killed tuner blocks nothing for long.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import time
from collections.abc import Collection
from dataclasses import dataclass

from flashgen.kernels.modes import AnyVariant
from flashgen.kernels.problem import Problem
from flashgen.store.db import (
    TrialRow,
    TuningDB,
    _problem_json,
    _trial_row,
    gone_here,
    settles,
)
from flashgen.store.keys import TuningKey

#: Seconds after which another host's mark counts as abandoned.
CLAIM_TTL_S = 600.0

#: Statuses of a row that stands for a measurement: such a variant is not measured again.
MEASURED: tuple[str, ...] = ("ok", "failed")


@dataclass(frozen=True)
class Claim:
    """The answer of `claim`: a stored row to take instead of measuring, or whether this run
    holds the variant (False: another tuner is measuring it now)."""

    row: TrialRow | None = None
    ours: bool = False


def stored_trial(db: TuningDB, key: TuningKey, problem: Problem, variant: AnyVariant,
                 statuses: Collection[str] = MEASURED) -> TrialRow | None:
    """The latest stored row of `variant` on `problem` under `key` with one of `statuses`
    that settles it, or None."""
    rows = db.db["trials"].rows_where(
        "key_id = ? and problem_json = ? and variant_json = ?",
        [key.id, _problem_json(problem), variant.to_json()], order_by="id desc")
    for row in map(_trial_row, rows):
        if row.status in statuses and settles(row):
            return row
    return None


def _alive(host: str, pid: int, claimed_at: float) -> bool:
    if time.time() - claimed_at > CLAIM_TTL_S:
        return False
    return not gone_here(host, pid)


def claim(db: TuningDB, key: TuningKey, problem: Problem, variant: AnyVariant,
          owner: str) -> Claim:
    """Take `variant` for measuring by `owner` (a run id), unless a row already settles it
    or another live tuner holds it; all in one write transaction."""
    problem_json, variant_json = _problem_json(problem), variant.to_json()
    with db._write():
        row = stored_trial(db, key, problem, variant)
        if row is not None:
            return Claim(row=row)
        held = list(db.db["claims"].rows_where(
            "key_id = ? and problem_json = ? and variant_json = ?",
            [key.id, problem_json, variant_json]))
        if held and held[0]["owner"] != owner and _alive(
                held[0]["host"], held[0]["pid"], held[0]["claimed_at"]):
            return Claim()
        db.db["claims"].upsert(
            {"key_id": key.id, "problem_json": problem_json, "variant_json": variant_json,
             "owner": owner, "host": socket.gethostname(), "pid": os.getpid(),
             "claimed_at": time.time()},
            pk=("key_id", "problem_json", "variant_json"))
    return Claim(ours=True)


def release(db: TuningDB, key: TuningKey, owner: str) -> None:
    """Drop every mark `owner` holds under `key`. Best effort: it runs while an error (a
    full disk, Ctrl-C) may be on its way out, which it must not replace; a mark left behind
    goes stale when this process ends."""
    with contextlib.suppress(sqlite3.Error), db._write():
        db.db.execute("DELETE FROM claims WHERE key_id = ? AND owner = ?", [key.id, owner])
