"""Merge tuning databases (runs on different machines or days) into one, for `slim_db.py`.

The first database is copied to --out and the others' rows are added to it: their trials
renumbered past its own (winners follow their trial), baselines appended, runs and winners
added where their ids are new (a winner of a key already there is kept as it is: re-tune
rather than merge two winners of one key). All databases must be at the same schema as the
first, or older by whole migrations that only deleted rows; the first should be the newest.

`--rechoose` then makes each key's winner the fastest correct trial whose kernel is current,
over every trial the merged file holds (the tuner's own rule, `TuningDB.update_winner`):
for runs that could not see each other's trials, such as a tune whose template was edited
while it ran and whose rows were later found to be of the same kernels.

    python scripts/merge_db.py new.db tuning_db/flashgen.db other.db --out merged.db
    python scripts/slim_db.py merged.db --out tuning_db/flashgen.db --force --provenance ...
"""

from __future__ import annotations

import argparse
import sqlite3
from pathlib import Path

TABLES = ("runs", "trials", "winners", "baselines")


def columns(db: sqlite3.Connection, table: str, schema: str = "main") -> list[str]:
    return [r[1] for r in db.execute(f"pragma {schema}.table_info({table})")]


def merge(first: Path, others: list[Path], out: Path) -> dict[str, int]:
    # SQLite's backup, not a file copy: rows of a run still in the first file's write-ahead
    # log (a run that was killed) come along.
    with sqlite3.connect(first) as source, sqlite3.connect(out) as copy:
        source.backup(copy)
    db = sqlite3.connect(out)
    for other in others:
        db.execute("attach ? as other", (str(other),))
        for table in TABLES:
            if columns(db, table) != columns(db, table, "other"):
                raise SystemExit(f"{other}: table {table} differs from {first}'s; migrate it "
                                 "first (open it with this flashgen)")
        offset = (db.execute("select coalesce(max(id), 0) from trials").fetchone()[0]
                  + db.execute("select coalesce(max(id), 0) from other.trials").fetchone()[0])
        trial = columns(db, "trials")
        db.execute(f"insert into trials ({', '.join(trial)}) select "
                   + ", ".join(f"id + {offset}" if c == "id" else c for c in trial)
                   + " from other.trials")
        winner = columns(db, "winners")
        db.execute(f"insert or ignore into winners ({', '.join(winner)}) select "
                   + ", ".join(f"trial_id + {offset}" if c == "trial_id" else c for c in winner)
                   + " from other.winners")
        base = [c for c in columns(db, "baselines") if c != "id"]
        db.execute(f"insert into baselines ({', '.join(base)}) select {', '.join(base)} "
                   "from other.baselines")
        run = columns(db, "runs")
        db.execute(f"insert or ignore into runs ({', '.join(run)}) select {', '.join(run)} "
                   "from other.runs")
        db.commit()
        db.execute("detach other")
    counts = {t: db.execute(f"select count(*) from {t}").fetchone()[0] for t in TABLES}
    db.close()
    return counts


def rechoose(path: Path) -> int:
    """Choose every key's winner again by the tuner's rule (`TuningDB.update_winner`);
    returns how many keys now have another winning trial."""
    from flashgen.store.db import TuningDB

    changed = 0
    with TuningDB(path) as db:
        for winner in db.all_winners():
            new = db.update_winner(winner.key)
            changed += new is not None and new.trial_id != winner.trial_id
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", type=Path, help="the newest database (its schema is kept)")
    parser.add_argument("others", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rechoose", action="store_true",
                        help="then choose each key's winner again over all its trials")
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"{args.out} exists")
    counts = merge(args.first, args.others, args.out)
    print(f"{args.out}: " + ", ".join(f"{n} {t}" for t, n in counts.items()))
    if args.rechoose:
        print(f"{rechoose(args.out)} keys have another winner")


if __name__ == "__main__":
    main()
