"""Re-key a tuning database from the old all-templates hash to the per-family template hashes.

Until the tuning key hashed each mode's templates on its own (`render.template_hash(mode)`),
every row carried one hash of *all* templates, so a backward template edit made the forward
winners stale. A row whose hash equals that old hash of the templates at git revision REV was
tuned with exactly REV's template texts, so its correct new hash is the family hash of REV's
templates for its mode. This rewrites `template_hash`, and `key_id` (which contains it), of
those rows in `trials` and `winners`, in one transaction; other rows are left alone. The
journal mode is not touched: the shipped database stays a single file, out of WAL mode.

    python scripts/rehash_db.py tuning_db/flashgen.db --rev 9685e9b [--dry-run]
"""

from __future__ import annotations

import argparse
import hashlib
import sqlite3
import subprocess
from pathlib import Path

from flashgen.kernels.render import family_hash
from flashgen.store.keys import MODES, TuningKey

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def templates_at(rev: str) -> dict[str, str]:
    """Every template's text at git revision `rev`, by file name."""
    names = _git("ls-tree", "--name-only", f"{rev}:templates").split()
    return {n: _git("show", f"{rev}:templates/{n}") for n in names if n.endswith(".jinja")}


def legacy_hash(templates: dict[str, str]) -> str:
    """The hash keys used before per-family hashing: every template's name and text."""
    digest = hashlib.sha256()
    for name, text in sorted(templates.items()):
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    return digest.hexdigest()[:16]


def rows_keyed(conn: sqlite3.Connection, table: str, template_hash: str,
               mode: str) -> list[sqlite3.Row]:
    """The `mode` rows of `table` keyed by `template_hash`, each with its `_rowid`."""
    return conn.execute(f"SELECT rowid AS _rowid, * FROM {table} "
                        "WHERE template_hash = ? AND mode = ?", (template_hash, mode)).fetchall()


def rekey(conn: sqlite3.Connection, table: str, row: sqlite3.Row, template_hash: str) -> None:
    """Give `row` of `table` the template hash `template_hash`, and the key id that implies."""
    key = TuningKey.from_columns({**dict(row), "template_hash": template_hash})
    conn.execute(f"UPDATE {table} SET template_hash = ?, key_id = ? WHERE rowid = ?",
                 (template_hash, key.id, row["_rowid"]))


def rehash(path: Path, rev: str, dry_run: bool = False) -> dict[tuple[str, str], int]:
    """Rewrite the rows keyed by the old hash of `rev`'s templates; counts per (table, mode)."""
    templates = templates_at(rev)
    old = legacy_hash(templates)
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    counts: dict[tuple[str, str], int] = {}
    with conn:  # one transaction: all rows or none
        for mode in MODES:
            new = family_hash(templates, mode)
            for table in ("trials", "winners"):
                rows = rows_keyed(conn, table, old, mode)
                for row in rows:
                    rekey(conn, table, row, new)
                counts[(table, mode)] = len(rows)
                print(f"{table} {mode}: {len(rows)} row(s) {old} -> {new}")
        if dry_run:
            conn.rollback()
    conn.close()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("db", type=Path, help="the SQLite tuning database to rewrite")
    parser.add_argument("--rev", default="HEAD",
                        help="git revision whose templates the rows were tuned with")
    parser.add_argument("--dry-run", action="store_true", help="count, change nothing")
    args = parser.parse_args()
    rehash(args.db, args.rev, args.dry_run)


if __name__ == "__main__":
    main()
