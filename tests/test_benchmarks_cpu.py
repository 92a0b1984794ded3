"""benchmarks/dispatch_overhead.py still launches what dispatch launches: one tiny iteration
of each path under the Triton interpreter, since its GPU run is where breakage used to hide."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import flashgen

ROOT = Path(__file__).resolve().parent.parent


def _load_benchmark() -> object:
    spec = importlib.util.spec_from_file_location(
        "dispatch_overhead", ROOT / "benchmarks" / "dispatch_overhead.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.interpreter
def test_dispatch_overhead_runs_each_path_once() -> None:
    bench = _load_benchmark()
    q, k, v = (torch.randn(1, 1, 16, 16) for _ in range(3))
    launch = bench.direct_launch(q, k, v, flashgen.Dispatcher())  # type: ignore[attr-defined]
    out, lse = launch()
    want, want_lse = flashgen.attention(q, k, v, return_lse=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    r = bench.measure("cpu", (1, 1, 16, 16), torch.float32, calls=1,  # type: ignore[attr-defined]
                      repeats=1, rounds=1, warmup=1)
    assert r["direct_us"] > 0 and r["dispatch_us"] > 0
