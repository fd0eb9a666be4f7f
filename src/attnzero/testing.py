"""The tolerance rule of DESIGN.md ("Numerics and tests"), in one place: the test suite, the fuzz,
``attnzero check`` and ``benchmarks/gpu.py`` all judge a result with it.

Inputs are rounded to a dtype X; the *golden* is the reference backend in float64 on exactly those
rounded inputs. A backend run in X passes when

    err(backend in X) <= factor × err(reference in X) + floor

where ``err`` is the max-abs difference from the golden, ``factor`` is 2 for outputs (out, lse, the
attention weights) and 3 for gradients, and ``floor`` is about one rounding in X of the result
(``FLOOR[X]`` times the size of the result, at least 1 unless a size is given). NaN never passes,
and an infinity must sit where the golden has the same infinity (the lse of a fully blocked row is
-inf in both).

Two options exist for the fuzz, whose values span 1e-30 to 1e30 and whose scores reach the
thousands:

* ``scores``: a *tiled* backend (flash, triton) rounds each score once more than the reference (it
  works in base 2, and its backward recomputes p from a float32 lse). That moves each weight p
  relatively by about κ = eps(accumulator)·|s|; the floor then gains 2κ per unit of the terms the
  result sums (the result's size for out and gradients, 1 for an lse or a weight). Below the plain
  floor for scores of ordinary size, it matters only for scores in the hundreds and beyond.
* ``ref_cap``: a broken reference must not loosen the rule; its error counts at most this much
  (usually :func:`sanity_bound`).

:func:`verdict` returns the judgement (for code that reports and must not raise);
:func:`assert_close_to_golden` raises ``AssertionError`` with the same message (for tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "FLOOR",
    "Kind",
    "Verdict",
    "accumulator_dtype",
    "assert_close_to_golden",
    "assert_reference_sane",
    "floor",
    "magnitude",
    "max_error",
    "reference_verdict",
    "sanity_bound",
    "verdict",
]

Kind = Literal["out", "grad", "lse", "weights"]
"""What a result is: an output (``"out"``), a gradient (``"grad"``, factor 3), a log-sum-exp
(``"lse"``) or attention weights (``"weights"``). The last two depend on the scores directly rather
than summing terms of the values."""

# The floor, in units of the result's size: about one rounding of the result in dtype X (a backend
# may round once differently where the reference happens to be exact). float64's reference *is*
# the golden (error 0), so its floor is what reordering the float64 sums costs.
FLOOR: dict[torch.dtype, float] = {
    torch.float64: 1e-12,
    torch.float32: 2 * torch.finfo(torch.float32).eps,
    torch.float16: torch.finfo(torch.float16).eps,
    torch.bfloat16: torch.finfo(torch.bfloat16).eps,
}


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores and softmax statistics are kept in for inputs of ``dtype``: float64 for
    float64, float32 for everything else (float16/bfloat16 accumulate in float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _abs_diff(x: Tensor, golden: Tensor) -> Tensor:
    """|x - golden| in float64; equal infinities count 0, NaN counts +inf."""
    x64, g64 = x.detach().to(torch.float64), golden.detach().to(torch.float64)
    same_inf = torch.isinf(g64) & (x64 == g64)
    d = torch.where(same_inf, torch.zeros_like(g64), (x64 - g64).abs())
    return torch.where(torch.isnan(d), math.inf, d)


def max_error(x: Tensor, golden: Tensor) -> float:
    """The error measure: max |x - golden| (computed in float64); equal infinities (the lse of a
    blocked row) count 0, NaN counts as an infinite error. 0 for empty tensors."""
    d = _abs_diff(x, golden)
    return float(d.max()) if d.numel() else 0.0


def _worst(x: Tensor, golden: Tensor) -> tuple[float, tuple[int, ...]]:
    """(max error, the index where it is)."""
    d = _abs_diff(x, golden)
    if d.numel() == 0:
        return 0.0, ()
    i = int(d.argmax())
    return float(d.reshape(-1)[i]), tuple(int(c) for c in torch.unravel_index(torch.tensor(i), d.shape))


def magnitude(golden: Tensor, *others: float) -> float:
    """The default unit of the floor: max(1, |golden| over its finite entries, ``others``)."""
    fin = golden.detach()[torch.isfinite(golden.detach())]
    return max(1.0, float(fin.abs().max()) if fin.numel() else 0.0, *others)


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _subnormal(dtype: torch.dtype) -> float:
    """The dtype's smallest subnormal: a result below it is not representable at all."""
    fi = torch.finfo(dtype)
    return fi.smallest_normal * fi.eps


def _score_term(dtype: torch.dtype, kind: Kind, size: float, scores: float) -> float:
    """κ = eps(accumulator)·|s| per unit of the terms the result sums (``size`` for out and
    gradients; 1 for an lse, a p-weighted mean of the scores, or a weight itself)."""
    per = 1.0 if kind in ("lse", "weights") else size
    return _eps(accumulator_dtype(dtype)) * scores * per


def floor(
    dtype: torch.dtype,
    size: float = 1.0,
    *,
    kind: Kind = "out",
    scores: float = 0.0,
    subnormal: bool = False,
) -> float:
    """The absolute floor for a result of ``dtype`` whose size is ``size``: ``FLOOR[dtype]·size``,
    plus 2κ (see the module docstring) when ``scores`` (the largest |score| of a kept pair) is given,
    plus the dtype's smallest subnormal when ``subnormal`` (results whose size itself is tiny: a
    gradient of 1e-49 is 0 in float32)."""
    fl = FLOOR[dtype] * size + 2 * _score_term(dtype, kind, size, scores)
    return fl + (_subnormal(dtype) if subnormal else 0.0)


def sanity_bound(
    dtype: torch.dtype,
    size: float = 1.0,
    *,
    kind: Kind = "out",
    scores: float = 0.0,
    subnormal: bool = False,
) -> float:
    """How far the *reference* backend in ``dtype`` may be from the golden: 16 roundings of the
    result's size (64 for gradients), plus 4κ for an lse or a weight (8κ·size for sums of terms,
    whose weights each move by up to 2κ: the reference rounds its scores in the accumulator dtype
    too), plus 4 smallest subnormals when ``subnormal``. It keeps the baseline of the rule honest:
    a sloppy reference would loosen every comparison made against it."""
    k = 64 if kind == "grad" else 16
    per_score = 4 if kind in ("lse", "weights") else 8
    bound = k * _eps(dtype) * size + per_score * _score_term(dtype, kind, size, scores)
    return bound + (4 * _subnormal(dtype) if subnormal else 0.0)


@dataclass(frozen=True)
class Verdict:
    """The judgement of one result. ``bool(verdict)`` is ``ok``; ``message`` says what is wrong
    ("" when ok)."""

    name: str
    ok: bool
    error: float
    ref_error: float
    bound: float
    message: str = ""

    def __bool__(self) -> bool:
        return self.ok


def _structural(name: str, got: Tensor, golden: Tensor) -> str | None:
    """Shape, NaN and infinity checks that no tolerance can excuse."""
    if tuple(got.shape) != tuple(golden.shape):
        return f"{name}: shape {tuple(got.shape)}, golden {tuple(golden.shape)}"
    if torch.isnan(golden).any():
        return f"{name}: the golden itself has NaN"
    nan = torch.isnan(got)
    if nan.any():
        idx = tuple(int(c) for c in nan.nonzero()[0])
        return f"{name}: NaN in {int(nan.sum())} of {got.numel()} entries (first at {idx})"
    bad = torch.isinf(got) != torch.isinf(golden)
    if bad.any():
        idx = tuple(int(c) for c in bad.nonzero()[0])
        return f"{name}: infinity mismatch at {idx}: got {got[idx].item()}, golden {golden[idx].item()}"
    return None


def _fail(name: str, message: str) -> Verdict:
    return Verdict(name, False, math.nan, math.nan, math.nan, message)


def verdict(
    got: Tensor,
    ref: Tensor,
    golden: Tensor,
    *,
    kind: Kind = "out",
    name: str | None = None,
    size: float | None = None,
    floor_dtype: torch.dtype | None = None,
    scores: float = 0.0,
    subnormal: bool = False,
    ref_cap: float | None = None,
) -> Verdict:
    """Judge ``got`` (the backend under test in dtype X) by the rule, with ``ref`` (the reference
    backend in X) as the baseline and ``golden`` (the reference in float64 on the same rounded
    inputs) as the truth: ``err(got) <= factor × err(ref) + floor``, factor 3 for ``kind="grad"``
    and 2 otherwise; NaN in ``got`` or an infinity where the golden has none fails.

    Options (defaults give DESIGN.md's plain rule):

    * ``size``: the floor's unit (default :func:`magnitude` of the golden, which is at least 1);
      the fuzz gives the size of the terms the result sums, so that values of 1e-30 are judged
      like values of 1;
    * ``floor_dtype``: whose roundings the floor allows (default ``got.dtype``; the gradient of a
      float32 bias for float16 inputs carries float16 roundings);
    * ``scores``, ``subnormal``: see :func:`floor`;
    * ``ref_cap``: the most the reference's error may count (a reference further off than that, or
      one with NaN, is held to it instead of failing the comparison); without it a reference with
      NaN or an infinite error fails the comparison.
    """
    name = name or kind
    wrong = _structural(name, got, golden)
    if wrong is not None:
        return _fail(name, wrong)
    if ref.shape != golden.shape:
        return _fail(name, f"{name}: the reference's shape {tuple(ref.shape)} != golden {tuple(golden.shape)}")
    err, where = _worst(got, golden)
    ref_err = max_error(ref, golden)
    base = ref_err if ref_cap is None else min(ref_err, ref_cap)
    if not math.isfinite(base):
        what = "NaN" if torch.isnan(ref).any() else "an infinite error"
        return _fail(name, f"{name}: the reference's result has {what} (no baseline)")
    fdt = got.dtype if floor_dtype is None else floor_dtype
    unit = magnitude(golden) if size is None else size
    fl = floor(fdt, unit, kind=kind, scores=scores, subnormal=subnormal)
    factor = 3.0 if kind == "grad" else 2.0
    bound = factor * base + fl
    if err <= bound:
        return Verdict(name, True, err, ref_err, bound)
    capped = " (capped at its sanity bound)" if base < ref_err else ""
    message = (
        f"{name} ({got.dtype}): error {err:.3e} at {where} (got {got[where].item():.6g}, golden "
        f"{golden[where].item():.6g}) > {factor:g} × reference error {ref_err:.3e}{capped} + floor {fl:.1e}"
    )
    return Verdict(name, False, err, ref_err, bound, message)


def reference_verdict(
    ref: Tensor,
    golden: Tensor,
    *,
    kind: Kind = "out",
    name: str | None = None,
    size: float | None = None,
    bound_dtype: torch.dtype | None = None,
    scores: float = 0.0,
    subnormal: bool = False,
) -> Verdict:
    """Judge the reference backend in dtype X itself: within :func:`sanity_bound` of the golden
    (``bound_dtype`` default ``ref.dtype``, ``size`` default :func:`magnitude` of the golden)."""
    name = name or kind
    wrong = _structural(name, ref, golden)
    if wrong is not None:
        return _fail(name, wrong)
    unit = magnitude(golden) if size is None else size
    bound = sanity_bound(ref.dtype if bound_dtype is None else bound_dtype, unit, kind=kind, scores=scores,
                         subnormal=subnormal)  # fmt: skip
    err, where = _worst(ref, golden)
    if err <= bound:
        return Verdict(name, True, err, err, bound)
    message = (
        f"{name}: reference error {err:.3e} at {where} (got {ref[where].item():.6g}, golden "
        f"{golden[where].item():.6g}) > sanity bound {bound:.2e}"
    )
    return Verdict(name, False, err, err, bound, message)


def assert_close_to_golden(
    got: Tensor,
    ref: Tensor,
    golden: Tensor,
    *,
    kind: Kind = "out",
    name: str | None = None,
    size: float | None = None,
    floor_dtype: torch.dtype | None = None,
    scores: float = 0.0,
    subnormal: bool = False,
    ref_cap: float | None = None,
) -> None:
    """:func:`verdict`, raising ``AssertionError`` with its message when the result fails."""
    v = verdict(got, ref, golden, kind=kind, name=name, size=size, floor_dtype=floor_dtype, scores=scores,
                subnormal=subnormal, ref_cap=ref_cap)  # fmt: skip
    if not v.ok:
        raise AssertionError(v.message)


def assert_reference_sane(
    ref: Tensor, golden: Tensor, *, kind: Kind = "out", name: str | None = None, size: float | None = None
) -> None:
    """:func:`reference_verdict`, raising ``AssertionError`` when the reference is off."""
    v = reference_verdict(ref, golden, kind=kind, name=name, size=size)
    if not v.ok:
        raise AssertionError(v.message)
