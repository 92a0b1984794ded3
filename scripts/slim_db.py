"""Cut a tuning database down to its current winners, their trials and provenance.

How the shipped `tuning_db/flashgen.db` is made from the databases tuning runs wrote
(`flashgen.store.slim`): the source is only read unless `--in-place` is given.

    python scripts/slim_db.py SOURCE.db --out tuning_db/flashgen.db --force \
        --provenance "flashgen tune --preset fa-bench --preset llama3-8b ..."
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flashgen.store.slim import check_current, slim


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="the database to read")
    parser.add_argument("--out", type=Path, help="where to write the slim copy")
    parser.add_argument("--in-place", action="store_true",
                        help="replace SOURCE itself (no other process may have it open)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    parser.add_argument("--provenance", required=True,
                        help="where rows without a run row came from (the runs row per GPU)")
    args = parser.parse_args(argv)
    if (args.out is None) == (not args.in_place):
        parser.error("give --out PATH or --in-place")
    report = slim(args.source, args.out, provenance=args.provenance, in_place=args.in_place,
                  force=args.force)
    out = args.out or args.source
    print(f"{args.source} ({report.source_bytes:,} bytes) -> {out} ({report.out_bytes:,} "
          f"bytes): {report.winners} winners, {report.trials} trials, {report.baselines} "
          f"baselines, {report.runs} runs; {report.stale_winners} stale winners left out")
    stale = check_current(out)
    if stale:
        print(f"error: {len(stale)} winners are not current: {stale[:3]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
