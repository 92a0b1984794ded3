"""FLOPs of windowed and packed problems: `visible_pairs`'s closed form against the reference
mask, and the tuner's benches counting what `flashgen bench` counts."""

from __future__ import annotations

import itertools

import pytest
import torch

from flashgen.bench.layouts import Layout
from flashgen.kernels.problem import Problem, visible_pairs
from flashgen.kernels.variant import Variant
from flashgen.tune import reference
from flashgen.tune.fwd_bench import KernelBench
from flashgen.tune.modified import make_modified_inputs
from flashgen.tune.timing import tflops

LENGTHS = (1, 2, 3, 5, 8, 13)
WINDOWS = (None, (0, 0), (1, 0), (3, -1), (-1, 2), (2, 5), (0, -1), (4, 4), (40, 0),
           (0, 40), (40, 40), (-1, -1))


def brute(lens_q: list[int], lens_k: list[int], causal: bool,
          window: tuple[int, int] | None) -> int:
    """The pairs the float64 reference's mask keeps, counted cell by cell."""
    return sum(int(reference.visible(nq, nk, causal, window).sum())
               for nq, nk in zip(lens_q, lens_k, strict=True))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_visible_pairs_match_the_reference_mask(causal: bool,
                                                window: tuple[int, int] | None) -> None:
    # Nq < Nk, Nq = Nk and Nq > Nk (causal rows with no key), windows wider than both.
    for nq, nk in itertools.product(LENGTHS, LENGTHS):
        assert visible_pairs([nq], [nk], causal, window) == brute([nq], [nk], causal, window), (
            nq, nk)
    lens_q, lens_k = [7, 1, 12, 3], [9, 4, 12, 1]
    assert visible_pairs(lens_q, lens_k, causal, window) == brute(lens_q, lens_k, causal,
                                                                  window)


def test_visible_pairs_of_a_long_sequence_are_closed_form() -> None:
    n, w = 32768, 4096
    assert visible_pairs([n], [n], True) == n * (n + 1) // 2
    assert visible_pairs([n], [n], True, (w, 0)) == (w + 1) * n - w * (w + 1) // 2
    assert visible_pairs([n], [n], False, (w, -1)) == n * n - (n - w) * (n - w - 1) // 2


def test_plain_flops_are_unchanged() -> None:
    """The dense and causal counts, as computed before windows and packing were counted."""
    for nq, nk, causal in [(1024, 1024, True), (100, 300, True), (300, 100, True),
                           (77, 77, False), (5, 9000, True)]:
        p = Problem(3, 8, 2, nq, nk, 64, causal=causal)
        full = 4.0 * p.batch * p.heads_q * nq * nk * p.head_dim
        seen = (sum(min(nk, max(0, i + nk - nq + 1)) for i in range(nq)) if causal
                else nq * nk)
        assert p.flops() == full * seen / (nq * nk)
    for small in (Problem(2, 4, 2, 24, 40, 16, causal=True), Problem(2, 4, 4, 17, 9, 16),
                  Problem(1, 2, 1, 24, 24, 16, softcap=True, sinks=True)):
        assert make_modified_inputs(small, torch.device("cpu"), 0).flops(small) == small.flops()


@pytest.mark.parametrize("changes", [
    {"window": True, "causal": True}, {"window": True}, {"varlen": True, "causal": True, "mix": 2},
    {"varlen": True, "mix": 2, "seq_k": 30}, {"varlen": True, "window": True, "causal": True,
                                              "mix": 4, "softcap": True}], ids=str)
def test_tuner_counts_the_pairs_its_inputs_leave_visible(changes: dict) -> None:
    p = Problem(3, 4, 2, 40, 40, 16).with_(**changes)
    made = make_modified_inputs(p, torch.device("cpu"), 5)
    window = made.reference.get("window")
    if made.cu is not None:
        cu_q, cu_k = made.cu
        lens_q = [b - a for a, b in itertools.pairwise(cu_q)]
        lens_k = [b - a for a, b in itertools.pairwise(cu_k)]
    else:
        lens_q, lens_k = [p.seq_q] * p.batch, [p.seq_k] * p.batch
    pairs = brute(lens_q, lens_k, p.causal, window)
    assert made.flops(p) == 4.0 * pairs * p.heads_q * p.head_dim
    assert made.flops(p) < p.flops()  # the dense count over the longest length is more


@pytest.mark.parametrize("layout", [Layout(window=5), Layout(sequences=3),
                                    Layout(window=4, sequences=3)], ids=str)
def test_bench_layouts_count_as_the_reference_mask(layout: Layout) -> None:
    p = layout.apply(Problem(2, 2, 1, 24, 24, 16, "fp32", True))
    lens = layout.lengths(p, 7) if layout.sequences else [24, 24]
    pairs = brute(lens, lens, p.causal, layout.window_arg())
    assert layout.pairs(p, 7) == pairs
    assert layout.flops(p, 7) == 4.0 * pairs * p.heads_q * p.head_dim


@pytest.mark.interpreter
def test_kernel_bench_reports_a_windowed_problems_visible_flops() -> None:
    tiny = Problem(1, 2, 1, 24, 24, 16, causal=True, window=True)
    bench = KernelBench(tiny, "cpu", seed=0)
    m = bench.measure(Variant("fa2", 16, 16, 2, 1))
    assert m.status == "ok", m.reason
    work = bench.modified_inputs.flops(tiny)
    assert work < tiny.flops()
    assert m.tflops == pytest.approx(tflops(work, m.timing.median_ms))
