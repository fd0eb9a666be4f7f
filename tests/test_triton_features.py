"""backend="triton", issue 13's features: softcap, window sides of any sign, segment masks that are
never densified, head dims beyond the tiles, and a backward from sink-folded (out, lse).

The backend functions (``triton_backend.attention`` / ``forward`` / ``backward`` / ``decode``) are
called directly and judged by attnzero.testing's rule against an independent formula written here
(``formula``: explicit repeat of K/V heads, torch.tanh, a dense keep-mask from torch.tril/triu or
from the ids, torch.softmax): the golden is the formula in float64 on the inputs rounded to dtype X,
and "the reference in X" is the same formula run as the reference backend runs X (float32 scores and
softmax, P rounded to X before P·V). Under Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1)
the tiles are 16×16, so lengths of 17-40 cross query and key blocks, ragged last blocks and whole
skipped blocks; shapes stay tiny because the interpreter is slow.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from conftest import check_against_golden, dense_keep, grad_units, qkv, random_keep, round_to
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

import attnzero as az
from attnzero import dropout as az_dropout
from attnzero import masks, sinks
from attnzero.testing import assert_close_to_golden, assert_reference_sane, magnitude

if os.environ.get("CI") == "true":
    import triton  # CI installs triton: its absence must fail, not skip
else:
    triton = pytest.importorskip("triton", reason="backend='triton' needs `pip install triton`")

import triton.language as tl

from attnzero.kernels import forward as fwd_k
from attnzero.kernels import triton_backend as tb

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
DTYPE_IDS = {F16: "f16", BF16: "bf16", F32: "f32"}


# ---------------------------------------------------------------------------------------------
# Segment masks: a Mask whose ``segments`` are known (ids per query and per key, pair kept iff equal)


def segment_keep(mask: masks.Mask) -> Tensor:
    """The keep-mask of a segments mask from its ids alone, (B|1, 1, Lq|1, Lk|1): the formula's,
    independent of the mask's predicate."""
    seg = mask.segments
    assert seg is not None, f"{mask!r} has no segments"
    return seg.q_ids[:, None, :, None] == seg.k_ids[:, None, None, :]


def refuse_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on, evaluating any Mask's predicate (densifying it) fails the test."""

    def refuse(*args: Any, **kw: Any) -> Tensor:
        raise AssertionError("a segment mask was evaluated (densified)")

    monkeypatch.setattr(masks.Mask, "to_tensor", refuse)
    monkeypatch.setattr(masks.Mask, "block", refuse)
    monkeypatch.setattr(masks.Mask, "__call__", refuse)


@pytest.fixture
def never_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """A segment mask must reach the kernels as ids: evaluating the predicate fails the test."""
    refuse_dense(monkeypatch)


# ---------------------------------------------------------------------------------------------
# The independent formula and one comparison by the tolerance rule


def formula(
    q: Tensor, k: Tensor, v: Tensor, *, keep: Tensor | None, bias: Tensor | None, scale: float,
    softcap: float | None, drop: Tensor | None = None, dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """(out, lse) of softmax(softcap·tanh(scale·QKᵀ/softcap) + bias, blocked removed) V. Scores and
    softmax in float64 for float64 inputs, else float32; P rounded to v's dtype before P·V."""
    acc = F64 if q.dtype == F64 else F32
    G = q.shape[1] // k.shape[1]
    kh = k.to(acc).repeat_interleave(G, dim=1)  # (B, Hq, Lk, D)
    vh = v.repeat_interleave(G, dim=1)  # (B, Hq, Lk, Dv)
    s = q.to(acc) @ kh.transpose(-1, -2) * scale  # (B, Hq, Lq, Lk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(acc)
    keep = torch.ones((), dtype=torch.bool, device=q.device) if keep is None else keep.to(q.device)
    keep = keep.expand_as(s)
    row_any = keep.any(dim=-1, keepdim=True)  # (B, Hq, Lq, 1)
    s_safe = torch.where(row_any, s.masked_fill(~keep, float("-inf")), torch.zeros_like(s))
    p = torch.softmax(s_safe, dim=-1) * row_any  # fully blocked rows: 0, no NaN either way
    lse = torch.logsumexp(s.detach().masked_fill(~keep, float("-inf")), dim=-1)  # (B, Hq, Lq)
    if drop is not None:
        p = p * drop.to(q.device) / (1.0 - dropout_p)
    return p.to(v.dtype) @ vh, lse


class Case(NamedTuple):
    out: Tensor
    lse: Tensor
    grads: dict[str, Tensor]


def _run(
    fn: Callable[..., tuple[Tensor, Tensor]], dtype: torch.dtype, xs: dict[str, Tensor], dout: Tensor | None
) -> Case:
    leaves = {n: t.detach().to(dtype).clone().requires_grad_(dout is not None) for n, t in xs.items()}
    out, lse = fn(**leaves)
    grads: dict[str, Tensor] = {}
    if dout is not None:
        names = list(leaves)
        gs = torch.autograd.grad(out, [leaves[n] for n in names], dout.to(dtype), allow_unused=True)
        grads = {n: torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(names, gs)}
    return Case(out.detach(), lse.detach(), grads)


def judge(got: Case, ref: Case, gold: Case, dtype: torch.dtype, units: dict[str, float]) -> None:
    """attnzero.testing's rule on out, lse and every gradient (as conftest.check_against_golden)."""
    assert got.out.dtype == dtype and got.out.shape == gold.out.shape
    assert got.lse.dtype == F32 and got.lse.shape == gold.lse.shape
    assert_reference_sane(ref.out, gold.out)
    assert_close_to_golden(got.out, ref.out, gold.out, name="out")
    assert_close_to_golden(got.lse, ref.lse, gold.lse, kind="lse")
    for n, g in gold.grads.items():
        assert got.grads[n].dtype == dtype
        assert_reference_sane(ref.grads[n], g, kind="grad", name=f"d{n}")
        size = magnitude(g, units.get("ds", 0.0), units.get(n, 0.0))  # conftest.grad_units
        assert_close_to_golden(got.grads[n], ref.grads[n], g, kind="grad", name=f"d{n}", size=size)


def check(
    dtype: torch.dtype, B: int, Hq: int, Hkv: int, Lq: int, Lk: int, D: int, *,
    mask: Tensor | masks.Mask | None = None, bias: Tensor | None = None, causal: bool = False,
    window: tuple[int | None, int | None] | None = None, scale: float | None = None, softcap: float | None = None,
    dropout_p: float = 0.0, seed: int = 0, grads: bool = True, path: str = "attention",
    inputs: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Case:
    """The triton backend (``path``: "attention" with autograd, or "decode" without gradients) on
    inputs rounded to ``dtype`` against the formula, by the tolerance rule. Returns the backend's."""
    q, k, v = (t.to(DEVICE) for t in (qkv(B, Hq, Hkv, Lq, Lk, D) if inputs is None else inputs))
    bias = None if bias is None else bias.to(DEVICE)
    mask = mask.to(DEVICE) if isinstance(mask, Tensor) else mask
    q, k, v, bias = round_to(dtype, q, k, v, bias)
    sc = D**-0.5 if scale is None else scale
    # the formula's keep-mask: dense, from the ids, and causal / window from torch.tril / triu
    dense = segment_keep(mask) if isinstance(mask, masks.Mask) else mask
    keep = dense_keep(Lq, Lk, causal=causal, window=window)
    if dense is not None:
        keep = dense.cpu() if keep is None else dense.cpu() & keep
    drop = az_dropout.keep_mask(seed, dropout_p, (B, Hq, Lq, Lk), device=DEVICE) if dropout_p > 0 else None
    xs = {"q": q, "k": k, "v": v, **({"bias": bias} if bias is not None else {})}

    def ours(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
        kw: dict[str, Any] = dict(mask=mask, bias=bias, causal=causal, window=window, scale=sc, softcap=softcap,
                                  dropout_p=dropout_p, dropout_seed=seed)
        return tb.decode(q, k, v, **kw) if path == "decode" else tb.attention(q, k, v, **kw)

    def theirs(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return formula(q, k, v, keep=keep, bias=bias, scale=sc, softcap=softcap, drop=drop, dropout_p=dropout_p)

    dout = torch.randn(B, Hq, Lq, v.shape[-1], dtype=F64).to(dtype).to(F64).to(DEVICE) if grads else None
    gold = _run(theirs, F64, xs, dout)
    ref = _run(theirs, dtype, xs, dout)
    got = _run(ours, dtype, xs, dout)
    units: dict[str, float] = {}
    if dout is not None:  # Σ_i p_ij of every key (its largest): the golden's dV for dO = 1
        colsum = float(_run(theirs, F64, xs, torch.ones_like(dout)).grads["v"].abs().max())
        units = grad_units(q.to(F64), k.to(F64), dout, v.to(F64), colsum, sc)
    judge(got, ref, gold, dtype, units)
    return got


# ---------------------------------------------------------------------------------------------
# softcap


@triton.jit
def _tanh_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N)
    tl.store(Y + offs, fwd_k.tanh(x), mask=offs < N)


def test_tanh_is_accurate_everywhere() -> None:
    """The kernels' tanh against float64's, relative error in float32 ulps, from 1e-30 to overflow
    (both forms and the switch between them), ±0 and ±inf. The bound leaves room for CUDA's
    approximate exp2 and division (a couple of ulps each); the cancellation that the polynomial
    avoids would cost thousands of ulps near 0."""
    mags = torch.cat([torch.logspace(-30, 2, 3000, dtype=F64), torch.linspace(0.3, 0.5, 1001, dtype=F64),
                      torch.tensor([0.0, 20.0, 44.0, 89.0, 1e30, float("inf")], dtype=F64)])
    x = torch.cat([mags, -mags]).to(F32)
    y = torch.empty_like(x)
    x_d, y_d = x.to(DEVICE), y.to(DEVICE)
    _tanh_kernel[(triton.cdiv(x.numel(), 256),)](x_d, y_d, x.numel(), BLOCK=256)
    got, want = y_d.cpu().to(F64), torch.tanh(x.to(F64))
    assert not got.isnan().any()
    ulps = ((got - want).abs() / want.abs().clamp_min(torch.finfo(F32).tiny) / torch.finfo(F32).eps)
    assert float(ulps.max()) <= 8.0, (float(ulps.max()), float(x[ulps.argmax()]))
    assert torch.equal(got.sign(), want.sign())


SOFTCAP_CASES: list[tuple[str, tuple[int, ...], dict[str, Any]]] = [
    ("plain_strong", (1, 2, 2, 33, 40, 16), {"softcap": 1.5, "scale": 1.0}),
    ("causal_gqa_bias", (2, 4, 2, 21, 37, 16), {"softcap": 3.0, "causal": True, "bias": True}),
    ("lq>lk_window_mqa", (1, 3, 1, 38, 19, 8), {"softcap": 0.7, "window": (6, 2), "scale": 0.9}),
    ("weak", (1, 2, 1, 17, 17, 16), {"softcap": 50.0}),
]
SOFTCAP_PARAMS = [
    pytest.param(dtype, *case, id=f"{case[0]}-{DTYPE_IDS[dtype]}")
    for case in SOFTCAP_CASES
    for dtype in (F32, BF16, F16)
    if dtype == F32 or case[0] in ("plain_strong", "causal_gqa_bias")
]


@pytest.mark.parametrize("dtype,name,shape,kw", SOFTCAP_PARAMS)
def test_softcap(dtype: torch.dtype, name: str, shape: tuple[int, ...], kw: dict[str, Any]) -> None:
    kw = dict(kw)
    _, Hq, _, Lq, Lk, _ = shape
    if kw.pop("bias", False):
        kw["bias"] = 2.0 * torch.randn(1, Hq, Lq, Lk, dtype=F64)  # the gradient of a bias added after the cap
    check(dtype, *shape, **kw)


def test_softcap_changes_the_result() -> None:
    """The cap is really applied: the same inputs without it are far from the capped formula."""
    q, k, v = qkv(1, 1, 1, 17, 20, 16)
    capped = check(F32, 1, 1, 1, 17, 20, 16, softcap=0.5, scale=1.0, inputs=(q, k, v), grads=False)
    plain = check(F32, 1, 1, 1, 17, 20, 16, scale=1.0, inputs=(q, k, v), grads=False)
    assert float((capped.out - plain.out).abs().max()) > 0.1


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic_dq"])
def test_softcap_with_blocked_rows_mask_and_dropout(monkeypatch: pytest.MonkeyPatch, deterministic: bool) -> None:
    """Masked pairs stay blocked under the cap (tanh(-inf) = -1 would un-block them): fully blocked
    rows give 0 and -inf; with dropout the same entries are dropped in forward and backward."""
    monkeypatch.setattr(tb, "DETERMINISTIC", deterministic)
    keep = random_keep(2, 1, 29, 35)  # (B, 1, Lq, Lk)
    keep[0, 0, 4] = False
    keep[1, 0, 17:] = False  # whole rows, a whole query block
    got = check(F32, 2, 2, 1, 29, 35, 16, mask=keep.to(DEVICE), softcap=1.0, scale=1.0, dropout_p=0.3, seed=77,
                causal=True)
    assert torch.equal(got.out[1, :, 17:], torch.zeros_like(got.out[1, :, 17:]))
    assert bool(torch.isneginf(got.lse[1, :, 17:]).all())


def test_softcap_decode() -> None:
    check(F32, 2, 4, 2, 3, 70, 16, softcap=2.0, scale=1.0, causal=True, grads=False, path="decode")
    check(BF16, 1, 2, 1, 1, 45, 16, softcap=1.0, window=(20, 0), grads=False, path="decode")


# ---------------------------------------------------------------------------------------------
# Window sides of any sign (e.g. torch's top-left causal with Lk > Lq is (None, -(Lk - Lq)))


WINDOW_CASES: list[tuple[str, tuple[int, ...], dict[str, Any]]] = [
    ("top_left_causal", (1, 2, 1, 20, 37, 16), {"window": (None, -17)}),
    ("top_left_causal_gqa", (2, 4, 2, 33, 40, 8), {"window": (None, -7), "causal": True}),
    ("negative_left", (1, 2, 2, 35, 35, 16), {"window": (-3, 12)}),
    ("negative_both_sides_lq>lk", (1, 2, 1, 40, 24, 16), {"window": (-2, -1)}),
    ("negative_right_causal_left", (1, 2, 1, 30, 30, 16), {"window": (9, -4), "causal": True}),
    ("empty_band", (1, 1, 1, 21, 25, 16), {"window": (3, -5)}),
    ("huge_sides", (1, 1, 1, 19, 23, 16), {"window": (2**62, -(2**62))}),
    ("huge_negative_left", (1, 1, 1, 19, 23, 16), {"window": (-(2**62), None)}),
    ("beyond_lengths", (1, 2, 1, 18, 34, 16), {"window": (40, 25)}),
]


@pytest.mark.parametrize("name,shape,kw", [pytest.param(*c, id=c[0]) for c in WINDOW_CASES])
def test_window_sides_of_any_sign(name: str, shape: tuple[int, ...], kw: dict[str, Any]) -> None:
    check(F32, *shape, **kw)


def test_negative_window_bf16_with_softcap_and_dropout() -> None:
    check(BF16, 1, 4, 2, 23, 41, 16, window=(None, -18), softcap=2.0, dropout_p=0.2, seed=5)


def test_negative_window_decode() -> None:
    check(F32, 1, 4, 1, 4, 60, 16, window=(10, -3), grads=False, path="decode")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    Lq=st.integers(1, 40),
    Lk=st.integers(1, 40),
    causal=st.booleans(),
    left=st.one_of(st.none(), st.integers(-45, 45)),
    right=st.one_of(st.none(), st.integers(-45, 45)),
    deterministic=st.booleans(),
)
def test_property_window_sides(
    monkeypatch: pytest.MonkeyPatch, Lq: int, Lk: int, causal: bool, left: int | None, right: int | None,
    deterministic: bool,
) -> None:
    """Random lengths and sides of either sign: every kernel's block ranges and edge checks agree
    with the dense formula."""
    monkeypatch.setattr(tb, "DETERMINISTIC", deterministic)
    check(F32, 1, 2, 1, Lq, Lk, 16, causal=causal, window=(left, right))


def test_window_normalisation() -> None:
    """_window: sides that bound nothing become None, sides that keep nothing are clamped (and
    still keep nothing), by brute force over small lengths."""
    for Lq, Lk in ((1, 1), (3, 5), (6, 2)):
        for left in (None, *range(-12, 13)):
            for right in (None, *range(-12, 13)):
                for causal in (False, True):
                    wl, wr = tb._window(causal, left, right, Lq, Lk)
                    assert wl is None or -Lq <= wl < Lk - 1
                    assert wr is None or -Lk <= wr < Lq - 1
                    want = dense_keep(Lq, Lk, causal=causal, window=(left, right))
                    got = dense_keep(Lq, Lk, window=(wl, wr))
                    assert want is not None and got is not None
                    assert torch.equal(want, got), (Lq, Lk, causal, left, right, wl, wr)


# ---------------------------------------------------------------------------------------------
# Segment masks: ids compared in the kernels, blocks outside the ids' ranges never visited


def test_segment_ranges_by_brute_force() -> None:
    """_segment_ranges covers exactly the columns with an id of the block (first to last), any
    order of ids, empty blocks (lo = hi = 0) and a ragged last block."""
    gen = torch.Generator().manual_seed(3)
    for Lr, Lc, block, n_ids, sort in ((37, 29, 16, 4, True), (40, 33, 16, 6, False), (5, 70, 8, 9, False)):
        row = torch.randint(0, n_ids, (2, Lr), generator=gen)
        col = torch.randint(0, n_ids, (2, Lc), generator=gen)
        if sort:
            row, col = row.sort(dim=1).values, col.sort(dim=1).values
        got = tb._segment_ranges(row.to(torch.int32), col.to(torch.int32), block)
        assert got.dtype == torch.int32 and got.shape == (2, -(-Lr // block), 2)
        for b in range(2):
            for i in range(got.shape[1]):
                ids = row[b, i * block : (i + 1) * block]
                hit = torch.isin(col[b], ids).nonzero().flatten()
                want = (int(hit.min()), int(hit.max()) + 1) if hit.numel() else (0, 0)
                assert tuple(got[b, i].tolist()) == want, (b, i)


SEGMENT_CASES: list[tuple[str, tuple[int, ...], Callable[[], masks.Mask], dict[str, Any]]] = [
    ("documents_causal_gqa", (1, 4, 2, 37, 37, 16),
     lambda: masks.document([0] * 9 + [1] * 17 + [2] * 11), {"causal": True}),
    ("unsorted_ids", (1, 2, 1, 34, 34, 16),
     lambda: masks.document([3, 3, 1, 1, 1, 3, 7] * 4 + [1] * 6), {}),
    ("per_batch_lq<lk", (2, 2, 1, 21, 39, 8),
     lambda: masks.document([[0] * 10 + [1] * 11, [5] * 21], [[0] * 20 + [1] * 19, [4] * 18 + [5] * 21]), {}),
    ("padding_blocked_batch", (2, 2, 2, 25, 33, 16), lambda: masks.padding([30, 0], 33), {"causal": True}),
    ("ids_beyond_int32_no_match_rows", (1, 2, 1, 26, 30, 16),
     lambda: masks.document([2**40] * 12 + [-(2**50)] * 14, [2**40] * 16 + [2**40 + 1] * 14), {}),
    ("window_softcap_bias", (1, 2, 1, 33, 33, 16),
     lambda: masks.document([0] * 20 + [1] * 13), {"window": (7, 3), "softcap": 2.0, "bias": True}),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic_dq"])
@pytest.mark.parametrize("name,shape,make,kw", [pytest.param(*c, id=c[0]) for c in SEGMENT_CASES])
def test_segment_masks(
    monkeypatch: pytest.MonkeyPatch, never_dense: None, deterministic: bool, name: str, shape: tuple[int, ...],
    make: Callable[[], masks.Mask], kw: dict[str, Any],
) -> None:
    monkeypatch.setattr(tb, "DETERMINISTIC", deterministic)
    kw = dict(kw)
    if kw.pop("bias", False):
        kw["bias"] = torch.randn(1, shape[1], shape[3], shape[4], dtype=F64)
    check(F32, *shape, mask=make(), **kw)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=DTYPE_IDS.get)
def test_segment_masks_16bit_with_dropout(never_dense: None, dtype: torch.dtype) -> None:
    ids = [0] * 11 + [1] * 14 + [2] * 8
    check(dtype, 2, 2, 1, 33, 33, 16, mask=masks.document(ids), causal=True, dropout_p=0.25, seed=3)


def test_segment_mask_decode(never_dense: None) -> None:
    ids_k = [[0] * 30 + [1] * 40, [2] * 70]
    check(F32, 2, 4, 2, 3, 70, 16, mask=masks.document([[1] * 3, [2] * 3], ids_k), grads=False, path="decode")
    check(F32, 1, 2, 1, 2, 50, 16, mask=masks.document([[0, 9]], [[0] * 25 + [9] * 25]), grads=False,
          path="decode", causal=True)
    check(BF16, 2, 2, 2, 1, 40, 16, mask=masks.padding([17, 40]), grads=False, path="decode")


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic_dq"])
def test_segment_mask_skips_blocks_it_cannot_see(monkeypatch: pytest.MonkeyPatch, deterministic: bool) -> None:
    """Keys outside a program's range are never read: their values are NaN, which a visited block
    would spread (P·V with P = 0 still gives NaN, and dP = dO·Vᵀ into dK and dQ). Documents are
    aligned to the tiles: queries of document 0 see keys of document 0 only, and the second query
    block has ids that no key has (its output is 0), so no program may visit the NaN keys."""
    cfgs = [tb._blocks(kind, 16, 16, F32, DEVICE) for kind in ("fwd", "dkdv", "dq")]
    T = max(max(c["BLOCK_M"], c["BLOCK_N"]) for c in cfgs)
    q, k, v = qkv(1, 2, 1, 2 * T, 2 * T, 16)
    v[:, :, T:] = float("nan")
    mask = masks.document([0] * T + [1] * T, [0] * T + [2] * T)
    monkeypatch.setattr(tb, "DETERMINISTIC", deterministic)
    xs = [t.to(DEVICE, F32).requires_grad_() for t in (q, k, v)]
    out, lse = tb.attention(*xs, mask=mask, scale=0.25)
    out.backward(torch.randn_like(out))
    assert not out.isnan().any() and torch.equal(out[:, :, T:], torch.zeros_like(out[:, :, T:]))
    assert bool(torch.isneginf(lse[:, :, T:]).all()) and bool(torch.isfinite(lse[:, :, :T]).all())
    for t in xs:
        assert t.grad is not None and not t.grad.isnan().any()
        if t is not xs[0]:  # keys and values of document 2: seen by no query
            assert torch.equal(t.grad[:, :, T:], torch.zeros_like(t.grad[:, :, T:]))


def test_other_masks_are_still_densified() -> None:
    """A Mask without segments goes to the kernels as a dense tensor, as before."""
    ids = [0] * 9 + [1] * 17 + [2] * 10
    mask = masks.document(ids) | masks.window(36, 36, 2)  # no segments
    assert mask.segments is None
    check(F32, 1, 2, 1, 36, 36, 16, mask=mask.to_tensor(), causal=True)
    q, k, v = (t.to(DEVICE, F32) for t in qkv(1, 2, 1, 36, 36, 16))
    a = tb.forward(q, k, v, mask=mask, bias=None, causal=True, window=None, scale=0.25, dropout_p=0.0, dropout_seed=0)
    b = tb.forward(q, k, v, mask=mask.to_tensor().to(DEVICE), bias=None, causal=True, window=None, scale=0.25,
                   dropout_p=0.0, dropout_seed=0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------------------------------------
# Head dims beyond the tiles


@pytest.mark.parametrize("D,Dv", [(257, 16), (512, 512), (16, 300)])
def test_head_dims_beyond_the_tiles_are_refused(D: int, Dv: int) -> None:
    q, k, v = torch.randn(1, 1, 3, D), torch.randn(1, 1, 3, D), torch.randn(1, 1, 3, Dv)
    q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    kw: dict[str, Any] = dict(mask=None, bias=None, causal=False, window=None, scale=1.0, dropout_p=0.0,
                              dropout_seed=0)
    n = max(D, Dv)
    for call in (lambda: tb.attention(q, k, v, **kw), lambda: tb.forward(q, k, v, **kw),
                 lambda: tb.decode(q, k, v, **kw), lambda: tb.backward(q[..., :Dv], q, k, v, q[..., :Dv], q[..., 0],
                                                                       **kw)):
        with pytest.raises(ValueError, match=rf"head dim .* = {n} .*backend='flash'"):
            call()


def test_head_dim_256_still_runs() -> None:
    check(F32, 1, 1, 1, 17, 18, 256, softcap=4.0, causal=True)


# ---------------------------------------------------------------------------------------------
# Sinks: the backward from sink-folded (out, lse)


@pytest.mark.parametrize(
    "path", ["decode", "decode_compiled", "forward", "forward_grad", "score_mod", "score_mod_grad", "score_mod_decode"]
)
def test_sinks_are_folded_into_the_float32_output_then_rounded_once(path: str) -> None:
    """A 16-bit call with sinks rounds its output once: the kernels' float32 O, the sinks folded in
    (sinks.fold), then q's dtype — as the CPU kernel and flash.py do. (Before: the split-KV decode,
    the forward and the score_mod paths folded the already rounded 16-bit O and rounded it again,
    up to one more ulp.) Compared bit for bit with the fold of the same kernel's float32 output."""
    B, Hq, Hkv, D = 2, 4, 2, 32
    Lq, Lk = (3, 1100) if "decode" in path else (21, 37)
    torch.manual_seed(0)
    q, k, v = (t.to(F16).to(DEVICE) for t in qkv(B, Hq, Hkv, Lq, Lk, D))
    sink = (torch.randn(Hq, dtype=F64) * 2).to(DEVICE)
    rel = torch.randn(2 * Lk, dtype=F32, device=DEVICE)
    score_mod = (lambda s, b, h, i, j: s + rel[i - j + Lk]) if "score_mod" in path else None
    opts = {"scale": 0.3, "score_mod": score_mod, "backend": "triton", "return_lse": True}
    if path.endswith("_grad"):
        got, lse = az.attention(q.requires_grad_(), k, v, sinks=sink, **opts)
    elif path.endswith("_compiled"):  # the op path (ops._forward_kept; torch.export and vmap take it too)
        with torch.no_grad():
            got, lse = torch.compile(lambda *a: az.attention(*a, sinks=sink, **opts), backend="eager", fullgraph=True)(
                q, k, v
            )
    else:
        with torch.no_grad():
            got, lse = az.attention(q, k, v, sinks=sink, **opts)
    # the same kernels' float32 output, without sinks: (B, Hq, Lq, D)
    gen = tb.generate(score_mod, q.device, grads=False) if score_mod is not None else None
    args = tb._args(q, k, v, mask=None, bias=None, causal=False, window=None, scale=0.3, softcap=None,
                    dropout_p=0.0, dropout_seed=0)  # fmt: skip
    with torch.no_grad():
        if "decode" in path:
            out32, lse32 = tb._decode(q, k, v, *args, True, score_gen=gen)
        else:
            _, lse32, out32 = tb._forward(q, k, v, *args, True, score_gen=gen)
    want, want_lse = sinks.fold(out32, lse32, sink)
    assert got.dtype == F16 and out32.dtype == F32
    torch.testing.assert_close(got, want.to(F16), rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
def test_backward_from_sink_folded_out_and_lse(dtype: torch.dtype) -> None:
    """With sinks (a virtual key of value 0 and logit ``sink``) applied outside the kernels, the
    backward given the folded (out2, lse2) returns the gradients of the sink attention. The golden:
    the formula over one more key, k = 0, v = 0, bias = sink, kept for every row (its score 0 is
    capped to 0, then the sink is added) — fully blocked rows included, whose lse is the sink."""
    B, Hq, Hkv, Lq, Lk, D = 2, 4, 2, 23, 31, 16
    q, k, v = (t.to(DEVICE) for t in qkv(B, Hq, Hkv, Lq, Lk, D))
    q, k, v = round_to(dtype, q, k, v)
    sink = torch.randn(Hq, dtype=F64).view(1, Hq, 1, 1).expand(B, Hq, Lq, 1).to(DEVICE)  # (B, Hq, Lq, 1)
    keep = random_keep(B, 1, Lq, Lk).to(DEVICE)
    keep[1, 0, 5:9] = False  # fully blocked rows: only the sink remains
    dout = torch.randn(B, Hq, Lq, D, dtype=F64).to(dtype).to(F64).to(DEVICE)
    scale, softcap = 0.6, 3.0

    def augmented(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        zero_k = torch.zeros(B, Hkv, 1, D, dtype=k.dtype, device=k.device)
        bias = torch.cat([torch.zeros(B, Hq, Lq, Lk, dtype=F64, device=k.device), sink], dim=-1)  # (B, Hq, Lq, Lk + 1)
        keep2 = torch.cat([keep, torch.ones(B, 1, Lq, 1, dtype=torch.bool, device=k.device)], dim=-1)
        return formula(q, torch.cat([k, zero_k], 2), torch.cat([v, zero_k.to(v.dtype)], 2), keep=keep2, bias=bias,
                       scale=scale, softcap=softcap)

    xs = {"q": q, "k": k, "v": v}
    gold, ref = _run(augmented, F64, xs, dout), _run(augmented, dtype, xs, dout)

    qd, kd, vd = (t.to(DEVICE, dtype) for t in (q, k, v))
    kw: dict[str, Any] = dict(mask=keep.to(DEVICE), bias=None, causal=False, window=None, scale=scale,
                              softcap=softcap, dropout_p=0.0, dropout_seed=0)
    out, lse = tb.forward(qd, kd, vd, **kw)
    s = sink[..., 0].to(DEVICE, F32)  # (B, Hq, Lq)
    lse2 = torch.logaddexp(lse, s)  # the fold (sinks.fold): lse2 = logaddexp(lse, sink), out2 = out·exp(lse − lse2)
    out2 = (out.float() * torch.exp(lse - lse2).unsqueeze(-1)).to(dtype)
    dq, dk, dv, _ = tb.backward(dout.to(DEVICE, dtype), qd, kd, vd, out2, lse2, **kw)
    got = Case(out2, lse2, {"q": dq, "k": dk, "v": dv})
    judge(got, ref, gold, dtype, {"ds": float(dout.abs().max()) * float(v.abs().max())})
    assert bool(torch.isfinite(lse2).all())


# ---------------------------------------------------------------------------------------------
# Through az.attention: functional folds mask bands into causal / window (negative sides for a
# top-left causal), keeps segments as a Mask, and applies sinks outside the kernels; judged against
# the reference backend in float64 (conftest.check_against_golden)


def golden_az(dtype: torch.dtype, B: int, Hq: int, Hkv: int, Lq: int, Lk: int, D: int, **kw: Any) -> None:
    q, k, v = (t.to(DEVICE) for t in qkv(B, Hq, Hkv, Lq, Lk, D))
    check_against_golden("triton", dtype, q, k, v, **kw)


AZ_CASES: list[tuple[str, tuple[int, ...], Callable[[], dict[str, Any]]]] = [
    ("softcap_causal_bias", (2, 4, 2, 21, 34, 16),
     lambda: {"softcap": 2.5, "causal": True, "bias": torch.randn(1, 4, 21, 34, dtype=F64).to(DEVICE)}),
    ("softcap_sinks_blocked_rows", (2, 2, 1, 25, 30, 16),
     lambda: {"softcap": 1.5, "scale": 1.0, "sinks": torch.randn(2, dtype=F64).to(DEVICE),
              "mask": torch.arange(25).view(1, 1, 25, 1).ge(20).logical_not().expand(2, 1, 25, 30).to(DEVICE)}),
    ("per_query_sinks_dropout", (1, 2, 2, 19, 23, 16),
     lambda: {"sinks": torch.randn(1, 2, 19, dtype=F64).to(DEVICE), "dropout_p": 0.3, "seed": 11}),
    ("top_left_causal_mask_lq<lk", (1, 2, 1, 18, 37, 16),
     lambda: {"mask": masks.causal(18, 37, align="top_left"), "softcap": 4.0}),
    ("document_and_causal_mask", (2, 2, 1, 35, 35, 16),
     lambda: {"mask": masks.document([0] * 12 + [1] * 16 + [2] * 7) & masks.causal(35)}),
    ("padding_mask_sinks", (2, 2, 2, 17, 33, 8),
     lambda: {"mask": masks.padding([33, 9]), "sinks": torch.randn(2, dtype=F64).to(DEVICE), "causal": True}),
]


AZ_PARAMS = [
    pytest.param(dtype, *case, id=f"{case[0]}-{DTYPE_IDS[dtype]}")
    for case in AZ_CASES
    for dtype in (F32, BF16)
    if dtype == F32 or case[0] in ("softcap_causal_bias", "document_and_causal_mask")  # the interpreter is slow
]


@pytest.mark.parametrize("dtype,name,shape,make", AZ_PARAMS)
def test_through_az_attention(
    dtype: torch.dtype, name: str, shape: tuple[int, ...], make: Callable[[], dict[str, Any]]
) -> None:
    golden_az(dtype, *shape, **make())


def test_double_backward_with_softcap_and_segments() -> None:
    """create_graph=True: the eager rule recomputes the gradients by the formula, with the softcap
    and the segment ids (as a dense keep-mask) passed through; second-order gradients equal the
    reference's."""
    q, k, v = (t.to(DEVICE, F32).requires_grad_(True) for t in qkv(1, 2, 1, 9, 12, 8))
    b = torch.randn(1, 2, 9, 12, device=DEVICE, requires_grad=True)
    mask = masks.document([0] * 5 + [1] * 4, [0] * 7 + [1] * 5)
    second = []
    for backend in ("triton", "reference"):
        out = az.attention(q, k, v, bias=b, mask=mask, causal=True, softcap=1.5, backend=backend)  # type: ignore[arg-type]
        (gq,) = torch.autograd.grad(out.square().sum(), (q,), create_graph=True)
        assert gq.requires_grad
        second.append(torch.autograd.grad(gq.square().sum(), (q, k, v, b)))
    for got, want in zip(*second):
        assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())


def test_varlen_packed_documents(monkeypatch: pytest.MonkeyPatch) -> None:
    """az.attention_varlen with queries and keys packed alike reaches the kernels as one call with a
    segments mask (never densified), an empty sequence included; judged against the reference in
    float64 by the tolerance rule, forward and backward."""
    cu = torch.tensor([0, 7, 7, 25, 40], dtype=torch.int32, device=DEVICE)
    T, Hq, Hkv, D = 40, 4, 2, 16
    q, k, v = torch.randn(T, Hq, D, dtype=F64), torch.randn(T, Hkv, D, dtype=F64), torch.randn(T, Hkv, D, dtype=F64)
    q, k, v = round_to(F32, q, k, v)
    dout = torch.randn(T, Hq, D, dtype=F64).to(F32).to(F64)

    def run(backend: str, dtype: torch.dtype) -> Case:
        xs = [t.detach().to(DEVICE, dtype).clone().requires_grad_() for t in (q, k, v)]
        out, lse = az.attention_varlen(*xs, cu, cu, causal=True, softcap=2.0, backend=backend,  # type: ignore[arg-type]
                                       return_lse=True)
        gs = torch.autograd.grad(out, xs, dout.to(DEVICE, dtype))
        return Case(out.detach(), lse.detach(), dict(zip("qkv", gs)))

    gold, ref = run("reference", F64), run("reference", F32)  # the reference evaluates the document mask
    refuse_dense(monkeypatch)  # the triton backend must not
    got = run("triton", F32)
    judge(got, ref, gold, F32, {"ds": float(dout.abs().max()) * float(v.abs().max())})


@pytest.mark.parametrize("value", [-1e9, -1e6, float(torch.finfo(torch.float32).min)], ids=["1e9", "1e6", "finfo"])
def test_rows_whose_whole_bias_is_huge_get_the_references_results(value: float) -> None:
    """A fully masked row written additively (−1e6, −1e9, finfo.min): its lse ≈ the bias keeps no
    bits of log Lk in float32, so its backward runs on flash.py (which shifts the row by its lse);
    the forward rounds q·k away as the float32 reference does (an ulp of 64 at −1e9: the golden keeps
    it, so those rows are held to the float32 reference; at finfo.min the golden rounds it away too,
    and the tolerance rule applies). Forward and backward, the bias's gradient included."""
    from conftest import check_against_golden, run_attention

    q, k, v, dout = (torch.randn(1, 2, 9, 8, dtype=torch.float64) for _ in range(4))
    bias = torch.zeros(1, 1, 9, 9, dtype=torch.float64)
    bias[..., 3, :] = value
    bias[..., 5, 4:] = value
    if value == torch.finfo(torch.float32).min:
        check_against_golden("triton", torch.float32, q, k, v, bias=bias)
        return
    ref = run_attention("reference", torch.float32, q, k, v, dout, bias=bias)
    got = run_attention("triton", torch.float32, q, k, v, dout, bias=bias)
    torch.testing.assert_close(got.out, ref.out, rtol=1e-4, atol=1e-4)
    for name in ("q", "k", "v", "bias"):
        torch.testing.assert_close(got.grads[name], ref.grads[name], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("value", [-1e9, float(torch.finfo(torch.float32).min)], ids=["1e9", "finfo"])
def test_the_plain_backward_of_rows_whose_whole_bias_is_huge(value: float) -> None:
    """The backend interface's backward gets only (out, lse) — here with a sink folded in — and sends
    rows whose lse needs a shift to flash.py, which recomputes the shifted lse (plus what the given
    lse adds: the sink)."""
    from conftest import check_against_golden

    q, k, v = (torch.randn(1, 2, 9, 8, dtype=torch.float64) for _ in range(3))
    bias = torch.zeros(1, 1, 9, 9, dtype=torch.float64)
    bias[..., 3, :] = value
    check_against_golden("triton", torch.float32, q, k, v, bias=bias, sinks=torch.randn(2, dtype=torch.float64))


def test_a_compiled_call_sends_rows_that_need_a_shift_to_flash_too() -> None:
    """Under torch.compile the op's backward cannot be told in advance (``_FarRows`` is eager only):
    the backward op looks at the lse itself. A left-padded additive mask with causal, whose first
    rows keep only finfo.min keys: compiled gradients equal the eager ones and the reference's."""
    B, H, L, D, pad = 2, 2, 12, 16, 5
    q, k, v = (torch.randn(B, H, L, D).to(DEVICE) for _ in range(3))
    real = torch.arange(L, device=DEVICE) >= pad
    bias = torch.where(real, 0.0, torch.finfo(torch.float32).min).view(1, 1, 1, L).expand(B, 1, L, L).contiguous()

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return az.attention(q, k, v, bias=bias, causal=True, backend="triton")  # type: ignore[return-value]

    grads = {}
    for name, fn in (("reference", None), ("eager", f), ("compiled", torch.compile(f, fullgraph=True))):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = az.attention(*xs, bias=bias, causal=True, backend="reference") if fn is None else fn(*xs)
        grads[name] = torch.autograd.grad(out.square().sum(), xs)
    for name in ("eager", "compiled"):
        for got, want in zip(grads[name], grads["reference"]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
