"""The golden suite: every backend in ``BACKENDS`` against the float64 reference, with DESIGN.md's
tolerance rule, and the float64 reference itself against an independent naive implementation.

Sizes are awkward on purpose (L = 1, 17, 113, 1023; D = 8, 40, 64, 96, 128), Lq ≠ Lk both ways,
Dv ≠ D, GQA and MQA; every mask kind; fully blocked rows forward and backward; non-contiguous inputs;
gradcheck; dropout; hypothesis properties.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import (
    BACKENDS,
    DTYPE_IDS,
    DTYPES,
    check_against_golden,
    dense_keep,
    naive_attention,
    qkv,
    random_keep,
    shapes_id,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

import attnzero as az
from attnzero import dropout as az_dropout
from attnzero import flash

backends = pytest.mark.parametrize("backend", BACKENDS)
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)


def naive_for(
    keep: torch.Tensor | None, scale: float | None = None, **kw: Any
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def f(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return naive_attention(q, k, v, keep=keep, bias=bias, scale=scale, **kw)

    return f


# ---------------------------------------------------------------------------------------------
# Shapes: (B, Hq, Hkv, Lq, Lk, D, Dv)

SHAPES = [
    (2, 2, 2, 1, 1, 8, 8),
    (1, 2, 2, 17, 17, 40, 40),
    (2, 4, 2, 113, 17, 64, 96),  # GQA, Lq > Lk, Dv != D
    (1, 4, 1, 17, 113, 96, 40),  # MQA, Lq < Lk, Dv != D
    (1, 2, 2, 113, 113, 128, 128),
    (1, 3, 3, 1, 113, 64, 64),  # one query over many keys (decoding)
]


@backends
@dtypes
@pytest.mark.parametrize("shape", SHAPES, ids=shapes_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_shapes(backend: str, dtype: torch.dtype, shape: tuple[int, ...], causal: bool) -> None:
    B, Hq, Hkv, Lq, Lk, D, Dv = shape
    q, k, v = qkv(B, Hq, Hkv, Lq, Lk, D, Dv)
    keep = dense_keep(Lq, Lk, causal=causal)
    check_against_golden(backend, dtype, q, k, v, causal=causal, naive=naive_for(keep))


@backends
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_long_sequence_1023(backend: str, dtype: torch.dtype) -> None:
    """One L = 1023 case (odd, just under a power of two), causal, forward and backward."""
    q, k, v = qkv(1, 1, 1, 1023, 1023, 64)
    check_against_golden(backend, dtype, q, k, v, causal=True, naive=naive_for(dense_keep(1023, 1023, causal=True)))


# ---------------------------------------------------------------------------------------------
# Every kind of mask. A kind builds (az.attention kwargs, dense keep for the naive check, bias).

Kind = Callable[[int, int, int, int], tuple[dict[str, Any], "torch.Tensor | None", "torch.Tensor | None"]]


def _doc_ids(B: int, L: int, n_docs: int = 3) -> torch.Tensor:
    return torch.randint(0, n_docs, (B, L)).sort(dim=-1).values  # (B, L), sorted: packed documents


def _dense_bool(B: int, H: int, Lq: int, Lk: int) -> tuple[dict[str, Any], torch.Tensor, None]:
    m = random_keep(B, H, Lq, Lk)
    m[0, 0, Lq // 2] = False  # one fully blocked row
    return {"mask": m}, m, None


def _dense_float(B: int, H: int, Lq: int, Lk: int) -> tuple[dict[str, Any], torch.Tensor, None]:
    m = random_keep(1, H, Lq, Lk).double() * torch.tensor([1.0, 2.5, -1.0])[torch.randint(0, 3, (1, H, Lq, Lk))]
    return {"mask": m}, m != 0, None  # non-zero keeps, whatever its value


def _dense_uint8(B: int, H: int, Lq: int, Lk: int) -> tuple[dict[str, Any], torch.Tensor, None]:
    m = random_keep(B, 1, 1, Lk).to(torch.uint8)
    return {"mask": m}, m != 0, None


def _from_tensor(B: int, H: int, Lq: int, Lk: int) -> tuple[dict[str, Any], torch.Tensor, None]:
    m = torch.randn(B, 1, Lq, Lk) * (torch.rand(B, 1, Lq, Lk) < 0.7)  # float, non-zero = keep
    return {"mask": az.masks.from_tensor(m)}, m != 0, None


def _padding(B: int, H: int, Lq: int, Lk: int) -> tuple[dict[str, Any], torch.Tensor, None]:
    lengths = [Lk - 3, 0] + [Lk] * (B - 2)  # the second sequence is empty: all its rows are blocked
    keep = torch.zeros(B, 1, 1, Lk, dtype=torch.bool)
    for b, n in enumerate(lengths):
        keep[b, ..., :n] = True
    return {"mask": az.masks.padding(lengths, Lk)}, keep, None


def _document(B: int, H: int, Lq: int, Lk: int) -> tuple[dict[str, Any], torch.Tensor, None]:
    qi, ki = _doc_ids(B, Lq), _doc_ids(B, Lk)
    keep = (qi[:, :, None] == ki[:, None, :])[:, None]  # (B, 1, Lq, Lk)
    return {"mask": az.masks.document(qi, ki)}, keep, None


def _bias(shape_of: Callable[[int, int, int, int], tuple[int, ...]]) -> Kind:
    def kind(B: int, H: int, Lq: int, Lk: int) -> tuple[dict[str, Any], None, torch.Tensor]:
        return {}, None, torch.randn(*shape_of(B, H, Lq, Lk), dtype=torch.float64)

    return kind


def _alibi(B: int, H: int, Lq: int, Lk: int) -> tuple[dict[str, Any], None, torch.Tensor]:
    return {}, None, az.masks.alibi(H, Lq, Lk).double()


def _everything(B: int, H: int, Lq: int, Lk: int) -> tuple[dict[str, Any], torch.Tensor | None, torch.Tensor]:
    m = random_keep(B, 1, Lq, Lk, p_keep=0.85)
    keep = dense_keep(Lq, Lk, mask=m, causal=True, window=(6, None))
    return {"mask": m, "causal": True, "window": (6, None)}, keep, torch.randn(1, H, Lq, Lk, dtype=torch.float64)


def _flags(**kw: Any) -> Kind:
    def kind(B: int, H: int, Lq: int, Lk: int) -> tuple[dict[str, Any], torch.Tensor | None, None]:
        win = kw.get("window")
        win = (win, 0) if isinstance(win, int) else win
        return dict(kw), dense_keep(Lq, Lk, causal=kw.get("causal", False), window=win), None

    return kind


def _builder(
    make: Callable[[int, int], az.Mask], expect: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]
) -> Kind:
    """An az.masks builder and, independently, its rule on index grids i (Lq, 1), j (1, Lk)."""

    def kind(B: int, H: int, Lq: int, Lk: int) -> tuple[dict[str, Any], torch.Tensor, None]:
        i, j = torch.arange(Lq).view(-1, 1), torch.arange(Lk).view(1, -1)
        return {"mask": make(Lq, Lk)}, expect(i, j, Lq, Lk), None

    return kind


KINDS: dict[str, Kind] = {
    "none": _flags(),
    "dense_bool": _dense_bool,
    "dense_float_nonzero_keeps": _dense_float,
    "dense_uint8_broadcast": _dense_uint8,
    "masks_causal_bottom_right": _builder(lambda a, b: az.masks.causal(a, b), lambda i, j, a, b: j <= i + b - a),
    "masks_causal_top_left": _builder(lambda a, b: az.masks.causal(a, b, align="top_left"), lambda i, j, a, b: j <= i),
    "masks_window": _builder(
        lambda a, b: az.masks.window(a, b, 3, 2), lambda i, j, a, b: (j >= i + b - a - 3) & (j <= i + b - a + 2)
    ),
    "masks_from_tensor": _from_tensor,
    "masks_padding": _padding,
    "masks_document": _document,
    "masks_and": _builder(
        lambda a, b: az.masks.and_(az.masks.causal(a, b), az.masks.window(a, b, 4, None)),
        lambda i, j, a, b: (j <= i + b - a) & (j >= i + b - a - 4),
    ),
    "masks_or": _builder(
        lambda a, b: az.masks.or_(az.masks.window(a, b, 1, 1), az.masks.causal(a, b, align="top_left")),
        lambda i, j, a, b: ((j - (i + b - a)).abs() <= 1) | (j <= i),
    ),
    "masks_broadcast_row": _builder(  # a (1, Lk) Mask broadcasts over the queries
        lambda a, b: az.masks.causal(1, b, align="top_left"), lambda i, j, a, b: (j <= 0) & (i >= 0)
    ),
    "masks_not_causal": _builder(lambda a, b: ~az.masks.causal(a, b), lambda i, j, a, b: j > i + b - a),
    "causal": _flags(causal=True),
    "window_both": _flags(window=(3, 2)),
    "window_int": _flags(window=5),
    "window_left_unbounded": _flags(window=(None, 0)),
    "window_right_unbounded": _flags(window=(4, None)),
    "window_zero": _flags(window=(0, 0)),
    "causal_and_window": _flags(causal=True, window=(4, None)),
    "scale": _flags(scale=0.3),
    "scale_zero": _flags(scale=0.0),
    "bias_full": _bias(lambda B, H, a, b: (B, H, a, b)),
    "bias_broadcast": _bias(lambda B, H, a, b: (1, H, 1, b)),
    "bias_2d": _bias(lambda B, H, a, b: (a, b)),
    "alibi": _alibi,
    "mask_bias_causal_window": _everything,
}

MASK_SHAPES = [(2, 4, 2, 17, 40, 40, 24), (2, 2, 1, 40, 17, 8, 8)]  # Lq < Lk and Lq > Lk


@backends
@dtypes
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=shapes_id)
@pytest.mark.parametrize("kind", list(KINDS))
def test_mask_kinds(backend: str, dtype: torch.dtype, shape: tuple[int, ...], kind: str) -> None:
    B, Hq, Hkv, Lq, Lk, D, Dv = shape
    q, k, v = qkv(B, Hq, Hkv, Lq, Lk, D, Dv)
    kwargs, keep, bias = KINDS[kind](B, Hq, Lq, Lk)
    check_against_golden(backend, dtype, q, k, v, bias=bias, naive=naive_for(keep, scale=kwargs.get("scale")), **kwargs)


@pytest.mark.parametrize("kind", list(KINDS))
def test_attention_weights_match_naive(kind: str) -> None:
    """az.attention_weights is the P of the formula: with V = I the naive output is P itself."""
    B, Hq, Hkv, Lq, Lk = 2, 4, 2, 17, 40
    q, k, _ = qkv(B, Hq, Hkv, Lq, Lk, 8)
    kwargs, keep, bias = KINDS[kind](B, Hq, Lq, Lk)
    eye = torch.eye(Lk, dtype=torch.float64).expand(B, Hkv, Lk, Lk)
    want, _ = naive_attention(q, k, eye, keep=keep, bias=bias, scale=kwargs.get("scale"))
    w = az.attention_weights(q, k, bias=bias, **kwargs)
    assert w.shape == (B, Hq, Lq, Lk) and w.dtype == torch.float64
    torch.testing.assert_close(w, want, rtol=1e-12, atol=1e-12)
    w16 = az.attention_weights(q.half(), k.half(), bias=None if bias is None else bias.half(), **kwargs)
    assert w16.dtype == torch.float16 and not torch.isnan(w16).any()


# ---------------------------------------------------------------------------------------------
# Fully blocked rows: output exactly 0, lse -inf, gradients exactly 0, never NaN


def _blocked_cases(Lq: int, Lk: int) -> dict[str, tuple[dict[str, Any], torch.Tensor]]:
    """Ways to block whole query rows, with the bool (Lq,) or (B, H, Lq) of rows they block."""
    cases: dict[str, tuple[dict[str, Any], torch.Tensor]] = {}
    m = random_keep(2, 2, Lq, Lk)
    m[:, :, 1] = False
    m[1, 0] = False  # a whole head: its k/v head (Hkv = Hq) must get zero gradients
    cases["bool_rows"] = ({"mask": m}, ~m.any(-1))
    cases["padding_empty_sequence"] = (
        {"mask": az.masks.padding([Lk, 0], Lk)},
        torch.tensor([False, True]).view(2, 1, 1).expand(2, 2, Lq),
    )
    rows = torch.arange(Lq) + (Lk - Lq) < 0  # bottom-right causal with Lq > Lk blocks the first rows
    cases["causal_lq_gt_lk"] = ({"causal": True}, rows)
    cases["window_out_of_range"] = ({"window": (0, 0)}, rows)
    bias = torch.randn(2, 2, Lq, Lk, dtype=torch.float64)
    bias[:, :, 2] = float("-inf")  # an additive -inf on a whole row blocks it too
    cases["bias_minus_inf_row"] = ({"bias": bias}, (torch.arange(Lq) == 2).expand(2, 2, Lq))
    return cases


@backends
@dtypes
@pytest.mark.parametrize(
    "case", ["bool_rows", "padding_empty_sequence", "causal_lq_gt_lk", "window_out_of_range", "bias_minus_inf_row"]
)
def test_fully_blocked_rows(backend: str, dtype: torch.dtype, case: str) -> None:
    Lq, Lk = 9, 5
    kwargs, blocked = _blocked_cases(Lq, Lk)[case]
    blocked = blocked.expand(2, 2, Lq)
    q, k, v = (t.to(dtype).requires_grad_() for t in qkv(2, 2, 2, Lq, Lk, 16, 12))
    bias = kwargs.pop("bias", torch.randn(2, 2, Lq, Lk, dtype=torch.float64)).to(dtype).requires_grad_()
    assert blocked.any()
    out, lse = az.attention(q, k, v, bias=bias, backend=backend, return_lse=True, **kwargs)
    (out * torch.randn_like(out)).sum().backward()
    for name, t in {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad, "dbias": bias.grad}.items():
        assert t is not None and not torch.isnan(t).any(), f"{name} has NaN"
    assert q.grad is not None and bias.grad is not None
    assert torch.equal(out[blocked], torch.zeros_like(out[blocked]))
    assert bool((lse[blocked] == float("-inf")).all())
    assert bool(torch.isfinite(lse[~blocked]).all())
    assert torch.equal(q.grad[blocked], torch.zeros_like(q.grad[blocked]))
    assert torch.equal(bias.grad[blocked], torch.zeros_like(bias.grad[blocked]))
    assert bool((out[~blocked].abs().sum(-1) > 0).all())
    if case == "bool_rows":  # head (1, 0) sees nothing: its keys and values get no gradient
        assert k.grad is not None and v.grad is not None
        assert not k.grad[1, 0].any() and not v.grad[1, 0].any()
        assert k.grad[0, 0].any() and v.grad[0, 0].any()
    w = az.attention_weights(q, k, bias=bias, **kwargs)
    assert not torch.isnan(w).any() and not w[blocked].any()
    torch.testing.assert_close(
        w[~blocked].sum(-1).double(), torch.ones_like(w[~blocked].sum(-1), dtype=torch.float64), atol=1e-2, rtol=0
    )


@backends
@dtypes
def test_fully_blocked_rows_against_golden(backend: str, dtype: torch.dtype) -> None:
    """The same case through the tolerance rule (lse -inf must match exactly)."""
    q, k, v = qkv(2, 2, 2, 9, 5, 16, 12)
    m = random_keep(2, 2, 9, 5)
    m[:, :, 3] = False
    check_against_golden(backend, dtype, q, k, v, mask=m, naive=naive_for(m))


# ---------------------------------------------------------------------------------------------
# return_lse, non-contiguous inputs


@backends
@dtypes
def test_return_lse(backend: str, dtype: torch.dtype) -> None:
    q, k, v = (t.to(dtype) for t in qkv(2, 4, 2, 17, 23, 40, 8))
    out = az.attention(q, k, v, backend=backend)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype
    res = az.attention(q, k, v, backend=backend, return_lse=True)
    assert isinstance(res, tuple) and len(res) == 2
    out2, lse = res
    assert torch.equal(out, out2)
    assert lse.shape == (2, 4, 17)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(40)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=tol, rtol=tol)


@backends
@dtypes
@pytest.mark.parametrize("layout", ["transpose", "strided", "sliced"])
def test_noncontiguous_inputs(backend: str, dtype: torch.dtype, layout: str) -> None:
    q, k, v = qkv(2, 4, 2, 17, 33, 40, 24, layout=layout)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    bias = torch.randn(2, 33, dtype=torch.float64).unsqueeze(1).unsqueeze(1)  # (2, 1, 1, 33)
    check_against_golden(
        backend, dtype, q, k, v, causal=True, bias=bias, naive=naive_for(dense_keep(17, 33, causal=True))
    )
    # Same values, contiguous: the same result.
    qx, kx, vx = (t.to(dtype) for t in (q, k, v))
    a = az.attention(qx, kx, vx, causal=True, backend=backend)
    b = az.attention(qx.contiguous(), kx.contiguous(), vx.contiguous(), causal=True, backend=backend)
    torch.testing.assert_close(a, b, atol=torch.finfo(dtype).eps * 16, rtol=0)


# ---------------------------------------------------------------------------------------------
# gradcheck in float64


@backends
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"causal": True}, {"window": (1, 1)}, {"causal": True, "window": 2}],
    ids=["plain", "causal", "window", "causal_window"],
)
def test_gradcheck(backend: str, kwargs: dict[str, Any]) -> None:
    """q, k, v and bias, GQA, a mask with one fully blocked row, Lq != Lk, Dv != D."""
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 1, 4, 5, 3, 2))
    bias = torch.randn(1, 2, 4, 5, dtype=torch.float64, requires_grad=True)
    m = random_keep(1, 1, 4, 5, p_keep=0.8)
    m[..., 1, :] = False  # fully blocked row

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (az.attention(q, k, v, mask=m, bias=bias, backend=backend, **kwargs),)  # type: ignore[return-value]

    assert torch.autograd.gradcheck(f, (q, k, v, bias), eps=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# Dropout


@backends
def test_dropout_reproducible(backend: str) -> None:
    q, k, v = qkv(2, 2, 2, 17, 19, 8)
    torch.manual_seed(1)
    a = az.attention(q, k, v, dropout_p=0.3, backend=backend)
    torch.manual_seed(1)
    b = az.attention(q, k, v, dropout_p=0.3, backend=backend)
    torch.manual_seed(2)
    c = az.attention(q, k, v, dropout_p=0.3, backend=backend)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    assert not torch.allclose(a, az.attention(q, k, v, backend=backend))


def test_dropout_keep_mask_is_a_pure_function() -> None:
    shape = (2, 3, 17, 33)
    full = az_dropout.keep_mask(123, 0.25, shape)
    assert full.shape == shape and full.dtype == torch.bool
    assert torch.equal(full, az_dropout.keep_mask(123, 0.25, shape))
    assert not torch.equal(full, az_dropout.keep_mask(124, 0.25, shape))
    # Any block regenerates the same entries as the full mask (what a tiled backend relies on).
    blk = az_dropout.keep_mask(123, 0.25, shape, rows=(5, 16), cols=(7, 30))
    assert torch.equal(blk, full[:, :, 5:16, 7:30])
    assert az_dropout.keep_mask(1, 0.0, shape).all()
    big = az_dropout.keep_mask(7, 0.3, (4, 4, 128, 128))
    assert abs(big.double().mean().item() - 0.7) < 0.01  # 262144 draws: sd of the mean ≈ 0.001


@backends
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_preserves_the_mean(backend: str, p: float) -> None:
    """Uniform attention (q = 0) over values 1: each output is (#kept / Lk) / (1 - p), of mean 1."""
    B, H, Lq, Lk = 2, 4, 64, 256
    q = torch.zeros(B, H, Lq, 8, dtype=torch.float64)
    k = torch.randn(B, H, Lk, 8, dtype=torch.float64)
    v = torch.ones(B, H, Lk, 1, dtype=torch.float64)
    out = az.attention(q, k, v, dropout_p=p, backend=backend)
    assert isinstance(out, torch.Tensor)
    # B·H·Lq·Lk = 131072 Bernoulli draws: the mean's sd is sqrt(p / ((1-p) n)) <= 0.003.
    assert abs(out.mean().item() - 1.0) < 0.015
    assert out.std().item() > 0  # something was dropped


@backends
@dtypes
@pytest.mark.parametrize("p", [0.2, 0.6])
def test_dropout_backward_uses_forward_entries(backend: str, dtype: torch.dtype, p: float) -> None:
    """Outputs and gradients equal the naive formula with the explicit keep-mask that
    ``attnzero.dropout.keep_mask`` gives for the seed drawn from torch's RNG (tolerance rule)."""
    B, Hq, Hkv, Lq, Lk, D, Dv = 2, 4, 2, 17, 23, 16, 8
    q, k, v = qkv(B, Hq, Hkv, Lq, Lk, D, Dv)
    m = random_keep(B, 1, Lq, Lk, p_keep=0.9)
    seed = 20241
    torch.manual_seed(seed)
    drawn = az_dropout.draw_seed(torch.device("cpu"))
    drop = az_dropout.keep_mask(drawn, p, (B, Hq, Lq, Lk))
    keep = dense_keep(Lq, Lk, mask=m, causal=True)
    check_against_golden(
        backend,
        dtype,
        q,
        k,
        v,
        mask=m,
        causal=True,
        dropout_p=p,
        seed=seed,
        naive=naive_for(keep, drop_keep=drop, dropout_p=p),
    )


# ---------------------------------------------------------------------------------------------
# Hypothesis: random shapes and masks, float64, against the naive formula. flash runs with blocks
# of 3-8 rows and columns (its default is 128 × 128), so that lengths up to 20 span several row and
# key blocks with a partial last one, and causal, window, mask and bias edges fall inside and
# across blocks.


@st.composite
def problems(draw: st.DrawFn) -> dict[str, Any]:
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.integers(1, 3))
    Lq, Lk = draw(st.integers(1, 20)), draw(st.integers(1, 20))
    D, Dv = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    causal = draw(st.booleans())
    left = draw(st.none() | st.integers(0, 8))
    right = draw(st.none() | st.integers(0, 8))
    window = draw(st.none() | st.just((left, right)))
    mask_kind = draw(st.sampled_from(["none", "full", "rows", "keys"]))
    with_bias = draw(st.booleans())
    scale = draw(st.none() | st.floats(0.0, 2.0))
    seed = draw(st.integers(0, 2**31 - 1))
    blocks = {
        "rows": draw(st.integers(3, 8)),
        "cols": draw(st.integers(3, 8)),
    }
    return dict(
        B=B,
        Hkv=Hkv,
        Hq=Hkv * G,
        Lq=Lq,
        Lk=Lk,
        D=D,
        Dv=Dv,
        causal=causal,
        window=window,
        mask_kind=mask_kind,
        with_bias=with_bias,
        scale=scale,
        seed=seed,
        blocks=blocks,
    )


def crossing(**kw: Any) -> dict[str, Any]:
    """A fixed problem for ``@example``: every feature on, lengths spanning several blocks."""
    pb: dict[str, Any] = dict(B=2, Hkv=2, Hq=6, Lq=17, Lk=19, D=5, Dv=3, causal=True, window=None, mask_kind="full",
                              with_bias=True, scale=None, seed=7, blocks={"rows": 4, "cols": 5})  # fmt: skip
    return pb | kw


@backends
@settings(max_examples=40, deadline=None)
@given(pb=problems())
@example(pb=crossing())  # causal, GQA (G = 3), a full mask and a bias over 5 × 4 blocks
@example(pb=crossing(causal=False, window=(2, 3), Lq=20, Lk=20, mask_kind="rows", with_bias=False,
                     blocks={"rows": 3, "cols": 7}))  # fmt: skip
@example(pb=crossing(Lq=19, Lk=6, window=(5, 0), mask_kind="keys", Hq=2, Hkv=2,
                     blocks={"rows": 5, "cols": 4}))  # fmt: skip  # Lq > Lk: rows with no key
def test_property_matches_naive(backend: str, pb: dict[str, Any]) -> None:
    g = torch.Generator().manual_seed(pb["seed"])
    B, Hq, Hkv, Lq, Lk, D, Dv = (pb[n] for n in ("B", "Hq", "Hkv", "Lq", "Lk", "D", "Dv"))
    q = torch.randn(B, Hq, Lq, D, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, Lk, D, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, Lk, Dv, dtype=torch.float64, generator=g, requires_grad=True)
    mask_shape = {"none": None, "full": (B, Hq, Lq, Lk), "rows": (1, 1, Lq, Lk), "keys": (B, 1, 1, Lk)}[pb["mask_kind"]]
    mask = None if mask_shape is None else torch.rand(*mask_shape, generator=g) < 0.6
    bias = torch.randn(1, Hq, Lq, Lk, dtype=torch.float64, generator=g) if pb["with_bias"] else None
    dout = torch.randn(B, Hq, Lq, Dv, dtype=torch.float64, generator=g)
    with flash.block_sizes(**pb["blocks"]):  # forward and backward both
        out, lse = az.attention(
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            causal=pb["causal"],
            window=pb["window"],
            scale=pb["scale"],
            backend=backend,
            return_lse=True,
        )
        got = torch.autograd.grad(out, (q, k, v), dout)
    keep = dense_keep(Lq, Lk, mask=mask, causal=pb["causal"], window=pb["window"])
    want, want_lse = naive_attention(q, k, v, keep=keep, bias=bias, scale=pb["scale"])
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse, atol=1e-10, rtol=1e-10)
    exp = torch.autograd.grad(want, (q, k, v), dout)
    for a, b in zip(got, exp):
        assert not torch.isnan(a).any()
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)
    # Rows with nothing to attend to: exactly zero.
    blocked = torch.zeros(B, Hq, Lq, dtype=torch.bool) if keep is None else ~keep.expand(B, Hq, Lq, Lk).any(-1)
    assert not out[blocked].any()
