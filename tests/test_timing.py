"""The timer's retry of unsteady measurements (`flashgen.timing.steady`), on made-up timings."""

from __future__ import annotations

from flashgen.timing import STEADY_RETRIES, UNSTEADY_SPREAD, Timing, steady


def _runs(*spreads: float) -> tuple[list[Timing], list[Timing]]:
    """Timings (medians 1, 2, 3 ... ms) with the given spreads, and the list `steady` draws
    them from."""
    made = [Timing(1.0 + i, 1.0 + i - s / 2 * (1.0 + i), 1.0 + i + s / 2 * (1.0 + i), 50)
            for i, s in enumerate(spreads)]
    return made, list(made)


def test_a_steady_measurement_is_taken_once() -> None:
    made, queue = _runs(0.02, 0.01)
    assert steady(lambda: queue.pop(0)) == made[0]
    assert len(queue) == 1


def test_an_unsteady_measurement_is_taken_again_until_steady() -> None:
    made, queue = _runs(0.5, 0.03, 0.01)
    assert steady(lambda: queue.pop(0)) == made[1]
    assert len(queue) == 1


def test_when_every_retry_is_unsteady_the_steadiest_is_kept() -> None:
    unsteady = [0.5, 0.2, 0.3, 0.4, 0.6][: STEADY_RETRIES + 1]
    made, queue = _runs(*unsteady, 0.01)
    kept = steady(lambda: queue.pop(0))
    assert kept == min(made[: STEADY_RETRIES + 1], key=lambda t: t.spread)
    assert kept.spread > UNSTEADY_SPREAD and len(queue) == 1
