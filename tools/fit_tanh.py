"""The polynomial behind ``src/attnzero/softcap.c``'s tanh for |x| <= 1 — not a benchmark, the fit.

``tanh(x) ≈ x + x³ · P(x²)`` with P of degree 7, fitted on [0, 1] to the relative error of tanh by
weighted least squares, reweighted toward the minimax (Lawson's iteration), in float64; then the
coefficients rounded to float32 and the formula evaluated as the kernel does (Horner with fused
multiply-adds, each rounded to float32) on every third float32 in [2^-12, 1], against float64's tanh.

    .venv/bin/python tools/fit_tanh.py

prints the coefficients (constant term first) and the largest error in units of 2^-24·|tanh x|
(last run: 1.32, mean 0.35; the fit alone is within 2^-31). tests/test_softcap_kernel.py checks the
built kernel itself over dense grids of floats.
"""

from __future__ import annotations

import numpy as np

X, DEGREE = 1.0, 7


def fit() -> np.ndarray:
    """P's coefficients, constant term first (float64)."""
    x = np.cos(np.linspace(0.0, np.pi, 40001)) * X / 2 + X / 2  # Chebyshev-spaced on [0, X]
    x = x[x > 1e-4]
    y, t = x * x, np.tanh(x)
    target, weight = (t - x) / x**3, x**3 / t  # P(y) = (t − x) / x³; an error in P moves t by x³/t of it, relatively
    w = weight.copy()
    a = np.vander(y, DEGREE + 1, increasing=True)
    for _ in range(100):  # Lawson: weigh up where the error is largest
        c, *_ = np.linalg.lstsq(a * w[:, None], target * w, rcond=None)
        err = np.abs((a @ c - target) * weight)
        w = w * np.sqrt(err / err.max()) + 1e-300
        w /= w.max()
    return c


def float32_error(c: np.ndarray) -> tuple[float, float]:
    """(largest, mean) error of the float32 evaluation, in units of 2^-24·|tanh x|."""

    def fma(a: np.ndarray, b: np.ndarray, d: np.ndarray) -> np.ndarray:  # one rounding to float32
        return (a.astype(np.float64) * b.astype(np.float64) + d.astype(np.float64)).astype(np.float32)

    c32 = c.astype(np.float32)
    lo, hi = np.float32(2.0**-12).view(np.int32), np.float32(X).view(np.int32)
    xs = np.arange(lo, hi + 1, 3, dtype=np.int32).view(np.float32)
    ys = (xs * xs).astype(np.float32)
    p = np.full_like(xs, c32[-1])
    for k in range(DEGREE - 1, -1, -1):
        p = fma(p, ys, np.full_like(xs, c32[k]))
    got = fma((xs * ys).astype(np.float32), p, xs)
    want = np.tanh(xs.astype(np.float64))
    ulps = np.abs(got - want) / (want * 2.0**-24)
    return float(ulps.max()), float(ulps.mean())


def main() -> None:
    c = fit()
    for k, v in enumerate(c.astype(np.float32)):
        print(f"x^{2 * k + 3}: {float(v)!r}")
    worst, mean = float32_error(c)
    print(f"float32 evaluation: largest error {worst:.2f}, mean {mean:.2f} (units of 2^-24 |tanh x|)")


if __name__ == "__main__":
    main()
