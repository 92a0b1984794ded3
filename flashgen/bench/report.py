"""What `flashgen bench` shows and writes: the ratio to the best competitor, tables, the CSV.

The ratio compares flashgen with the fastest *correct* competitor of the same problem and mode:
a wrong answer's speed proves nothing, so it never counts as the best, and flashgen's own
ratio exists only where flashgen itself passed its check.
"""

from __future__ import annotations

import csv
import re
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from flashgen.bench.competitors import FLASHGEN
from flashgen.bench.suite import Mode, Row
from flashgen.kernels.presets import problem_label
from flashgen.kernels.problem import Problem
from flashgen.tune.timing import UNSTEADY_SPREAD

MODE_TITLES: dict[str, str] = {"fwd": "forward", "bwd": "backward",
                               "both": "forward + backward"}
#: A cell whose p20..p80 range is wider than UNSTEADY_SPREAD of its median, even after the
#: timer's retries, is marked "~": its median may move from run to run, so re-time it alone
#: before drawing conclusions.
UNSTEADY_NOTE = (f"~: the repeats spread over more than {UNSTEADY_SPREAD:.0%} of the median "
                 "(p20..p80), typically a host-bound call; re-time that cell alone")


@dataclass(frozen=True)
class Summary:
    """One problem in one mode: flashgen's row, the fastest correct other, and their ratio."""

    problem: Problem
    mode: Mode
    rows: tuple[Row, ...]
    subject: Row | None  # flashgen's row, if flashgen was benchmarked
    best: Row | None  # the fastest correct competitor other than flashgen

    @property
    def ratio(self) -> float | None:
        """flashgen's TFLOP/s over the best competitor's (> 1: flashgen is faster)."""
        if self.subject is None or self.best is None or self.subject.status != "ok":
            return None
        mine, theirs = self.subject.tflops, self.best.tflops
        return None if mine is None or not theirs else mine / theirs


def summarize(rows: Iterable[Row], subject: str = FLASHGEN) -> list[Summary]:
    """Group rows by (problem, mode), in order of first appearance, and rank the others."""
    groups: dict[tuple[Problem, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.problem, r.mode), []).append(r)
    out = []
    for (problem, _), group in groups.items():
        mine = next((r for r in group if r.competitor == subject), None)
        others = [r for r in group if r.competitor != subject and r.status == "ok"
                  and r.tflops is not None]
        best = max(others, key=lambda r: r.tflops or 0.0, default=None)
        out.append(Summary(problem, group[0].mode, tuple(group), mine, best))
    return out


def short_problem(p: Problem) -> str:
    heads = f"H{p.heads_q}" if p.heads_q == p.heads_kv else f"H{p.heads_q}/{p.heads_kv}"
    seq = f"N{p.seq_q}" if p.seq_q == p.seq_k else f"N{p.seq_q}/{p.seq_k}"
    mods = "".join(f" {m}" for m in p.modifiers)
    return (f"B{p.batch} {heads} {seq} D{p.head_dim} {p.dtype}{' causal' if p.causal else ''}"
            f"{mods}")


def _unsteady(r: Row) -> bool:
    return r.timing is not None and r.timing.unsteady


def _cell(r: Row | None) -> str:
    if r is None:
        return "-"
    if r.status == "n/a" or r.tflops is None:
        return "n/a"
    text = f"{r.tflops:.3g}"
    if _unsteady(r):
        text = f"~{text}"
    return text if r.status == "ok" else f"[red]{text} wrong[/red]"


def print_whole(console: Console, table: Table) -> None:
    """`table` at the console's width where it fits, else at its own (the terminal wraps
    its lines): a cell cut to "123…" is a number lost. The tables fit 80 columns for the
    presets; a longer label (many query heads, Nq and pages at once) may not."""
    need = console.measure(table, options=console.options.update_width(1000)).maximum
    if need > console.width:
        Console(file=console.file, width=need, force_terminal=console.is_terminal).print(table)
    else:
        console.print(table)


def short_name(competitor: str) -> str:
    """A competitor as the best-other column names it: SDPA's backends without "sdpa-"
    (the column headers above say which are SDPA's), so five fit at 80 columns."""
    return competitor.removeprefix("sdpa-")


def timing_table(summaries: Iterable[Summary], mode: Mode, competitors: Sequence[str],
                 device_name: str) -> Table:
    """TFLOP/s of every competitor, one row per problem of `mode`, and flashgen's ratio to
    the best other. Compact, to read at 80 columns with the GPU's five competitors: the
    tuner's problem labels, headers broken at their dashes, the best other's short name."""
    table = Table(title=f"flashgen bench: {MODE_TITLES[mode]}, TFLOP/s ({device_name})",
                  box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False,
                  show_edge=False)
    table.add_column("problem", no_wrap=True)
    for name in competitors:
        table.add_column(name.replace("-", "-\n"), justify="right")
    table.add_column("best\nother", justify="left")
    table.add_column("vs\nbest", justify="right")
    for s in summaries:
        if s.mode != mode:
            continue
        by_name = {r.competitor: r for r in s.rows}
        ratio = "-" if s.ratio is None else f"{s.ratio:.2f}x"
        table.add_row(problem_label(s.problem), *(_cell(by_name.get(n)) for n in competitors),
                      short_name(s.best.competitor) if s.best else "-", ratio)
    return table


def unavailable_notes(rows: Iterable[Row]) -> list[str]:
    """Distinct reasons for n/a and wrong cells, whole (`wrapped` folds them for printing),
    and the legend of "~" when a cell has it."""
    seen: dict[str, list[str]] = {}
    unsteady = False
    for r in rows:
        if r.status != "ok" and r.reason:
            text = f"{r.competitor} {r.status}: {r.reason}"
            # Reasons that differ only in sizes (SDPA names each call's shapes) are one note.
            seen.setdefault(_DIGITS.sub("#", text), []).append(text)
        unsteady |= _unsteady(r)
    notes = [texts[0] if len(texts) == 1 else
             f"{texts[0]} (and {len(texts) - 1} more like it)" for texts in seen.values()]
    return [*notes, UNSTEADY_NOTE] if unsteady else notes


_DIGITS = re.compile(r"\d+")


def wrapped(text: str, indent: str = "", width: int = 80) -> str:
    """`text` folded at word boundaries into lines of at most `width` columns, after
    `indent`, continuation lines two columns deeper. Not cut: a reason's end ("use float16
    or float32 on the CPU, or ...") is usually what to do. A word longer than a line (a
    path) stays whole, and hyphens do not break ("sdpa-math")."""
    return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_long_words=False, break_on_hyphens=False)


CSV_FIELDS = (
    "mode", "batch", "heads_q", "heads_kv", "seq_q", "seq_k", "head_dim", "dtype", "causal",
    "competitor", "status", "tflops", "median_ms", "p20_ms", "p80_ms", "reps", "timer",
    "host_us", "flops",
    "best_competitor", "flashgen_vs_best", "check_error", "check_bound", "checked_on",
    "reason", "note", "device", "modifiers",
)


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def csv_records(summaries: Iterable[Summary], device_name: str,
                timer: str = "wall") -> list[dict[str, str]]:
    """One record per row (competitor x problem x mode); the ratio is repeated in every
    record of its group, so each line stands alone in a spreadsheet filter. `timer`: how
    the times were taken ("wall" or "gpu", `tune.timing`)."""
    records = []
    for s in summaries:
        for r in s.rows:
            p, t = r.problem, r.timing
            records.append({
                "mode": r.mode, "batch": str(p.batch), "heads_q": str(p.heads_q),
                "heads_kv": str(p.heads_kv), "seq_q": str(p.seq_q), "seq_k": str(p.seq_k),
                "head_dim": str(p.head_dim), "dtype": p.dtype, "causal": str(p.causal).lower(),
                "competitor": r.competitor, "status": r.status, "tflops": _fmt(r.tflops),
                "median_ms": _fmt(None if t is None else t.median_ms),
                "p20_ms": _fmt(None if t is None else t.p20_ms),
                "p80_ms": _fmt(None if t is None else t.p80_ms),
                "reps": "" if t is None else str(t.reps), "timer": timer,
                "host_us": _fmt(None if t is None or t.host_ms is None else t.host_ms * 1e3),
                "flops": _fmt(r.flops), "best_competitor": s.best.competitor if s.best else "",
                "flashgen_vs_best": _fmt(s.ratio), "check_error": _fmt(r.error),
                "check_bound": _fmt(r.bound),
                "checked_on": "timed inputs" if r.checked_on is None else str(r.checked_on),
                "reason": r.reason, "note": r.note, "device": device_name,
                "modifiers": " ".join(p.modifiers),
            })
    return records


#: The leading columns by which a CSV is known as an earlier bench's (`check_csv_target`).
_CSV_ID_COLUMNS = 11


def check_csv_target(path: Path, fields: Sequence[str] = CSV_FIELDS,
                     option: str = "--csv") -> None:
    """Raise ValueError if writing `fields` to `path` would replace a file flashgen did not
    write: a user's own file is never changed. An earlier bench's CSV is replaced, as
    re-running into the same folder expects: its first row starts with the columns that
    name a row (`_CSV_ID_COLUMNS` of `fields`, the problem, competitor and status, which
    every flashgen version wrote first; later columns were added over time). So is an empty
    file, which holds nothing to lose. `option` is the one that picks another path."""
    if not path.exists() or (path.is_file() and path.stat().st_size == 0):
        return
    header: list[str] = []
    if path.is_file():
        with path.open(newline="", encoding="utf-8", errors="replace") as f:
            try:
                header = next(csv.reader(f), [])
            except csv.Error:  # not CSV at all (a NUL byte, a huge field): not ours
                header = []
    if header[:_CSV_ID_COLUMNS] != list(fields[:_CSV_ID_COLUMNS]):
        raise ValueError(f"{path} exists and is not a flashgen bench CSV; flashgen did not "
                         f"change it: pick another {option}, or remove the file")


def write_csv(records: Sequence[dict[str, str]], path: Path,
              fields: Sequence[str] = CSV_FIELDS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(records)
