"""Numeric constants of the Triton kernels (``kernels/``, which work in base 2): plain floats, no
imports, so that the host side can read them without importing triton."""

from __future__ import annotations

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x · LOG2E)
LN2 = 0.6931471805599453  # ln(2):    ln(x) = log2(x) · LN2
