"""Rich tables for the CLI: a tuning run's progress and results, the databases' winners and
their runs.

Each fits 80 columns by default, a row a line: problems go by their short labels
(`presets.problem_label`, e.g. "bf16 c D128 g4 2k B8 H32"), and the columns a reader needs
less (milliseconds, failure counts, versions) appear with `wide` only. Numbers are never cut.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rich import box
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Column, Table
from rich.text import Text

from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.decode_variant import DecodeVariant
from flashgen.kernels.modes import AnyVariant, space_of
from flashgen.kernels.presets import kind_label, problem_label
from flashgen.kernels.problem import MODIFIER_LETTERS
from flashgen.store.current import row_is_current
from flashgen.store.db import RunRow, WinnerRow
from flashgen.store.keys import TuningKey, Versions
from flashgen.tune.search import TuneResult


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def tflops_text(value: float | None) -> str:
    """Three digits; below 0.01 (the CPU interpreter's) two in exponent form, which is
    never wider than the column's header; from 1000 (fp8 on Hopper) whole numbers, as
    "1230" is both shorter and plainer than "1.23e+03"."""
    if value is None:
        return "-"
    if value >= 999.5:
        return f"{value:.0f}"
    return f"{value:.3g}" if value >= 0.01 else f"{value:.1e}"


def _table(title: str | None = None) -> Table:
    """A table with a rule under its header and no vertical borders: the narrowest frame
    that still reads as a table."""
    return Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
                 collapse_padding=True)


def variant_label(variant: AnyVariant | None, wide: bool = False) -> str:
    """A winner as the narrow tables print it. A backward variant drops its "bwd-" prefix
    (its table is the backward one), the usual dQ mode "separate" ("atomic" stays) and, with
    both kernels Gluon ones, their fixed 4 warps, and its switches shrink to "+delta"
    (fused_delta) and "+stats" (smem_stats): full names ("bwd-separate own128x64 w4 s2 fa3
    fused-delta smem-stats") took the table past 80 columns. `--wide` prints them. A decode
    variant drops its "decode " prefix the same way, and "fused" (the combine in the split
    pass) shrinks to "+f"."""
    if variant is None:
        return "none passed"
    if not wide and isinstance(variant, DecodeVariant):
        return str(variant).removeprefix("decode ").replace(" fused", " +f")
    if wide or not isinstance(variant, BwdVariant):
        return str(variant)
    short = str(variant).removeprefix("bwd-").removeprefix("separate ")
    if variant.fa3 == "both":
        short = short.replace(" w4 ", " ", 1)
    return short.replace(" fused-delta", " +delta").replace(" smem-stats", " +stats")


class _LastColumn(ProgressColumn):
    """The latest trial, for `wide` progress: the one column that gives way (cut with an
    ellipsis) when a line would pass the console's width, so the problem and the counts
    never do."""

    def __init__(self) -> None:
        super().__init__(table_column=Column(no_wrap=False))  # the only column rich shrinks

    def render(self, task: Task) -> Text:
        return Text(str(task.fields.get("last", "")), no_wrap=True, overflow="ellipsis")


#: What a progress line holds besides its label and bar: the count ("100/100"), the best
#: throughput ("best 1230 TFLOP/s"), the elapsed time, and the gaps between the columns.
_FIXED_WIDTH = len("100/100") + len("best 1230 TFLOP/s") + len("0:00:00") + 4


def progress_columns(wide: bool = False, longest: int = 0,
                     width: int = 80) -> list[ProgressColumn]:
    """The columns of tune's progress line; the task's description is "MODE LABEL" and its
    fields `best` and `last` (the latest trial, shown with `wide` only: it is long).

    Labels of modified, decode and fp8 problems run to 40 characters; the bar is what gets
    narrower for them (`longest`: the widest description; `width`: the console's), so a line
    still fits (with `wide`, leaving the latest trial a few cells). Only the description
    may fold, and only where even a 3-cell bar leaves no room: rich would otherwise squeeze
    every column alike and cut the counts ("49/…")."""
    bar = max(3, min(10, width - longest - _FIXED_WIDTH - (8 if wide else 0)))
    columns: list[ProgressColumn] = [
        TextColumn("{task.description}",
                   table_column=Column(no_wrap=wide, overflow="fold")),
        BarColumn(bar_width=bar, table_column=Column(no_wrap=True)),
        MofNCompleteColumn(table_column=Column(no_wrap=True)),
        TextColumn("best {task.fields[best]}", table_column=Column(no_wrap=True)),
        TimeElapsedColumn(table_column=Column(no_wrap=True)),
    ]
    if wide:
        columns.append(_LastColumn())
    return columns


#: The words for each modifier letter of a label ("... B4 H16 wv4", "mods:wv4"), by
#: `MODIFIER_LETTERS`' names; a table whose rows carry letters explains them in a caption.
_MODIFIER_WORDS = {"window": "window", "softcap": "softcap", "sinks": "sinks",
                   "varlen": "varlen, N = longest/mean length"}


def legend(modifier_keys: Iterable[str], decode: bool = False, bh: bool = False) -> str:
    """The caption that spells out the short suffixes of a table's labels: the modifier
    letters that occur in `modifier_keys` (e.g. "w window; vN varlen, ..."), with `decode`
    the cache (pages of N keys, or contiguous) and with `bh` the decode key's batch x
    KV-heads bucket. "" when the rows have none of them."""
    letters = {ch for key in modifier_keys for ch in key if ch.isalpha()}
    parts = [f"{letter}{'N' if name == 'varlen' else ''} {_MODIFIER_WORDS[name]}"
             for name, letter in MODIFIER_LETTERS.items() if letter in letters]
    if decode:
        parts.append("pN pages of N keys; contig contiguous cache; +f combine fused")
    if bh:
        parts.append("bhN batch x KV heads")
    return "; ".join(parts)


#: Titles of the per-mode tables.
MODE_NAMES = {"fwd": "forward", "bwd": "backward", "decode": "decode"}


def results_tables(results: Sequence[TuneResult], wide: bool = False) -> list[Table]:
    """A table per mode (so no column repeats it), a row per tuned problem: its best variant,
    throughput and, with `wide`, the search's cost (time; measured, failed, pruned and
    resumed trials)."""
    tables = []
    for mode, name in MODE_NAMES.items():
        rows = [r for r in results if r.mode == mode]
        if not rows:
            continue
        table = _table(f"flashgen tune: {name}")
        table.add_column("problem", no_wrap=True)
        table.add_column("winner", no_wrap=True)
        table.add_column("TFLOP/s", justify="right", no_wrap=True)
        if wide:
            table.add_column("ms", justify="right", no_wrap=True)
        table.add_column("vs SDPA", justify="right", no_wrap=True)
        if wide:
            for column in ("trials", "failed", "pruned", "resumed", "time"):
                table.add_column(column, justify="right", no_wrap=True)
        for r in rows:
            sdpa = "-" if r.speedup is None else f"{r.speedup:.2f}x"
            if wide and r.speedup is not None and r.baseline is not None:
                sdpa += f" ({r.baseline.backend})"
            # Nothing measured (say --trials 0 on a fresh key) is not a search that failed.
            tried = r.best is not None or r.measured or r.failed or r.resumed
            cells = [problem_label(r.problem),
                     variant_label(r.best, wide) if tried else "none measured",
                     tflops_text(r.best_tflops)]
            if wide:
                cells.append(_num(r.best_ms, ".4g"))
            cells.append(sdpa)
            if wide:
                cells += [str(r.measured), str(r.failed), str(r.pruned), str(r.resumed),
                          f"{r.seconds:.1f}s"]
            table.add_row(*cells)
        table.caption = legend([r.problem.modifier_key for r in rows],
                               decode=mode == "decode") or None
        table.caption_justify = "left"
        tables.append(table)
    return tables


def none_passed_notes(results: Sequence[TuneResult], interpreter: bool = False) -> list[str]:
    """A line for each problem where no variant passed, with the commonest failure reason:
    the table alone says "none passed" and the reasons sit in the database. With
    `interpreter`, an fp8 problem whose variants gave wrong answers adds why that is
    expected there."""
    lines = []
    for r in results:
        if r.best is not None or not r.failed:
            continue
        reasons = Counter(o.reason for o in r.outcomes.values() if o.status == "failed")
        why = f"; most often: {reasons.most_common(1)[0][0][:120]}" if reasons else ""
        lines.append(f"note: {r.mode} {problem_label(r.problem)}: no variant passed "
                     f"({r.failed} failed){why}")
        if interpreter and r.problem.dtype == "fp8" and any(
                reason.startswith("wrong answer") for reason in reasons):
            lines.append("note: Triton's interpreter rounds to e4m3 inexactly (seen in "
                         "Triton 3.6), so fp8 kernels fail the check on --device cpu; tune "
                         "fp8 on a GPU of compute capability 8.9 or newer")
    return lines


def is_current(winner: WinnerRow, versions: Versions | None = None) -> bool:
    """Whether dispatch would serve this row: same Triton, and its kernel is the one its
    variant renders to now. `versions` default to the running ones."""
    versions = versions or Versions.current()
    return winner.key.triton_version == versions.triton and row_is_current(winner)


def key_label(key: TuningKey) -> str:
    """`presets.kind_label` of a key: its lengths are the buckets' upper ends. A decode key
    adds its cache (p<page size>, or contig) and its batch x Hkv bucket (bh<n>); a key of a
    modified problem its modifiers (mods:w, mods:v4: `Problem.modifier_key`)."""
    label = kind_label(key.dtype, key.causal, key.head_dim, key.gqa, key.seq_q_bucket,
                       key.seq_k_bucket)
    if key.mode == "decode":
        cache = f"p{key.page_size}" if key.page_size else "contig"
        label += f" {cache} bh{key.bh_bucket}"
    if key.modifiers:
        label += f" mods:{key.modifiers}"
    return label


@dataclass(frozen=True)
class Listed:
    """A winner as `flashgen show` lists it: the database it is in (`source` names the
    database's role: "user", "shipped", or "db" for a file given with --db), whether
    dispatch would serve its versions, and whether a row of the same bucket in a database
    read before it (the user's, before the shipped one) is served instead."""

    winner: WinnerRow
    source: str
    path: Path
    current: bool
    shadowed: bool = False

    def to_dict(self) -> dict:
        """The winner's row, where it is, whether dispatch serves it, and whether it is
        deterministic (served under torch.use_deterministic_algorithms; in the tables, a
        nondeterministic backward winner's label says "atomic")."""
        w = self.winner
        return {**w.to_dict(), "db": str(self.path), "source": self.source,
                "current": self.current, "shadowed": self.shadowed,
                "deterministic": space_of(w.key.mode).deterministic(w.variant)}


def _bucket(w: WinnerRow) -> tuple:
    k = w.key
    return (k.device_key, k.mode, k.dtype, k.causal, k.head_dim, k.gqa, k.seq_q_bucket,
            k.seq_k_bucket)


def listed(sources: Sequence[tuple[str, Path, list[WinnerRow]]],
           versions: Versions | None = None) -> list[Listed]:
    """The winners of several databases, highest precedence first, as dispatch reads them:
    a current row is `shadowed` where an earlier database has a current row of its bucket.
    `versions`: as for `is_current`."""
    out: list[Listed] = []
    served: set[tuple] = set()
    for source, path, winners in sources:
        mine: set[tuple] = set()
        for w in winners:
            current = is_current(w, versions)
            out.append(Listed(w, source, path, current, current and _bucket(w) in served))
            if current:
                mine.add(_bucket(w))
        served |= mine
    return out


def winners_tables(rows: Iterable[Listed], wide: bool = False) -> list[Table]:
    """A table per database, GPU and mode (the title says which), a row per key: its kind,
    winner, TFLOP/s, speed-up over SDPA, and a note where dispatch would not serve the row
    ("stale": other Triton, or its variant renders another kernel now; "shadowed": an
    earlier database has the bucket).
    With `wide`: the problem it was tuned on, the SDPA backend, versions and the date."""
    groups: dict[tuple[str, str, str], list[Listed]] = {}
    for row in rows:
        k = row.winner.key
        groups.setdefault((row.source, k.device_key, k.mode), []).append(row)
    order = {mode: i for i, mode in enumerate(MODE_NAMES)}
    sources = list(dict.fromkeys(source for source, _, _ in groups))
    tables = []
    for (source, _, mode), group in sorted(groups.items(), key=lambda item: (
            sources.index(item[0][0]), item[0][1], order.get(item[0][2], len(order)))):
        k = group[0].winner.key
        table = _table(f"{source} · {k.gpu_name} · sm{k.capability.replace('.', '')} · "
                       f"{MODE_NAMES.get(mode, mode)}")
        table.add_column("kind", no_wrap=True)
        table.add_column("winner", no_wrap=True)
        table.add_column("TFLOP/s", justify="right", no_wrap=True)
        table.add_column("vs SDPA", justify="right", no_wrap=True)
        if wide:
            for column in ("SDPA", "tuned on", "triton", "kernel", "updated"):
                table.add_column(column, no_wrap=True)
        notes = [_note(r) for r in group]
        if any(notes):
            table.add_column("note", no_wrap=True)
        for row, note in zip(group, notes, strict=True):
            w = row.winner
            cells = [key_label(w.key), variant_label(w.variant, wide), tflops_text(w.tflops),
                     "-" if w.speedup is None else f"{w.speedup:.2f}x"]
            if wide:
                p = w.problem
                cells += [w.sdpa_backend or "-",
                          f"B{p.batch} Hq{p.heads_q} Hkv{p.heads_kv} Nq{p.seq_q} Nk{p.seq_k}",
                          w.key.triton_version, (w.kernel_hash or "-")[:16],
                          w.updated_at[:10]]
            table.add_row(*cells, *([note] if any(notes) else []))
        caption = [legend([r.winner.key.modifiers for r in group], decode=mode == "decode",
                          bh=mode == "decode")]
        caption += [NOTE_WORDS[n] for n in NOTE_WORDS if n in notes]
        table.caption = "; ".join(filter(None, caption)) or None
        table.caption_justify = "left"
        tables.append(table)
    return tables


#: What each note of `winners_tables` means, spelt out under a table that has it.
NOTE_WORDS = {
    "stale": "stale: not served (tuned with other Triton or torch versions, or its "
             "variant renders another kernel now: re-tune it)",
    "shadowed": "shadowed: not served (an earlier database has this bucket)",
}


def _note(row: Listed) -> str:
    return "stale" if not row.current else "shadowed" if row.shadowed else ""


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
        status = "died" if run.died else run.status  # no process left to end it
        table.add_row(
            f"{run.started_at[:16].replace('T', ' ')}\n{status} {_took(run)}".rstrip(),
            "\n".join(stack), f"{_num(run.trials, 'd')} trials\n{_num(run.winners, 'd')} won",
            run.command or "-",
        )
    return table
