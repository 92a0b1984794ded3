"""`flashgen bench --memory`: peak GPU memory of one call at long sequence lengths.

It shows what tiling buys: flashgen never stores the N x N scores, so its memory grows with N,
while SDPA's math backend materialises them and grows with N^2 until it runs out (reported as
"OOM", which is the point, not a failure of the run).

The peak is `torch.cuda.max_memory_allocated` during the call minus what was allocated before
it: the inputs (and `do`) are excluded; the output, the log-sum-exp, workspaces, and for
forward + backward the saved tensors and the three gradients are included. One-time
allocations of a first call (e.g. a cuBLAS workspace) count too; flashgen has none.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from rich import box
from rich.table import Table

from flashgen.bench.competitors import AttentionFn, Competitor
from flashgen.bench.suite import Mode
from flashgen.kernels.problem import Problem
from flashgen.tune.fwd_bench import describe_failure

MEMORY_SEQ_LENS = (32768, 65536, 131072)
MemoryStatus = Literal["ok", "OOM", "n/a"]
Measure = Callable[[Callable[[], object], torch.device], int]
_GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryRow:
    problem: Problem
    mode: Mode
    competitor: str
    status: MemoryStatus
    peak_bytes: int | None = None
    reason: str = ""


def memory_problems(problems: Iterable[Problem],
                    seq_lens: Sequence[int] = MEMORY_SEQ_LENS) -> list[Problem]:
    """Batch 1 at each length, for every head layout, dtype and mask among `problems`."""
    kinds = dict.fromkeys((p.heads_q, p.heads_kv, p.head_dim, p.dtype, p.causal)
                          for p in problems)
    return [Problem(1, hq, hkv, n, n, d, dtype, causal)
            for hq, hkv, d, dtype, causal in kinds for n in seq_lens]


def memory_modes(modes: Iterable[Mode]) -> list[Mode]:
    """The forward always; forward + backward when the run times a backward."""
    return ["fwd", "both"] if {"bwd", "both"} & set(modes) else ["fwd"]


def peak_memory(call: Callable[[], object], device: torch.device) -> int:
    """Bytes allocated at the peak of `call` beyond what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    call()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _inputs(p: Problem, device: torch.device,
            seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Drawn on the device: at 128k tokens a CPU generator would spend seconds per tensor, and
    # the values only need to be random, not equal to the timing run's.
    gen = torch.Generator(device=device).manual_seed(seed)

    def one(heads: int, seq: int) -> torch.Tensor:
        return torch.randn(p.batch, heads, seq, p.head_dim, device=device, dtype=p.torch_dtype,
                           generator=gen)

    return one(p.heads_q, p.seq_q), one(p.heads_kv, p.seq_k), one(p.heads_kv, p.seq_k), \
        one(p.heads_q, p.seq_q)


def _call(fn: AttentionFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          do: torch.Tensor, mode: Mode) -> Callable[[], object]:
    if mode == "fwd":
        def forward() -> None:
            with torch.no_grad():
                fn(q, k, v)

        return forward
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

    def step() -> None:
        fn(*leaves).backward(do)

    return step


def _release(device: torch.device) -> None:
    gc.collect()  # an OOM's traceback can hold the frames that own the partial tensors
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_memory(problems: Sequence[Problem], modes: Sequence[Mode], device: torch.device,
               competitors: Sequence[Competitor], *, seed: int = 0,
               measure: Measure = peak_memory,
               on_row: Callable[[MemoryRow], None] | None = None) -> list[MemoryRow]:
    """Peak memory of each competitor on each problem; OOM and other failures become rows.
    `on_row` sees each row as soon as it exists (progress, incremental CSV)."""
    rows: list[MemoryRow] = []

    def add(row: MemoryRow) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)
    for index, problem in enumerate(problems):
        q, k, v, do = _inputs(problem, device, seed + index)
        for competitor in competitors:
            try:
                fn = competitor.prepare(problem, device).fn
            except Exception as exc:
                for m in modes:
                    add(MemoryRow(problem, m, competitor.name, "n/a",
                                  reason=describe_failure(exc)))
                continue
            for mode in modes:
                row: MemoryRow
                try:
                    peak = measure(_call(fn, q, k, v, do, mode), device)
                    row = MemoryRow(problem, mode, competitor.name, "ok", peak)
                except torch.OutOfMemoryError as exc:
                    row = MemoryRow(problem, mode, competitor.name, "OOM",
                                    reason=describe_failure(exc, limit=200))
                except Exception as exc:
                    row = MemoryRow(problem, mode, competitor.name, "n/a",
                                    reason=describe_failure(exc))
                add(row)
                _release(device)
        del q, k, v, do
        _release(device)
    return rows


def _size(row: MemoryRow | None) -> str:
    if row is None:
        return "-"
    if row.status != "ok" or row.peak_bytes is None:
        return row.status
    return f"{row.peak_bytes / _GIB:.2f}"


def memory_table(rows: Sequence[MemoryRow], device_name: str) -> Table:
    """Peak GiB per problem, a column per (mode, competitor), next to the inputs' size."""
    columns = list(dict.fromkeys((r.mode, r.competitor) for r in rows))
    table = Table(title=f"flashgen bench: peak memory beyond the inputs, GiB ({device_name})",
                  box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
    table.add_column("problem", no_wrap=True)
    table.add_column("q+k+v", justify="right")
    for mode, name in columns:  # two header lines: the name, then the mode
        table.add_column(f"{name}\n{'fwd+bwd' if mode == 'both' else mode}", justify="right")
    by_problem: dict[Problem, dict[tuple[str, str], MemoryRow]] = {}
    for r in rows:
        by_problem.setdefault(r.problem, {})[r.mode, r.competitor] = r
    for p, cells in by_problem.items():
        inputs = (p.heads_q * p.seq_q + 2 * p.heads_kv * p.seq_k) * p.batch * p.head_dim \
            * p.torch_dtype.itemsize
        name = f"H{p.heads_q}/{p.heads_kv} N{p.seq_q} D{p.head_dim} {p.dtype}" \
               f"{' causal' if p.causal else ''}"
        table.add_row(name, f"{inputs / _GIB:.2f}", *(_size(cells.get(c)) for c in columns))
    return table


MEMORY_CSV_FIELDS = ("mode", "batch", "heads_q", "heads_kv", "seq_q", "seq_k", "head_dim",
                     "dtype", "causal", "competitor", "status", "peak_bytes", "peak_gib",
                     "reason", "device")


def memory_records(rows: Iterable[MemoryRow], device_name: str) -> list[dict[str, str]]:
    return [{
        "mode": r.mode, "batch": str(r.problem.batch), "heads_q": str(r.problem.heads_q),
        "heads_kv": str(r.problem.heads_kv), "seq_q": str(r.problem.seq_q),
        "seq_k": str(r.problem.seq_k), "head_dim": str(r.problem.head_dim),
        "dtype": r.problem.dtype, "causal": str(r.problem.causal).lower(),
        "competitor": r.competitor, "status": r.status,
        "peak_bytes": "" if r.peak_bytes is None else str(r.peak_bytes),
        "peak_gib": "" if r.peak_bytes is None else f"{r.peak_bytes / _GIB:.4f}",
        "reason": r.reason, "device": device_name,
    } for r in rows]
