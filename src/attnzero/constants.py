"""Numeric constants shared by the plain-PyTorch code (``flash.py``) and the Triton kernels
(``kernels/``): plain floats, no imports, so that either side can import them."""

from __future__ import annotations

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x · LOG2E)
LN2 = 0.6931471805599453  # ln(2):    ln(x) = log2(x) · LN2
