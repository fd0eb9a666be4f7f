"""attnzero.testing, the tolerance rule itself: it must be able to fail. NaN, a misplaced infinity,
an error just above the bound fail; just below passes; the options move the bound as documented."""

from __future__ import annotations

import math

import pytest
import torch

from attnzero import testing
from attnzero.testing import FLOOR, assert_close_to_golden, floor, magnitude, max_error, verdict

F16, F32, F64 = torch.float16, torch.float32, torch.float64


def golden_and_ref(ref_err: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 golden of size 3 and a 'reference in float16' off by exactly ``ref_err``."""
    golden = torch.tensor([[0.5, -3.0], [1.0, 0.25]], dtype=F64)
    ref = golden.clone()
    ref[1, 1] += ref_err
    return golden, ref


def bound(ref_err: float, size: float, dtype: torch.dtype, factor: float) -> float:
    return factor * ref_err + FLOOR[dtype] * size


def with_error(golden: torch.Tensor, err: float, dtype: torch.dtype = F32) -> torch.Tensor:
    """The golden with one entry moved by ``err``, in float64 (the bound is checked exactly)."""
    got = golden.clone()
    got[0, 0] += err
    return got if dtype == F64 else got.to(dtype).to(F64)


@pytest.mark.parametrize("kind", ["out", "grad"])
def test_just_below_passes_just_above_fails(kind: testing.Kind) -> None:
    golden, ref = golden_and_ref(1e-3)
    factor = 3.0 if kind == "grad" else 2.0
    b = bound(1e-3, 3.0, F64, factor)  # size: max(1, |golden|) = 3
    below = verdict(with_error(golden, 0.999 * b, F64), ref, golden, kind=kind, floor_dtype=F64)
    above = verdict(with_error(golden, 1.001 * b, F64), ref, golden, kind=kind, floor_dtype=F64)
    assert below.ok and below.bound == pytest.approx(b)
    assert not above.ok and "error" in above.message and f"{factor:g} × reference error" in above.message
    with pytest.raises(AssertionError, match="reference error"):
        assert_close_to_golden(with_error(golden, 1.001 * b, F64), ref, golden, kind=kind, floor_dtype=F64)


def test_gradients_get_three_times_outputs_two() -> None:
    golden, ref = golden_and_ref(1e-2)
    got = with_error(golden, 2.5e-2, F64)  # between 2× and 3× the reference's error
    assert not verdict(got, ref, golden, kind="out", floor_dtype=F64).ok
    assert verdict(got, ref, golden, kind="grad", floor_dtype=F64).ok


def test_nan_never_passes() -> None:
    golden, ref = golden_and_ref(1.0)  # a huge baseline: everything finite would pass
    got = golden.clone()
    got[0, 1] = math.nan
    v = verdict(got, ref, golden)
    assert not v.ok and "NaN" in v.message
    assert max_error(got, golden) == math.inf
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_to_golden(got, ref, golden)


def test_a_reference_with_nan_is_no_baseline() -> None:
    """Without a cap, a NaN or infinite error in the reference would make the bound infinite:
    the comparison fails instead; with a cap, the reference's error counts as the cap."""
    golden, ref = golden_and_ref()
    ref[0, 0] = math.nan
    got = with_error(golden, 0.5, F64)
    assert not verdict(got, ref, golden).ok
    ref[0, 0] = math.inf
    assert not verdict(got, ref, golden).ok
    capped = verdict(got, ref, golden, ref_cap=1e-3, floor_dtype=F64)
    assert not capped.ok and "capped at its sanity bound" in capped.message
    assert verdict(with_error(golden, 1e-3, F64), ref, golden, ref_cap=1e-3, floor_dtype=F64).ok


def test_lse_infinities_must_match() -> None:
    """The lse of a fully blocked row is -inf: equal infinities are no error; a finite value there,
    an infinity elsewhere, or +inf for -inf fail."""
    golden = torch.tensor([1.5, -math.inf, 0.25], dtype=F64)
    ref = golden.to(F32)
    assert max_error(golden.to(F32), golden) == 0.0
    assert verdict(golden.to(F32), ref, golden, kind="lse").ok
    for bad in ([1.5, 0.0, 0.25], [1.5, -math.inf, -math.inf], [1.5, math.inf, 0.25]):
        v = verdict(torch.tensor(bad, dtype=F32), ref, golden, kind="lse")
        assert not v.ok and ("infinity" in v.message or "error" in v.message), bad


def test_shape_mismatch_fails() -> None:
    golden, ref = golden_and_ref()
    v = verdict(golden[:1], ref, golden)
    assert not v.ok and "shape" in v.message


def test_floor_scales_with_the_size_of_the_result() -> None:
    """Default unit max(1, |golden|); ``size`` replaces it (tiny values are judged tightly)."""
    small = torch.full((3,), 1e-20, dtype=F64)
    exact = small.clone()
    off = small + 1e-21  # 10 % off: far above a float32 rounding of 1e-20
    assert verdict(off, exact, small, floor_dtype=F32).ok  # unit 1: the floor hides it
    assert not verdict(off, exact, small, floor_dtype=F32, size=1e-20).ok
    big = torch.full((3,), 1e6, dtype=F64)
    assert magnitude(big) == 1e6 and magnitude(small) == 1.0 and magnitude(small, 7.0) == 7.0
    assert floor(F32, 1e6) == FLOOR[F32] * 1e6


@pytest.mark.parametrize("dtype", [F32, F16, torch.bfloat16], ids=["f32", "f16", "bf16"])
def test_the_floor_is_about_one_rounding_of_the_result(dtype: torch.dtype) -> None:
    """The rule's slack from first principles, not from FLOOR: with a reference that is exact, a
    result one ulp (of its largest entry) off passes and one four ulps off fails — a floor loosened
    to several roundings would let a backend that rounds carelessly pass."""
    eps = torch.finfo(dtype).eps
    golden = torch.tensor([1.0, -0.5, 0.25], dtype=F64)
    ref = golden.clone()
    assert verdict(golden + torch.tensor([eps, 0, 0], dtype=F64), ref, golden, floor_dtype=dtype).ok
    assert not verdict(golden + torch.tensor([4 * eps, 0, 0], dtype=F64), ref, golden, floor_dtype=dtype).ok


def test_score_term_for_tiled_backends() -> None:
    """``scores`` adds 2·eps(accumulator)·|s| per unit of the summed terms (out, gradients) or
    absolutely (lse, weights)."""
    e32 = torch.finfo(F32).eps
    assert floor(F16, 4.0, scores=100.0) == pytest.approx(FLOOR[F16] * 4 + 2 * e32 * 100 * 4)
    assert floor(F32, 4.0, kind="lse", scores=100.0) == pytest.approx(FLOOR[F32] * 4 + 2 * e32 * 100)
    golden = torch.tensor([0.5, 0.25], dtype=F64)
    ref = golden.clone()
    got = golden + 300 * e32  # above FLOOR[float32], below the allowance for scores of 200
    assert not verdict(got, ref, golden, floor_dtype=F32).ok
    assert verdict(got, ref, golden, floor_dtype=F32, scores=200.0).ok


def test_reference_sanity() -> None:
    golden = torch.tensor([1.0, -2.0], dtype=F64)
    near = (golden + 4 * torch.finfo(F16).eps).to(F16)
    far = (golden + 0.1).to(F16)
    assert testing.reference_verdict(near, golden).ok
    v = testing.reference_verdict(far, golden)
    assert not v.ok and "sanity bound" in v.message
    with pytest.raises(AssertionError, match="sanity bound"):
        testing.assert_reference_sane(far, golden)
