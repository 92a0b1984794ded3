"""How close does the tuner get to the best variant of a space, and how fast? (GPU)

For each problem: an exhaustive sweep (`tune_problem(..., exhaustive=True)`: every valid
variant checked and timed, as `flashgen tune --exhaustive` does) into OUT/sweep.db, timing
each variant's share of its batch's compile and its own check-and-time. Then the tuner is
replayed on the sweep's measurements (a bench that answers from the sweep, so no device
time): for each seed, a fresh database (no earlier winners: a new problem), the default and
the device's portfolio first, then TPE, `--trials` trials in batches of `--compile-workers`.
Reported per problem, the median over seeds of:

* ratio: the tuner's best time / the sweep's best time (1.000: it found the best);
* trials to 2%: measured trials until one within 2% of the sweep's best;
* seconds to 2%: the sweep's cost of those trials (compile share + check-and-time), an
  estimate of a live run's time to 2% with a warm process;
* and the sweep's own wall time.

The spaces hold thousands of valid variants (about 3,300 to 4,400 on an H100 for these
problems), more than a few minutes of device time can sweep, so `--limit N` sweeps N
variants: the default, the portfolio, every point of the loop orders named by `--every`, and a
seeded uniform sample of the rest; the tuner searches the same set (the mode's space is
narrowed to it while the script runs). `--limit 0` sweeps the whole space. The docs say which
was used (docs/search-quality.md).

The sweep needs the GPU and the replay does not: `--phase sweep` on the GPU machine (it
resumes a cut-off sweep of the same `--out`), then `--phase replay` anywhere on that folder.
`--part K/N` sweeps every N-th variant of the set from the K-th, so one problem's sweep can
be spread over GPUs or sessions, each part in its own folder; the replay takes the merged
database and every part's cost file (`cost-...-pKofN.json`) from one folder and adds up
their sweep times.

    python scripts/search_quality.py --out out/sq --phase sweep --every fa3 --limit 120
    python scripts/search_quality.py --out out/sq --phase replay --every fa3 --limit 120
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import optuna
import torch

from flashgen.kernels import modes
from flashgen.kernels.hardware import DeviceInfo, device_info
from flashgen.kernels.problem import Problem
from flashgen.kernels.variant import Variant
from flashgen.store.db import TuningDB
from flashgen.store.keys import TuningKey
from flashgen.tune.fwd_bench import KernelBench, Measurement
from flashgen.tune.search import TuneOptions, tune_problem

#: (head dim, causal, sequence length), in the order `--problems N` takes them: the first
#: four cover D64 and D128, causal and not, 2k and 8k.
GRID: tuple[tuple[int, bool, int], ...] = (
    (64, False, 2048), (128, True, 2048), (64, True, 8192), (128, False, 8192),
    (128, False, 2048), (64, True, 2048), (128, True, 8192), (64, False, 8192),
)
#: Within this factor of the sweep's best counts as found.
WITHIN = 1.02


def problems(count: int, dtype: str) -> list[Problem]:
    """FlashAttention's benchmark shapes: batch x length = 16k tokens, heads x dim = 2048."""
    return [Problem(16384 // n, 2048 // d, 2048 // d, n, n, d, dtype, causal)
            for d, causal, n in GRID[:count]]


def shape_problem(text: str, dtype: str) -> Problem:
    """"B,HQ,HKV,N,D,CAUSAL" -> a square problem (Nq = Nk = N)."""
    b, hq, hkv, n, d, causal = (int(x) for x in text.split(","))
    return Problem(b, hq, hkv, n, n, d, dtype, bool(causal))


def sample(problem: Problem, device: DeviceInfo, limit: int, seed: int,
           every: Sequence[str] = ()) -> list[Variant]:
    """The variants swept: all valid ones, or `limit` in all (more if the kept ones are
    more): the default and the portfolio (which the tuner measures first), every valid point
    of the loop orders in `every` (a uniform sample holds few fa3 points, where the winners
    are), then a seeded uniform sample of the rest."""
    space = modes.space_of("fwd")
    valid = space.points(problem, device)
    if not limit or limit >= len(valid):
        return valid
    keep = [space.default(problem, device), *space.portfolio(problem, device),
            *(v for v in valid if v.loop_order in every)]
    keep = list(dict.fromkeys(keep))
    rest = [v for v in valid if v not in set(keep)]
    picked = random.Random(seed).sample(rest, max(0, limit - len(keep)))
    return list(dict.fromkeys([*keep, *picked]))


@contextlib.contextmanager
def narrowed(points: list[Variant]) -> Iterator[None]:
    """The forward space, narrowed to `points` while the block runs: the sweep and the
    tuner then search the same set."""
    original = modes.SPACES["fwd"]
    allowed = set(points)

    def why_invalid(v: Variant, problem: Problem, device: DeviceInfo) -> str | None:
        reason = original.why_invalid(v, problem, device)
        return reason or (None if v in allowed else "outside the swept sample")

    modes.SPACES["fwd"] = dataclasses.replace(
        original, points=lambda problem, device: list(points), why_invalid=why_invalid)
    try:
        yield
    finally:
        modes.SPACES["fwd"] = original


class TimedBench:
    """A bench that notes what each variant cost: its share of its batch's compile wall
    time, and its own check and timing."""

    def __init__(self, bench: KernelBench) -> None:
        self.bench = bench
        self.cost: dict[Variant, float] = {}

    def compile(self, variants: Sequence[Variant]) -> dict[Variant, str]:
        start = time.perf_counter()
        failures = self.bench.compile(variants)
        share = (time.perf_counter() - start) / max(1, len(variants))
        for v in variants:
            self.cost[v] = share
        return failures

    def measure(self, variant: Variant) -> Measurement:
        start = time.perf_counter()
        try:
            return self.bench.measure(variant)
        finally:
            self.cost[variant] = self.cost.get(variant, 0.0) + time.perf_counter() - start

    def baseline(self) -> Any:
        return self.bench.baseline()


class ReplayBench:
    """Answers from the sweep: the stored measurement of each variant, in the order asked."""

    def __init__(self, rows: dict[Variant, Measurement]) -> None:
        self.rows = rows
        self.order: list[Variant] = []

    def compile(self, variants: Sequence[Variant]) -> dict[Variant, str]:
        return {}

    def measure(self, variant: Variant) -> Measurement:
        self.order.append(variant)
        return self.rows.get(variant) or Measurement.failed("not measured by the sweep")

    def baseline(self) -> None:
        return None


def sweep_rows(db: TuningDB, key: TuningKey | None,
               problem: Problem) -> dict[Variant, Measurement]:
    rows = {}
    for row in db.trials(key, problem):  # oldest first: the latest row of a variant stays
        if row.status == "pruned":
            continue
        variant = Variant.from_dict(row.variant)
        rows[variant] = (Measurement("ok", timing=row.timing, tflops=row.tflops,
                                     error=row.error, bound=row.bound)
                         if row.status == "ok" else Measurement.failed(row.reason))
    return rows


def replay(problem: Problem, device: DeviceInfo, rows: dict[Variant, Measurement],
           cost: dict[Variant, float], best_ms: float, trials: int, seed: int,
           batch: int) -> dict[str, Any]:
    bench = ReplayBench(rows)
    with tempfile.TemporaryDirectory() as folder, TuningDB(Path(folder) / "t.db") as db:
        result = tune_problem(problem, bench, db, device,  # type: ignore[arg-type]
                              TuneOptions(trials=trials, seed=seed, batch=batch))
    reached, seconds, best = None, 0.0, float("inf")
    for i, variant in enumerate(bench.order, 1):
        seconds += cost.get(variant, 0.0)
        m = rows.get(variant)
        if m is not None and m.status == "ok" and m.timing is not None:
            best = min(best, m.timing.median_ms)
        if reached is None and best <= WITHIN * best_ms:
            reached = (i, seconds)
    return {"ratio": (result.best_ms or float("inf")) / best_ms,
            "trials_to_2pct": reached[0] if reached else None,
            "seconds_to_2pct": reached[1] if reached else None}


def cost_path(out: Path, problem: Problem, part: tuple[int, int] = (0, 1)) -> Path:
    """Where the sweep (or part K of N of it) notes each variant's cost (a plain file name:
    it travels anywhere)."""
    mask = "causal" if problem.causal else "full"
    suffix = f"-p{part[0]}of{part[1]}" if part[1] > 1 else ""
    return out / (f"cost-{problem.dtype}-D{problem.head_dim}-{mask}-N{problem.seq_q}"
                  f"-B{problem.batch}-H{problem.heads_q}-{problem.heads_kv}{suffix}.json")


def noted_costs(out: Path, problem: Problem) -> dict[str, Any] | None:
    """The costs every sweep of `problem` noted in `out`, a whole one's or its parts'
    merged: their variants' costs and the sum of their sweep times (GPU seconds, however
    many GPUs ran the parts). None where there are none."""
    whole = cost_path(out, problem)
    files = sorted(out.glob(whole.stem + "-p*of*.json"))
    if files:  # parts: all N of them, of one N (a whole sweep's file beside them is older)
        found = {tuple(map(int, f.stem.rsplit("-p", 1)[1].split("of"))) for f in files}
        counts = {n for _, n in found}
        if len(counts) != 1 or {k for k, _ in found} != set(range(counts.pop())):
            print(f"warning: {problem}: parts {sorted(found)} are not all parts of one sweep; "
                  "the replay covers what they hold", file=sys.stderr)
    elif whole.exists():
        files = [whole]
    else:
        return None
    merged: dict[str, Any] = {"cost": {}, "sweep_s": 0.0}
    for path in files:
        known = json.loads(path.read_text())
        merged["cost"].update(known["cost"])
        merged["sweep_s"] += known["sweep_s"]
    return merged


def parse_part(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N): part K (from 0) of N."""
    k, sep, n = text.partition("/")
    if not sep or not (k.isdigit() and n.isdigit()) or not 0 <= int(k) < int(n):
        raise argparse.ArgumentTypeError(f"--part takes K/N with 0 <= K < N, not {text!r}")
    return int(k), int(n)


def sweep(problem: Problem, db: TuningDB, device: DeviceInfo, target: torch.device,
          args: argparse.Namespace) -> float:
    """Sweep `problem`'s sample into `db` (resuming: measured variants are skipped) and add
    the costs of what this run measured to its cost file, also when it is interrupted (a
    sweep spread over calls is stopped with SIGINT each time). Returns the wall seconds."""
    points = sample(problem, device, args.limit, seed=0, every=args.every)
    part, parts = args.part
    with narrowed(points[part::parts]):
        bench = TimedBench(KernelBench(problem, target, compile_workers=args.compile_workers))
        start = time.perf_counter()
        try:
            tune_problem(problem, bench, db, device,  # type: ignore[arg-type]
                         TuneOptions(exhaustive=True, batch=args.compile_workers))
        finally:
            wall = time.perf_counter() - start
            path = cost_path(args.out, problem, args.part)
            known = (json.loads(path.read_text()) if path.exists()
                     else {"cost": {}, "sweep_s": 0.0})
            known["cost"].update({v.to_json(): c for v, c in bench.cost.items()})
            known["sweep_s"] += wall
            path.write_text(json.dumps(known))
    return wall


def estimated_costs(db: TuningDB, problem: Problem) -> dict[str, Any]:
    """Costs when the sweep's cost file is missing: its wall time from the rows' timestamps,
    spread evenly over the variants it recorded (an estimate, said so in the table)."""
    rows = db.trials(None, problem)
    stamps = sorted(datetime.datetime.fromisoformat(r.created_at) for r in rows)
    wall = (stamps[-1] - stamps[0]).total_seconds() * len(rows) / max(1, len(rows) - 1)
    return {"cost": {Variant.from_dict(r.variant).to_json(): wall / len(rows) for r in rows},
            "sweep_s": wall, "estimated": True}


def replay_problem(problem: Problem, db: TuningDB, device: DeviceInfo,
                   args: argparse.Namespace) -> dict[str, Any] | None:
    """Replay the tuner `--seeds` times on the sweep of `problem`; one table line."""
    rows = sweep_rows(db, None, problem)
    ok = [m.timing.median_ms for m in rows.values() if m.status == "ok" and m.timing is not None]
    if not ok:
        print(f"{problem}: nothing passed the sweep", file=sys.stderr)
        return None
    known = noted_costs(args.out, problem) or estimated_costs(db, problem)
    cost = {Variant.from_json(k): c for k, c in known["cost"].items()}
    # Variants a cut-off run measured before its cost file was written: the mean noted cost.
    mean = statistics.fmean(cost.values()) if cost else 0.0
    cost = {v: cost.get(v, mean) for v in rows} | cost
    best_ms = min(ok)
    # The tuner searches exactly what was swept (pruned points included: it may pick them).
    swept = list(dict.fromkeys(Variant.from_dict(r.variant) for r in db.trials(None, problem)))
    with narrowed(swept):
        runs = [replay(problem, device, rows, cost, best_ms, args.trials, seed,
                       args.compile_workers) for seed in range(args.seeds)]
    return {
        "problem": f"D{problem.head_dim} {'causal' if problem.causal else 'full'} "
                   f"N{problem.seq_q} B{problem.batch} H{problem.heads_q}"
                   + (f"/{problem.heads_kv}" if problem.heads_kv != problem.heads_q else ""),
        "swept": len(swept), "passed": len(ok), "best_ms": best_ms,
        "sweep_s": known["sweep_s"], "cost": "estimated" if known.get("estimated") else "noted",
        "ratio": statistics.median(r["ratio"] for r in runs),
        "trials_to_2pct": _median([r["trials_to_2pct"] for r in runs]),
        "seconds_to_2pct": _median([r["seconds_to_2pct"] for r in runs]),
        "reached": sum(r["trials_to_2pct"] is not None for r in runs),
        "seeds": len(runs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for results")
    parser.add_argument("--problems", type=int, default=4, help=f"first N of {len(GRID)}")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--limit", type=int, default=256,
                        help="variants swept per problem (0: the whole valid space)")
    parser.add_argument("--trials", type=int, default=50, help="tuner trials per replay")
    parser.add_argument("--seeds", type=int, default=5, help="replays per problem")
    parser.add_argument("--compile-workers", type=int, default=16)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--every", action="append", default=[], choices=("fa1", "fa2", "fa3"),
                        help="also sweep every valid variant of this loop order (repeatable)")
    parser.add_argument("--shape", action="append", default=[], metavar="B,HQ,HKV,N,D,CAUSAL",
                        help="sweep this problem instead of the grid's (repeatable); CAUSAL "
                             "is 0 or 1. For problems the portfolio was not picked on")
    parser.add_argument("--phase", choices=("both", "sweep", "replay"), default="both",
                        help="sweep: GPU only; replay: CPU only, from OUT's sweep")
    parser.add_argument("--part", type=parse_part, default=(0, 1), metavar="K/N",
                        help="sweep every N-th variant from the K-th (0-based): one part of "
                             "a sweep spread over GPUs or sessions")
    args = parser.parse_args(argv)
    if args.part[1] > 1 and args.phase != "sweep":
        print("error: --part sweeps one part: run it with --phase sweep, then replay the "
              "merged parts (docs/search-quality.md)", file=sys.stderr)
        return 2
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    device_file = args.out / "device.json"
    if args.phase != "replay":
        if not torch.cuda.is_available():
            print("error: the sweep needs a CUDA GPU (--phase replay runs on the CPU)",
                  file=sys.stderr)
            return 2
        target = torch.device("cuda", args.gpu)
        device = device_info(target)
        device_file.write_text(json.dumps(dataclasses.asdict(device)))
    elif not device_file.exists():
        print(f"error: no sweep in {args.out} (device.json is missing)", file=sys.stderr)
        return 2
    else:
        found = json.loads(device_file.read_text())
        device = DeviceInfo(**{**found, "capability": tuple(found["capability"])})
    lines = []
    with TuningDB(args.out / "sweep.db") as db:
        chosen = ([shape_problem(text, args.dtype) for text in args.shape] if args.shape
                  else problems(args.problems, args.dtype))
        for problem in chosen:
            if args.phase != "replay":
                wall = sweep(problem, db, device, target, args)
                print(f"swept {problem} in {wall:.0f} s", flush=True)
            if args.phase != "sweep":
                line = replay_problem(problem, db, device, args)
                if line is not None:
                    lines.append(line)
                    print(json.dumps(line), flush=True)
    _write(args.out, lines, device, args)
    return 0


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) * 2 > len(values) else None


def _write(out: Path, lines: list[dict[str, Any]], device: DeviceInfo,
           args: argparse.Namespace) -> None:
    if not lines:
        return
    with (out / "search_quality.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(lines[0]))
        writer.writeheader()
        writer.writerows(lines)
    fmt = lambda v, f: "-" if v is None else format(v, f)
    table = [f"{device.name}, {args.dtype}, limit {args.limit or 'none'}, {args.trials} "
             f"trials, {args.seeds} seeds, {args.compile_workers} compile threads", "",
             "| problem | swept (passed) | sweep s | tuner/best | trials to 2% | s to 2% "
             "| seeds reaching 2% | costs |", "|---|---|---|---|---|---|---|---|"]
    for line in lines:
        table.append(f"| {line['problem']} | {line['swept']} ({line['passed']}) | "
                     f"{line['sweep_s']:.0f} | {line['ratio']:.3f} | "
                     f"{fmt(line['trials_to_2pct'], '.0f')} | "
                     f"{fmt(line['seconds_to_2pct'], '.1f')} | "
                     f"{line['reached']}/{line['seeds']} | {line['cost']} |")
    (out / "search_quality.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    sys.exit(main())
