"""What a timing is, as stored: the median and spread of repeated launches.

It lives in `store` because the database keeps timings; `tune.timing` takes them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

#: Repeats whose p20..p80 range is wider than this fraction of their median are unsteady:
#: something else held the GPU or the host for part of the run, and the median may be off by
#: far more than the differences being measured (on an H100 one fa3 point timed 0.219 ms
#: with p20..p80 0.200..0.244, then 0.118 ms steady on the same problem in bf16).
UNSTEADY_SPREAD = 0.10


def percentile(ordered: list[float], q: float) -> float:
    # Linear interpolation between closest ranks (numpy's default method).
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call over `reps` launches."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int
    #: Host milliseconds to queue one timed call, its L2 flush and two events included (GPU
    #: timings only). The medians above are GPU time; a caller that cannot queue calls this
    #: fast leaves the GPU idle.
    host_ms: float | None = None

    @classmethod
    def from_samples(cls, samples: list[float]) -> Timing:
        if not samples:
            raise ValueError("no timing samples")
        ordered = sorted(samples)
        return cls(statistics.median(ordered), percentile(ordered, 0.2),
                   percentile(ordered, 0.8), len(ordered))

    @property
    def spread(self) -> float:
        """(p80 - p20) / median: how unsteady the repeats were. Host-bound calls that the GPU
        sometimes waits on show up as a wide spread (seen at 0.5 on an H100)."""
        return (self.p80_ms - self.p20_ms) / self.median_ms if self.median_ms > 0 else 0.0

    @property
    def unsteady(self) -> bool:
        """Whether the repeats spread past UNSTEADY_SPREAD: a median not to be trusted."""
        return self.spread > UNSTEADY_SPREAD
