"""Fit the polynomial that the capped fa3 kernels use for exp2 on the FMA pipes.

The kernels compute 2^x (x <= 0) for half of each score tile's columns as 2^n p(f), with
n = floor(x) and f = x - n in [0, 1) (`_exp2_fma` in templates/_fa3_softmax.py.jinja). p is
1 + c1 f + c2 f^2 + ... : its constant term is held at exactly 1, so a score equal to its
row's max gives exactly 1 and a masked score (clamped to -127, so n = -127 and f = 0) gives
the bit pattern of +0.0, as exp2(-inf) does. The other coefficients minimise the largest
relative error |p(f) / 2^f - 1| over [0, 1] (Remez exchange on the linear system with the
error's sign alternating at degree + 1 points). The coefficients are then rounded to fp32
and the kernel's fp32 sequence (clamp, floor by a round-down add, Horner by FMAs, exponent
add on the bits) is emulated over x in [-126, 0] to measure what a kernel gets.

    python scripts/fit_exp2_poly.py --degree 3
"""

from __future__ import annotations

import argparse

import numpy as np

_MAGIC = np.float32(12582912.0)  # 1.5 x 2^23: adding it leaves floor(x) in the low bits


def remez(degree: int, iterations: int = 30) -> tuple[np.ndarray, float]:
    """Coefficients c1..c_degree of the minimax-relative-error fit 1 + sum c_i f^i of 2^f
    on [0, 1], and that error (float64)."""
    grid = np.linspace(0.0, 1.0, 200001)
    # Start from Chebyshev extrema; the first is not 0, where the error is pinned at 0.
    k = np.arange(degree + 1)
    points = 0.5 - 0.5 * np.cos(np.pi * (k + 1) / (degree + 1))
    coeffs = np.zeros(degree)
    err = 0.0
    for _ in range(iterations):
        # c . f_k^i - E (-1)^k 2^f_k = 2^f_k - 1 at each point
        powers = points[:, None] ** np.arange(1, degree + 1)[None, :]
        sign = (-1.0) ** k * np.exp2(points)
        solved = np.linalg.solve(np.column_stack([powers, -sign]), np.exp2(points) - 1.0)
        coeffs = solved[:-1]
        rel = _relative_error(coeffs, grid)
        # New points: the extremum of each run of one sign of the error.
        runs = np.split(np.arange(grid.size), np.flatnonzero(np.diff(np.sign(rel)) != 0) + 1)
        peaks = [r[np.argmax(np.abs(rel[r]))] for r in runs if grid[r[-1]] > 0.0]
        peaks = sorted(peaks, key=lambda i: -abs(rel[i]))[:degree + 1]
        points = np.sort(grid[peaks])
        err = float(np.abs(rel).max())
        if len(points) < degree + 1:
            break
    return coeffs, err


def _relative_error(coeffs: np.ndarray, f: np.ndarray) -> np.ndarray:
    p = np.polynomial.polynomial.polyval(f, np.concatenate([[1.0], coeffs]))
    return p / np.exp2(f) - 1.0


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    # A product of two fp32 values is exact in fp64; the sum is then rounded twice (to
    # fp64, to fp32), which can differ from one fp32 FMA by one unit in rare ties.
    return (a.astype(np.float64) * b + c).astype(np.float32)


def emulate(x: np.ndarray, coeffs: np.ndarray) -> np.ndarray:
    """The kernel's fp32 steps for 2^x, x <= 0 (`coeffs` c1..c_d as fp32)."""
    x = np.maximum(x.astype(np.float32), np.float32(-127.0))
    # add.rm.f32: x + 1.5 x 2^23 rounded down is floor(x) + 1.5 x 2^23 exactly (ulp 1 there)
    r = np.floor(x.astype(np.float64) + np.float64(_MAGIC)).astype(np.float32)
    n = r - _MAGIC
    f = x - n
    p = np.full_like(f, coeffs[-1])
    for c in coeffs[-2::-1]:
        p = _fma32(p, f, np.full_like(f, c))
    p = _fma32(p, f, np.ones_like(f))
    bits = p.view(np.int32) + (r.view(np.int32) << 23)
    return bits.view(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--degree", type=int, default=3)
    a = ap.parse_args()
    coeffs, err = remez(a.degree)
    c32 = coeffs.astype(np.float32)
    x = np.concatenate([np.linspace(-126.0, 0.0, 4_000_001, dtype=np.float32),
                        -np.logspace(-30, 0, 100001).astype(np.float32)])
    got = emulate(x, c32).astype(np.float64)
    rel = np.abs(got / np.exp2(x.astype(np.float64)) - 1.0).max()
    print(f"degree {a.degree}: minimax relative error {err:.3e} (fp64 coefficients)")
    for i, c in enumerate(c32, start=1):
        print(f"  c{i} = {float(c)!r}")
    print(f"fp32 emulation over [-126, 0]: max relative error {rel:.3e}")
    print(f"x = -inf -> {emulate(np.array([-np.inf]), c32)[0]!r}, x = 0 -> "
          f"{emulate(np.array([0.0]), c32)[0]!r}")


if __name__ == "__main__":
    main()
