"""Tuning modified and packed problems under keys of their own (`TuningKey.modifiers`), and
dispatch serving their winners to matching calls, on the CPU interpreter."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flashgen.bench.layouts import Layout
from flashgen.cli import app
from flashgen.kernels.problem import Problem, mix_bucket
from flashgen.runtime import table as runtime_table
from flashgen.runtime.modifiers import Mods, Varlen
from flashgen.serve import Dispatcher
from flashgen.store.db import TuningDB
from flashgen.tune.check import make_inputs

runner = CliRunner()
DENSE = "1,2,1,32,32,16"


def _tune(db: Path, shape: str, *extra: str) -> None:
    result = runner.invoke(app, ["tune", "--device", "cpu", "--shape", shape, "--dtype",
                                 "fp32", "--trials", "2", "--db", str(db), *extra])
    assert result.exit_code == 0, result.output


def _keys(db: Path) -> set[str]:
    with TuningDB(db) as opened:
        return {r.key.modifiers for r in opened.trials() if r.status == "ok"}


def test_runtime_and_problem_agree_on_the_modifier_key() -> None:
    for window, softcap, sinks, varlen in itertools.product((False, True), repeat=4):
        p = Problem(3, 2, 1, 40, 40, 16, window=window, softcap=softcap, sinks=sinks,
                    varlen=varlen, mix=4 if varlen else 0)
        assert runtime_table.modifier_key(runtime_table.Shape(*vars(p).values())) == \
            p.modifier_key
    for batch, longest, tokens in ((4, 10, 40), (4, 10, 21), (16, 2048, 16384), (3, 7, 9)):
        assert runtime_table.mix_bucket(batch, longest, tokens) == mix_bucket(batch, longest,
                                                                             tokens)
    assert mix_bucket(16, 2048, 16384) == 2 and mix_bucket(4, 10, 40) == 1


@pytest.mark.interpreter
def test_tuned_window_rows_are_served_to_window_calls_and_plain_rows_still_back_them(
        tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    q, k, v = make_inputs(1, 2, 1, 32, 32, 16, torch.float32)
    window = Mods(window=(8, 0))
    # Only plain rows: a window call runs the plain winner, as before modifier keys.
    _tune(db, DENSE, "--causal", "yes")
    choice = Dispatcher(db).explain(q, k, v, causal=True, mods=window)
    assert choice.how == "nearest" and "nothing tuned with modifiers 'w'" in choice.reason
    assert "tuned winner of plain attention" in choice.reason and "|w" not in choice.source
    # Tuned with a window: its own rows, served first.
    _tune(db, DENSE, "--causal", "yes", "--window", "8,0")
    assert _keys(db) == {"", "w"}
    choice = Dispatcher(db).explain(q, k, v, causal=True, mods=window)
    assert choice.how == "exact" and "tuned winner with modifiers 'w'" in choice.reason
    assert choice.source.split("winners[")[1].split("]")[0].endswith("|w")
    shown = runner.invoke(app, ["show", "--db", str(db), "--wide"])
    assert shown.exit_code == 0 and "mods:w" in shown.output, shown.output
    # A softcap call has no rows of its own: the plain winner, still.
    capped = Dispatcher(db).explain(q, k, v, causal=True, mods=Mods(softcap=2.0))
    assert "nothing tuned with modifiers 'k'" in capped.reason
    assert not capped.source.split("]")[0].endswith("|w")


@pytest.mark.interpreter
def test_tuned_varlen_rows_are_served_to_packed_calls_of_their_mix(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    _tune(db, "2,2,1,32,32,16", "--varlen", "3")
    lengths = Layout(None, 3).lengths(Problem(2, 2, 1, 32, 32, 16, "fp32"), 0)
    mix = mix_bucket(3, max(lengths), sum(lengths))
    assert _keys(db) == {f"v{mix}"}
    with TuningDB(db) as opened:
        (winner,) = opened.all_winners()
    assert winner.problem.varlen and winner.problem.batch == 3
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    q, k, v = (t[0].transpose(0, 1).contiguous()
               for t in make_inputs(1, 2, 1, sum(lengths), sum(lengths), 16, torch.float32))
    packed = Mods(varlen=Varlen(cu, cu, max(lengths), max(lengths)))
    choice = Dispatcher(db).explain(q, k, v, mods=packed)
    assert choice.how == "exact" and f"modifiers 'v{mix}'" in choice.reason
    assert choice.source.split("]")[0].endswith(f"|v{mix}")
    # A dense call of the same kind finds no plain rows: the default.
    dense = make_inputs(1, 2, 1, 32, 32, 16, torch.float32)
    assert Dispatcher(db).explain(*dense).how == "fallback"


@pytest.mark.parametrize(("args", "message"), [
    (["--window", "8"], "--window must be L,R"),
    (["--window", "-1,-1"], "cuts nothing"),
    (["--softcap", "0"], "softcap must be a finite number > 0"),
    (["--varlen", "2", "--shape", "1,2,1,16,32,16"], "Nq != Nk"),
])
def test_tune_refuses_bad_modifier_options(args: list[str], message: str) -> None:
    base = ["tune", "--device", "cpu", "--trials", "0"]
    shape = [] if "--shape" in args else ["--shape", DENSE]
    result = runner.invoke(app, [*base, *shape, *args])
    assert result.exit_code != 0 and message in result.output, result.output


def test_plain_persistent_fa3_winners_do_not_serve_modified_calls_untuned() -> None:
    """A plain winner serves a softcap call with the cap rendered in, except the persistent
    fa3 kernel, whose modifiers serve only from keys tuned with them (their gate)."""
    def entry(variant: dict, q: int, modifiers: str = "") -> dict:
        return {"dtype": "bf16", "causal": True, "head_dim": 128, "gqa": 1,
                "seq_q_bucket": q, "seq_k_bucket": q, "variant": variant,
                "modifiers": modifiers}

    persistent = {"loop_order": "fa3", "block_m": 128, "block_n": 128, "num_warps": 4,
                  "num_stages": 2, "programs_per_sm": 1, "pingpong": True}
    one_tile = {**persistent, "programs_per_sm": 0, "pingpong": False, "num_stages": 3}
    table = runtime_table.Table({"preprocess_block_m": 64, "fwd": [
        entry(persistent, 4096), entry(one_tile, 1024)]}, "test", 132)
    capped = runtime_table.Shape(1, 8, 8, 4096, 4096, 128, "bf16", True, softcap=True)
    e, how, reason = table.lookup("fwd", capped, lambda e: None)
    assert e is not None and e["variant"] == one_tile and how == "nearest"
    assert "persistent fa3 kernel runs softcap, sinks and packed sequences only where tuned" in (
        reason)
    # Plain calls still take it, and a key tuned with the cap serves it to capped calls.
    plain = capped._replace(softcap=False)
    assert table.lookup("fwd", plain, lambda e: None)[0]["variant"] == persistent
    tuned = runtime_table.Table({"preprocess_block_m": 64, "fwd": [
        entry(persistent, 4096, "k")]}, "test", 132)
    assert tuned.lookup("fwd", capped, lambda e: None)[0]["variant"] == persistent


def test_persistent_winners_serve_packed_and_window_calls_as_one_tile_kernels() -> None:
    """Where every plain winner near a packed or window call is the persistent fa3 kernel
    (whose tile walk takes neither), the nearest one runs as the one-tile fa3 kernel of its
    tiles, warps and stages, not the untuned default; a row whose kernel changed since its
    tuning does not lend its tiles."""
    import flashgen

    hopper = flashgen.DeviceInfo("H-test", (9, 0), 132, 232448)
    persistent = {"loop_order": "fa3", "block_m": 128, "block_n": 128, "num_warps": 4,
                  "num_stages": 2, "programs_per_sm": 1, "pingpong": True}
    stale: set[int] = set()

    class Fixed(Dispatcher):
        def kernel_is_current(self, mode: str, entry: dict) -> str | None:
            return "changed" if entry["seq_q_bucket"] in stale else None

    rows = [{"dtype": "bf16", "causal": True, "head_dim": 128, "gqa": 1, "seq_q_bucket": n,
             "seq_k_bucket": n, "variant": {**persistent, "block_n": 128 if n > 2048 else 64},
             "source": f"row {n}"} for n in (1024, 4096)]
    table = runtime_table.Table({"preprocess_block_m": 64, "fwd": rows}, "test", 132, hopper)
    for flags in ({"varlen": True, "mix": 2}, {"window": True}):
        shape = runtime_table.Shape(16, 16, 16, 4096, 4096, 128, "bf16", True, **flags)
        choice, e = Fixed().lookup(table, "fwd", shape)
        assert choice.how == "nearest" and "run as the one-tile fa3 kernel" in choice.reason
        assert flashgen.Variant.from_dict(e["variant"]) == flashgen.Variant(**{
            **persistent, "programs_per_sm": 0, "pingpong": False})
        assert choice.variant.programs_per_sm == 0 and choice.variant.block_n == 128
        assert choice.source == "row 4096"  # the row whose tiles run
        stale.add(4096)  # the nearest row changed: the next one lends its tiles
        choice, e = Fixed().lookup(table, "fwd", shape)
        assert choice.variant.block_n == 64 and "bucket (1024, 1024)" in choice.reason
        stale.clear()
    # A whole-heads row, where whole heads would leave programs idle (two heads): its
    # one-tile form has no whole heads, so it still lends its tiles.
    heads = runtime_table.Table({"preprocess_block_m": 64, "fwd": [
        {**rows[1], "variant": {**persistent, "head_units": True}}]}, "test", 132, hopper)
    few = runtime_table.Shape(1, 2, 2, 4096, 4096, 128, "bf16", True, window=True)
    choice, e = Fixed().lookup(heads, "fwd", few)
    assert "run as the one-tile fa3 kernel" in choice.reason
    assert not choice.variant.head_units and not choice.variant.programs_per_sm
    # Without any persistent row: the default, as before.
    empty = runtime_table.Table({"preprocess_block_m": 64, "fwd": []}, "test", 132, hopper)
    packed = runtime_table.Shape(16, 16, 16, 4096, 4096, 128, "bf16", True, varlen=True, mix=2)
    assert Fixed().lookup(empty, "fwd", packed)[0].how == "fallback"
