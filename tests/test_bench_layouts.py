"""`flashgen bench --window` / `--varlen`: layouts' FLOPs, checks and competitors, with a
fake timer (interpreter kernels)."""

from __future__ import annotations

import pytest
import torch

from flashgen.bench.competitors import Competitor, Prepared, resolve
from flashgen.bench.layouts import Layout
from flashgen.bench.suite import run_suite
from flashgen.kernels.problem import Problem
from flashgen.tune import reference
from flashgen.tune.timing import Timing

pytestmark = pytest.mark.interpreter

PROBLEM = Problem(2, 2, 1, 24, 24, 16, "fp32", True)


def _timer(fn: object) -> Timing:
    fn()  # type: ignore[operator]
    return Timing(1.0, 1.0, 1.0, 3)


def test_layout_counts_visible_pairs() -> None:
    p = Problem(1, 1, 1, 4, 4, 16, "fp32", True)
    assert Layout(window=1).pairs(p, 0) == 1 + 2 + 2 + 2
    assert Layout(sequences=1).pairs(p, 0) == 10  # one sequence: plain causal
    lens = Layout(sequences=3).lengths(PROBLEM, 7)
    assert sum(lens) == 48 and len(lens) == 3 and min(lens) >= 1
    assert Layout(sequences=3).pairs(PROBLEM.with_(causal=False), 7) == sum(n * n for n in lens)
    with pytest.raises(ValueError, match="--varlen packs self-attention"):
        Layout(sequences=2).apply(PROBLEM.with_(seq_k=30))


@pytest.mark.parametrize("layout", [Layout(window=5), Layout(sequences=3),
                                    Layout(window=4, sequences=3)], ids=str)
def test_layout_rows(layout: Layout) -> None:
    """flashgen runs and passes the checks; SDPA is n/a; a competitor that ignores the
    layout is caught as wrong; FLOPs are the layout's."""

    def ignores(problem: Problem, device: torch.device, layout: Layout) -> Prepared:
        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **_: object) -> torch.Tensor:
            if q.dim() == 3:  # packed: one causal sequence across every boundary
                out = reference.attention(*(t.transpose(0, 1)[None] for t in (q, k, v)),
                                          causal=True)[0]
                return out[0].transpose(0, 1)
            return reference.attention(q, k, v, causal=True)[0]

        return Prepared(run)

    competitors = [*resolve(["flashgen", "sdpa-math"]),
                   Competitor("ignores", "drops the layout", ignores)]
    rows = run_suite([PROBLEM], ["fwd", "both"], torch.device("cpu"), competitors,
                     timer=_timer, layout=layout)
    status = {(r.competitor, r.mode): r.status for r in rows}
    assert status == {("flashgen", "fwd"): "ok", ("flashgen", "both"): "ok",
                      ("sdpa-math", "fwd"): "n/a", ("sdpa-math", "both"): "n/a",
                      ("ignores", "fwd"): "wrong", ("ignores", "both"): "wrong"}, rows
    work = layout.flops(layout.apply(PROBLEM), 0)
    assert {r.flops for r in rows if r.mode == "fwd"} == {work}
    assert {r.flops for r in rows if r.mode == "both"} == {3.5 * work}
    assert all(r.problem.window == (layout.window is not None) for r in rows)
