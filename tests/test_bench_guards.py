"""`flashgen bench` refuses what it must not use or replace, runs each problem once, and keeps
its notes within 80 columns.

Where a test runs the command, its only competitor is sdpa-math (n/a under a window), so no
kernel runs through the Triton interpreter and each run takes well under a second.
"""

from __future__ import annotations

import csv
import sqlite3
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flashgen.bench.command import Outputs
from flashgen.bench.decoding import DECODE_CSV_FIELDS
from flashgen.bench.layouts import Layout
from flashgen.bench.memory import MEMORY_CSV_FIELDS
from flashgen.bench.report import (
    CSV_FIELDS,
    UNSTEADY_NOTE,
    check_csv_target,
    unavailable_notes,
    wrapped,
)
from flashgen.bench.suite import Row
from flashgen.cli import app
from flashgen.kernels.problem import Problem
from flashgen.store.db import TuningDB

runner = CliRunner()

#: A bench that runs no kernel: sdpa-math alone, on the CPU.
QUICK = ["bench", "--device", "cpu", "--shape", "1,2,1,32,32,16", "--competitors", "sdpa-math"]


def _foreign_files(tmp_path: Path) -> list[Path]:
    """A text file and another program's SQLite database."""
    text = tmp_path / "notes.txt"
    text.write_text("not a database\n")
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE songs (title TEXT)")
    return [text, other]


# ---- --db: only flashgen's databases -------------------------------------------------------

@pytest.mark.interpreter
def test_bench_refuses_a_db_that_is_not_flashgens(tmp_path: Path) -> None:
    """It once benchmarked the default variants and exited 0; now it stops before any work
    with the one `error:` line `show --db` prints for the same file."""
    out = tmp_path / "out"
    for path in _foreign_files(tmp_path):
        before = path.read_bytes()
        result = runner.invoke(app, [*QUICK, "--out", str(out), "--db", str(path)])
        assert result.exit_code != 0, result.output
        lines = result.output.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0]
        shown = runner.invoke(app, ["show", "--db", str(path)])
        assert shown.exit_code == result.exit_code and shown.output == result.output
        assert path.read_bytes() == before and not out.exists()


@pytest.mark.interpreter
def test_bench_takes_a_db_flashgen_wrote_without_winners(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    with TuningDB(path):
        pass
    result = runner.invoke(app, [*QUICK, "--out", str(tmp_path / "out"), "--no-plot",
                                 "--db", str(path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "bench.csv").is_file()


# ---- --window: each problem once -----------------------------------------------------------

def test_a_window_makes_causal_and_full_one_problem() -> None:
    full = Problem(1, 2, 1, 32, 32, 16, "fp16", False)
    causal = full.with_(causal=True)
    other = full.with_(head_dim=32)
    laid = Layout(window=8).problems([causal, full, other, full])
    assert laid == [causal.with_(window=True), other.with_(causal=True, window=True)]
    assert Layout().problems([causal, full, causal]) == [causal, full]


@pytest.mark.interpreter
def test_bench_window_runs_each_problem_once(tmp_path: Path) -> None:
    """With --causal both, the causal and full problems both became 'causal window': the
    log said [1/2] twice and the CSV held each row twice."""
    out = tmp_path / "out"
    result = runner.invoke(app, [*QUICK, "--window", "8", "--causal", "both", "--no-plot",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "benchmarking 1 problem(s)" in result.output and "[1/1]" in result.output
    assert "[1/2]" not in result.output
    with (out / "bench.csv").open() as f:
        (record,) = list(csv.DictReader(f))
    assert record["causal"] == "true" and record["modifiers"] == "window"


# ---- notes: whole, and within 80 columns ---------------------------------------------------

def _fits(text: str) -> None:
    assert all(len(line) <= 80 for line in text.splitlines()), text


def test_notes_keep_the_whole_reason_and_wrap_at_80_columns() -> None:
    reason = ("TypeError: bf16 (torch.bfloat16) needs a GPU: Triton's interpreter computes "
              "bf16 dot products wrongly; use float16 or float32 on the CPU, or move the "
              "tensors to a GPU")
    row = Row(Problem(1, 2, 1, 32, 32, 16, "bf16"), "fwd", "flashgen", "n/a", 1.0,
              reason=f"check could not run: {reason}")
    (note,) = unavailable_notes([row])
    assert note.endswith("move the tensors to a GPU")  # it was cut at 160 characters
    for text in (note, UNSTEADY_NOTE):
        folded = wrapped(text, "  ")
        _fits(folded)
        lines = folded.splitlines()
        assert len(lines) > 1 and lines[0].startswith("  ") and not lines[0].startswith("   ")
        assert all(line.startswith("    ") for line in lines[1:])  # a hanging indent
        assert " ".join(folded.split()) == " ".join(text.split())  # nothing lost


def test_wrapping_breaks_no_word() -> None:
    """Not at a hyphen ("sdpa-" would fit the first line), and a path wider than a line
    goes whole on a line of its own."""
    folded = wrapped("a " * 36 + "sdpa-efficient")
    assert folded.splitlines()[1] == "  sdpa-efficient"
    path = "/very/long/" + "x" * 90 + "/bench.csv"
    assert wrapped(f"no plot: see {path} later").splitlines() == [
        "no plot: see", f"  {path}", "  later"]


@pytest.mark.interpreter
def test_bench_output_fits_80_columns(tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The n/a note (98 columns) and the no-plot line (about 140) were printed whole on one
    line, or, on a wide console, the note cut mid-word."""
    from flashgen.bench import plot

    monkeypatch.chdir(tmp_path)  # a short CSV path in the no-plot line
    monkeypatch.setattr(plot, "available", lambda: False)
    result = runner.invoke(app, [*QUICK, "--window", "8", "--causal", "yes", "--out", "out"],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    _fits(result.output)
    words = " ".join(result.output.split())
    assert "SDPA has no sliding-window or packed-sequence mask (only a dense one)" in words
    assert "no plot: matplotlib is not installed" in words
    assert "python -m flashgen.bench.plot out/bench.csv bench.png)" in words


# ---- CSV files: a user's file is never replaced --------------------------------------------

@pytest.mark.parametrize("fields", [CSV_FIELDS, MEMORY_CSV_FIELDS, DECODE_CSV_FIELDS])
def test_only_flashgens_own_csv_is_replaced(tmp_path: Path, fields: tuple[str, ...]) -> None:
    path = tmp_path / "results.csv"
    check_csv_target(path, fields)  # missing
    path.write_text("")
    check_csv_target(path, fields)  # empty: nothing to lose
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([fields, ["1"] * len(fields)])
    check_csv_target(path, fields)  # an earlier bench's
    path.write_text(",".join(fields[:-1]) + "\n")
    check_csv_target(path, fields)  # an older flashgen's, a column short
    for text in ("name,score\nada,3\n", ",".join(fields[1:]) + "\n", "\x00\x01binary"):
        path.write_text(text)
        with pytest.raises(ValueError, match="is not a flashgen bench CSV") as caught:
            check_csv_target(path, fields)
        assert str(path) in str(caught.value) and "remove the file" in str(caught.value)
        assert path.read_text() == text


def test_outputs_check_the_csv_files_the_run_writes(tmp_path: Path) -> None:
    outputs = Outputs.under(tmp_path)
    (tmp_path / "memory.csv").write_text("mine\n")
    outputs.check(timing=True, memory=False)  # the memory CSV is not written
    with pytest.raises(ValueError, match=r"memory\.csv .*pick another --out"):
        outputs.check(timing=False, memory=True)


@pytest.mark.interpreter
def test_bench_refuses_to_overwrite_a_users_csv(tmp_path: Path) -> None:
    """`--csv mine.csv` replaced the user's file without a word; now bench stops before any
    work. A CSV an earlier bench wrote is still replaced, at --csv and at OUT/bench.csv."""
    mine = tmp_path / "mine.csv"
    mine.write_text("name,score\nada,3\n")
    result = runner.invoke(app, [*QUICK, "--no-plot", "--csv", str(mine)])
    assert result.exit_code == 2
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(mine) in lines[0]
    assert "--csv" in lines[0] and mine.read_text() == "name,score\nada,3\n"

    out = tmp_path / "out"
    out.mkdir()
    (out / "bench.csv").write_text("mine\n")
    refused = runner.invoke(app, [*QUICK, "--no-plot", "--out", str(out)])
    assert refused.exit_code == 2 and (out / "bench.csv").read_text() == "mine\n"

    (out / "bench.csv").unlink()
    for _ in range(2):  # the second run replaces the first run's CSV
        again = runner.invoke(app, [*QUICK, "--no-plot", "--out", str(out)])
        assert again.exit_code == 0, again.output
    with (out / "bench.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 2  # causal and full, once each


@pytest.mark.interpreter
def test_bench_decode_refuses_to_overwrite_a_users_csv(tmp_path: Path) -> None:
    mine = tmp_path / "mine.csv"
    mine.write_text("name,score\n")
    result = runner.invoke(app, ["bench", "--mode", "decode", "--device", "cpu", "--shape",
                                 "1,4,1,1,24,16", "--page-size", "0", "--csv", str(mine)])
    assert result.exit_code == 2 and str(mine) in result.output, result.output
    assert "not a flashgen bench CSV" in result.output
    assert mine.read_text() == "name,score\n"


def test_notes_differing_only_in_sizes_are_one_note() -> None:
    """SDPA names each call's shapes in its refusal: eight GQA cells gave eight paragraphs."""
    def refused(n: int) -> Row:
        why = (f"RuntimeError: No available kernel. | both fused kernels require query, key "
               f"and value to have the same num_heads. Query.sizes(): [2, 4, {n}, 256]")
        return Row(Problem(1, 4, 2, n, n, 256, "bf16"), "fwd", "sdpa-efficient", "n/a", 1.0,
                   reason=f"check could not run: {why}")
    other = Row(Problem(1, 2, 1, 32, 32, 16, "bf16"), "fwd", "flex", "n/a", 1.0,
                reason="check could not run: ImportError: no flex")
    notes = unavailable_notes([refused(1024), refused(1280), other, refused(512)])
    assert len(notes) == 2
    assert "[2, 4, 1024, 256]" in notes[0] and notes[0].endswith("(and 2 more like it)")
    assert notes[1] == "flex n/a: check could not run: ImportError: no flex"


def test_torch_source_locations_are_left_out_of_reasons() -> None:
    from flashgen.bench.suite import _explained, _why

    with _explained() as caught:
        warnings.warn("Memory efficient kernel not used because: (Triggered internally at "
                      "/pytorch/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:986.)",
                      UserWarning, stacklevel=1)
        warnings.warn("(Triggered internally at /pytorch/x.cpp:1.)", UserWarning,
                      stacklevel=1)
    why = _why(RuntimeError("No available kernel."), caught)
    assert "Triggered" not in why and "sdp_utils" not in why
    assert why.endswith("| Memory efficient kernel not used because:")

