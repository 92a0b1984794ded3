"""Rich tables for the CLI: a tuning run's results, the database's winners and its runs."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from rich import box
from rich.table import Table

from flashgen.store.current import row_is_current
from flashgen.store.db import RunRow, WinnerRow
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
    """Whether dispatch would serve this row: same Triton, and its kernel is the one its
    variant renders to now. `versions` default to the running ones."""
    versions = versions or Versions.current()
    return winner.key.triton_version == versions.triton and row_is_current(winner)


def winners_table(winners: Iterable[WinnerRow], versions: Versions | None = None) -> Table:
    """The database's winners, one per key; stale rows (other Triton or kernel) marked.
    `versions`: as for `is_current`."""
    table = Table(title="flashgen winners")
    for name in ("device", "kind", "buckets", "winner", "TFLOP/s", "vs SDPA", "tuned on",
                 "triton / kernel"):
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
            f"{k.triton_version} / {(w.kernel_hash or '-')[:16]}{stale}",
        )
    return table


def _took(run: RunRow) -> str:
    if not run.ended_at:
        return ""
    seconds = (datetime.fromisoformat(run.ended_at)
               - datetime.fromisoformat(run.started_at)).total_seconds()
    minutes = round(seconds / 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m"


def runs_table(runs: Iterable[RunRow]) -> Table:
    """The database's provenance, one row per run: when and how it ended, the GPU and
    software, what it wrote, and the command. Few narrow columns, so it fits 80 columns."""
    table = Table(title="flashgen runs", box=box.SIMPLE_HEAD, pad_edge=False, show_lines=True)
    table.add_column("started (UTC)", no_wrap=True)
    table.add_column("GPU, versions", max_width=16)
    table.add_column("wrote", justify="right", no_wrap=True)
    table.add_column("command", ratio=1, overflow="fold")
    for run in runs:
        stack = [(run.gpu_name or "-").removeprefix("NVIDIA ")] + [
            f"{name} {value}" for name, value in (
                ("triton", run.triton_version), ("torch", run.torch_version),
                ("flashgen", run.flashgen_version)) if value]
        table.add_row(
            f"{run.started_at[:16].replace('T', ' ')}\n{run.status} {_took(run)}".rstrip(),
            "\n".join(stack), f"{_num(run.trials, 'd')} trials\n{_num(run.winners, 'd')} won",
            run.command or "-",
        )
    return table
