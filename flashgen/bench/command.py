"""The job of `flashgen bench`: measure, print the tables, write the CSV files and the plot.

The CLI parses options and calls `run_bench`; this module owns what a run produces, so the
command stays a thin layer, as `tune` is over the tuner.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from flashgen.bench import plot as bench_plot
from flashgen.bench.competitors import MEMORY_COMPETITORS, resolve
from flashgen.bench.layouts import Layout
from flashgen.bench.memory import (
    MEMORY_CSV_FIELDS,
    MemoryRow,
    memory_modes,
    memory_problems,
    memory_records,
    memory_table,
    run_memory,
)
from flashgen.bench.report import (
    check_csv_target,
    csv_records,
    print_whole,
    short_problem,
    summarize,
    timing_table,
    unavailable_notes,
    wrapped,
    write_csv,
)
from flashgen.bench.suite import Mode, Row, default_timer, run_suite
from flashgen.kernels.hardware import CPU_INTERPRETER
from flashgen.kernels.problem import Problem
from flashgen.serve import Dispatcher


def resolve_device(device: str, gpu: int) -> torch.device:
    """`--device` and `--gpu` -> a torch device; ValueError says what is wrong."""
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"--device must be cuda or cpu, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError("no CUDA GPU is visible; use --device cpu for the interpreter")
    if gpu >= torch.cuda.device_count():
        raise ValueError(f"--gpu {gpu}: only {torch.cuda.device_count()} GPU(s) visible")
    return torch.device("cuda", gpu)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else CPU_INTERPRETER


@dataclass(frozen=True)
class Outputs:
    """Where a run writes: the timing CSV, the plot (None: no plot), the memory CSV."""

    csv: Path
    plot: Path | None
    memory_csv: Path

    @classmethod
    def under(cls, out_dir: Path, csv: Path | None = None, plot: Path | None = None,
              no_plot: bool = False) -> Outputs:
        return cls(csv or out_dir / "bench.csv",
                   None if no_plot else plot or out_dir / "bench.png",
                   out_dir / "memory.csv")

    def check(self, timing: bool = True, memory: bool = False) -> None:
        """Raise ValueError, before anything is measured, if a CSV the run would write
        (`timing`: the timing CSV, `memory`: the memory CSV) would replace a file that is
        not an earlier bench's: see `report.check_csv_target`; and the OSError of a folder
        it cannot make or write (a path through a file, a read-only place), which once came
        after the first problem's measurements and lost them."""
        if timing:
            check_csv_target(self.csv)
        if memory:
            check_csv_target(self.memory_csv, MEMORY_CSV_FIELDS, option="--out")
        written = [p for p, on in ((self.csv, timing), (self.plot, timing),
                                   (self.memory_csv, memory)) if on and p is not None]
        for folder in dict.fromkeys(p.parent for p in written):
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass


def _progress_lines(head: str, problem: Problem, rows: list[Row], width: int = 80) -> str:
    """flashgen's TFLOP/s per mode and its ratio to the best other, for the log: one line
    after `head` where it fits `width`, else the modes on an indented line of their own (a
    problem with modifiers, three modes and their yardsticks ran to 120 characters)."""
    summaries = summarize(rows)
    bests = {s.best.competitor for s in summaries if s.ratio is not None and s.best}
    parts = []
    for s in summaries:
        mine = s.subject.tflops if s.subject is not None else None
        text = f"{s.mode} {'-' if mine is None else format(mine, '.3g')}"
        if s.ratio is not None and s.best is not None:
            # One yardstick for every mode is named once, at the end.
            whom = "" if len(bests) == 1 else f" {s.best.competitor}"
            text += f" ({s.ratio:.2f}x{whom})"
        parts.append(text)
    found = ", ".join(parts) + (f" vs {bests.pop()}" if len(bests) == 1 else "")
    line = f"{head} {short_problem(problem)}: {found}"
    return line if len(line) <= width else f"{head} {short_problem(problem)}:\n    {found}"


def run_bench(
    problems: Sequence[Problem],
    modes: Sequence[Mode],
    device: torch.device,
    competitor_names: Sequence[str],
    outputs: Outputs,
    *,
    timing: bool = True,
    memory: bool = False,
    seed: int = 0,
    rep_ms: float = 100.0,
    timer: str = "wall",
    console: Console | None = None,
    log: Console | None = None,
    dispatcher: Dispatcher | None = None,
    layout: Layout | None = None,
    on_interrupt: Callable[[], None] | None = None,
) -> list[Row]:
    """Time (and with `memory`, measure the peak memory of) the competitors; print and write.
    `rep_ms`: milliseconds of timed calls per measurement on a GPU and `timer` how they are
    timed, "wall" or "gpu" (see `default_timer`).
    `dispatcher` chooses flashgen's kernels (default: the one `flashgen.attention` uses).
    `layout`: windowed or packed problems (`flashgen.bench.layouts`); not with `memory`.
    `problems` come laid out already (`Layout.problems`: each once).

    Tables go to `console`, progress to `log` (stderr by default). The CSV files are
    rewritten after every problem, so a run killed by a time limit leaves what it measured;
    Ctrl-C (SIGINT), or SIGTERM through `flashgen bench`, keeps it too, printed and written
    like a finished run; then `on_interrupt` is called (the command exits 130, so a script
    can tell a partial CSV from a whole one) and nothing more is measured.
    """
    console = console or Console()
    log = log or Console(stderr=True)
    competitors = resolve(competitor_names, dispatcher)
    name = device_name(device)
    rows: list[Row] = []
    interrupted = False
    if timing:
        log.print(wrapped(f"benchmarking {len(problems)} problem(s) x {', '.join(modes)} on "
                          f"{name}: {', '.join(c.name for c in competitors)}"),
                  highlight=False, soft_wrap=True)

        def keep(problem: Problem, found: list[Row]) -> None:
            rows.extend(found)
            write_csv(csv_records(summarize(rows), name, timer), outputs.csv)
            done = len({r.problem for r in rows})
            log.print(_progress_lines(f"[{done}/{len(problems)}]", problem, found),
                      highlight=False, markup=False)

        try:
            run_suite(problems, modes, device, competitors, seed=seed,
                      timer=default_timer(device, rep_ms, timer), on_problem=keep,
                      layout=layout)
        except KeyboardInterrupt:
            log.print("interrupted: reporting the problems finished so far")
            interrupted = True
        summaries = summarize(rows)
        for mode in modes:
            print_whole(console, timing_table(summaries, mode, [c.name for c in competitors],
                                              f"{name}, {timer} timer"))
        for note in unavailable_notes(rows):
            console.print(wrapped(note, "  "), highlight=False, markup=False, soft_wrap=True)
        records = csv_records(summaries, name, timer)
        write_csv(records, outputs.csv)
        console.print(f"CSV: {outputs.csv}")
        if outputs.plot is not None:
            if not bench_plot.available():
                console.print(wrapped("no plot: matplotlib is not installed (pip install "
                                      "'flashgen[bench]', or later: python -m "
                                      f"flashgen.bench.plot {outputs.csv} bench.png)"),
                              highlight=False, markup=False, soft_wrap=True)
            elif any(r.status == "ok" for r in rows):
                bench_plot.plot(records, outputs.plot, title=f"flashgen bench ({name})")
                console.print(f"plot: {outputs.plot}")
    if memory and not interrupted:
        targets = memory_problems(problems)
        mem_modes = memory_modes(modes)
        log.print(f"peak memory: {len(targets)} problem(s) x {', '.join(mem_modes)}",
                  highlight=False)
        mem_rows: list[MemoryRow] = []

        def note(row: MemoryRow) -> None:
            mem_rows.append(row)
            write_csv(memory_records(mem_rows, name), outputs.memory_csv, MEMORY_CSV_FIELDS)

        try:
            run_memory(targets, mem_modes, device, resolve(MEMORY_COMPETITORS, dispatcher),
                       seed=seed, on_row=note)
        except KeyboardInterrupt:
            log.print("interrupted: reporting the memory measured so far")
            interrupted = True
        print_whole(console, memory_table(mem_rows, name))
        console.print(f"memory CSV: {outputs.memory_csv}")
    if interrupted and on_interrupt is not None:
        on_interrupt()
    return rows
