"""The `flashgen` command: tune kernels into the database, and show what it holds.

Imports of torch-facing modules happen inside the commands: `--device cpu` must set
TRITON_INTERPRET=1 before anything imports triton, and `--help` and `--version` must not
wait seconds for torch (a test checks that they do not import it).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sqlite3
import sys
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

    from flashgen.kernels.hardware import DeviceInfo
    from flashgen.kernels.problem import Problem
    from flashgen.store.db import TuningDB
    from flashgen.tune.search import RunOptions, TuneResult
    from flashgen.tune.workers import WorkerEnd, WorkerPlan

def _explained(invoke: Callable[[typer.Context], Any], ctx: typer.Context) -> Any:
    """Run a command; a known database or file error (not a database, damaged, read-only,
    disk full, locked, refused by `store.guard`) ends it with one `error:` line naming the
    file and what to do, and exit status 1. Anything else keeps its traceback. flashgen's
    own warnings print as `note:` lines, as the commands' other notes do (Python's format
    adds the file, line and source line of the warning)."""
    shown = warnings.showwarning

    def note(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        if f"{os.sep}flashgen{os.sep}" in filename:
            typer.echo(f"note: {message}", err=True)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = note
    try:
        return invoke(ctx)
    except (sqlite3.Error, OSError) as exc:
        failure = _store_failure(exc, ctx.params.get("db"))
        if failure is None:
            raise
        raise failure from None
    finally:
        warnings.showwarning = shown


def _store_failure(exc: sqlite3.Error | OSError, db: Path | None) -> typer.Exit | None:
    """Print the one `error:` line for a known store or file error of database `db` (None:
    the default user database) and return the exit to raise; None for other errors."""
    from flashgen.store.db import BUSY_TIMEOUT_S, default_db_path
    from flashgen.store.guard import busy_timeout_s, explain

    message = explain(exc, db or default_db_path(), busy_timeout_s(BUSY_TIMEOUT_S))
    if message is None:
        return None
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(1)


class _Group(TyperGroup):
    """The command group; it wraps each command it runs in `_explained`, so that every
    command reports store and file errors the same way without a try block of its own."""

    def resolve_command(self, ctx: typer.Context,
                        args: list[str]) -> tuple[str | None, Any, list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        if command is not None:
            command.invoke = functools.partial(  # type: ignore[method-assign]
                _explained, command.invoke)
        return name, command, rest


app = typer.Typer(
    cls=_Group,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)

#: How the tables name problems; in the help of the commands that print them.
LABELS_HELP = (
    "Tables fit 80 columns; --wide adds every column. Problems go by short labels: "
    "'bf16 c D128 g4 2k B8 H32' is bf16, causal (f: full), head dim 128, 4 query heads per "
    "key/value head (left out when 1), Nq = Nk = 2048 ('512/2k' where they differ; for "
    "stored winners the length buckets), batch 8, 32 query heads. Backward winners leave "
    "out 'bwd-' and the usual dQ mode 'separate'. Modified problems end in a letter each "
    "(stored winners: 'mods:'): w sliding window, k softcap, s sinks, vN packed varlen "
    "(N: longest / mean length), as in 'wv4'. Decode problems end in their cache: pN (pages "
    "of N keys) or contig; stored decode winners add bhN (the batch x KV heads bucket)."
)

def _expand(path: Path | None) -> Path | None:
    """A path option with `~` expanded: the shell leaves `--db=~/x.db` alone, and a folder
    named `~` in the working directory is one `rm -rf ~` away from a deleted home."""
    return path.expanduser() if path is not None else None


#: The one --db option of tune, show, bench and export. No envvar= on purpose: the default
#: is resolved by `default_db_path()` (which reads $FLASHGEN_DB), so a command can tell a
#: file given on the command line from the default, which dispatch reads with the shipped
#: database behind it.
DbOption = Annotated[
    Path | None,
    typer.Option("--db", dir_okay=False, metavar="FILE", callback=_expand,
                 help="Tuning database file (default: $FLASHGEN_DB, else the user database "
                      "~/.cache/flashgen/tuning.db)."),
]
WideOption = Annotated[bool, typer.Option(
    "--wide", help="Print every column of the tables, not only those that fit 80 columns.")]


def _print_version(value: bool) -> None:
    if value:
        from flashgen import __version__

        typer.echo(f"flashgen {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=_print_version,
        help="Print flashgen's version and exit.")] = False,
) -> None:
    """Generate, autotune and store Triton flash-attention kernels.

    Environment: FLASHGEN_DB names the user tuning database (default
    ~/.cache/flashgen/tuning.db); FLASHGEN_CACHE_DIR the folder whose kernels/ holds the
    rendered kernel sources (default ~/.cache/flashgen). Both defaults follow
    $XDG_CACHE_HOME where it is set.
    """

#: Why --dtype bf16 is refused with --device cpu (`verb`: tune or bench).
BF16_ON_CPU = ("--dtype bf16 needs a GPU: Triton's interpreter computes bf16 dot products "
               "wrongly, so flashgen's kernels fail their check; {verb} fp16 or fp32 on the CPU")
#: --page-size's defaults, which also tell an option given outside --mode decode (an error).
TUNE_PAGE_SIZES, BENCH_PAGE_SIZES = "0", "0,16"
#: The largest --seed: numpy's and Optuna's generators take 0 to 2**32 - 1.
SEED_MAX = 2**32 - 1
#: Trials per problem when neither --trials nor --timeout is given.
DEFAULT_TRIALS = 50


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (from `timeout`, a batch scheduler's time limit, `kill`) stops a long command
    as Ctrl-C does: the tune closes its run row as interrupted and prints what it measured,
    the bench prints the problems it finished, rather than dying with neither."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _console() -> Console:
    """A console for tables: a terminal's width, or $COLUMNS; other piped output gets 200
    columns, so that `--wide` tables reach a file whole."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal or "COLUMNS" in os.environ else Console(width=200)


def _print_tables(console: Console, tables: list[Any], wide: bool) -> None:
    """Print tables a blank line apart. With `wide`, a table wider than the console is
    printed at its own width (the terminal wraps the lines) rather than cut by rich."""
    from flashgen.bench.report import print_whole

    for i, table in enumerate(tables):
        if i:
            console.print()
        if wide:
            print_whole(console, table)
        else:
            console.print(table)


def _use_interpreter() -> None:
    """Make the Triton interpreter run the kernels; only possible before triton is imported."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise _fail("triton was imported before --device cpu could select its interpreter")
    os.environ["TRITON_INTERPRET"] = "1"
    # The interpreter's own numpy noise (log2 of 0 in its integer helpers), which landed in
    # the middle of the progress lines; flashgen's results do not depend on it.
    warnings.filterwarnings("ignore", "divide by zero encountered in log2", RuntimeWarning)


#: Options that `tune` and `bench` share.
ShapeOption = Annotated[list[str] | None, typer.Option(
    "--shape", metavar="B,Hq,Hkv,Nq,Nk,D",
    help="A problem: batch, query heads, key/value heads, query and key lengths, head "
         "dim. Repeatable.")]
PresetOption = Annotated[list[str] | None, typer.Option(
    "--preset", metavar="NAME",
    help="A named set of problems (see `flashgen presets`), e.g. fa-bench or llama3-8b. "
         "Repeatable.")]


@app.command(epilog=LABELS_HELP)
def tune(
    shape: ShapeOption = None,
    preset: PresetOption = None,
    dtype: Annotated[str, typer.Option(
        metavar="LIST", help="Comma-separated input dtypes to tune: fp16, bf16, fp32, fp8 "
                             "(e4m3 forward, quantized inputs).")] = "fp16",
    causal: Annotated[str | None, typer.Option(
        metavar="yes|no|both", help="Masking to tune: yes (causal), no (full), or both. "
                                    "Default no; yes with --mode decode, as "
                                    "attention_with_kvcache's default.")] = None,
    trials: Annotated[int | None, typer.Option(
        min=0, help=f"New variants to measure per problem (pruned and resumed ones are "
                    f"free). Default {DEFAULT_TRIALS} when --timeout is not given.")] = None,
    timeout: Annotated[float | None, typer.Option(
        min=0, help="Seconds of tuning per problem (with --trials: whichever ends "
                    "first).")] = None,
    gpu: Annotated[int, typer.Option(
        min=0, help="Index of the CUDA GPU to tune on.")] = 0,
    device: Annotated[str, typer.Option(
        metavar="cuda|cpu",
        help="cuda, or cpu to run tiny problems through the Triton interpreter (tests the "
             "pipeline; its timings say nothing about GPUs).")] = "cuda",
    seed: Annotated[int, typer.Option(
        min=0, max=SEED_MAX,
        help="Seed of the sampler and of all random inputs: equal seeds repeat a run.")] = 0,
    compile_workers: Annotated[int, typer.Option(
        min=1, help="Threads compiling candidates ahead of timing; also how many trials are "
                    "asked of the sampler at once.")] = min(16, os.cpu_count() or 1),
    mode: Annotated[str, typer.Option(
        metavar="fwd|bwd|both|decode",
        help="What to tune: the forward kernel (fwd), the backward kernels (bwd: gradients "
             "checked against the reference, the backward alone timed), or both, forward "
             "first, for each problem; decode: the decode family (attention_with_kvcache) "
             "on caches of each --page-size, with decode presets such as "
             "llama3-8b-decode.")] = "fwd",
    page_size: Annotated[str, typer.Option(
        metavar="LIST", help="--mode decode: comma-separated cache page sizes; 0 is a "
                             "contiguous cache.")] = TUNE_PAGE_SIZES,
    remeasure: Annotated[bool, typer.Option(
        help="Measure again the variants each problem already has timings for (fastest "
             "stored first; they count toward --trials) before sampling new ones: for "
             "timings a flawed timer took. Old rows stay as history.")] = False,
    exhaustive: Annotated[bool, typer.Option(
        "--exhaustive", help="Measure every valid variant of each problem (resumable; no "
                             "budget needed, though --trials or --timeout still stop it) "
                             "instead of sampling: the ground truth the tuner is judged "
                             "against.")] = False,
    gpus: Annotated[str | None, typer.Option(
        metavar="LIST|all",
        help="Tune on several GPUs: one worker process per listed index (0,1,2,3), or per "
             "visible GPU (all); an index may repeat (0,0: two workers share GPU 0). "
             "Workers share each problem's studies and trial budget.")] = None,
    workers: Annotated[int | None, typer.Option(
        min=1, help="Worker processes on the one --device (the CPU interpreter, or --gpu), "
                    "sharing each problem's studies and trial budget.")] = None,
    storage: Annotated[str | None, typer.Option(
        metavar="URL",
        help="Shared Optuna storage for the studies, so workers on several hosts tune "
             "together: postgresql+psycopg://user:pw@host/db, mysql://..., or a journal "
             "file path ending in .log on a shared filesystem (needs flashgen[distributed] "
             "for PostgreSQL). Each worker still writes its --db; `flashgen pull` gathers "
             "every host's rows.")] = None,
    campaign: Annotated[str | None, typer.Option(
        metavar="NAME",
        help="Join campaign NAME in --storage: invocations (say one per host) giving the same "
             "name share each problem's --trials budget and lead different problems, as the "
             "workers of one invocation do. Reusing a name resumes its campaign: problems it "
             "finished are not tuned again, even with a larger --trials (a new name brings a "
             "new budget). Default: a campaign of this invocation alone.")] = None,
    deterministic: Annotated[bool, typer.Option(
        "--deterministic",
        help="Search only variants whose gradients are bitwise equal run to run: for the "
             "backward, the separate dQ kernel (no fp32 atomics). What dispatch serves under "
             "torch.use_deterministic_algorithms(True). The forward is deterministic "
             "already: every forward variant qualifies.")] = False,
    window: Annotated[str | None, typer.Option(
        metavar="L,R",
        help="Tune with a sliding window (attention's window=(L, R), -1 unbounded). A key "
             "records that a window is used, not its size: the bench times a representative "
             "one (a quarter of Nk to the left; right unbounded, or 0 under causal), and "
             "its winners serve every window.")] = None,
    softcap: Annotated[float | None, typer.Option(
        metavar="C",
        help="Tune with a logit softcap (C > 0); timed at 30.0, served to every cap.")] = None,
    sinks: Annotated[bool, typer.Option(
        "--sinks", help="Tune with attention sinks (random per-head logits).")] = False,
    varlen: Annotated[int | None, typer.Option(
        metavar="S", min=1,
        help="Tune packed variable-length batches: each problem's B x N tokens cut into S "
             "sequences of seeded random lengths, as `flashgen bench --varlen` does; the "
             "key holds the longest length's bucket and the mix (max / mean length).")] = None,
    db: DbOption = None,
    wide: WideOption = False,
) -> None:
    """Tune every problem: search variants with Optuna, check each against the reference,
    time the correct ones, and store all trials and the winners in the database."""
    if device not in ("cuda", "cpu"):
        raise _fail(f"--device must be cuda or cpu, got {device!r}")
    modes = {"fwd": ("fwd",), "bwd": ("bwd",), "both": ("fwd", "bwd"),
             "decode": ("decode",)}.get(mode)
    if modes is None:
        raise _fail(f"--mode must be fwd, bwd, both or decode, got {mode!r}")
    if device == "cpu":
        _use_interpreter()
    if not shape and not preset:
        raise _fail("give at least one --shape or --preset")
    if gpus is not None and workers is not None:
        raise _fail("give --gpus or --workers, not both")
    if gpus is not None and device == "cpu":
        raise _fail("--gpus needs --device cuda; use --workers N for CPU workers")
    distributed = storage is not None or gpus is not None or workers is not None
    if remeasure and distributed:
        raise _fail("--remeasure runs in one process: drop --storage, --gpus and --workers")
    if campaign is not None:
        # Through a temporary journal nobody else could join the campaign, nor resume it.
        if storage is None:
            raise _fail("--campaign needs --storage: invocations join a campaign through the "
                        "storage they share")
        from flashgen.tune.workers import check_campaign

        try:
            check_campaign(campaign)
        except ValueError as exc:
            raise _fail(str(exc)) from None
    if timeout is not None and timeout <= 0:
        raise _fail(f"--timeout must be more than 0 seconds, got {timeout:g} (it would "
                    "measure nothing); leave it out to tune by --trials alone")
    if device == "cpu" and (gpu != 0 or gpus is not None):
        raise _fail("--gpu and --gpus choose CUDA GPUs; --device cpu runs the Triton "
                    "interpreter (--workers sets how many)")
    if trials is None and timeout is None and not exhaustive:
        trials = DEFAULT_TRIALS

    causal = causal or ("yes" if mode == "decode" else "no")
    if mode != "decode" and page_size != TUNE_PAGE_SIZES:
        raise _fail("--page-size is for --mode decode (KV-cache problems)")
    try:
        problems = _problems(shape, preset, dtype, causal, mode == "decode", page_size,
                             window, softcap, sinks, varlen, seed)
    except (ValueError, TypeError) as exc:
        raise _fail(str(exc)) from None
    if device == "cpu" and any(p.dtype == "bf16" for p in problems):
        raise _fail(BF16_ON_CPU.format(verb="tune"))
    if any(p.dtype == "fp8" for p in problems):
        if mode != "fwd":
            raise _fail(f"--dtype fp8 tunes the forward only (fp8 has no backward or decode "
                        f"kernels): use --mode fwd, not --mode {mode}")
        if device == "cuda":
            _check_fp8_gpus(gpu, gpus)
    from flashgen.tune.search import RunOptions

    run = RunOptions(device, gpu, trials, timeout, seed, compile_workers, db, modes, remeasure,
                     wide, exhaustive, deterministic)
    if distributed:
        slots = _worker_slots(run, gpus, workers)  # a bad --gpus first: nothing is opened yet
        if storage is not None:
            # A bad URL fails here, before any GPU work.
            _check_storage(storage, db, campaign, run.trials)
        with _terminate_as_interrupt():
            _run_workers(problems, run, slots, storage, campaign)
    else:
        with _terminate_as_interrupt():
            _run_tuning(problems, run)


def _problems(shape: list[str] | None, preset: list[str] | None, dtype: str, causal: str,
              decode: bool, page_size: str, window: str | None, softcap: float | None,
              sinks: bool, varlen: int | None, seed: int) -> list[Problem]:
    """The problems of `tune`'s and `explain`'s options: decode ones (with `decode`, one per
    page size) or attention ones with the modifiers asked for (`_modified`)."""
    from flashgen.kernels import presets

    if decode:
        if window or softcap is not None or sinks or varlen:
            raise ValueError("--mode decode takes plain decode problems: drop --window, "
                             "--softcap, --sinks and --varlen")
        return list(presets.decode_problems(
            shape or [], preset or [], presets.parse_dtypes(dtype),
            presets.parse_causal(causal), presets.parse_page_sizes(page_size)))
    problems = presets.expand(shape or [], preset or [], presets.parse_dtypes(dtype),
                              presets.parse_causal(causal))
    return _modified(problems, window, softcap, sinks, varlen, seed)


def _modified(problems: list[Problem], window: str | None, softcap: float | None,
              sinks: bool, varlen: int | None, seed: int) -> list[Problem]:
    """`flashgen tune`'s problems with the modifiers asked for. Their values are checked as
    `attention` checks them; only which modifiers there are is part of a key. `--varlen S`
    cuts each problem's B x N tokens into S sequences as `flashgen bench --varlen` does:
    the problem becomes S sequences, the longest of them its length, and their mix."""
    from flashgen.bench.layouts import Layout
    from flashgen.kernels.problem import mix_bucket
    from flashgen.runtime.modifiers import check_softcap, check_window

    if window is not None:
        parts = window.split(",")
        if len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
            raise ValueError(f"--window must be L,R (ints, -1 unbounded), got {window!r}")
        if check_window(tuple(int(p) for p in parts)) is None:
            raise ValueError("--window -1,-1 cuts nothing: leave --window out")
    check_softcap(softcap)
    out = []
    for p in problems:
        p = p.with_(window=window is not None, softcap=softcap is not None, sinks=sinks)
        if varlen is not None:
            layout = Layout(None, varlen)
            layout.apply(p)  # the problems it cannot pack are named errors
            lengths = layout.lengths(p, seed)
            longest = max(lengths)
            p = p.with_(batch=len(lengths), seq_q=longest, seq_k=longest, varlen=True,
                        mix=mix_bucket(len(lengths), longest, sum(lengths)))
        out.append(p)
    return list(dict.fromkeys(out))


def _check_fp8_gpus(gpu: int, gpus: str | None) -> None:
    """fp8 tuning needs fp8 tensor cores on every GPU it runs on: one error line, not a
    search with no valid variant."""
    import torch

    from flashgen.runtime.inputs import FP8_MIN_CAPABILITY
    from flashgen.tune.workers import parse_gpus

    if not torch.cuda.is_available():
        return  # the tuner says so itself
    visible = torch.cuda.device_count()
    try:
        indices = [gpu] if gpus is None else parse_gpus(gpus, visible)
    except ValueError:
        return  # a bad --gpus is reported where the workers are planned
    for index in sorted({i for i in indices if i < visible}):  # a bad --gpu: the same
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) < FP8_MIN_CAPABILITY:
            raise _fail(f"--dtype fp8 needs fp8 tensor cores (compute capability 8.9 or "
                        f"newer); GPU {index} has {major}.{minor}")


def _check_storage(url: str, db: Path | None, campaign: str | None = None,
                   trials: int | None = None) -> None:
    """Open the storage once, so an unreachable or malformed URL is one error line; a
    storage file that is the --db file too is refused first (each would be written as the
    other's kind: a worker's traceback, and the file changed). With `campaign`, its
    --trials must be the one its first invocation recorded: each invocation held its
    problems to its own, so one campaign's problems got 3 or 6 trials by who led them."""
    from flashgen.store.db import default_db_path
    from flashgen.tune.storage import (
        StorageError,
        campaign_trials,
        check_journal_tail,
        clear_stale_journal_lock,
        open_storage,
        storage_file,
    )

    shared = storage_file(url)
    tuning = (db or default_db_path()).expanduser().resolve()
    if shared is not None and shared.expanduser().resolve() == tuning:
        raise _fail(f"--storage {url} and --db name the same file ({tuning}): the shared "
                    "studies and the tuning database must be two files")
    age = clear_stale_journal_lock(url)
    if age is not None:  # a tuner killed while writing left it
        typer.echo(f"removed the journal's stale lock file {url}.lock ({age:.0f} s old, left "
                   "by a tuner killed while writing)", err=True)
    try:
        storage = open_storage(url)
        check_journal_tail(url)
        recorded = campaign_trials(storage, campaign, trials) if campaign else trials
    except StorageError as exc:
        raise _fail(str(exc)) from None
    if recorded != trials:
        def said(n: int | None) -> str:
            return "no --trials" if n is None else f"--trials {n}"

        raise _fail(f"campaign {campaign} runs {said(recorded)} (as its first invocation "
                    f"gave); this one gave {said(trials)}. Give {said(recorded)}, or a new "
                    "--campaign")


def _worker_slots(run: RunOptions, gpus: str | None, workers: int | None) -> list[int | None]:
    """The device of each worker: a GPU index, or None for the CPU interpreter."""
    if run.device_type == "cpu":
        return [None] * (workers or 1)
    import torch

    from flashgen.tune.workers import parse_gpus

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus is None and visible == 0:
        raise _fail("no CUDA GPU is visible: --workers runs its workers on --gpu; use "
                    "--device cpu for the Triton interpreter")
    try:
        if gpus is not None:
            return list(parse_gpus(gpus, visible))
        return parse_gpus(",".join([str(run.gpu)] * (workers or 1)), visible)  # type: ignore[return-value]
    except ValueError as exc:
        raise _fail(str(exc)) from None


def _run_workers(problems: list[Problem], run: RunOptions, slots: list[int | None],
                 storage: str | None, campaign: str | None = None) -> None:
    """Tune `problems` with one worker process per slot, sharing studies through `storage`
    (default: a journal file in a temporary folder, for this run only) in `campaign`
    (default: this invocation's own); one progress line per worker, then the merged
    summary."""
    from rich.console import Console
    from rich.progress import Progress

    from flashgen.bench.report import wrapped
    from flashgen.kernels.presets import problem_label
    from flashgen.store.db import TuningDB, default_db_path
    from flashgen.store.keys import package_version
    from flashgen.tune.report import progress_columns, results_tables, tflops_text
    from flashgen.tune.storage import temporary_journal
    from flashgen.tune.workers import WorkerPlan, new_id, run_workers

    run = replace(run, db_path=run.db_path or default_db_path())
    with contextlib.nullcontext(storage) if storage else temporary_journal() as url:
        invocation = new_id()
        plan = WorkerPlan(tuple(problems), run, url, campaign or invocation,
                          package_version("flashgen"), invocation=invocation)
        console, stderr = _console(), Console(stderr=True)
        labels = [f"w{i} {'cpu' if gpu is None else f'gpu{gpu}'}" for i, gpu in enumerate(slots)]
        longest = max(len(f"{w} {mode} {problem_label(p)}")
                      for w in labels for p in problems for mode in run.modes)
        with Progress(*progress_columns(run.wide, longest, stderr.width),
                      console=stderr) as progress:
            where = f"storage {_redacted(storage)}" if storage else "a temporary journal"
            if campaign:
                where += f", campaign {campaign}"
            progress.console.print(
                f"tuning {len(problems)} problem(s) with {len(slots)} worker(s) through "
                f"{where} (db: {run.db_path})")
            tasks = [progress.add_task(w, total=run.trials, best="-", last="") for w in labels]

            logs: dict[tuple[int, str], _LogLines] = {}  # plain lines off a terminal

            latest: dict[str, TuneResult] = {}  # each key's last report, by any worker

            def show(index: int, r: TuneResult) -> None:
                held = latest.get(r.key.id)
                if held is None or (r.best_tflops or 0) >= (held.best_tflops or 0):
                    latest[r.key.id] = r
                best = f"{tflops_text(r.best_tflops)} TFLOP/s" if r.best_tflops else "-"
                label = f"{labels[index]} {r.mode} {problem_label(r.problem)}"
                progress.update(tasks[index], completed=r.measured, best=best,
                                last=r.last[:50], description=label)
                logs.setdefault((index, label), _LogLines(progress)).step(label, r)

            def skip(index: int, problem: Problem, kind: str) -> None:
                # In the description, which every width shows: a worker with nothing of
                # its own left would otherwise sit at 0/N without a word.
                why = ("done by the campaign" if kind == "done"
                       else "led by another worker, no budget to share")
                left = f"{labels[index]} left {problem_label(problem)}"
                # Its count and best were the last problem's: this one it did not measure.
                progress.update(tasks[index], completed=0, best="-", last=why,
                                description=left)
                if not stderr.is_terminal:
                    progress.console.print(f"{left}: {why}", soft_wrap=True)

            def killed(index: int, signal_number: int) -> None:
                # Its line stops at once (its clock ran on until the whole run ended).
                what = f"{labels[index]} killed by signal {signal_number}"
                progress.update(tasks[index], description=what, last="")
                progress.stop_task(tasks[index])
                if not stderr.is_terminal:
                    progress.console.print(what, soft_wrap=True)

            interrupted = False
            try:
                results, ends = run_workers(plan, slots, show, skip, killed)
            except KeyboardInterrupt:  # the workers got it too, and stored what they had
                progress.console.print("interrupted: results so far are in the database")
                # The summary of what they reported last, as a single process prints it.
                interrupted, results, ends = True, list(latest.values()), []
    with TuningDB(run.db_path) as database:
        for r in results:
            r.winner = database.winner(r.key)
    tables = results_tables(results, run.wide)
    _print_tables(console, tables, run.wide)
    if interrupted:
        raise typer.Exit(130)
    notes = _left_to_campaign(problems, results, ends, plan.campaign)
    if storage is not None and run.trials is not None:
        notes += _running_elsewhere(storage, plan, results)
    if tables and notes:
        typer.echo()
    for line in notes:  # folded at 80 columns, whole
        typer.echo(wrapped(line))
    bad = [e for e in ends if e.status != "ok"]
    for end in bad:
        typer.echo(f"worker {end.index} ({'cpu' if end.gpu is None else f'gpu {end.gpu}'}) "
                   f"{end.status}{': ' + end.message if end.message else ''}; its finished "
                   f"trials are stored, its running one goes back to the study", err=True)
    if bad:
        raise typer.Exit(1)


def _left_to_campaign(problems: list[Problem], results: list[TuneResult],
                      ends: list[WorkerEnd], campaign: str) -> list[str]:
    """Lines on the problems no worker of this invocation tuned: finished by the campaign
    (a rerun of a named one) or led by another of its workers and not joined. Without them
    a rerun of a finished campaign would end with no table and no word."""
    from flashgen.tune.storage import GRACE_S

    tuned = {r.problem for r in results}
    kinds: dict[Problem, str] = {}
    for end in ends:
        for problem, kind in end.skipped.items():
            if problem not in tuned and kinds.get(problem) != "done":
                kinds[problem] = kind

    done = [p for p in problems if kinds.get(p) == "done"]
    held = [p for p in problems if kinds.get(p) == "held"]
    lines = []
    if done:
        lead = "nothing new to tune: " if len(done) == len(problems) else ""
        lines.append(f"{lead}{_named(done)} already done by campaign {campaign}: an "
                     f"invocation of it measured their --trials, and a campaign tunes a "
                     f"problem once; a new --campaign tunes them again. `flashgen pull` "
                     f"gathers their rows")
    if held:
        # Not joined: its budget was taken, or --timeout alone left none to share.
        lines.append(f"{_named(held)} led by another worker of campaign {campaign} and left "
                     f"to it; its rows go to that worker's --db (`flashgen pull` gathers them). "
                     f"A dead worker's lease expires {GRACE_S} s after its last heartbeat: run "
                     f"again to take it over")
    return lines


def _running_elsewhere(url: str, plan: WorkerPlan, results: list[TuneResult]) -> list[str]:
    """A line on the problems this invocation tuned whose campaign still has measurements
    running when its own workers have all ended: another invocation's, or a worker of
    another host killed moments ago, whose claims count toward the budget until its
    heartbeat goes stale (this host's dead workers' claims fail at once). A rerun right
    after a kill otherwise ended short of --trials with status 0 and no word."""
    from flashgen.tune.storage import GRACE_S, Shared, StorageError, open_storage

    try:
        shared = Shared(open_storage(url), plan.version, plan.campaign, "parent")
    except StorageError:
        return []  # the workers' own errors say more
    try:
        busy = [r for r in results if shared.running(r.key, r.problem)]
    finally:
        shared.close()
    if not busy:
        return []
    return [f"{_named([r.problem for r in busy])} still have measurements of campaign "
            f"{plan.campaign} running elsewhere: another invocation's, or the claims of a "
            f"worker killed on another host, until {GRACE_S} s after its last heartbeat. "
            f"Their budget counts them; if none is running, run again after {GRACE_S} s to "
            f"measure what they held"]


def _named(group: list[Problem]) -> str:
    """`group` in a note: how many problems, and the first three's labels."""
    from flashgen.kernels.presets import problem_label

    labels = [problem_label(p) for p in group[:3]]
    more = f" and {len(group) - 3} more" if len(group) > 3 else ""
    return f"{len(group)} problem(s) ({', '.join(labels)}{more})"


def _redacted(url: str | None) -> str:
    from flashgen.tune.storage import redact

    return redact(url or "")


def _run_tuning(problems: list[Problem], run: RunOptions) -> None:
    """Tune `problems` as `run` says, with progress, a summary, and one database run row."""
    import optuna
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from flashgen.kernels.hardware import device_info
    from flashgen.kernels.presets import problem_label
    from flashgen.store.db import TuningDB
    from flashgen.tune.report import (
        none_passed_notes,
        progress_columns,
        results_tables,
        tflops_text,
    )
    from flashgen.tune.search import TuneOptions, tune_problem
    from flashgen.tune.workers import make_bench

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if run.device_type == "cuda":
        if not torch.cuda.is_available():
            raise _fail("no CUDA GPU is visible; use --device cpu for the interpreter")
        if run.gpu >= torch.cuda.device_count():
            raise _fail(f"--gpu {run.gpu}: only {torch.cuda.device_count()} GPU(s) visible")
        target = torch.device("cuda", run.gpu)
    else:
        target = torch.device("cpu")
    info = device_info(target)
    batch = run.compile_workers if run.device_type == "cuda" else 1
    run_id = uuid.uuid4().hex[:12]
    console = _console()
    results: list[TuneResult] = []
    current: tuple[Problem, str] | None = None  # the problem and mode being tuned
    reported: list[TuneResult] = []  # its result, as its progress last gave it
    interrupted = False
    stderr = Console(stderr=True)
    longest = max(len(f"{mode} {problem_label(p)}") for p in problems for mode in run.modes)
    with TuningDB(run.db_path) as database, Progress(
        *progress_columns(run.wide, longest, stderr.width), console=stderr,
    ) as progress:
        logged = _LogLines(progress)
        progress.console.print(f"tuning {len(problems)} problem(s) on {info.name} "
                               f"(db: {database.path})")
        database.start_run(run_id, info)
        status = "failed"  # unless the loop ends or is interrupted
        try:
            for problem, mode in ((p, m) for p in problems for m in run.modes):
                current, reported[:] = (problem, mode), []
                label = f"{mode} {problem_label(problem)}"
                task = progress.add_task(label, total=run.trials, best="-", last="")

                def show(r: TuneResult, task: int = task, label: str = label) -> None:
                    reported[:] = [r]
                    best = f"{tflops_text(r.best_tflops)} TFLOP/s" if r.best_tflops else "-"
                    progress.update(task, completed=r.measured, best=best, last=r.last[:50])
                    logged.step(label, r)

                bench = make_bench(mode, problem, target, run.seed, run.compile_workers,
                                   database.path)
                options = TuneOptions(mode, run.trials, run.timeout, run.seed, batch,
                                      run.remeasure, run.exhaustive, run.deterministic)
                results.append(tune_problem(problem, bench, database, info, options,
                                           run_id=run_id, on_progress=show))
                logged.done(label, results[-1])
            status = "ok"
        except KeyboardInterrupt:
            interrupted = True
            status = "interrupted"
            if current is not None:
                results.append(_interrupted(*current, info, run.trials, reported, database,
                                            progress))
        finally:
            database.finish_run(run_id, status)
    _print_tables(console, results_tables(results, run.wide), run.wide)
    for line in none_passed_notes(results, info.is_interpreter):
        typer.echo(line, err=True)
    if interrupted:
        raise typer.Exit(130)  # as a shell reports a process that SIGINT stopped


def _exit_interrupted() -> None:
    """After an interrupted bench has printed and written what it finished: exit 130, as a
    shell reports a process SIGINT stopped (and as `tune` does), so a script can tell a
    partial CSV from a whole one."""
    raise typer.Exit(130)


class _LogLines:
    """Progress as plain lines where stderr is no terminal (a batch job's log, `| tee`):
    rich draws its bars there only when they stop, so a long run's log stayed empty until
    its end, and a run killed by a time limit left none. A line every LOG_EVERY measured
    trials of a problem, and one when it is done."""

    LOG_EVERY = 10

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.live = progress.console.is_terminal
        self.logged = 0

    def step(self, label: str, r: TuneResult) -> None:
        if not self.live and r.measured >= self.logged + self.LOG_EVERY:
            self.logged = r.measured - r.measured % self.LOG_EVERY
            self.progress.console.print(f"{label}: {r.measured} measured, best "
                                        f"{self._best(r)}", soft_wrap=True)

    def done(self, label: str, r: TuneResult) -> None:
        self.logged = 0
        if not self.live:
            self.progress.console.print(
                f"{label}: done, {r.measured} measured ({r.failed} failed, {r.pruned} "
                f"pruned, {r.resumed} resumed) in {r.seconds:.0f} s, best {self._best(r)}",
                soft_wrap=True)

    @staticmethod
    def _best(r: TuneResult) -> str:
        from flashgen.tune.report import tflops_text

        return (f"{tflops_text(r.best_tflops)} TFLOP/s ({r.best})"
                if r.best_tflops and r.best is not None else "-")


@contextlib.contextmanager
def _compile_progress() -> Iterator[Callable[[int, int], None]]:
    """`on_progress` for the AOT compile (minutes for a full export): a bar on a terminal,
    else a plain line when it starts and at each further tenth (see `_LogLines`)."""
    import time

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    stderr = Console(stderr=True)
    if stderr.is_terminal:
        with Progress(TextColumn("compiling cubins"), BarColumn(bar_width=20),
                      MofNCompleteColumn(), TimeElapsedColumn(), console=stderr) as bar:
            task = bar.add_task("compile", total=None)
            yield lambda done, total: bar.update(task, completed=done, total=total)
        return
    start, told = time.monotonic(), [-1]

    def line(done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if tenth > told[0]:
            told[0] = tenth
            what = (f"compiling {total} cubin(s)" if done == 0 else
                    f"compiled {done}/{total} cubin(s) in {time.monotonic() - start:.0f} s")
            stderr.print(what, soft_wrap=True)

    yield line


def _interrupted(problem: Problem, mode: str, info: DeviceInfo, trials: int | None,
                 reported: list[TuneResult], database: TuningDB,
                 progress: Progress) -> TuneResult:
    """The result of the problem Ctrl-C stopped, for the summary: what its progress last
    reported (this run's best so far, resumed results included), with the key's stored
    winner, since its trials are in the database too."""
    from flashgen.store.keys import TuningKey
    from flashgen.tune.search import TuneResult

    if reported:
        result = reported[0]
    else:  # stopped before anything was measured or resumed
        result = TuneResult(problem, TuningKey.for_problem(problem, info, mode), trials)
    result.winner = database.winner(result.key)
    result.seconds = (progress.tasks[-1].elapsed or 0.0) if progress.tasks else 0.0
    best = (f"best so far {result.best} ({result.best_tflops:.3g} TFLOP/s)"
            if result.best is not None and result.best_tflops else "nothing passed yet")
    from flashgen.kernels.presets import problem_label

    progress.console.print(f"interrupted: {mode} {problem_label(problem)}: {best}; results "
                           f"so far are in the database")
    return result


@app.command()
def pull(
    storage: Annotated[str, typer.Option(
        metavar="URL", help="The shared Optuna storage the workers tuned through (as given "
                            "to `flashgen tune --storage`).")],
    db: DbOption = None,
) -> None:
    """Copy every host's trials (ok, failed and pruned, with reasons) and SDPA baselines
    from a shared storage into one tuning database, and choose its winners, so `show`,
    dispatch and `export` use them. Only this flashgen version's studies are read; rows
    the file already holds are not copied again."""
    from flashgen.store.db import TuningDB
    from flashgen.store.keys import package_version
    from flashgen.tune.pull import pull as pull_rows
    from flashgen.tune.storage import StorageError, open_storage

    try:
        # must_exist: opening a file storage creates it, so a mistyped path would pull
        # nothing, silently.
        shared = open_storage(storage, must_exist=True)
    except StorageError as exc:
        raise _fail(str(exc)) from None
    with TuningDB(db) as database:
        report = pull_rows(shared, database, package_version("flashgen"),
                           f"flashgen pull --storage {_redacted(storage)}")
        typer.echo(f"pulled {report.copied} trial(s) from {report.studies} study(ies) into "
                   f"{database.path} ({report.present} already there); "
                   f"{report.winners} winner(s)")
    if report.other_versions:
        typer.echo(f"note: {report.other_versions} study(ies) of other flashgen versions "
                   f"left out", err=True)
    if report.unreadable:
        typer.echo(f"note: {report.unreadable} row(s) with variants this flashgen cannot "
                   f"build left out", err=True)


@app.command(epilog=LABELS_HELP)
def show(
    db: DbOption = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print the winners (or runs) as JSON instead of tables.")] = False,
    current: Annotated[bool, typer.Option(
        help="Only winners that the installed Triton and templates can use.")] = False,
    runs: Annotated[bool, typer.Option(
        "--runs", help="List the runs that wrote the database (its provenance) instead.")
    ] = False,
    wide: WideOption = False,
) -> None:
    """List the winners, one per key (device, versions, dtype, mask, head dim, GQA ratio and
    sequence-length buckets), or with --runs the runs that wrote them. Without --db, the
    databases dispatch reads: the user database, then the one shipped with flashgen; each
    table (JSON: each row's "db" and "source") says which, and a note marks the rows
    dispatch would not serve."""
    from flashgen.store.db import default_db_path
    from flashgen.store.table import shipped_db_path
    from flashgen.tune.report import listed, winners_tables

    if runs and (current or wide):
        raise _fail("--runs lists runs, which --current and --wide do not apply to (they "
                    "filter and widen the winners' tables)")
    if db is not None and not db.exists():
        raise _fail(f"no tuning database at {db}")
    named = [("db", db)] if db else [("user", default_db_path()), ("shipped", shipped_db_path())]
    sources = []
    for source, path in named:
        if path.exists() and not path.is_file() and not path.is_dir():
            raise _fail(f"{path} is not a file: name a tuning database file (--db, "
                        "$FLASHGEN_DB)")
        if not path.is_file() and not path.is_dir():  # a folder: open_readonly names it
            typer.echo(f"note: no {source} database at {path} yet (`flashgen tune` writes it)",
                       err=True)
            continue
        sources.append((source, path, _read_ours(
            path, lambda d: d.runs() if runs else d.all_winners())))
    if runs:
        _show_runs(sources, as_json)
        return
    rows = [r for r in listed(sources) if r.current or not current]
    if as_json:
        typer.echo(json.dumps([r.to_dict() for r in rows], indent=2))
        return
    console = _console()
    for source, path, _ in sources:
        console.print(f"{source}: {path}", highlight=False, markup=False, soft_wrap=True)
    if not rows:
        console.print("no winners")
    _print_tables(console, winners_tables(rows, wide), wide)


@app.command()
def explain(
    shape: ShapeOption = None,
    preset: PresetOption = None,
    dtype: Annotated[str, typer.Option(
        metavar="LIST", help="Comma-separated input dtypes: fp16, bf16, fp32, fp8.")] = "bf16",
    causal: Annotated[str, typer.Option(
        metavar="yes|no|both", help="Masking: yes (causal), no (full), or both.")] = "both",
    gpu_name: Annotated[str | None, typer.Option(
        "--gpu-name", metavar="TEXT",
        help="Only the GPUs whose name holds this text (case ignored), e.g. H100.")] = None,
    mode: Annotated[str, typer.Option(
        metavar="attention|decode",
        help="attention: the forward and backward of `flashgen.attention`; decode: the "
             "KV-cache call's (`attention_with_kvcache`), with --page-size.")] = "attention",
    page_size: Annotated[str, typer.Option(
        metavar="LIST", help="--mode decode: comma-separated page sizes of the cache (0: "
                             "contiguous).")] = "0",
    window: Annotated[str | None, typer.Option(
        metavar="L,R", help="With a sliding window (attention's window=(L, R)).")] = None,
    softcap: Annotated[float | None, typer.Option(
        metavar="C", help="With a logit softcap (C > 0).")] = None,
    sinks: Annotated[bool, typer.Option("--sinks", help="With attention sinks.")] = False,
    varlen: Annotated[int | None, typer.Option(
        metavar="S", min=1,
        help="Packed: each problem's B x N tokens cut into S sequences of seeded random "
             "lengths, as `flashgen tune --varlen` cuts them.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of --varlen's lengths.")] = 0,
    db: DbOption = None,
) -> None:
    """Which variants each problem would run on each GPU the databases hold winners for,
    and why: what `flashgen.explain` says on that GPU, asked from any machine (to check
    what a database covers before shipping it). Without --db, the databases dispatch reads:
    the user database, then the one shipped with flashgen."""
    import dataclasses

    from flashgen.bench.report import wrapped
    from flashgen.export.rows import device_of
    from flashgen.kernels.presets import problem_label
    from flashgen.runtime.kvcache import serves_as_decode
    from flashgen.serve import Dispatcher, shape_of
    from flashgen.store.db import TuningDB
    from flashgen.store.table import default_paths

    if not shape and not preset:
        raise _fail("name the problems: --shape B,Hq,Hkv,Nq,Nk,D or --preset NAME")
    if mode not in ("attention", "decode"):
        raise _fail(f"--mode is attention or decode, not {mode!r}")
    if db is not None and not db.is_file():
        raise _fail(f"no tuning database at {db}")
    try:
        problems = _problems(shape, preset, dtype, causal, mode == "decode", page_size,
                             window, softcap, sinks, varlen, seed)
    except (ValueError, TypeError) as exc:
        raise _fail(str(exc)) from None
    paths = [db] if db is not None else default_paths()
    gpus: dict[str, tuple[str, str, int]] = {}
    for path in paths:
        if not path.is_file():
            continue
        for row in _read_ours(path, TuningDB.all_winners):
            k = row.key
            gpus.setdefault(k.device_key, (k.gpu_name, k.capability, k.sm_count))
    found = sorted(gpus.values())
    chosen = [g for g in found if gpu_name is None or gpu_name.lower() in g[0].lower()]
    if not chosen:
        where = ", ".join(str(p) for p in paths)
        names = ", ".join(sorted({g[0] for g in found})) or "none"
        raise _fail(f"no GPU {'named like ' + repr(gpu_name) + ' ' if gpu_name else ''}has "
                    f"winners in {where} (GPUs there: {names})")
    dispatcher = Dispatcher(paths)
    for name, capability, sm_count in chosen:
        device = device_of(name, capability, sm_count)
        for problem in problems:
            typer.echo(f"{name} · sm{capability.replace('.', '')} · {problem_label(problem)}")
            if mode == "decode":
                table = dispatcher.table_for(device)
                typer.echo(f"{dispatcher.lookup(table, 'decode', shape_of(problem))[0]}\n")
                continue
            if problem.dtype != "fp8" and serves_as_decode(problem.seq_q, problem.seq_k):
                typer.echo(wrapped(f"the decode family: {problem.seq_q} queries against "
                                   f"{problem.seq_k} keys (--mode decode says which of its "
                                   "variants)") + "\n")
                continue
            choice = dispatcher.choose(problem, device)
            if problem.dtype != "fp8":  # fp8 is forward only
                choice = dataclasses.replace(choice,
                                             backward=dispatcher.choose_bwd(problem, device))
            hint = _tune_hint(problem, choice, window, softcap)
            # The command stays whole on its line, to be copied.
            typer.echo(f"{choice}\n" + (f"for rows of its own:\n  {hint}\n" if hint else ""))


def _tune_hint(problem: Problem, choice: Any, window: str | None,
               softcap: float | None) -> str | None:
    """The `flashgen tune` command that gives `problem` rows of its own where a pass of it
    runs another bucket's row or a default (None where both are exact or explicit, and for a
    packed problem, whose --shape is the batch before it was cut)."""
    modes = [mode for mode, c in (("fwd", choice), ("bwd", choice.backward))
             if c is not None and c.how in ("nearest", "fallback")]
    if not modes or problem.varlen:
        return None
    p = problem
    flags = [f"--shape {p.batch},{p.heads_q},{p.heads_kv},{p.seq_q},{p.seq_k},{p.head_dim}",
             f"--dtype {p.dtype}", f"--causal {'yes' if p.causal else 'no'}",
             f"--mode {'both' if len(modes) == 2 else modes[0]}"]
    if p.window:
        flags.append(f"--window {window}")
    if p.softcap and softcap is not None:
        flags.append(f"--softcap {softcap:g}")
    if p.sinks:
        flags.append("--sinks")
    return "flashgen tune " + " ".join(flags)


def _read_ours(path: Path, read: Callable[[TuningDB], list[Any]]) -> list[Any]:
    """`read` of flashgen's database at `path`, opened read only: `show` and `explain` must
    not migrate or re-journal the file they read (say the database shipped inside the
    installed package, which may not be writable at all). A database error is one error
    line naming this file."""
    from flashgen.store.db import TuningDB

    try:
        with TuningDB.open_ours(path) as database:
            return read(database)
    except (sqlite3.Error, OSError) as exc:
        failure = _store_failure(exc, path)
        if failure is None:
            raise
        raise failure from None


def _show_runs(sources: list[tuple[str, Path, list[Any]]], as_json: bool) -> None:
    """`show --runs`: each database's runs, in a table that fits 80 columns however wide
    the console (its command column folds), or as JSON with each run's database."""
    from flashgen.tune.report import runs_table

    if as_json:
        typer.echo(json.dumps([{**vars(r), "died": r.died, "db": str(path), "source": source}
                               for source, path, rows in sources for r in rows], indent=2))
        return
    console = _console()
    for i, (source, path, rows) in enumerate(sources):
        if i:
            console.print()
        console.print(f"{source}: {path}", highlight=False, markup=False, soft_wrap=True)
        if not rows:
            console.print("no runs recorded")
            continue
        console.print(runs_table(rows), width=min(80, console.width))
        if any(r.died for r in rows):
            console.print("died: marked running, but its process on this host is gone (killed "
                          "or crashed); its trials are stored, and a rerun resumes it",
                          highlight=False, soft_wrap=True)


@app.command("presets")
def list_presets() -> None:
    """List the problem presets that `flashgen tune --preset` accepts."""
    from rich.table import Table

    from flashgen.kernels.presets import DECODE_PRESETS, PRESETS

    table = Table(title="flashgen presets",
                  caption="n: problems; first: the first one's B,Hq,Hkv,Nq,Nk,D")
    table.add_column("name", no_wrap=True)
    table.add_column("n", justify="right")
    table.add_column("description")
    table.add_column("first", no_wrap=True)
    for name, p in [*PRESETS.items(), *DECODE_PRESETS.items()]:
        shapes = p.shapes()
        table.add_row(name, str(len(shapes)), p.description, ",".join(map(str, shapes[0])))
    console = _console()
    console.print(table, width=min(80, console.width))  # the description wraps


@app.command()
def bench(
    shape: ShapeOption = None,
    preset: PresetOption = None,
    dtype: Annotated[str | None, typer.Option(
        metavar="LIST", help="Comma-separated input dtypes: fp16, bf16, fp32, fp8 (forward). "
                             "Default fp16,bf16 on cuda, fp16 on cpu (the interpreter's bf16 dots "
                             "are wrong); --mode decode: bf16 on cuda, fp32 on cpu.")] = None,
    causal: Annotated[str, typer.Option(
        metavar="yes|no|both", help="Masking: yes (causal), no (full), or both.")] = "both",
    mode: Annotated[str, typer.Option(
        metavar="fwd|bwd|both|decode",
        help="What is timed: fwd (forward), bwd (backward alone), both (forward+backward "
             "in one call); a comma-separated list such as fwd,both times each. decode: "
             "attention_with_kvcache against SDPA flash, cuDNN and FlexAttention, in us, "
             "GB/s of K/V read and share of the measured copy rate (decode presets: "
             "llama3-8b-decode, llama3-70b-decode, qwen2.5-7b-decode, decode-targets; "
             "--causal defaults to yes).")] = "fwd",
    page_size: Annotated[str, typer.Option(
        metavar="LIST", help="--mode decode: comma-separated page sizes of the caches; 0 is "
                             "a contiguous cache.")] = BENCH_PAGE_SIZES,
    competitors: Annotated[str | None, typer.Option(
        metavar="LIST",
        help="Comma-separated: flashgen, sdpa-flash, sdpa-cudnn, sdpa-efficient, sdpa-math, "
             "flex. Default: all but sdpa-math on cuda; flashgen,sdpa-math on cpu. --mode "
             "decode takes flashgen, sdpa-flash, sdpa-cudnn, flex and sdpa-math.")] = None,
    gpu: Annotated[int, typer.Option(min=0, help="Index of the CUDA GPU to run on.")] = 0,
    device: Annotated[str, typer.Option(
        metavar="cuda|cpu",
        help="cuda, or cpu to run tiny problems through the Triton interpreter (tests the "
             "pipeline; its timings say nothing about GPUs).")] = "cuda",
    out: Annotated[Path, typer.Option(
        file_okay=False, callback=_expand,
        help="Folder for bench.csv, bench.png and memory.csv.")] = Path("flashgen-bench"),
    csv_path: Annotated[Path | None, typer.Option(
        "--csv", dir_okay=False, callback=_expand,
        help="Timing CSV (default: OUT/bench.csv).")] = None,
    plot: Annotated[Path | None, typer.Option(
        dir_okay=False, callback=_expand,
        help="PNG plot of TFLOP/s against N (default: OUT/bench.png); needs matplotlib, else "
             "skipped with a note.")] = None,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="Write no plot.")] = False,
    memory: Annotated[bool, typer.Option(
        "--memory", help="Also measure peak memory of flashgen and sdpa-math at N = 32k, 64k "
                         "and 128k (batch 1; fwd, and fwd+bwd when a backward is timed); "
                         "cuda only.")] = False,
    timing: Annotated[bool, typer.Option(
        "--timing/--no-timing", help="Time the problems (--no-timing with --memory measures "
                                     "memory only).")] = True,
    seed: Annotated[int, typer.Option(help="Seed of all random inputs.")] = 0,
    rep_ms: Annotated[float, typer.Option(
        min=1, help="Milliseconds of timed calls per measurement on a GPU (10 to 200 calls, "
                    "after a quarter of that of warm-up); the median is reported.")] = 100.0,
    timer: Annotated[str, typer.Option(
        metavar="wall|gpu",
        help="wall: calls back to back, L2 cleared, CUDA events, the median (as "
             "triton.testing.do_bench): a call's host launch cost counts wherever it exceeds "
             "its GPU work, as in eager PyTorch. gpu: calls queued behind a GPU spin, the "
             "GPU's work alone.")] = "wall",
    window: Annotated[int | None, typer.Option(
        metavar="W", min=0,
        help="Causal sliding window: each query sees itself and the W keys before it. Only "
             "flashgen and flex run it; FLOPs count the visible pairs.")] = None,
    varlen: Annotated[int | None, typer.Option(
        metavar="S", min=1,
        help="Packed variable-length batch: each problem's B x N tokens cut into S "
             "sequences of seeded random lengths (flashgen.attention_varlen; flex with a "
             "document mask).")] = None,
    db: DbOption = None,
) -> None:
    """Compare flashgen's dispatched kernels with torch SDPA's backends and compiled
    FlexAttention on the same inputs: each output (and gradient) checked against the
    reference, then timed (median of repeats, CUDA events); prints TFLOP/s tables with
    flashgen's ratio to the best competitor, writes a CSV and a PNG plot. flashgen's kernels
    are dispatched from the database (--db), then the one shipped with flashgen."""
    if device not in ("cuda", "cpu"):
        raise _fail(f"--device must be cuda or cpu, got {device!r}")
    if timer not in ("wall", "gpu"):
        raise _fail(f"--timer must be wall or gpu, got {timer!r}")
    if device == "cpu":
        _use_interpreter()
        if memory:
            raise _fail("--memory needs a CUDA GPU (it reads torch.cuda's allocator)")
    if not shape and not preset:
        raise _fail("give at least one --shape or --preset")
    if not timing and not memory:
        raise _fail("--no-timing leaves nothing to do without --memory")
    if memory and (window is not None or varlen is not None):
        raise _fail("--memory measures dense problems: run it without --window/--varlen")
    if db is not None and not db.is_file():
        raise _fail(f"no tuning database at {db}")
    if db is not None:
        # Refused as `show` and `export` refuse it (one `error:` line from `_explained`):
        # another program's file would bench the default variants without a word.
        from flashgen.store.db import TuningDB

        TuningDB.open_ours(db).close()
    named = {m.strip().lower() for m in mode.split(",") if m.strip()}
    if named == {"decode"}:
        if window is not None or varlen is not None or memory:
            raise _fail("--mode decode times plain KV-cache calls: drop --window, --varlen "
                        "and --memory")
        _bench_decode(shape or [], preset or [], dtype, causal, page_size, device, gpu, out,
                      csv_path, seed, rep_ms, timer, db, competitors)
        return
    if "decode" in named:
        raise _fail(f"--mode decode runs alone (its problems are KV-cache calls), got {mode!r}")
    if page_size != BENCH_PAGE_SIZES:
        raise _fail("--page-size is for --mode decode (KV-cache problems)")

    from flashgen.bench.command import Outputs, resolve_device, run_bench
    from flashgen.bench.competitors import parse_names, resolve
    from flashgen.bench.layouts import Layout
    from flashgen.bench.suite import parse_modes
    from flashgen.kernels import presets
    from flashgen.serve import Dispatcher
    from flashgen.store.table import shipped_db_path

    dispatcher = Dispatcher([db, shipped_db_path()]) if db else None
    try:
        target = resolve_device(device, gpu)
        dtypes = presets.parse_dtypes(dtype or ("fp16,bf16" if device == "cuda" else "fp16"))
        if device == "cpu" and "bf16" in dtypes:
            raise ValueError(BF16_ON_CPU.format(verb="bench"))
        problems = presets.expand(shape or [], preset or [], dtypes,
                                  presets.parse_causal(causal))
        modes = parse_modes(mode)
        names = parse_names(competitors, target)
        resolve(names)
        layout = Layout(window, varlen)
        problems = layout.problems(problems)  # raises for problems the layout cannot take
        outputs = Outputs.under(out, csv_path, plot, no_plot)
        outputs.check(timing=timing, memory=memory)  # a user's file there stays untouched
    except ValueError as exc:
        raise _fail(str(exc)) from None
    with _terminate_as_interrupt():
        run_bench(problems, modes, target, names, outputs,
                  timing=timing, memory=memory, seed=seed, rep_ms=rep_ms, timer=timer,
                  console=_console(), layout=layout if layout else None,
                  dispatcher=dispatcher, on_interrupt=_exit_interrupted)


def _bench_decode(shapes: list[str], preset_names: list[str], dtype: str | None, causal: str,
                  page_size: str, device: str, gpu: int, out: Path, csv_path: Path | None,
                  seed: int, rep_ms: float, timer: str, db: Path | None,
                  competitors: str | None) -> None:
    """`flashgen bench --mode decode`: see `flashgen.bench.decoding`."""
    from flashgen.bench.command import resolve_device
    from flashgen.bench.decoding import (
        DECODE_COMPETITORS,
        DECODE_CSV_FIELDS,
        FLASHGEN,
        run_decode_bench,
    )
    from flashgen.bench.report import check_csv_target
    from flashgen.kernels import presets
    from flashgen.serve import Dispatcher
    from flashgen.store.table import shipped_db_path

    try:
        target = resolve_device(device, gpu)
        dtypes = presets.parse_dtypes(dtype or ("bf16" if device == "cuda" else "fp32"))
        if "fp8" in dtypes:
            raise ValueError("--dtype fp8 is forward only: the decode family takes fp16, bf16 "
                             "(and fp32 on the CPU)")
        problems = presets.decode_problems(
            shapes, preset_names, dtypes,
            presets.parse_causal("yes" if causal == "both" else causal),
            presets.parse_page_sizes(page_size))
        target_csv = csv_path or out / "decode.csv"
        check_csv_target(target_csv, DECODE_CSV_FIELDS)  # a user's file there stays untouched
    except ValueError as exc:
        raise _fail(str(exc)) from None
    known = (*DECODE_COMPETITORS, "sdpa-math")
    if competitors is None:
        names = DECODE_COMPETITORS if target.type == "cuda" else (FLASHGEN, "sdpa-math")
    else:
        names = tuple(dict.fromkeys(n.strip() for n in competitors.split(",") if n.strip()))
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise _fail(f"--mode decode takes competitors among {', '.join(known)}; got "
                        f"{competitors!r}")
    with _terminate_as_interrupt():
        run_decode_bench(problems, target, names, seed=seed, rep_ms=rep_ms, timer=timer,
                         csv_path=target_csv, console=_console(),
                         dispatcher=Dispatcher([db, shipped_db_path()]) if db else None,
                         on_interrupt=_exit_interrupted)


@app.command()
def export(
    out: Annotated[Path, typer.Option(
        "--out", file_okay=False, callback=_expand,
        help="Directory to write the package into.")],
    db: DbOption = None,
    gpu: Annotated[str | None, typer.Option(
        metavar="NAME", help="Export only this GPU model's winners, e.g. 'NVIDIA H200' "
                             "(default: every GPU in the database).")] = None,
    name: Annotated[str, typer.Option(
        help="Name of the written package (an ASCII Python identifier, not an installed "
             "module's).")] = "flashgen_kernels",
    fmt: Annotated[str, typer.Option(
        "--format", metavar="python|aot",
        help="python: a package needing only torch and triton; aot: cubins compiled for each "
             "tuned GPU, with a manifest and a C header for C/C++ launchers.")] = "python",
    force: Annotated[bool, typer.Option(
        help="Replace an earlier export of the same name (never another folder, a file "
             "or a link).")] = False,
    fp8_out: Annotated[str | None, typer.Option(
        "--fp8-out", metavar="LIST",
        help="aot: output dtypes to compile each fp8 kernel for, bf16 and/or fp16 "
             "(comma-separated; each is a cubin of its own). Default bf16.")] = None,
    modifiers: Annotated[str | None, typer.Option(
        "--modifiers", metavar="SETS",
        help="python: also ship kernels for these modifier sets, comma-separated, each a "
             "modifier or several joined by '+': window, softcap, sinks, varlen (packed "
             "sequences), e.g. 'softcap,window+softcap', into every entry and default. "
             "Winners tuned with modifiers ship either way, for their own buckets.")] = None,
    kinds: Annotated[str | None, typer.Option(
        "--kinds", metavar="LIST",
        help="Also ship default kernels for these kinds of problem, which no winner covers: "
             "comma-separated DTYPE:HEAD_DIM, each causal and not, e.g. 'bf16:128,fp16:80' "
             "(a kind without them is a named error in the package).")] = None,
) -> None:
    """Write the tuned winners (and default variants for their kinds) as a self-contained
    package DIR/NAME that runs without flashgen. Without --db: the user database, then the
    shipped one."""
    if fmt not in ("python", "aot"):
        raise _fail(f"--format must be python or aot, got {fmt!r}")
    if fmt == "python" and fp8_out is not None:
        raise _fail("--fp8-out is for --format aot: the python package compiles its fp8 "
                    "kernels on first use, for the out_dtype each call asks")
    if fmt == "aot" and modifiers is not None:
        raise _fail("--modifiers is for --format python: the AOT format compiles plain "
                    "attention only")
    from flashgen.export.rows import parse_kinds, parse_modifier_sets, select_winners
    from flashgen.store.db import default_db_path
    from flashgen.store.table import shipped_db_path

    paths = [db] if db else [default_db_path(), shipped_db_path()]
    if db and not db.is_file():
        raise _fail(f"no tuning database at {db}")
    try:
        sets = parse_modifier_sets(modifiers or "")
        extra = parse_kinds(kinds or "")
    except ValueError as exc:
        raise _fail(str(exc)) from None
    selection = select_winners(paths, gpu, sets, extra)
    for note in selection.notes:
        typer.echo(f"note: {note}", err=True)
    shown = len(selection.notes)
    if not selection.gpus:
        where = f" for GPU {gpu!r}" if gpu else ""
        raise _fail(f"no current winners{where} in {', '.join(map(str, paths))}")
    try:
        if fmt == "python":
            from flashgen.export.package import write_package

            report = write_package(selection, out, name, force)
            for note in selection.notes[shown:]:  # the defaults' notes, found while writing
                typer.echo(f"note: {note}", err=True)
            typer.echo(f"wrote {report.path}: {report.tuned} tuned entries for "
                       f"{', '.join(report.gpus)}; {report.kernels} kernel sources")
        else:
            from flashgen.export.aot import write_aot

            with _compile_progress() as show:
                aot = write_aot(selection, out, name, force,
                                fp8_out=[d.strip() for d in (fp8_out or "bf16").split(",")
                                         if d.strip()], on_progress=show)
            typer.echo(f"wrote {aot.path}: {aot.kernels} cubins for {', '.join(aot.gpus)}; "
                       f"{len(aot.skipped)} winner(s) skipped (see manifest.json)")
    except (ValueError, FileExistsError) as exc:
        raise _fail(str(exc)) from None


if __name__ == "__main__":
    app(prog_name="flashgen")
