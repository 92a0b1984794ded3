"""`flashgen pull`: every host's trials and winners, from a shared Optuna storage into one
SQLite file, so that `show`, dispatch and `export` read them as if tuned there.

Each measured or pruned trial of a flashgen study carries its row (`storage.ROW_ATTR`): the
variant, status, reason, timings, error and bound, seed, the worker's run id, the hash of
the kernel it ran and when. The study says its key and problem (`storage.INFO_ATTR`). A
row already in the file (same key, problem, variant, status, run and time) is not copied
again, so pulling twice, or into a worker's own database, adds nothing twice; a pruned
point is stored once per problem. Winners are then chosen by the file's own rule
(`TuningDB.update_winner`). Studies of other flashgen versions are left where they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from optuna.storages import BaseStorage

from flashgen.kernels.modes import space_of
from flashgen.store.db import TuningDB
from flashgen.store.keys import TuningKey
from flashgen.store.measurement import Timing
from flashgen.tune.storage import BASELINE_ATTR, ROW_ATTR, flashgen_studies


@dataclass
class PullReport:
    """What a pull did: studies read, rows copied and skipped, winners after it."""

    studies: int = 0
    copied: int = 0
    present: int = 0  # rows the file already held
    unreadable: int = 0  # rows whose variant this flashgen cannot build
    other_versions: int = 0  # studies left out: another flashgen version
    winners: int = 0
    keys: set[TuningKey] = field(default_factory=set)


def pull(storage: BaseStorage, db: TuningDB, version: str,
         command: str = "flashgen pull") -> PullReport:
    """Copy the rows of every study of flashgen `version` in `storage` into `db`, and a
    "pulled" run row for each run they came from (`command`: this pull's, kept in it)."""
    report = PullReport()
    # run id -> (a key of its, its first and last row's time)
    runs: dict[str, tuple[TuningKey, str, str]] = {}
    for frozen, info in flashgen_studies(storage):
        if info.version != version:
            report.other_versions += 1
            continue
        report.studies += 1
        key, problem = info.key, info.problem
        variant_type = space_of(key.mode).variant_type
        rows = db.trials(key, problem)
        held = {(r.variant_json, r.status, r.created_at) for r in rows}
        # A pruned point is stored once per problem, whoever pruned it and when: two
        # workers' pruned rows of one variant are one row here.
        pruned = {r.variant_json for r in rows if r.status == "pruned"}
        for trial in storage.get_all_trials(frozen._study_id, deepcopy=False):
            row = trial.user_attrs.get(ROW_ATTR)
            if not row:
                continue  # a trial told from a known outcome: its row is another trial's
            try:
                variant = variant_type.from_dict(row["variant"])
            except (TypeError, ValueError):
                report.unreadable += 1
                continue
            if row["run_id"]:
                first, last = runs.get(row["run_id"], (key, row["created_at"],
                                                       row["created_at"]))[1:]
                runs[row["run_id"]] = (key, min(first, row["created_at"]),
                                       max(last, row["created_at"]))
            text = json.dumps(row["variant"], sort_keys=True)
            if ((text, row["status"], row["created_at"]) in held
                    or (row["status"] == "pruned" and text in pruned)):
                report.present += 1
                continue
            timing = None
            if row["median_ms"] is not None:
                timing = Timing(row["median_ms"], row["p20_ms"], row["p80_ms"], row["reps"])
            db.record_trial(key, problem, variant, row["status"], reason=row["reason"],
                            timing=timing, tflops=row["tflops"], error=row["error"],
                            bound=row["bound"], seed=row["seed"], run_id=row["run_id"],
                            kernel_hash=row["kernel_hash"], once=row["status"] == "pruned",
                            created_at=row["created_at"])
            if row["status"] == "pruned":
                pruned.add(text)
            report.copied += 1
        baseline = frozen.user_attrs.get(BASELINE_ATTR)
        if baseline and db.baseline(key.device_key, key.torch_version, problem,
                                    key.mode) is None:
            db.record_baseline(key.device_key, problem, baseline["backend"],
                               Timing(baseline["median_ms"], baseline["p20_ms"],
                                      baseline["p80_ms"], baseline["reps"]),
                               key.torch_version, key.mode)
        report.keys.add(key)
    report.winners = sum(db.update_winner(key) is not None for key in report.keys)
    for run_id, (key, first, last) in runs.items():
        db.record_pulled_run(run_id, key, version, first, last, command)
    return report
