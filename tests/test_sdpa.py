"""az.scaled_dot_product_attention is a drop-in for torch.nn.functional.scaled_dot_product_attention:
same semantics (bool mask keeps True, float mask is added, is_causal top-left, enable_gqa, scale),
same results to float32 rounding, except that a row with every key blocked gives 0, never NaN."""

from __future__ import annotations

import contextlib
import itertools
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from conftest import flash_py
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import attnzero as az
from attnzero import flash, functional

B, H, D, DV = 2, 6, 16, 12


def _mask(kind: str, Lq: int, Lk: int, dtype: torch.dtype) -> torch.Tensor | None:
    shapes = {"bool4": (B, H, Lq, Lk), "bool2": (Lq, Lk), "bool_keys": (B, 1, 1, Lk), "bool_heads": (H, Lq, Lk)}
    if kind == "none":
        return None
    if kind.startswith("bool"):
        m = torch.rand(shapes[kind]) < 0.7
        m[..., 0] = True  # every row keeps a key (rows with none are tested below)
        return m
    shape = (B, H, Lq, Lk) if kind == "float4" else (Lq, Lk)
    m = torch.randn(shape, dtype=dtype)
    m[torch.rand(shape) < 0.2] = float("-inf")
    m[..., 0] = 0.0
    return m


MASKS = ["none", "bool4", "bool2", "bool_keys", "bool_heads", "float4", "float2"]
CASES = [
    (lq_lk, mask, causal, gqa, scale)
    for lq_lk, mask, causal, gqa, scale in itertools.product(
        [(5, 5), (3, 8), (8, 3)], MASKS, [False, True], [False, True], [None, 0.7]
    )
    if not (causal and mask != "none")  # torch refuses attn_mask together with is_causal
]


def _ids(case: tuple[object, ...]) -> str:
    (lq, lk), mask, causal, gqa, scale = case  # type: ignore[misc]
    return f"{lq}x{lk}-{mask}{'-causal' if causal else ''}{'-gqa' if gqa else ''}{'-scale' if scale else ''}"


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_matches_torch_float32_and_float64(case: tuple[tuple[int, int], str, bool, bool, float | None]) -> None:
    (Lq, Lk), mask_kind, causal, gqa, scale = case
    Hkv = 2 if gqa else H
    q = torch.randn(B, H, Lq, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, Lk, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, Lk, DV, dtype=torch.float64, requires_grad=True)
    mask = _mask(mask_kind, Lq, Lk, torch.float64)
    kw = dict(attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    ours = az.scaled_dot_product_attention(q, k, v, **kw)  # type: ignore[arg-type]
    theirs = F.scaled_dot_product_attention(q, k, v, **kw)  # type: ignore[arg-type]
    assert ours.shape == theirs.shape == (B, H, Lq, DV)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), dout), torch.autograd.grad(theirs, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # float32: the same to float32 rounding (torch's default float32 tolerances).
    q32, k32, v32 = (t.detach().float() for t in (q, k, v))
    kw32 = dict(kw, attn_mask=None if mask is None else (mask if mask.dtype == torch.bool else mask.float()))
    ours32 = az.scaled_dot_product_attention(q32, k32, v32, **kw32)  # type: ignore[arg-type]
    theirs32 = F.scaled_dot_product_attention(q32, k32, v32, **kw32)  # type: ignore[arg-type]
    assert ours32.dtype == torch.float32
    torch.testing.assert_close(ours32, theirs32)


@pytest.mark.parametrize(("Lq", "Lk"), [(3, 8), (8, 3), (6, 6)])
def test_is_causal_is_top_left(Lq: int, Lk: int) -> None:
    q, k, v = torch.randn(1, 1, Lq, 8), torch.randn(1, 1, Lk, 8), torch.randn(1, 1, Lk, 8)
    top_left = torch.ones(Lq, Lk, dtype=torch.bool).tril()
    ours = az.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, az.scaled_dot_product_attention(q, k, v, attn_mask=top_left))
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    if Lq != Lk:  # and not az.attention's bottom-right causal
        assert not torch.allclose(ours, az.attention(q, k, v, causal=True))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("q_shape", "kv_lead", "mask_shape"),
    [
        ((7, 16), (), (7, 9)),  # 2-D (L, E)
        ((3, 7, 16), (3,), (7, 9)),  # 3-D (N, L, E)
        ((3, 7, 16), (3,), (3, 7, 9)),
        ((2, 3, 4, 7, 16), (2, 3, 4), (2, 3, 4, 7, 9)),  # 5-D (A, B, H, L, E)
        ((2, 3, 4, 7, 16), (2, 3, 4), (7, 9)),
        ((2, 3, 4, 7, 16), (2, 3, 4), (3, 1, 7, 9)),
    ],
)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_other_ranks(
    q_shape: tuple[int, ...], kv_lead: tuple[int, ...], mask_shape: tuple[int, ...], mask_dtype: torch.dtype
) -> None:
    q = torch.randn(q_shape)
    k, v = torch.randn(*kv_lead, 9, 16), torch.randn(*kv_lead, 9, 5)
    if mask_dtype == torch.bool:
        mask = torch.rand(mask_shape) < 0.7
        mask[..., 0] = True
    else:
        mask = torch.randn(mask_shape)
    ours = az.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert ours.shape == theirs.shape == (*q_shape[:-1], 5)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(
        az.scaled_dot_product_attention(q, k, v, is_causal=True),
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
    )


def test_gqa_five_dims_and_three_dims() -> None:
    q, k, v = torch.randn(2, 3, 6, 5, 8), torch.randn(2, 3, 2, 7, 8), torch.randn(2, 3, 2, 7, 8)
    torch.testing.assert_close(
        az.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    )
    q3, k3 = torch.randn(4, 5, 8), torch.randn(2, 7, 8)
    torch.testing.assert_close(
        az.scaled_dot_product_attention(q3, k3, k3, enable_gqa=True),
        F.scaled_dot_product_attention(q3, k3, k3, enable_gqa=True),
    )


_LAYOUTS = {  # (B, H, L, E) views as models make them, by how their memory is laid out
    "contiguous": lambda B, H, L, E: torch.randn(B, H, L, E),
    "one projection (B, L, H, E)": lambda B, H, L, E: torch.randn(B, L, H, E).transpose(1, 2),
    "heads first (H, B, L, E)": lambda B, H, L, E: torch.randn(H, B, L, E).transpose(0, 1),
    "sequence first (L, B, H, E)": lambda B, H, L, E: torch.randn(L, B, H, E).permute(1, 2, 0, 3),
    "split from qkv (ViT)": lambda B, H, L, E: torch.randn(B, L, 3, H, E).permute(2, 0, 3, 1, 4)[0],
    "expanded over heads": lambda B, H, L, E: torch.randn(B, 1, L, E).expand(B, H, L, E),
    "a slice of E": lambda B, H, L, E: torch.randn(B, H, L, 2 * E)[..., :E],
    "E not unit stride": lambda B, H, L, E: torch.randn(B, H, L, E, 2)[..., 0],
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("path", ["kernel", "flash.py"])
def test_the_output_is_laid_out_as_torchs(layout: str, dtype: torch.dtype, path: str) -> None:
    """The output's strides are torch's on CPU — q's memory order where torch's flash kernel runs (no
    dropout, Dv = D), else contiguous — so that code viewing it works as with torch
    (``out.permute(2, 0, 1, 3).view(L * B, H * D)`` after a sequence-first projection raised)."""
    make = _LAYOUTS[layout]
    options: list[dict[str, object]] = [{}, {"dropout_p": 0.2}, {"dropout_p": 1.0}, {"is_causal": True}]
    for dv, extra, gqa in itertools.product([D, DV], options, [False, True]):
        q = make(B, H, 7, D).to(dtype)
        k, v = make(B, H // 2 if gqa else H, 9, D).to(dtype), make(B, H // 2 if gqa else H, 9, dv).to(dtype)
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **extra)
        with flash_py() if path == "flash.py" else contextlib.nullcontext():
            got = az.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **extra)
        assert got.stride() == want.stride(), (dv, extra, gqa)
        if not extra:
            tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
            torch.testing.assert_close(got, want, **tol)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["one projection (B, L, H, E)", "sequence first (L, B, H, E)"])
def test_the_output_is_laid_out_as_torchs_where_torch_leaves_its_flash_kernel(layout: str) -> None:
    """torch's own choice decides the order: k / v broadcast over heads or batch, a mask that needs a
    gradient, no keys, a CausalBias, flash turned off by ``sdpa_kernel`` send torch to its math path
    (contiguous output; the drop-in's was q's order, and ``out.view(B, H * L, E)`` raised)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    make = _LAYOUTS[layout]
    q = make(B, H, 7, D)
    kv, one_head, one_batch, no_keys = make(B, H, 9, D), make(B, 1, 9, D), make(1, H, 9, D), make(B, H, 0, D)
    bias = torch.randn(7, 9)
    calls: dict[str, tuple[torch.Tensor, dict[str, object]]] = {
        "same shapes": (kv, {}),
        "k, v of one head": (one_head, {}),
        "k, v of one batch": (one_batch, {}),
        "no keys": (no_keys, {}),
        "bool mask": (kv, {"attn_mask": torch.rand(7, 9) > 0.3}),
        "float mask": (kv, {"attn_mask": bias}),
        "float mask needing its gradient": (kv, {"attn_mask": bias.clone().requires_grad_()}),
        "CausalBias lower right": (kv, {"attn_mask": causal_lower_right(7, 9)}),
        "CausalBias upper left": (kv, {"attn_mask": causal_upper_left(7, 9)}),
    }
    for (name, (k, extra)), math in itertools.product(calls.items(), [False, True]):
        with sdpa_kernel([SDPBackend.MATH]) if math else contextlib.nullcontext():
            want = F.scaled_dot_product_attention(q, k, k, **extra)  # type: ignore[arg-type]
            got = az.scaled_dot_product_attention(q, k, k, **extra)  # type: ignore[arg-type]
        assert got.stride() == want.stride(), (name, math)
        torch.testing.assert_close(got, want)


def test_the_output_of_other_ranks_and_a_strided_head_dim_of_one_is_contiguous_as_torchs() -> None:
    """torch's math path (3-D and 5-D calls, rows not of unit stride) returns a contiguous output:
    the drop-in's was a view of its 4-D layout (out.view(-1) raised)."""
    x = torch.randn(5, 3, 4)
    y = torch.randn(5, 2, 2, 3, 4)
    z = torch.randn(2, 5, 1, 3)
    for q in (x.transpose(0, 1), y.permute(1, 2, 3, 0, 4), z.permute(0, 3, 1, 2)):  # (H, L, D), 5-D, D = 1
        want = F.scaled_dot_product_attention(q, q, q)
        got = az.scaled_dot_product_attention(q, q, q)
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want)


def test_fully_masked_rows_give_zero() -> None:
    q, k, v = (torch.randn(2, 2, 5, 8, requires_grad=True) for _ in range(3))
    keep = torch.rand(2, 2, 5, 5) < 0.7
    keep[..., 0] = True
    keep[:, :, 2] = False  # row 2: nothing to attend to
    additive = torch.zeros(2, 2, 5, 5).masked_fill(~keep, float("-inf"))
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # 0 or NaN, depending on torch's path
    for m in (keep, additive):
        ours = az.scaled_dot_product_attention(q, k, v, attn_mask=m)
        assert not torch.isnan(ours).any()
        assert not ours[:, :, 2].any()
        rows = [0, 1, 3, 4]
        torch.testing.assert_close(ours[:, :, rows], theirs[:, :, rows])
        (g,) = torch.autograd.grad(ours.sum(), (q,))
        assert not torch.isnan(g).any() and not g[:, :, 2].any()


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_reproducible_with_the_same_seed(p: float) -> None:
    q, k, v = (torch.randn(2, 2, 9, 8) for _ in range(3))
    torch.manual_seed(3)
    a = az.scaled_dot_product_attention(q, k, v, dropout_p=p)
    torch.manual_seed(3)
    b = az.scaled_dot_product_attention(q, k, v, dropout_p=p)
    torch.manual_seed(4)
    c = az.scaled_dot_product_attention(q, k, v, dropout_p=p)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.allclose(a, az.scaled_dot_product_attention(q, k, v))
    # Statistically the same mean as without dropout (uniform weights, values 1).
    ones = torch.ones(1, 4, 256, 1)
    out = az.scaled_dot_product_attention(torch.zeros(1, 4, 128, 8), torch.randn(1, 4, 256, 8), ones, dropout_p=p)
    assert abs(out.mean().item() - 1.0) < 0.02


def test_dropout_zero_is_deterministic_and_default() -> None:
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    assert torch.equal(
        az.scaled_dot_product_attention(q, k, v, dropout_p=0.0), az.scaled_dot_product_attention(q, k, v)
    )



def test_dropout_one_and_a_tensor_scale_are_taken_as_torch_takes_them() -> None:
    """torch's SDPA takes dropout_p=1.0 (every weight dropped: the output 0, zero gradients) and a
    0-d tensor as ``scale`` or ``dropout_p``, or a bool as ``dropout_p`` (its argument parser reads
    the float): so does the drop-in."""
    q, k, v = (torch.randn(2, 3, 5, 8, requires_grad=True) for _ in range(3))
    for attend, p in itertools.product((F.scaled_dot_product_attention, az.scaled_dot_product_attention),
                                       (1.0, True, torch.tensor(1.0), torch.tensor(1))):  # fmt: skip
        out = attend(q, k, v, dropout_p=p)  # type: ignore[arg-type]
        assert torch.equal(out, torch.zeros(2, 3, 5, 8))
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(not g.any() for g in grads)
    for p in (False, torch.tensor(0.0)):
        torch.testing.assert_close(
            az.scaled_dot_product_attention(q, k, v, dropout_p=p),  # type: ignore[arg-type]
            F.scaled_dot_product_attention(q, k, v, dropout_p=p),  # type: ignore[arg-type]
        )
    dropped = az.scaled_dot_product_attention(q, k, v, dropout_p=torch.tensor(0.5))  # type: ignore[arg-type]
    assert not torch.allclose(dropped, az.scaled_dot_product_attention(q, k, v))
    torch.testing.assert_close(
        az.scaled_dot_product_attention(q, k, v, scale=torch.tensor(0.3)),
        F.scaled_dot_product_attention(q, k, v, scale=torch.tensor(0.3)),  # type: ignore[arg-type]
    )
    # one that asks for a gradient is refused, as torch refuses it (it would get none: it was read as a float)
    for attend in (F.scaled_dot_product_attention, az.scaled_dot_product_attention):
        with pytest.raises(TypeError):
            attend(q, k, v, scale=torch.tensor(0.3, requires_grad=True))  # type: ignore[arg-type]
        with pytest.raises(TypeError):  # (1.0 too: not taken as "every weight dropped")
            attend(q, k, v, dropout_p=torch.tensor(1.0, requires_grad=True))  # type: ignore[arg-type]


def test_numpy_scalars_are_taken_as_torch_takes_them() -> None:
    """np.float32 / np.float16 / np.int64 for ``scale`` and ``dropout_p`` (torch's argument parser
    reads their float); they were refused, quoting a torch error that torch does not raise."""
    import numpy as np

    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    for x in (np.float32(0.3), np.float16(0.3), np.float64(0.3), np.int64(2)):
        torch.testing.assert_close(
            az.scaled_dot_product_attention(q, k, v, scale=x),  # type: ignore[arg-type]
            F.scaled_dot_product_attention(q, k, v, scale=x),  # type: ignore[arg-type]
        )
    torch.testing.assert_close(
        az.scaled_dot_product_attention(q, k, v, dropout_p=np.float32(0.0)),  # type: ignore[arg-type]
        F.scaled_dot_product_attention(q, k, v),
    )
    with pytest.raises(az.ArgumentTypeError, match="scale: expected None or a real number"):
        az.scaled_dot_product_attention(q, k, v, scale=np.bool_(True))  # type: ignore[arg-type]
    with pytest.raises(az.ArgumentError, match=r"dropout_p: expected a float in \[0, 1\), got -0.1$"):
        az.scaled_dot_product_attention(q, k, v, dropout_p=-0.1)  # refused, without a phrase torch never says


@settings(max_examples=40, deadline=None)
@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    Hkv=st.integers(1, 3),
    G=st.integers(1, 2),
    Lq=st.integers(1, 16),
    Lk=st.integers(1, 16),
    E=st.integers(1, 8),
    Ev=st.integers(1, 8),
    mask_kind=st.sampled_from(["none", "bool", "float", "causal"]),
    scale=st.none() | st.floats(0.01, 3.0),
    seed=st.integers(0, 2**31 - 1),
    blocks=st.none() | st.tuples(st.integers(3, 8), st.integers(3, 8)),
)
def test_property_matches_torch(
    lead: list[int], Hkv: int, G: int, Lq: int, Lk: int, E: int, Ev: int, mask_kind: str, scale: float | None,
    seed: int, blocks: tuple[int, int] | None,
) -> None:
    """The drop-in equals torch's; with ``blocks`` (rows, cols) it runs through flash in blocks
    that small (at these sizes "auto" would take the reference), so that top-left causal and the
    masks cross block edges."""
    g = torch.Generator().manual_seed(seed)
    Hq = Hkv * G
    q = torch.randn(*lead, Hq, Lq, E, dtype=torch.float64, generator=g)
    k = torch.randn(*lead, Hkv, Lk, E, dtype=torch.float64, generator=g)
    v = torch.randn(*lead, Hkv, Lk, Ev, dtype=torch.float64, generator=g)
    mask: torch.Tensor | None = None
    if mask_kind == "bool":
        mask = torch.rand(Lq, Lk, generator=g) < 0.6
        mask[:, 0] = True  # torch may give NaN on a row with no key; that case is tested above
    elif mask_kind == "float":
        mask = torch.randn(Hq, Lq, Lk, dtype=torch.float64, generator=g)
    kw = dict(attn_mask=mask, is_causal=mask_kind == "causal", scale=scale, enable_gqa=G > 1)
    with contextlib.ExitStack() as stack:
        if blocks is not None:
            stack.enter_context(mock.patch.object(functional, "_auto", lambda q, k: "flash"))
            stack.enter_context(flash.block_sizes(rows=blocks[0], cols=blocks[1]))
        ours = az.scaled_dot_product_attention(q, k, v, **kw)  # type: ignore[arg-type]
    theirs = F.scaled_dot_product_attention(q, k, v, **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# torch.nn.attention.bias.CausalBias: the causal pattern it names, never a float bias


@pytest.mark.parametrize(("Lq", "Lk"), [(6, 6), (3, 8), (8, 3)])
@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
def test_causal_bias_is_honoured(Lq: int, Lk: int, variant: str) -> None:
    make = causal_upper_left if variant == "upper_left" else causal_lower_right
    q = torch.randn(2, 3, Lq, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, Lk, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, Lk, 5, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that its lower_right gives NaN rows for Lq > Lk
        bias = make(Lq, Lk)
    ours = az.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert type(ours) is torch.Tensor  # not a CausalBias carried along by __torch_function__
    assert str(ours)
    offset = Lk - Lq if variant == "lower_right" else 0
    keep = torch.ones(Lq, Lk, dtype=torch.bool).tril(diagonal=offset)  # what the variant draws
    expected = az.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    rows = keep.any(dim=-1)  # torch gives NaN on rows with no key (lower_right, Lq > Lk); we give 0
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(ours[:, :, rows], theirs[:, :, rows], rtol=1e-12, atol=1e-12)
    assert not ours[:, :, ~rows].any()
    dout = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), dout), torch.autograd.grad(expected, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _spy_backend(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """Record the keyword arguments every backend call receives."""
    calls: list[dict[str, object]] = []
    real = functional._backend

    def spy(name: str):  # type: ignore[no-untyped-def]
        fn = real(name)

        def recorded(q, k, v, **kw):  # type: ignore[no-untyped-def]
            calls.append(kw)
            return fn(q, k, v, **kw)

        return recorded

    monkeypatch.setattr(functional, "_backend", spy)
    return calls


@pytest.mark.parametrize("how", ["is_causal", "upper_left", "lower_right"])
def test_square_causal_reaches_the_backend_as_causal(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Lq == Lk: both alignments are the lower triangle, passed as causal=True (backends skip the
    blocked blocks), not as a mask."""
    calls = _spy_backend(monkeypatch)
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    if how == "is_causal":
        az.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        bias = (causal_upper_left if how == "upper_left" else causal_lower_right)(9, 9)
        az.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert len(calls) == 1 and calls[0]["causal"] is True and calls[0]["mask"] is None and calls[0]["bias"] is None


def test_attn_mask_with_is_causal_is_refused() -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="is_causal: expected False when attn_mask is given"):
        az.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool), is_causal=True)
    with pytest.raises(RuntimeError, match="is_causal: expected False with a CausalBias"):
        az.scaled_dot_product_attention(q, q, q, attn_mask=causal_lower_right(4, 4), is_causal=True)
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):  # torch: ValueError
        F.scaled_dot_product_attention(q, q, q, attn_mask=causal_lower_right(4, 4), is_causal=True)


# ---------------------------------------------------------------------------------------------
# Zero sizes: torch's results, forward and backward

ZERO_CASES = {
    "B=0": ((0, 3, 4, 8), (0, 3, 5, 8), (0, 3, 5, 6)),
    "H=0": ((2, 0, 4, 8), (2, 0, 5, 8), (2, 0, 5, 6)),
    "Lq=0": ((2, 3, 0, 8), (2, 3, 5, 8), (2, 3, 5, 6)),
    "Lk=0": ((2, 3, 4, 8), (2, 3, 0, 8), (2, 3, 0, 6)),
    "D=0": ((2, 3, 4, 0), (2, 3, 5, 0), (2, 3, 5, 6)),
    "Dv=0": ((2, 3, 4, 8), (2, 3, 5, 8), (2, 3, 5, 0)),
    "D=Lk=0": ((2, 3, 4, 0), (2, 3, 0, 0), (2, 3, 0, 0)),
    "gqa_Hq=0": ((2, 0, 4, 8), (2, 3, 5, 8), (2, 3, 5, 6)),
    "2d_Lq=0": ((0, 8), (5, 8), (5, 6)),
    "2d_D=0": ((4, 0), (5, 0), (5, 6)),
    "5d_lead=0": ((2, 0, 3, 4, 8), (2, 0, 3, 5, 8), (2, 0, 3, 5, 6)),
}


@pytest.mark.parametrize("case", list(ZERO_CASES))
@pytest.mark.parametrize("extra", ["plain", "is_causal", "bool_mask", "float_mask", "scale"])
def test_zero_sizes_match_torch(case: str, extra: str) -> None:
    qs, ks, vs = ZERO_CASES[case]
    q, k, v = (torch.randn(s, dtype=torch.float64, requires_grad=True) for s in (qs, ks, vs))
    Lq, Lk = qs[-2], ks[-2]
    kw: dict[str, object] = {"enable_gqa": case.startswith("gqa")}
    if extra == "is_causal":
        kw["is_causal"] = True
    elif extra == "bool_mask":
        kw["attn_mask"] = torch.rand(Lq, Lk) < 0.7
    elif extra == "float_mask":
        kw["attn_mask"] = torch.randn(Lq, Lk, dtype=torch.float64)
    elif extra == "scale":
        kw["scale"] = 0.3
    theirs = F.scaled_dot_product_attention(q, k, v, **kw)  # type: ignore[arg-type]
    ours = az.scaled_dot_product_attention(q, k, v, **kw)  # type: ignore[arg-type]
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12, equal_nan=True)
    dout = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), dout), torch.autograd.grad(theirs, (q, k, v), dout)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
