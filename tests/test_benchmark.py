"""`flashgen bench`: ratio and table logic on made-up rows, the suite with fake competitors
and a fake timer, the memory table with a fake measure, and the whole command on the CPU
interpreter in a fresh process."""

from __future__ import annotations

import csv
import io
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from flashgen.bench.competitors import (
    COMPETITORS,
    Competitor,
    Prepared,
    Unavailable,
    parse_names,
    resolve,
)
from flashgen.bench.memory import (
    MemoryRow,
    memory_modes,
    memory_problems,
    memory_records,
    memory_table,
    run_memory,
)
from flashgen.bench.plot import series
from flashgen.bench.report import (
    UNSTEADY_NOTE,
    csv_records,
    summarize,
    timing_table,
    unavailable_notes,
    write_csv,
)
from flashgen.bench.suite import FLOP_FACTOR, Row, mode_flops, parse_modes, run_suite
from flashgen.cli import app
from flashgen.kernels.problem import Problem
from flashgen.tune import reference
from flashgen.tune.fwd_bench import GATE_MAX_SEQ
from flashgen.tune.timing import Timing

P = Problem(1, 2, 1, 64, 64, 16, "fp32", causal=True)


def _row(name: str, ms: float | None, status: str = "ok", problem: Problem = P,
         mode: str = "fwd") -> Row:
    timing = None if ms is None else Timing(ms, ms, ms, 3)
    return Row(problem, mode, name, status, 1e9, timing,  # type: ignore[arg-type]
               reason="" if status == "ok" else f"{name} {status}")


def _text(renderable: object) -> str:
    console = Console(width=250, record=True)
    console.print(renderable)
    return console.export_text()


# ---- ratio and tables ----------------------------------------------------------------------

def test_ratio_is_against_the_fastest_correct_other() -> None:
    rows = [_row("flashgen", 2.0), _row("sdpa-flash", 4.0), _row("sdpa-cudnn", 1.0, "wrong"),
            _row("flex", None, "n/a"), _row("sdpa-efficient", 8.0)]
    (s,) = summarize(rows)
    assert s.best is not None and s.best.competitor == "sdpa-flash"  # cuDNN is wrong
    assert s.ratio == pytest.approx(2.0)  # half the time: twice the TFLOP/s


@pytest.mark.parametrize("rows", [
    [_row("flashgen", 1.0, "wrong"), _row("sdpa-flash", 2.0)],  # a wrong flashgen has none
    [_row("flashgen", 1.0), _row("sdpa-flash", None, "n/a")],  # nothing to compare with
    [_row("sdpa-flash", 2.0)],  # flashgen not benchmarked
])
def test_no_ratio_without_a_correct_pair(rows: list[Row]) -> None:
    (s,) = summarize(rows)
    assert s.ratio is None


def test_rows_group_by_problem_and_mode_in_order() -> None:
    other = P.with_(seq_q=128, seq_k=128)
    rows = [_row("flashgen", 1.0), _row("sdpa-math", 2.0), _row("flashgen", 1.0, mode="both"),
            _row("flashgen", 1.0, problem=other), _row("sdpa-math", 0.5, problem=other)]
    summaries = summarize(rows)
    assert [(s.problem, s.mode, len(s.rows)) for s in summaries] == [
        (P, "fwd", 2), (P, "both", 1), (other, "fwd", 2)]
    assert summaries[2].ratio == pytest.approx(0.5)


def test_table_marks_wrong_and_unavailable_cells() -> None:
    rows = [_row("flashgen", 2.0), _row("sdpa-flash", 4.0), _row("sdpa-cudnn", 1.0, "wrong"),
            _row("flex", None, "n/a")]
    text = _text(timing_table(summarize(rows), "fwd",
                              ["flashgen", "sdpa-flash", "sdpa-cudnn", "flex"], "test-gpu"))
    assert "wrong" in text and "n/a" in text and "2.00x" in text and "test-gpu" in text
    row = next(line for line in text.splitlines() if "2.00x" in line)
    assert " flash " in row and "sdpa-flash" not in row  # the best other's short name


def test_unsteady_cells_are_marked_and_explained() -> None:
    steady = _row("sdpa-flash", 4.0)
    wobbly = replace(_row("flashgen", 2.0), timing=Timing(2.0, 1.7, 2.6, 30))  # spread 0.45
    text = _text(timing_table(summarize([wobbly, steady]), "fwd", ["flashgen", "sdpa-flash"],
                              "test-gpu"))
    assert "~0.5" in text and "~0.25" not in text
    assert unavailable_notes([wobbly, steady]) == [UNSTEADY_NOTE]
    assert unavailable_notes([steady]) == []


def test_csv_repeats_the_ratio_and_keeps_reasons(tmp_path: Path) -> None:
    rows = [_row("flashgen", 2.0), _row("sdpa-flash", 4.0), _row("flex", None, "n/a")]
    path = tmp_path / "out" / "bench.csv"
    write_csv(csv_records(summarize(rows), "test-gpu"), path)
    with path.open() as f:
        records = list(csv.DictReader(f))
    assert [r["competitor"] for r in records] == ["flashgen", "sdpa-flash", "flex"]
    assert {r["flashgen_vs_best"] for r in records} == {"2"}
    assert {r["best_competitor"] for r in records} == {"sdpa-flash"}
    assert records[2]["status"] == "n/a" and records[2]["reason"] == "flex n/a"
    assert records[2]["tflops"] == "" and records[0]["tflops"] == "0.5"  # 1e9 FLOP in 2 ms
    assert records[0]["device"] == "test-gpu" and records[0]["causal"] == "true"
    # The timer is named on every record, the users' "wall" unless told otherwise.
    assert {r["timer"] for r in records} == {"wall"}
    write_csv(csv_records(summarize(rows), "test-gpu", "gpu"), path)
    with path.open() as f:
        assert {r["timer"] for r in csv.DictReader(f)} == {"gpu"}


def test_an_unknown_timer_is_refused_before_any_gpu_work() -> None:
    from flashgen.tune.timing import time_cuda

    with pytest.raises(ValueError, match="timer must be one of"):
        time_cuda(lambda: None, torch.device("cuda"), timer="cpu")


def test_plot_series_keeps_correct_points_sorted_by_length() -> None:
    records = [
        {"mode": "both", "heads_q": "2", "heads_kv": "1", "head_dim": "16", "dtype": "fp16",
         "causal": "false", "competitor": "flashgen", "status": "ok", "seq_q": "64",
         "tflops": "2"},
        {"mode": "fwd", "heads_q": "2", "heads_kv": "1", "head_dim": "16", "dtype": "fp16",
         "causal": "false", "competitor": "flashgen", "status": "ok", "seq_q": "64",
         "tflops": "3"},
        {"mode": "fwd", "heads_q": "2", "heads_kv": "1", "head_dim": "16", "dtype": "fp16",
         "causal": "false", "competitor": "flashgen", "status": "ok", "seq_q": "32",
         "tflops": "1"},
        {"mode": "fwd", "heads_q": "2", "heads_kv": "1", "head_dim": "16", "dtype": "fp16",
         "causal": "false", "competitor": "flex", "status": "wrong", "seq_q": "32",
         "tflops": "9"},
    ]
    panels = series(records)
    assert [family[0] for family in panels] == ["fwd", "both"]  # by mode
    fwd = next(iter(panels.values()))
    assert fwd == {"flashgen": [(32, 1.0), (64, 3.0)]}  # the wrong flex point is left out


def test_plot_writes_a_png(tmp_path: Path) -> None:
    # matplotlib is in the dev extra, so CI runs this: a missing one fails, never skips.
    from flashgen.bench.plot import plot

    rows = [_row("flashgen", 2.0), _row("sdpa-math", 4.0),
            _row("flashgen", 2.0, problem=P.with_(seq_q=128, seq_k=128))]
    path = tmp_path / "bench.png"
    plot(csv_records(summarize(rows), "test"), path, title="test")
    assert path.read_bytes()[:4] == b"\x89PNG"


# ---- modes, names --------------------------------------------------------------------------

def test_mode_flops_follow_the_papers_convention() -> None:
    assert FLOP_FACTOR == {"fwd": 1.0, "bwd": 2.5, "both": 3.5}
    full = P.with_(causal=False)
    assert mode_flops(full, "fwd") == 4 * 1 * 2 * 64 * 64 * 16
    assert mode_flops(full, "both") == 3.5 * mode_flops(full, "fwd")


def test_parse_modes_and_competitor_names() -> None:
    assert parse_modes("both,fwd") == ["fwd", "both"]
    with pytest.raises(ValueError, match="--mode"):
        parse_modes("train")
    cpu = torch.device("cpu")
    assert parse_names(None, cpu) == ["flashgen", "sdpa-math"]
    assert "flex" in parse_names(None, torch.device("cuda", 0))
    with pytest.raises(ValueError, match="unknown competitor"):
        resolve(["flashgen", "xformers"])


# ---- the suite, with fake competitors and timer ---------------------------------------------

def _competitor(name: str, fn: object = None, prepare_error: Exception | None = None,
                calls: list[tuple[int, ...]] | None = None) -> Competitor:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if calls is not None:
            calls.append(tuple(q.shape))
        if fn is not None:
            return fn(q, k, v)  # type: ignore[operator]
        return reference.attention(q, k, v, causal=True)[0]

    def prepare(problem: Problem, device: torch.device) -> Prepared:
        if prepare_error is not None:
            raise prepare_error
        return Prepared(attend, f"{name} note")

    return Competitor(name, f"fake {name}", prepare)


def _refuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("No available kernel")


def test_suite_checks_times_and_explains_failures() -> None:
    timed: list[int] = []

    def timer(fn: object) -> Timing:
        fn()  # type: ignore[operator]
        timed.append(1)
        return Timing(2.0, 1.9, 2.1, 3)

    competitors = [
        _competitor("flashgen"),
        _competitor("wrong", fn=lambda q, k, v: reference.attention(q, k, v)[0]),  # not causal
        _competitor("gone", prepare_error=Unavailable("needs a CUDA GPU")),
        _competitor("refuses", fn=_refuse),
    ]
    rows = run_suite([P], ["fwd", "bwd", "both"], torch.device("cpu"), competitors,
                     timer=timer)
    by = {(r.competitor, r.mode): r for r in rows}
    assert len(rows) == 12
    for mode in ("fwd", "bwd", "both"):
        ok = by["flashgen", mode]
        assert ok.status == "ok" and ok.error is not None and ok.error <= ok.bound
        assert ok.tflops == pytest.approx(mode_flops(P, mode) / 2e-3 / 1e12)
        assert ok.note == "flashgen note" and ok.checked_on is None
        assert by["wrong", mode].status == "wrong" and by["wrong", mode].timing is not None
        assert by["gone", mode].status == "n/a" and "needs a CUDA GPU" in by["gone", mode].reason
        assert by["refuses", mode].status == "n/a"
        assert "No available kernel" in by["refuses", mode].reason
    assert "output" in by["wrong", "both"].reason  # the grad check reports the output first
    assert len(timed) == 6  # flashgen and wrong, three modes each
    (s, *_) = summarize(rows)
    assert s.best is None and s.ratio is None  # the only other that ran is wrong


def test_large_problems_are_checked_on_the_gate_problem() -> None:
    big = Problem(1, 1, 1, 8192, 8192, 16, "fp32")  # 2^26 scores: over the gate's limit
    calls: list[tuple[int, ...]] = []
    rows = run_suite([big], ["fwd"], torch.device("cpu"),
                     [_competitor("x", fn=lambda q, k, v: reference.attention(q, k, v)[0],
                                  calls=calls)],
                     timer=lambda fn: Timing(1.0, 1.0, 1.0, 1))
    (row,) = rows
    assert row.status == "ok" and row.checked_on is not None
    assert row.checked_on.seq_q <= GATE_MAX_SEQ and row.checked_on.head_dim == 16
    assert calls == [(1, 1, row.checked_on.seq_q, 16)]  # the fake timer never ran it


# ---- memory ------------------------------------------------------------------------------

def test_memory_problems_and_modes() -> None:
    problems = [P, P.with_(seq_q=128, seq_k=128), P.with_(dtype="fp16")]
    got = memory_problems(problems, seq_lens=(1024, 2048))
    assert [(p.batch, p.seq_q, p.seq_k, p.dtype) for p in got] == [
        (1, 1024, 1024, "fp32"), (1, 2048, 2048, "fp32"),
        (1, 1024, 1024, "fp16"), (1, 2048, 2048, "fp16")]
    assert memory_modes(["fwd"]) == ["fwd"]
    assert memory_modes(["bwd"]) == ["fwd", "both"]


def _out_of_memory(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")


def test_memory_reports_oom_and_failures_as_rows() -> None:
    def measure(call: object, device: torch.device) -> int:
        call()  # type: ignore[operator]
        return 3 << 30

    problems = memory_problems([P], seq_lens=(32,))
    seen: list[MemoryRow] = []
    rows = run_memory(problems, ["fwd", "both"], torch.device("cpu"), [
        _competitor("flashgen"), _competitor("sdpa-math", fn=_out_of_memory),
        _competitor("gone", prepare_error=Unavailable("no"))], measure=measure,
        on_row=seen.append)
    assert seen == rows
    status = {(r.competitor, r.mode): r.status for r in rows}
    assert status == {("flashgen", "fwd"): "ok", ("flashgen", "both"): "ok",
                      ("sdpa-math", "fwd"): "OOM", ("sdpa-math", "both"): "OOM",
                      ("gone", "fwd"): "n/a", ("gone", "both"): "n/a"}
    text = _text(memory_table(rows, "test-gpu"))
    assert "3.00" in text and "OOM" in text and "fwd+bwd" in text and "flashgen" in text
    records = memory_records(rows, "test-gpu")
    assert records[0]["peak_gib"] == "3.0000" and records[2]["status"] == "OOM"


def test_memory_table_of_rows_alone() -> None:
    p = Problem(1, 32, 32, 32768, 32768, 64, "fp16")
    rows = [MemoryRow(p, "fwd", "flashgen", "ok", 1 << 29), MemoryRow(p, "fwd", "sdpa-math",
                                                                      "OOM")]
    text = _text(memory_table(rows, "gpu"))
    assert "0.50" in text and "OOM" in text and "N32768" in text


# ---- the command -------------------------------------------------------------------------

runner = CliRunner()


@pytest.mark.parametrize(("args", "message"), [
    (["--shape", "1,2,1,8,8,16", "--mode", "train"], "--mode"),
    (["--shape", "1,2,1,8,8,16", "--competitors", "xformers"], "unknown competitor"),
    (["--shape", "1,2,1,8,8,16", "--memory"], "--memory needs a CUDA GPU"),
    (["--shape", "1,2,1,8,8,16", "--timer", "cpu"], "--timer must be wall or gpu"),
    ([], "--shape or --preset"),
])
def test_bench_arguments_are_explained(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["bench", "--device", "cpu", *args])
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.interpreter
def test_bench_on_the_cpu_interpreter(tmp_path: Path) -> None:
    # No TRITON_INTERPRET in the environment: `--device cpu` must set it itself.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FLASHGEN_CACHE_DIR"] = str(tmp_path / "cache")
    env["FLASHGEN_DB"] = str(tmp_path / "none.db")
    env["COLUMNS"] = "200"
    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, "-m", "flashgen", "bench", "--device", "cpu", "--shape",
         "1,2,1,32,32,16", "--mode", "both", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "forward + backward" in done.stdout and "1,2,1,32,32,16" not in done.stdout
    assert re.search(r"^fp16 f D16 g2 32 B1 H2 .* \d+\.\d\dx$", done.stdout, re.MULTILINE)
    # Nothing is tuned for the interpreter: the hint is the command that tunes it there
    # (it once said `--gpu 0 --preset fa-bench`, which fails on a CPU).
    assert "`flashgen tune --device cpu --shape 1,2,1,32,32,16 --dtype fp16" in done.stderr
    assert "--gpu" not in done.stderr
    with (out / "bench.csv").open() as f:
        records = list(csv.DictReader(f))
    # Causal both ways, flashgen and sdpa-math each: four rows, all checked and timed.
    assert len(records) == 4
    assert {(r["competitor"], r["causal"]) for r in records} == {
        (c, m) for c in ("flashgen", "sdpa-math") for m in ("true", "false")}
    for r in records:
        assert r["mode"] == "both" and r["status"] == "ok", r
        assert float(r["tflops"]) > 0 and float(r["check_error"]) <= float(r["check_bound"])
        assert r["best_competitor"] == "sdpa-math" and float(r["flashgen_vs_best"]) > 0
        assert r["device"] == "cpu-interpreter" and r["timer"] == "wall"
    flashgen_rows = [r for r in records if r["competitor"] == "flashgen"]
    assert all("fwd " in r["note"] and "bwd " in r["note"] for r in flashgen_rows)


def test_competitors_without_fp8_are_n_a_with_that_reason() -> None:
    fp8 = Problem(1, 1, 1, 64, 64, 32, "fp8")
    for name in ("sdpa-math", "sdpa-cudnn"):
        with pytest.raises(Unavailable, match="takes no fp8 inputs"):
            COMPETITORS[name].prepare(fp8, torch.device("cpu"))


def test_a_forward_only_bench_asks_for_no_backward(tmp_path: Path) -> None:
    """Forward-only, flashgen's competitor chooses no backward: nothing to note, and no
    hint logged about tuning backward kernels the bench does not time."""
    from flashgen.bench import competitors
    from flashgen.serve import Dispatcher

    asked: list[Problem] = []

    class Recording(Dispatcher):
        def choose_bwd(self, problem: Problem, device: object = None) -> object:
            asked.append(problem)
            return super().choose_bwd(problem, device)  # type: ignore[arg-type]

    problem = Problem(1, 2, 1, 32, 32, 16, "fp16")
    dispatcher = Recording(tmp_path / "none.db")
    forward = competitors._flashgen(problem, torch.device("cpu"), dispatcher, backward=False)
    assert not asked and "bwd" not in forward.note and forward.note.startswith("fwd ")
    both = competitors._flashgen(problem, torch.device("cpu"), dispatcher)
    assert asked == [problem] and "; bwd " in both.note


def test_progress_lines_fit_80_columns() -> None:
    """A problem with modifiers and three modes ran to 120 characters and wrapped wherever
    the terminal cut it: the modes go on an indented line of their own, one yardstick for
    every mode is named once, and a short problem stays on one line."""
    from flashgen.bench.command import _progress_lines
    from flashgen.bench.report import short_problem

    long = Problem(4, 16, 8, 4096, 2048, 192, "bf16", True, window=True, softcap=True)
    rows = [_row(name, ms, problem=long, mode=mode) for mode in ("fwd", "bwd", "both")
            for name, ms in (("flashgen", 2.0), ("sdpa-cudnn", 2.1), ("flex", 4.0))]
    text = _progress_lines("[12/24]", long, rows)
    lines = text.splitlines()
    assert len(lines) == 2 and all(len(line) <= 80 for line in lines), lines
    assert lines[0].startswith("[12/24] B4 H16/8 N4096/2048 D192 bf16 causal")
    assert lines[1] == "    fwd 0.5 (1.05x), bwd 0.5 (1.05x), both 0.5 (1.05x) vs sdpa-cudnn"
    short = [_row("flashgen", 2.0), _row("sdpa-cudnn", 1.0), _row("flex", 4.0, "n/a")]
    assert _progress_lines("[1/1]", P, short) == (
        f"[1/1] {short_problem(P)}: fwd 0.5 (0.50x) vs sdpa-cudnn")


def test_an_interrupted_bench_writes_what_it_finished_and_exits_130(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or SIGTERM) after the first problem: its rows are printed and in the CSV, the
    memory part is not started, and the command exits 130 as `tune` does (it exited 0, so a
    script could not tell a partial CSV from a whole one)."""
    from flashgen.bench import command
    from flashgen.cli import app

    def suite(problems, modes, device, competitors, *, on_problem, **kwargs):
        on_problem(problems[0], [])
        raise KeyboardInterrupt

    def memory(*args: object, **kwargs: object) -> None:
        raise AssertionError("memory measured after an interrupt")

    monkeypatch.setattr(command, "run_suite", suite)
    monkeypatch.setattr(command, "run_memory", memory)
    result = CliRunner().invoke(app, ["bench", "--device", "cpu", "--shape", "1,2,1,32,32,16",
                                      "--no-plot", "--out", str(tmp_path)])
    assert result.exit_code == 130, result.output
    assert "interrupted: reporting" in result.output and (tmp_path / "bench.csv").exists()


def _at_80(table: object) -> list[str]:
    console = Console(width=80, record=True)
    console.print(table)
    return console.export_text().splitlines()


def test_the_gpu_tables_read_whole_at_80_columns() -> None:
    """The GPU's five competitors and the longest labels of the presets (gemma2-9b's
    GQA D256, ViT's B64): no header or number cut ("flash…", "123…" were), and the decode
    table's longest labels (B128, 128k keys, pages of 256) the same."""
    from flashgen.bench.competitors import GPU_DEFAULT
    from flashgen.bench.decoding import DECODE_COMPETITORS, DecodeRow, decode_table
    from flashgen.kernels.problem import DecodeProblem
    from flashgen.store.measurement import Timing

    rows = [Row(p, "both", name, "ok", 5e9, Timing(ms, ms, ms, 3))
            for p in (Problem(4, 16, 8, 8192, 8192, 256, "bf16", True),
                      Problem(64, 12, 12, 197, 197, 64, "fp16", False))
            for name, ms in zip(GPU_DEFAULT, (0.01, 0.014, 0.0099, 0.037, 0.1), strict=True)]
    lines = _at_80(timing_table(summarize(rows), "both", GPU_DEFAULT, "NVIDIA H200"))
    assert "…" not in "".join(lines) and max(map(len, lines)) <= 80
    assert any(re.search(r"^fp16 f D64 197 B64 H12 .* cudnn +0\.99x$", line) for line in lines)
    decode = [DecodeRow(DecodeProblem(b, 64, 8, 1, 131072, 128, "bf16", True, page_size=256),
                        name, "ok", us, 4400.0)
              for b in (128, 1)
              for name, us in zip(DECODE_COMPETITORS, (7543.8, 8000.1, 9999.7, 12345.6),
                                  strict=True)]
    lines = _at_80(decode_table(decode, DECODE_COMPETITORS, 4.3e12))
    assert "…" not in "".join(lines) and max(map(len, lines)) <= 80
    assert any(re.search(r"^bf16 D128 64:8 B128 Nk128k p256 +7544 +8000 +10k +12k ", line)
               for line in lines)
    # Every median unsteady (its p20..p80 wider than UNSTEADY_SPREAD): "~" and still 80.
    shaky = [DecodeRow(r.problem, r.competitor, "ok", r.us, r.gbps, "", 0.5 * r.us, 2 * r.us)
             for r in decode]
    lines = _at_80(decode_table(shaky, DECODE_COMPETITORS, 4.3e12))
    assert "…" not in "".join(lines) and max(map(len, lines)) <= 80
    assert any(re.search(r"^bf16 D128 64:8 B128 Nk128k p256 +~7544 +~8000 +~10k +~12k ",
                         line) for line in lines)


def test_a_table_wider_than_the_console_is_printed_whole() -> None:
    """Where a label is longer than the presets' (Nq 4 and pages too), the decode table
    comes out at its own width, its cells whole, not cut to fit."""
    from flashgen.bench.decoding import DECODE_COMPETITORS, DecodeRow, decode_table
    from flashgen.bench.report import print_whole
    from flashgen.kernels.problem import DecodeProblem

    p = DecodeProblem(128, 64, 8, 4, 131072, 256, "bf16", True, page_size=256)
    table = decode_table([DecodeRow(p, n, "ok", 7543.8, 4400.0) for n in DECODE_COMPETITORS],
                         DECODE_COMPETITORS, 4.3e12)
    out = io.StringIO()
    print_whole(Console(file=out, width=80), table)
    text = out.getvalue()
    assert "…" not in text and "flashgen" in text
    assert max(map(len, text.splitlines())) > 80  # it did not fit: printed wider
