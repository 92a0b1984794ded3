"""Carry tuning rows across a template change that leaves their kernels byte-identical.

A row's key holds the hash of its mode's templates, so any edit of a forward template
(adding a kernel family, say) retires every forward row. Where the edit did not touch a row's
own kernel, its measurement still stands: this re-keys such rows to the current hash. For
each `mode` row in `trials` and `winners` keyed by the family hash of the templates at git
revision REV, the row's variant is rendered for its problem with REV's templates and with the
current ones; only when the two sources are identical are `template_hash` and `key_id`
rewritten (one transaction). Other rows are left as they were, retired.

What this does not claim: that a carried winner is still the fastest point of a space that
has grown since. `flashgen tune` resumes from the carried trials and measures the new
default and portfolio points first, so a re-run settles that.

A retired winner is never served (dispatch looks rows up by the current hash), but it keeps
the shipped database out of step with the templates; `--drop-retired` deletes the `winners`
rows still keyed by REV's hash once the carry is done, so `flashgen tune` on those problems
fills the gap. Retired trials stay, as history.

    python scripts/carry_rows.py tuning_db/flashgen.db --rev 9f884c0 [--dry-run] [--drop-retired]
        [--mode bwd]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from pathlib import Path

import jinja2

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rehash_db import rekey, rows_keyed, templates_at

from flashgen.kernels.bwd_render import bwd_roles, render_bwd, render_bwd_with
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.problem import Problem
from flashgen.kernels.render import family_hash, render, render_with, template_hash
from flashgen.kernels.variant import Variant


def _unchanged(old_texts: dict[str, str], variant: Variant | BwdVariant,
               problem: Problem) -> bool:
    """Whether `variant`'s kernels render byte-identical with the old and current templates
    (False where either set has no template for one); a backward variant's every kernel."""
    try:
        if isinstance(variant, BwdVariant):
            return all(render_bwd_with(old_texts, r, variant, problem)
                       == render_bwd(r, variant, problem) for r in bwd_roles(variant))
        return render_with(old_texts, variant, problem) == render(variant, problem)
    except jinja2.TemplateNotFound:
        return False


def carry(path: Path, rev: str, mode: str = "fwd", dry_run: bool = False,
          drop_retired: bool = False) -> dict[str, tuple[int, int]]:
    """Re-key `mode` rows tuned with `rev`'s templates whose kernels did not change;
    (carried, left) counts per table."""
    variant_type = {"fwd": Variant, "bwd": BwdVariant}[mode]
    old_texts = templates_at(rev)
    old, new = family_hash(old_texts, mode), template_hash(mode)
    same: dict[tuple[str, str], bool] = {}
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    counts: dict[str, tuple[int, int]] = {}
    with conn:  # one transaction: all rows or none
        for table in ("trials", "winners"):
            rows = rows_keyed(conn, table, old, mode)
            carried = 0
            for row in rows:
                if table == "trials" and row["status"] == "pruned":
                    # Pruned by REV's rules, which may have changed (a knob a family gained);
                    # the tuner ignores pruned rows and re-checks validity for free anyway.
                    continue
                pair = (row["variant_json"], row["problem_json"])
                if pair not in same:
                    same[pair] = _unchanged(old_texts, variant_type.from_json(pair[0]),
                                            Problem.from_dict(json.loads(pair[1])))
                if same[pair]:
                    rekey(conn, table, row, new)
                    carried += 1
            counts[table] = (carried, len(rows) - carried)
            print(f"{table} {mode}: {carried} row(s) carried {old} -> {new}, "
                  f"{len(rows) - carried} left (kernel changed, or pruned)")
        if drop_retired:
            dropped = conn.execute("DELETE FROM winners WHERE template_hash = ? AND mode = ?",
                                   (old, mode)).rowcount
            print(f"winners {mode}: {dropped} retired row(s) keyed {old} dropped; "
                  "re-tune those problems")
        if dry_run:
            conn.rollback()
    conn.close()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("db", type=Path, help="the SQLite tuning database to rewrite")
    parser.add_argument("--rev", required=True,
                        help="git revision whose templates the rows were tuned with")
    parser.add_argument("--dry-run", action="store_true", help="count, change nothing")
    parser.add_argument("--drop-retired", action="store_true",
                        help="delete the winners left keyed by REV's hash (trials stay)")
    parser.add_argument("--mode", choices=["fwd", "bwd"], default="fwd",
                        help="which family's rows to carry (default: fwd)")
    args = parser.parse_args()
    carry(args.db, args.rev, args.mode, dry_run=args.dry_run, drop_retired=args.drop_retired)


if __name__ == "__main__":
    main()
