"""Rich tables for the CLI: a tuning run's results and the database's winners."""

from __future__ import annotations

from collections.abc import Iterable

from rich.table import Table

from flashgen.store.db import WinnerRow
from flashgen.store.keys import Versions
from flashgen.tune.tuner import TuneResult


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def results_table(results: Iterable[TuneResult]) -> Table:
    """One row per tuned problem and mode: its best variant, throughput and search cost."""
    table = Table(title="flashgen tune", show_lines=False)
    table.add_column("problem")
    table.add_column("mode")
    table.add_column("winner")
    table.add_column("TFLOP/s", justify="right")
    table.add_column("ms", justify="right")
    table.add_column("vs SDPA", justify="right")
    table.add_column("trials", justify="right")
    table.add_column("failed", justify="right")
    table.add_column("pruned", justify="right")
    table.add_column("resumed", justify="right")
    table.add_column("time", justify="right")
    for r in results:
        sdpa = "-"
        if r.speedup is not None and r.baseline is not None:
            sdpa = f"{r.speedup:.2f}x ({r.baseline.backend})"
        table.add_row(
            str(r.problem), r.mode, str(r.best) if r.best else "none passed",
            _num(r.best_tflops, ".3g"), _num(r.best_ms, ".4g"), sdpa, str(r.measured),
            str(r.failed), str(r.pruned), str(r.resumed), f"{r.seconds:.1f}s",
        )
    return table


def is_current(winner: WinnerRow, versions: Versions | None = None) -> bool:
    """Whether dispatch would serve this row: same Triton and template text. `versions`
    default to the running ones of the row's mode (each mode hashes its own templates)."""
    versions = versions or Versions.current(winner.key.mode)
    return (winner.key.triton_version, winner.key.template_hash) == (versions.triton,
                                                                      versions.template_hash)


def winners_table(winners: Iterable[WinnerRow], versions: Versions | None = None) -> Table:
    """The database's winners, one per key; stale rows (other Triton or templates) marked.
    `versions`: as for `is_current`."""
    table = Table(title="flashgen winners")
    for name in ("device", "kind", "buckets", "winner", "TFLOP/s", "vs SDPA", "tuned on",
                 "triton / templates"):
        table.add_column(name, justify="right" if name in ("TFLOP/s", "vs SDPA") else "left")
    for w in winners:
        k = w.key
        mask = "causal" if k.causal else "full"
        stale = "" if is_current(w, versions) else " (stale)"
        table.add_row(
            f"{k.gpu_name} sm{k.capability}",
            f"{k.mode} {k.dtype} {mask} D{k.head_dim} GQA{k.gqa}",
            f"Nq<={k.seq_q_bucket} Nk<={k.seq_k_bucket}",
            str(w.variant), _num(w.tflops, ".3g"),
            "-" if w.speedup is None else f"{w.speedup:.2f}x",
            f"B{w.problem.batch} Hq{w.problem.heads_q} Nq{w.problem.seq_q} Nk{w.problem.seq_k}",
            f"{k.triton_version} / {k.template_hash}{stale}",
        )
    return table
