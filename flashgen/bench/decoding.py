"""`flashgen bench --mode decode`: the decode family against SDPA and FlexAttention.

Decode is memory-bound, so the figures are time (us), GB/s of K/V read (every valid key and
value of every K/V head once: `DecodeProblem.kv_bytes`) and that rate's share of the GPU's
copy rate, measured in the same run by a large device-to-device copy (bytes read plus bytes
written, per second: the rate the HBM sustains when it streams).

flashgen runs `attention_with_kvcache` on the problem's own cache (paged or contiguous); the
others run on the same keys as one contiguous (B, Hkv, Nk, D) cache (SDPA and FlexAttention
take no block table), every sequence full. A single query needs no mask (causal or not, it
sees every key), so it runs unmasked everywhere; longer chunks take the bottom-right mask.
Every function is first checked against the float64 reference on a small problem of the
same kind (`gate`), then timed with L2 flushed (`tune.timing.time_cuda`, by `--timer`).
"""

from __future__ import annotations

import csv
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from flashgen.bench.competitors import FLASHGEN, resolve
from flashgen.bench.report import UNSTEADY_NOTE, print_whole, wrapped
from flashgen.kernels.problem import DecodeProblem, Problem
from flashgen.runtime.api import attention_with_kvcache
from flashgen.serve import Dispatcher, default_dispatcher
from flashgen.tune.decode_bench import KVCache, compare_kvcache, make_kvcache
from flashgen.tune.timing import UNSTEADY_SPREAD, time_cpu, time_cuda

#: The yardsticks of a GPU run (sdpa-efficient is slower at decode than both of these).
DECODE_COMPETITORS = (FLASHGEN, "sdpa-flash", "sdpa-cudnn", "flex")
#: Bytes of the copy that measures the copy rate: far past any L2.
COPY_BYTES = 2 << 30
#: The largest gate problem: its float64 reference repeats K/V for every query head.
GATE_KEYS = 2048
#: The decode CSV's columns; its first row, by which a re-run knows the file as its own.
DECODE_CSV_FIELDS = ("batch", "heads_q", "heads_kv", "seq_q", "seq_k", "head_dim", "dtype",
                     "causal", "page_size", "competitor", "status", "us", "gbps", "copy_gbps",
                     "timer", "note", "p20_us", "p80_us")


@dataclass(frozen=True)
class DecodeRow:
    problem: DecodeProblem
    competitor: str
    status: str  # "ok", "failed" (wrong answer or error) or "n/a"
    us: float | None = None
    gbps: float | None = None
    note: str = ""
    p20_us: float | None = None  # the repeats' spread around the median `us`
    p80_us: float | None = None

    @property
    def unsteady(self) -> bool:
        """Repeats spread past UNSTEADY_SPREAD of the median, as the forward's tables mark:
        typically a call whose host time exceeds its GPU work."""
        return (self.us is not None and self.p20_us is not None and self.p80_us is not None
                and self.p80_us - self.p20_us > UNSTEADY_SPREAD * self.us)


def copy_rate(device: torch.device, nbytes: int = COPY_BYTES) -> float:
    """Bytes per second a device-to-device copy moves (read plus written)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    timing = time_cuda(lambda: dst.copy_(src), device, warmup_ms=25, rep_ms=100, timer="gpu")
    return 2 * nbytes / (timing.median_ms * 1e-3)


def gate(problem: DecodeProblem) -> DecodeProblem:
    """A problem of the same kind small enough for the float64 reference: two sequences, at
    most GATE_KEYS keys."""
    return replace(problem, batch=min(problem.batch, 2), seq_k=min(problem.seq_k, GATE_KEYS))


Call = Callable[[KVCache], torch.Tensor]


def _flashgen(problem: DecodeProblem, dispatcher: Dispatcher) -> tuple[Call, str]:
    def run(c: KVCache) -> torch.Tensor:
        out = attention_with_kvcache(c.q, c.k, c.v, c.seqlens, block_table=c.block_table,
                                     causal=problem.causal, dispatcher=dispatcher)
        assert isinstance(out, torch.Tensor)
        return out

    return run, ""


def _dense(c: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache as (B, Hkv, Nk, D) K and V, every sequence full: a contiguous cache as it is
    (a (B, Nk, Hkv, D) tensor viewed so, FlashAttention's own layout; no copy of tens of GB),
    a paged one gathered into a copy."""
    if c.block_table is None:
        return c.k, c.v
    keys = [c.valid(b) for b in range(c.q.shape[0])]
    return (torch.cat([k for k, _ in keys]).contiguous(),
            torch.cat([v for _, v in keys]).contiguous())


def _other(name: str, problem: DecodeProblem, device: torch.device) -> tuple[Call, str]:
    (competitor,) = resolve([name])
    # One query sees every key under either mask: SDPA's and Flex's fastest path is unmasked.
    base = Problem(*[getattr(problem, f) for f in ("batch", "heads_q", "heads_kv", "seq_q",
                                                    "seq_k", "head_dim", "dtype")],
                   causal=problem.causal and problem.seq_q > 1)
    prepared = competitor.prepare(base, device)
    dense: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def run(c: KVCache) -> torch.Tensor:
        if id(c) not in dense:  # outside the timed calls: the timed call reuses it
            dense.clear()
            dense[id(c)] = _dense(c)
        k, v = dense[id(c)]
        return prepared.fn(c.q, k, v)

    return run, prepared.note


def run_decode_bench(problems: Sequence[DecodeProblem], device: torch.device,
                     names: Sequence[str] = DECODE_COMPETITORS, *, seed: int = 0,
                     rep_ms: float = 100.0, timer: str = "wall",
                     csv_path: Path | None = None,
                     console: Console | None = None,
                     dispatcher: Dispatcher | None = None,
                     on_interrupt: Callable[[], None] | None = None) -> list[DecodeRow]:
    """Check and time each competitor on each problem; print one table, write the CSV.
    `timer` as `flashgen bench --timer` takes it: "wall" (calls back to back, a call's host
    launch cost counting where it exceeds its GPU work, as do_bench times) or "gpu".
    Interrupted (Ctrl-C, or SIGTERM through the command), it reports the problems finished,
    then calls `on_interrupt`."""
    console = console or Console()
    dispatcher = dispatcher or default_dispatcher()
    gpu = device.type == "cuda"
    rate = copy_rate(device) if gpu else None
    if rate is not None:
        console.print(f"copy rate: {rate / 1e9:.0f} GB/s (device-to-device, read + write)")
    rows: list[DecodeRow] = []
    interrupted = False
    try:
        for problem in problems:
            _bench_one(problem, names, rows, device, dispatcher, seed, rep_ms, timer)
            if csv_path is not None:  # after every problem: a run cut short keeps its rows
                write_decode_csv(rows, csv_path, rate, timer if gpu else "cpu")
            # Let go of this problem's caches before the next is made: two 128k caches of B64
            # do not fit an 80 GB GPU together.
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM through the command
        console.print("interrupted: reporting the problems finished so far")
        done = {r.problem for r in rows if r.competitor == names[-1]}
        rows = [r for r in rows if r.problem in done]  # a half-measured problem is dropped
        interrupted = True
    print_whole(console, decode_table(rows, names, rate))
    if any(r.unsteady for r in rows):
        console.print(wrapped(UNSTEADY_NOTE, "  "), highlight=False, markup=False,
                      soft_wrap=True)
    if csv_path is not None:
        write_decode_csv(rows, csv_path, rate, timer if gpu else "cpu")
        console.print(f"CSV: {csv_path}")
    if interrupted and on_interrupt is not None:
        on_interrupt()
    return rows


def _bench_one(problem: DecodeProblem, names: Sequence[str], rows: list[DecodeRow],
               device: torch.device, dispatcher: Dispatcher, seed: int, rep_ms: float,
               timer: str) -> None:
    """Each competitor on `problem`, its rows appended to `rows`; its caches go when this
    returns."""
    small = make_kvcache(gate(problem), device, seed,
                         seqlens=[gate(problem).seq_k] * gate(problem).batch)
    cache = make_kvcache(problem, device, seed + 1)
    twin = replace(problem, page_size=0)
    for name in names:
        if name != FLASHGEN and problem.paged and any(
                r.problem == twin and r.competitor == name for r in rows):
            # The others take no block table: their figures are the contiguous twin's.
            rows.append(next(replace(r, problem=problem, note="contiguous twin's figure")
                             for r in rows if r.problem == twin and r.competitor == name))
            continue
        rows.append(_measure(name, problem, small, cache, device, dispatcher, rep_ms, timer))


def _measure(name: str, problem: DecodeProblem, small: KVCache, cache: KVCache,
             device: torch.device, dispatcher: Dispatcher, rep_ms: float,
             timer: str) -> DecodeRow:
    """One competitor on one problem: checked on `small`, then timed on `cache`. Its call
    (and any copy of the cache it made) goes when this returns."""
    try:
        fn, note = (_flashgen(problem, dispatcher) if name == FLASHGEN
                    else _other(name, problem, device))
        checked = compare_kvcache(fn(small), small, problem.causal)
        timing = None
        if checked.ok:  # the timed shape may compile again (FlexAttention) and fail
            timing = (time_cuda(lambda: fn(cache), device, warmup_ms=rep_ms / 4,
                                rep_ms=rep_ms, timer=timer)
                      if device.type == "cuda" else time_cpu(lambda: fn(cache)))
    except Exception as exc:  # a competitor that cannot run this is a data point
        return DecodeRow(problem, name, "n/a", note=f"{type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:160] if str(exc) else ''}")
    if timing is None:
        return DecodeRow(problem, name, "failed", note=checked.reason)
    us = timing.median_ms * 1e3
    return DecodeRow(problem, name, "ok", us, problem.kv_bytes / (us * 1e-6) / 1e9, note,
                     timing.p20_ms * 1e3, timing.p80_ms * 1e3)


def _label(p: DecodeProblem) -> str:
    """E.g. "bf16 D128 32:8 B8 Nk32k p16": Nq only where it is not 1, pN for pages of N
    keys (the table's title says so), nothing for a contiguous cache."""
    nq = f" Nq{p.seq_q}" if p.seq_q != 1 else ""
    nk = f"{p.seq_k // 1024}k" if p.seq_k % 1024 == 0 else str(p.seq_k)
    cache = f" p{p.page_size}" if p.page_size else ""
    return f"{p.dtype} D{p.head_dim} {p.heads_q}:{p.heads_kv} B{p.batch}{nq} Nk{nk}{cache}"


def _us_text(us: float | None) -> str:
    """Microseconds in four characters (tenths under 100 us, thousands as "12k" from 10 ms),
    so a row with a 128k cache keeps within 80 columns."""
    if us is None:
        return "-"
    return f"{us:.1f}" if us < 100 else f"{us:.0f}" if us < 9999.5 else f"{us / 1e3:.0f}k"


def decode_table(rows: Sequence[DecodeRow], names: Sequence[str], rate: float | None) -> Table:
    """us per competitor ("~" before an unsteady median); flashgen's GB/s of K/V read, its
    share of the copy rate and its ratio to the fastest other competitor (above 1: flashgen
    is faster). Compact, to read at 80 columns: headers broken at their dashes, a simple
    box, us to four digits (the CSV has them whole, with the p20 and p80 repeats)."""
    table = Table(title="decode: us a call; flashgen's K/V read rate (pN: pages of N keys)",
                  box=box.SIMPLE_HEAD,
                  collapse_padding=True, pad_edge=False, show_edge=False)
    table.add_column("problem", no_wrap=True)
    for name in names:
        table.add_column(name.replace("-", "-\n"), justify="right")
    table.add_column("GB/s", justify="right")
    table.add_column("of\ncopy", justify="right")
    table.add_column("vs\nbest", justify="right")
    by_problem: dict[DecodeProblem, dict[str, DecodeRow]] = {}
    for r in rows:
        by_problem.setdefault(r.problem, {})[r.competitor] = r
    for problem, found in by_problem.items():
        cells = []
        for name in names:
            r = found.get(name)
            cells.append("-" if r is None else r.status if r.status != "ok"
                         else f"{'~' if r.unsteady else ''}{_us_text(r.us)}")
        mine = found.get(FLASHGEN)
        others = [r.us for n, r in found.items() if n != FLASHGEN and r.status == "ok"]
        share = (f"{mine.gbps * 1e9 / rate:.0%}" if mine and mine.gbps and rate else "-")
        ratio = (f"{min(others) / mine.us:.2f}x" if mine and mine.us and others else "-")
        rate_text = f"{mine.gbps:.0f}" if mine and mine.gbps else "-"
        table.add_row(_label(problem), *cells, rate_text, share, ratio)
    return table


def write_decode_csv(rows: Sequence[DecodeRow], path: Path, rate: float | None,
                     timer: str) -> None:
    """One row per competitor and problem; `timer`: "wall" or "gpu" (`flashgen bench
    --timer`), or "cpu" for the interpreter's wall clock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(DECODE_CSV_FIELDS)
        for r in rows:
            p = r.problem
            writer.writerow([p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim,
                             p.dtype, int(p.causal), p.page_size, r.competitor, r.status,
                             "" if r.us is None else f"{r.us:.2f}",
                             "" if r.gbps is None else f"{r.gbps:.1f}",
                             "" if rate is None else f"{rate / 1e9:.1f}", timer, r.note,
                             "" if r.p20_us is None else f"{r.p20_us:.2f}",
                             "" if r.p80_us is None else f"{r.p80_us:.2f}"])
