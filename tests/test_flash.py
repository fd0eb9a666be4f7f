"""What is particular to the flash backend (the golden suite in test_reference.py covers every
argument on it too): the plain forward/backward functions, block boundaries at awkward sizes with
tiny forced blocks, skipped blocks, dropout equal to the reference's, float64 exactness, the running
max rebase, and what backend="auto" picks."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from conftest import qkv, randn, torch_threads

import attnzero as az
from attnzero import flash, functional, reference
from attnzero.testing import assert_close_to_golden

F64 = torch.float64


def ref_grads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, bias: torch.Tensor | None = None, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
    """Reference (out, lse, [dq, dk, dv, dbias]) by autograd through reference.attention."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    b = None if bias is None else bias.detach().clone().requires_grad_(True)
    out, lse = reference.attention(*leaves, bias=b, **kw)
    wrt = [*leaves] + ([b] if b is not None else [])
    gs = torch.autograd.grad(out, wrt, dout, allow_unused=True)
    return out.detach(), lse.detach(), [*gs] + ([None] if b is None else [])


def options(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "mask": None,
        "causal": False,
        "window": None,
        "scale": 0.3,
        "dropout_p": 0.0,
        "dropout_seed": 0,
    }
    return {**base, **kw}


def assert_close(a: torch.Tensor | None, b: torch.Tensor | None, tol: float = 1e-12, name: str = "") -> None:
    assert a is not None and b is not None, name
    assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
    assert not torch.isnan(a).any(), f"{name}: NaN"
    same_inf = torch.isinf(b) & (a == b)
    err = torch.where(same_inf, 0.0, (a - b).abs()).max().item()
    assert err <= tol * max(1.0, b[torch.isfinite(b)].abs().max().item()), f"{name}: error {err:.2e}"


# (B, Hq, Hkv, Lq, Lk, D, Dv) and forced (rows, cols): blocks that do not divide the lengths,
# a single row, more rows than keys and the other way round, GQA and MQA.
CASES = [
    ((2, 4, 2, 37, 53, 16, 24), (8, 16)),
    ((1, 3, 1, 1, 29, 8, 8), (4, 5)),
    ((2, 2, 2, 41, 7, 8, 12), (16, 3)),
    ((1, 6, 3, 23, 23, 8, 8), (5, 7)),
]
ARGS = [
    {},
    {"causal": True},
    {"window": (5, 2)},
    {"window": (None, 0), "causal": True},
    {"window": (3, None)},
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[0])))
@pytest.mark.parametrize("args", ARGS, ids=lambda a: "-".join(a) or "full")
def test_plain_functions_match_reference_with_tiny_blocks(case: Any, args: dict[str, Any]) -> None:
    """flash.forward / flash.backward called directly, against autograd of the reference, float64."""
    (B, Hq, Hkv, Lq, Lk, D, Dv), (rows, cols) = case
    q, k, v = qkv(B, Hq, Hkv, Lq, Lk, D, Dv)
    bias = torch.randn(1, Hq, Lq, Lk, dtype=F64)
    keep = torch.rand(B, 1, Lq, Lk) < 0.8
    dout = torch.randn(B, Hq, Lq, Dv, dtype=F64)
    kw = options(mask=keep, **args)
    out_r, lse_r, g_r = ref_grads(q, k, v, dout, bias, **kw)
    with flash.block_sizes(rows=rows, cols=cols):
        out, lse = flash.forward(q, k, v, bias=bias, **kw)
        grads = flash.backward(dout, q, k, v, out, lse, bias=bias, **kw)
    assert_close(out, out_r, name="out")
    assert_close(lse, lse_r, name="lse")
    for name, g, want in zip(["dq", "dk", "dv", "dbias"], grads, g_r):
        assert_close(g, want, tol=1e-11, name=name)


@pytest.mark.parametrize("bias_shape", [(1, 1, 1, 19), (2, 1, 13, 1), (2, 4, 13, 19), (1, 4, 1, 1)])
def test_bias_gradient_reduced_to_its_broadcast_shape(bias_shape: tuple[int, ...]) -> None:
    q, k, v = qkv(2, 4, 2, 13, 19, 8)
    bias = torch.randn(*bias_shape, dtype=F64)
    dout = torch.randn(2, 4, 13, 8, dtype=F64)
    _, _, g_r = ref_grads(q, k, v, dout, bias, **options(causal=True))
    with flash.block_sizes(rows=4, cols=6):
        out, lse = flash.forward(q, k, v, bias=bias, **options(causal=True))
        *_, dbias = flash.backward(dout, q, k, v, out, lse, bias=bias, **options(causal=True))
    assert_close(dbias, g_r[3], tol=1e-11, name="dbias")
    _, _, _, none = flash.backward(dout, q, k, v, out, lse, bias=None, **options(causal=True))
    assert none is None


def test_float64_exact_at_default_blocks() -> None:
    """float64 keeps float64 everywhere (lse included): ~1e-12 of the reference at a size that
    spans several default blocks."""
    q, k, v = qkv(1, 2, 1, 700, 1100, 64)
    dout = torch.randn(1, 2, 700, 64, dtype=F64)
    out_r, lse_r, g_r = ref_grads(q, k, v, dout, **options(causal=True, scale=0.125))
    out, lse = flash.forward(q, k, v, bias=None, **options(causal=True, scale=0.125))
    assert lse.dtype == F64
    dq, dk, dv, _ = flash.backward(dout, q, k, v, out, lse, bias=None, **options(causal=True, scale=0.125))
    assert_close(out, out_r, name="out")
    assert_close(lse, lse_r, name="lse")
    for name, g, want in zip(["dq", "dk", "dv"], (dq, dk, dv), g_r):
        assert_close(g, want, name=name)


def test_causal_skips_the_blocks_above_the_diagonal() -> None:
    """With 16 × 16 blocks over L = 128, full attention visits 8 × 8 blocks and causal only the
    8 · 9 / 2 on or below the diagonal — forward and backward."""
    q, k, v = qkv(1, 2, 2, 128, 128, 8)
    dout = torch.randn(1, 2, 128, 8, dtype=F64)
    visited = {}
    with flash.block_sizes(rows=16, cols=16):
        for causal in (False, True):
            for key in flash.COUNTS:
                flash.COUNTS[key] = 0
            out, lse = flash.forward(q, k, v, bias=None, **options(causal=causal))
            flash.backward(dout, q, k, v, out, lse, bias=None, **options(causal=causal))
            visited[causal] = dict(flash.COUNTS)
    assert visited[False]["forward"] == visited[False]["backward"] == 64
    assert visited[True]["forward"] == visited[True]["backward"] == 36


def test_window_visits_only_the_band() -> None:
    """A window (left 16, right 0) over L = 256 with 16-wide blocks: at most 3 key blocks per row
    block (the diagonal one and the ones the window reaches back into)."""
    q, k, v = qkv(1, 1, 1, 256, 256, 8)
    flash.COUNTS["forward"] = 0
    with flash.block_sizes(rows=16, cols=16):
        out, _ = flash.forward(q, k, v, bias=None, **options(window=(16, 0)))
    assert flash.COUNTS["forward"] <= 3 * 16
    want, _ = reference.attention(q, k, v, window=(16, 0), scale=0.3)
    assert_close(out, want, name="out")


def test_a_mask_object_is_evaluated_only_on_the_needed_blocks() -> None:
    """A Mask is read per block, and never on a block that causal already rules out."""
    Lq, Lk = 40, 64
    seen: list[tuple[int, int, int, int]] = []
    inner = az.masks.document(torch.arange(Lk) // 10, None)  # 10-token documents

    def keep(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        seen.append((int(qi.min()), int(qi.max()), int(kv.min()), int(kv.max())))
        return inner.keep(b, h, qi + (Lk - Lq), kv)

    mask = az.Mask(keep, (1, 1, Lq, Lk), "recording")
    q, k, v = qkv(1, 2, 2, Lq, Lk, 8)
    with flash.block_sizes(rows=8, cols=8):
        out, _ = flash.forward(q, k, v, bias=None, **options(mask=mask, causal=True))
    assert seen, "the mask was never evaluated"
    for q0, q1, k0, k1 in seen:
        assert q1 - q0 < 8 and k1 - k0 < 8, "evaluated on more than one block at a time"
        assert k0 <= q1 + (Lk - Lq), f"evaluated on block rows {q0}..{q1} × keys {k0}..{k1} above the diagonal"
    want, _ = reference.attention(q, k, v, mask=mask.to_tensor(), causal=True, scale=0.3)
    assert_close(out, want, name="out")


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_dropout_drops_the_same_entries_as_the_reference(dtype: torch.dtype) -> None:
    """Same seed → the same dropped entries as backend="reference", forward and backward, also
    with GQA, causal, tiny blocks and chunks of single heads."""
    q, k, v = (t.to(dtype).requires_grad_(True) for t in qkv(2, 4, 2, 29, 35, 16, 8))
    dout = torch.randn(2, 4, 29, 8, dtype=dtype)
    res = {}
    for backend in ("reference", "flash"):
        torch.manual_seed(1234)
        with flash.block_sizes(rows=8, cols=8):
            out = az.attention(q, k, v, causal=True, dropout_p=0.4, backend=backend)
            assert isinstance(out, torch.Tensor)
            res[backend] = (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))
    tol = 1e-12 if dtype == F64 else 2e-5
    for name, a, b in zip(["out", "dq", "dk", "dv"], res["flash"], res["reference"]):
        assert_close(a, b, tol=tol, name=name)
    # and dropout did drop: a different seed gives a different output
    torch.manual_seed(99)
    other = az.attention(q, k, v, causal=True, dropout_p=0.4, backend="flash")
    assert isinstance(other, torch.Tensor)
    assert not torch.allclose(other, res["flash"][0])


def test_fully_blocked_rows_give_zero_and_zero_gradients() -> None:
    """Rows with no key (left padding of a query block, causal with Lq > Lk, a −inf bias row):
    output 0, lse −inf, zero gradients, never NaN — also when a block in the middle of a row is
    all blocked (the running max must not be poisoned by it)."""
    B, H, Lq, Lk = 1, 2, 24, 16
    q, k, v = (t.requires_grad_(True) for t in qkv(B, H, H, Lq, Lk, 8))
    keep = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
    keep[..., 3, :] = False  # one row blocked by the mask
    keep[..., 12:20, 4:8] = False  # a block in the middle of some rows
    bias = torch.zeros(1, 1, Lq, Lk, dtype=F64)
    bias[..., 20, :] = float("-inf")  # one row blocked by the bias
    with flash.block_sizes(rows=4, cols=4):
        out, lse = az.attention(q, k, v, mask=keep, bias=bias, causal=True, backend="flash", return_lse=True)
        out.sum().backward()
    blocked = torch.zeros(Lq, dtype=torch.bool)
    blocked[: Lq - Lk] = True  # causal, bottom-right: the first Lq - Lk rows see nothing
    blocked[3] = blocked[20] = True
    assert torch.equal(torch.isinf(lse[0, 0]), blocked)
    assert (out[:, :, blocked] == 0).all() and not torch.isnan(out).any()
    assert q.grad is not None and (q.grad[:, :, blocked] == 0).all() and not torch.isnan(q.grad).any()
    want, want_lse = reference.attention(
        q.detach(), k.detach(), v.detach(), mask=keep, bias=bias, causal=True, scale=8**-0.5
    )
    assert_close(out.detach(), want, name="out")
    assert_close(lse, want_lse, name="lse")


@pytest.mark.parametrize("backend", ["flash", "reference"])
def test_a_nan_score_gives_nan_rows_out_and_lse(backend: str) -> None:
    """A NaN key: every row that sees it has a NaN row sum, so a NaN output and lse, as torch's — not
    lse −inf (a row without keys, whose backward gives zero gradients), and not acc / 1 where dropout
    dropped the NaN's p from acc (flash.py took a NaN l for l = 0)."""
    q, k, v = (torch.randn(1, 1, 32, 16, dtype=F64) for _ in range(3))
    k[0, 0, 5, 0] = float("nan")
    for p in (0.0, 0.5):
        with flash.block_sizes(rows=8, cols=8):
            out, lse = az.attention(q, k, v, dropout_p=p, backend=backend, return_lse=True)
        assert bool(out.isnan().any(-1).all()) and bool(lse.isnan().all()), (p, int(out.isnan().any(-1).sum()))


def test_scores_growing_far_past_the_first_block_move_the_running_max() -> None:
    """Scores far too large for exp without a max (a later key block ~200× the first): the running
    max moves at the jump, alpha rescales what the first blocks gave, and the result stays exact
    (no overflow, no lost mass)."""
    q, k, v = qkv(1, 1, 1, 8, 64, 4)
    q = q.abs()
    k = k.abs()
    k[..., 32:, :] *= 200.0  # scores of the second half are ~200× larger
    want, want_lse = reference.attention(q, k, v, scale=1.0)
    with flash.block_sizes(rows=8, cols=16):
        out, lse = flash.forward(q, k, v, bias=None, **options(scale=1.0))
    assert_close(out, want, name="out")
    assert_close(lse, want_lse, name="lse")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_low_precision_keeps_float32_statistics(dtype: torch.dtype) -> None:
    q, k, v = (t.to(dtype) for t in qkv(1, 2, 1, 50, 70, 16))
    out, lse = flash.forward(q, k, v, bias=None, **options(causal=True))
    assert out.dtype == dtype and lse.dtype == torch.float32
    want, want_lse = reference.attention(*(t.double() for t in (q, k, v)), causal=True, scale=0.3)
    ref_lp, ref_lse = reference.attention(q, k, v, causal=True, scale=0.3)
    # size=1: this test always held the output to one rounding of 1, not of max(1, |out|)
    assert_close_to_golden(out, ref_lp, want, size=1.0)
    assert_close_to_golden(lse, ref_lse, want_lse, kind="lse")


def test_attention_entry_is_differentiable_and_lse_is_not() -> None:
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 2, 2, 9, 9, 8))
    out, lse = flash.attention(q, k, v, scale=0.3)
    assert out.requires_grad and not lse.requires_grad
    assert torch.autograd.gradcheck(
        lambda a, b, c: flash.attention(a, b, c, causal=True, scale=0.3)[0], (q, k, v), fast_mode=True
    )
    with torch.no_grad():
        out2, _ = flash.attention(q, k, v, scale=0.3)
    assert out2.grad_fn is None and torch.equal(out2, out.detach())


def test_auto_picks_flash_on_the_cpu_at_every_size(caplog: pytest.LogCaptureFixture) -> None:
    tiny = torch.randn(1, 1, 8, 8)
    big = torch.randn(1, 1, 512, 8)
    with caplog.at_level(logging.DEBUG, logger="attnzero"):
        assert functional._auto(tiny, tiny) == "flash"
        assert functional._auto(big, big) == "flash"
    assert "'flash'" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, causal",
    [
        ((1, 1, 1, 16, 16, 64), False),  # the tiny call
        ((3, 4, 2, 7, 13, 5), False),  # GQA, awkward sizes
        ((2, 6, 3, 9, 9, 8), True),
        ((2, 2, 1, 5, 11, 8), True),  # causal with Lq < Lk: bottom-right
        ((1, 1, 1, 1, 300, 8), True),  # decode-like
    ],
)
def test_keys_in_one_block_match_the_reference(shape, causal, dtype) -> None:  # type: ignore[no-untyped-def]
    """Every row's keys in one block (the tiny call, GQA at awkward sizes, causal with Lq < Lk, a
    decode step) with 1 and 2 torch threads: the tolerance rule of the float64 reference (float64
    to 1e-12); the output is the same whether the lse is asked for or not."""
    B, Hq, Hkv, Lq, Lk, D = shape
    q, k, v = (t.to(dtype) for t in qkv(B, Hq, Hkv, Lq, Lk, D))
    gold, gold_lse = reference.attention(q.double(), k.double(), v.double(), causal=causal, scale=D**-0.5)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, scale=D**-0.5)
    for threads in (1, 2):
        with torch_threads(threads), torch.no_grad():
            got, _ = flash.attention(q, k, v, causal=causal, scale=D**-0.5, need_lse=False)
            got2, lse2 = flash.attention(q, k, v, causal=causal, scale=D**-0.5)
        assert lse2 is not None and torch.equal(got, got2)
        assert got.dtype == dtype and got.shape == (B, Hq, Lq, D)
        if dtype == torch.float64:
            assert_close(got, gold, name="out")
            assert_close(lse2, gold_lse, name="lse")
        else:
            assert_close_to_golden(got, ref, gold, name="out")
            assert_close_to_golden(lse2, ref_lse, gold_lse, kind="lse", name="lse")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("largest", [1e-30, 1e18, 1e38])
def test_one_key_block_at_the_edges_of_float32(largest: float, threads: int) -> None:
    """Scores near float32's largest and smallest values (q scaled so that the largest |score| is
    ``largest``: at 1e38 anything taken before subtracting the max would overflow; at 1e-30 every
    score is ~0): no overflow, and the tolerance rule against the float64 golden. (Not 3e38: there
    float32's own matmul, the reference's too, can round a score to inf.)"""
    for heads in (1, 2):
        q, k, v = (t.float() for t in qkv(1, heads, heads, 16, 16, 64))
        q = q * (largest / float((q.double() @ k.double().transpose(-2, -1)).abs().max()))
        gold, gold_lse = reference.attention(q.double(), k.double(), v.double(), scale=1.0)
        ref, ref_lse = reference.attention(q, k, v, scale=1.0)
        with torch_threads(threads), torch.no_grad():
            got, lse = flash.attention(q, k, v, scale=1.0)
        assert lse is not None
        assert_close_to_golden(got, ref, gold, name="out")
        assert_close_to_golden(lse, ref_lse, gold_lse, kind="lse", name="lse")


def test_rows_that_could_be_fully_blocked_in_one_key_block() -> None:
    """A mask, a bias, a window or causal with Lq > Lk that block whole rows of a problem whose keys
    fit one block: those rows are 0, never NaN, the others the reference's."""
    q, k, v = qkv(1, 2, 2, 6, 4, 8)
    cases = [
        dict(mask=torch.zeros(1, 1, 6, 4, dtype=torch.bool)),
        dict(bias=torch.full((1, 1, 6, 4), float("-inf"))),
        dict(window=(0, 0)),
        dict(causal=True),  # Lq = 6 > Lk = 4: the first two rows see nothing
    ]
    for kw in cases:
        with torch.no_grad():
            got, _ = flash.attention(q, k, v, scale=0.3, need_lse=False, **kw)
        want, _ = reference.attention(q, k, v, scale=0.3, **kw)
        assert not got.isnan().any()
        assert_close(got, want, name=str(kw))


def test_concurrent_calls_from_threads_are_right_and_restore_torch_threads() -> None:
    """Calls made at the same time from several Python threads give the right result, and torch's
    thread setting is left as it was."""
    q, k, v = qkv(1, 4, 2, 600, 600, 16)
    want, _ = reference.attention(q, k, v, causal=True, scale=0.3)
    before = torch.get_num_threads()
    errs: list[float] = []

    def run() -> None:
        for _ in range(3):
            out, _ = flash.forward(q, k, v, bias=None, **options(causal=True))
            errs.append((out - want).abs().max().item())

    workers = [threading.Thread(target=run) for _ in range(3)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert len(errs) == 9 and max(errs) < 1e-12
    assert torch.get_num_threads() == before


@contextmanager
def deterministic() -> Iterator[None]:
    """torch.use_deterministic_algorithms(True) for the duration."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def test_backward_is_bitwise_reproducible_under_use_deterministic_algorithms() -> None:
    """GQA + causal: under the flag, dq / dk / dv are the same bits on every run."""
    q, k, v = (t.float() for t in qkv(1, 8, 2, 700, 700, 16))
    dout = torch.randn(1, 8, 700, 16)
    runs = []
    with flash.block_sizes(rows=64), deterministic():
        for _ in range(3):
            out, lse = flash.forward(q, k, v, bias=None, **options(causal=True))
            runs.append(flash.backward(dout, q, k, v, out, lse, bias=None, **options(causal=True))[:3])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["nan_key", "inf_bias"])
def test_blocked_pairs_stay_blocked_whatever_their_score(case: str) -> None:
    """A pair that causal blocks does not matter even when its score is NaN or +inf (a NaN in a
    future key, a +inf bias there), as in the reference: the causal edge is then masked after the
    scores instead of entering the matmul as a −inf tile."""
    q, k, v = qkv(1, 2, 2, 40, 40, 8)
    bias = None
    if case == "nan_key":
        k[:, :, 30] = float("nan")  # only rows ≥ 30 see key 30
    else:
        bias = torch.zeros(1, 1, 40, 40, dtype=F64)
        bias[..., 5, 7] = float("inf")  # blocked for row 5, in a block that is visited
    dout = torch.randn(1, 2, 40, 8, dtype=F64)
    want_out, want_lse, want = ref_grads(q, k, v, dout, bias=bias, causal=True, scale=0.3)
    with flash.block_sizes(rows=8, cols=16):
        out, lse = flash.forward(q, k, v, bias=bias, **options(causal=True))
        dq, dk, dv, _ = flash.backward(dout, q, k, v, out, lse, bias=bias, **options(causal=True))
    rows = slice(0, 30) if case == "nan_key" else slice(None)  # the rows the reference keeps finite
    assert torch.isfinite(want_out[:, :, rows]).all()
    assert_close(out[:, :, rows], want_out[:, :, rows], name="out")
    assert_close(lse[:, :, rows], want_lse[:, :, rows], name="lse")
    if case == "inf_bias":  # (a NaN key makes dQ = dS·K NaN everywhere, in the reference too)
        for name, got, exp in zip(("dq", "dk", "dv"), (dq, dk, dv), want[:3]):
            assert_close(got, exp, name=name)


# ---------------------------------------------------------------------------------------------
# Scores of any size: the online softmax is exact for any finite scores (issue 11: NaN when every score a row saw in its
# first key block was below float32 exp's underflow).


def _check_f32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None, **kw: Any) -> None:
    """flash in float32 against the float64 reference by the tolerance rule (2× the float32
    reference's error, plus one float32 rounding: FLOOR)."""
    f = [t.float() for t in (q, k, v)]
    b = None if bias is None else bias.float()
    want, want_lse = reference.attention(q, k, v, bias=bias, **options(**kw))
    ref32, ref32_lse = reference.attention(*f, bias=b, **options(**kw))
    with flash.block_sizes(rows=16, cols=16):
        out, lse = flash.forward(*f, bias=b, **options(**kw))
    assert_close_to_golden(out, ref32, want, name="out")
    assert_close_to_golden(lse, ref32_lse, want_lse, kind="lse", name="lse")


@pytest.mark.parametrize("bias", [-100.0, -1e4, -3e38])
def test_scores_below_exp_underflow_give_the_reference(bias: float) -> None:
    """Every score far below −88 (float32 exp underflows): the softmax is still well defined."""
    q, k, v = qkv(1, 2, 1, 40, 50, 16)
    _check_f32(q, k, v, torch.tensor(bias, dtype=F64).view(1, 1, 1, 1))
    _check_f32(q, k, v, torch.tensor(bias, dtype=F64).view(1, 1, 1, 1), causal=True)


def test_one_row_scaled_far_under_alibi_at_long_range() -> None:
    """ALiBi at long range with one query row scaled ×20: that row's first key block lies far below
    the rest (issue 11 saw NaN rows here)."""
    q, k, v = qkv(1, 4, 4, 300, 300, 16)
    q[:, :, 200] *= 20.0
    q[:, :, 10] *= -20.0
    _check_f32(q, k, v, az.masks.alibi(4, 300).double(), causal=True, scale=0.25)


@pytest.mark.parametrize("factor", [1e30, 1e-30, 1e-40], ids=["v*1e30", "v*1e-30", "v*1e-40"])
def test_values_far_from_one_give_the_reference(factor: float) -> None:
    q, k, v = qkv(2, 2, 1, 33, 70, 8)
    _check_f32(q, k, v * factor, causal=True)
    _check_f32(q * 4, k, v * factor)


def test_scores_far_above_and_rows_with_no_key_yet() -> None:
    """Huge positive scores (exp would overflow without a max), with rows whose first blocks are
    fully blocked by a mask and rows blocked entirely."""
    q, k, v = qkv(1, 1, 1, 40, 64, 8)
    keep = torch.ones(1, 1, 40, 64, dtype=torch.bool)
    keep[..., :20, :32] = False  # the first 20 rows see nothing in the first key blocks
    keep[..., 5, :] = False  # row 5 sees nothing at all
    _check_f32(q * 30, k * 30, v, mask=keep)


def test_inference_mode_gives_the_same_result() -> None:
    """Serving code runs under torch.inference_mode: the result is the same as without it — through
    flash, auto and the module — and a training step afterwards works."""
    q, k, v = (t.float() for t in qkv(1, 8, 8, 300, 300, 16))
    with flash.block_sizes(rows=64):
        want = flash.forward(q, k, v, bias=None, **options(causal=True))[0]
        want_auto = az.attention(q, k, v, causal=True, scale=0.3, backend="auto")
    with flash.block_sizes(rows=64), torch.inference_mode():
        out, _ = flash.attention(q, k, v, causal=True, scale=0.3)
        auto = az.attention(q, k, v, causal=True, scale=0.3, backend="auto")
        mha = az.MultiHeadAttention(32, 4, dropout=0.0)
        y = mha(torch.randn(2, 300, 32), causal=True)
    assert torch.equal(out, want) and torch.equal(auto, want_auto)
    assert y.shape == (2, 300, 32) and torch.isfinite(y).all()
    # and a training step afterwards
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with flash.block_sizes(rows=64):
        flash.attention(*leaves, causal=True, scale=0.3)[0].sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_double_backward_gives_a_differentiable_gradient(bias: bool) -> None:
    """create_graph=True (a gradient penalty): the gradient has a graph, and its own gradient is the
    reference's; gradgradcheck agrees with finite differences."""
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 2, 1, 7, 9, 4))
    b = torch.randn(1, 2, 7, 9, dtype=F64, requires_grad=True) if bias else None
    inputs = (q, k, v) + ((b,) if b is not None else ())

    def penalty(backend: str) -> list[torch.Tensor]:
        out = az.attention(q, k, v, bias=b, causal=True, backend=backend)  # type: ignore[arg-type]
        assert isinstance(out, torch.Tensor)
        gq, gk = torch.autograd.grad(out.square().sum(), (q, k), create_graph=True)
        assert gq.requires_grad and gk.requires_grad
        return list(torch.autograd.grad(gq.square().sum() + gk.sum(), inputs))

    for got, want in zip(penalty("flash"), penalty("reference")):
        assert_close(got, want, name="second-order gradient")

    def fn(*xs: torch.Tensor) -> torch.Tensor:
        return flash.attention(xs[0], xs[1], xs[2], bias=xs[3] if bias else None, causal=True, scale=0.4)[0]

    assert torch.autograd.gradgradcheck(fn, inputs, fast_mode=True)


FINFO32_MIN = torch.finfo(torch.float32).min


@pytest.mark.parametrize("how", ["padding_bias_causal", "mask_hides_the_max", "mask_hides_the_max_1e9", "mod"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("backend", ["flash", "triton"])
def test_rows_that_keep_only_huge_negative_scores_get_the_references_gradients(
    how: str, dtype: torch.dtype, backend: str
) -> None:
    """A left-padded batch's additive mask (finfo.min on the padded keys, 0 on the others) with
    causal: the first rows keep only padded keys, while their bias's largest entry, 0, sits on a key
    that causal blocks. So does a −1e9 bias whose 0s are where a mask blocks, and a mod that writes
    finfo.min. Such a row's lse (≈ finfo.min + log n) keeps none of log n's bits; a backward that
    took P from it gave every gradient of those rows n times too large (found by an adversarial
    sweep). Against the golden: the kernel where it is built (its backward sends these rows to
    flash.py), flash.py with ATTNZERO_NO_BUILD=1; and the Triton kernels (their backward sends them
    to flash.py too; their forward once multiplied finfo.min by log2 e, overflowing to −inf: out 0)."""
    from conftest import check_against_golden, randn

    B, H, L, D, pad = 2, 2, 12, 8, 5
    q, k, v = (randn(B, H, L, D) for _ in range(3))
    real = torch.arange(L) >= pad  # keys 0..4 are padding (left padding)
    if how == "padding_bias_causal":
        bias = torch.where(real, 0.0, FINFO32_MIN).to(F64).view(1, 1, 1, L).expand(B, 1, L, L)
        check_against_golden(backend, dtype, q, k, v, bias=bias, causal=True)
    elif how in ("mask_hides_the_max", "mask_hides_the_max_1e9"):
        mask = torch.ones(1, 1, L, L, dtype=torch.bool)
        mask[..., -1] = False  # the last key blocked: the only one whose bias is 0
        bias = torch.full((1, 1, L, L), FINFO32_MIN if how == "mask_hides_the_max" else -1e9, dtype=F64)
        bias[..., -1] = 0.0
        bias[..., 4:, :3] = 0.0  # rows 4.. keep some keys near 0 as well
        if how == "mask_hides_the_max":
            check_against_golden(backend, dtype, q, k, v, bias=bias, mask=mask)
        else:  # q·k + −1e9 rounds q·k away in float32 (an ulp of 64), not in the golden: as the reference rounds
            from conftest import run_attention

            dout = randn(B, H, L, D)
            ref = run_attention("reference", dtype, q, k, v, dout, bias=bias, mask=mask)
            got = run_attention(backend, dtype, q, k, v, dout, bias=bias, mask=mask)
            tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
            torch.testing.assert_close(got.out, ref.out, **tol)
            for name in ("q", "k", "v", "bias"):
                torch.testing.assert_close(got.grads[name], ref.grads[name], **tol)
    else:
        def padded(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            return torch.where(j < pad, FINFO32_MIN, s)

        check_against_golden(backend, dtype, q, k, v, score_mod=padded, causal=True)


@pytest.mark.parametrize("shared", ["k_is_v", "q_is_k_is_v"])
@pytest.mark.parametrize("extra", ["plain", "bias_causal", "sinks", "score_mod"])
def test_create_graph_with_one_tensor_in_several_slots(shared: str, extra: str) -> None:
    """``attention(x, x, x)`` (or k is v) with create_graph=True — a gradient penalty on
    self-attention: the backward through the formula gave each slot the sum of all the tensor's uses
    (autograd.grad of one tensor listed twice), so the first-order gradient came out 2× or 3×. Now
    the default backend's first and second order equal the reference's, and its plain backward's."""
    x0, q0 = randn(2, 3, 7, 8), randn(2, 3, 5, 8)
    kw: dict[str, Any] = {
        "plain": {}, "bias_causal": {"bias": randn(1, 3, 1, 7), "causal": True},
        "sinks": {"sinks": randn(3)}, "score_mod": {"score_mod": lambda s, b, h, i, j: s - 0.1 * (i - j).abs()},
    }[extra]  # fmt: skip
    res = {}
    for backend in ("flash", "reference"):
        for create_graph in (False, True):
            x = x0.clone().requires_grad_()
            q = x if shared == "q_is_k_is_v" else q0.clone().requires_grad_()
            out = az.attention(q, x, x, backend=backend, **kw)  # type: ignore[arg-type]
            (g,) = torch.autograd.grad(out.square().sum(), [x], create_graph=create_graph)
            res[backend, create_graph] = g.detach()
            if create_graph:
                res[backend, "second"] = torch.autograd.grad(g.square().sum(), [x])[0]
    torch.testing.assert_close(res["flash", True], res["flash", False], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(res["flash", True], res["reference", False], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(res["flash", "second"], res["reference", "second"], rtol=1e-10, atol=1e-12)


def test_the_drop_in_gradient_penalty_on_self_attention_is_torchs() -> None:
    """``scaled_dot_product_attention(x, x, x)`` differentiated twice equals torch's math backend."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x0 = randn(2, 3, 5, 8)
    got = []
    for fn in (az.scaled_dot_product_attention, F.scaled_dot_product_attention):
        x = x0.clone().requires_grad_()
        with sdpa_kernel(SDPBackend.MATH):
            (g,) = torch.autograd.grad(fn(x, x, x, is_causal=True).sum(), [x], create_graph=True)
        got.append((g.detach(), torch.autograd.grad(g.square().sum(), [x])[0]))
    for a, b in zip(got[0], got[1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
