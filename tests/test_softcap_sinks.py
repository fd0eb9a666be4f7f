"""softcap (Gemma 2) and sinks (gpt-oss) on every backend, forward and backward, against the float64
golden (whose own formula is checked against the naive attention of conftest.py, written with an
explicit sink column), with fully blocked rows, GQA, Lq ≠ Lk, masks and dropout."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import (
    BACKENDS,
    DTYPE_IDS,
    DTYPES,
    check_against_golden,
    dense_keep,
    naive_attention,
    need,
    qkv,
    randn,
)

import attnzero as az
from attnzero import flash
from attnzero import sinks as sinks_mod

SHAPES = [  # (B, Hq, Hkv, Lq, Lk, D)
    (1, 1, 1, 1, 1, 8),
    (2, 4, 2, 17, 17, 8),
    (1, 3, 1, 33, 70, 16),
    (2, 2, 2, 70, 33, 40),
]


def _sinks(kind: str, B: int, Hq: int, Lq: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "head":
        return randn(Hq) * 2
    return randn(B, Hq, Lq) * 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("softcap", [None, 0.7, 30.0], ids=["nocap", "cap0.7", "cap30"])
@pytest.mark.parametrize("sinks", ["none", "head", "query"])
def test_softcap_and_sinks_match_the_golden(
    backend: str, shape: tuple[int, ...], softcap: float | None, sinks: str
) -> None:
    B, Hq, Hkv, Lq, Lk, D = shape
    q, k, v = qkv(B, Hq, Hkv, Lq, Lk, D)
    q = q * 3  # scores of several units: the cap bends them
    keep = torch.rand(B, 1, Lq, Lk) < 0.8
    keep[..., 0, :] = False  # a fully blocked row
    sk = _sinks(sinks, B, Hq, Lq)
    if sk is not None:
        sk = sk.float().double()  # as the golden sees it (rounded to the run's dtype)

    def naive(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return naive_attention(q, k, v, keep=keep, bias=bias, softcap=softcap, sinks=sk)

    bias = randn(1, Hq, Lq, Lk)
    check_against_golden(
        backend, torch.float32, q, k, v, bias=bias, mask=keep, softcap=softcap, sinks=sk, naive=naive
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_every_dtype_causal_gqa(backend: str, dtype: torch.dtype) -> None:
    q, k, v = qkv(2, 4, 2, 37, 53, 16)
    check_against_golden(backend, dtype, q * 2, k, v, causal=True, softcap=5.0, sinks=randn(4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_and_dropout(backend: str) -> None:
    q, k, v = qkv(1, 2, 1, 41, 41, 8)
    check_against_golden(
        backend, torch.float64, q, k, v, window=(5, 3), softcap=2.0, sinks=randn(1, 2, 41), dropout_p=0.3, seed=7
    )


@pytest.mark.parametrize("case", ["mask-bias", "causal-gqa", "huge", "natural", "dropout", "blocks", "bf16"])
def test_flash_softcap_cases(case: str) -> None:
    """flash's softcap against the golden, with sinks: masks, a bias, a fully blocked row, causal,
    scores far past the cap (tanh saturates at ±1), a bias far from 0 (the row shift), dropout,
    many blocks, bfloat16."""
    q, k, v = qkv(2, 4, 2, 37, 53, 16)
    kw: dict[str, object] = {"softcap": 5.0, "sinks": randn(4)}
    dtype, sizes = torch.float32, {}
    if case == "mask-bias":
        keep = torch.rand(2, 1, 37, 53) < 0.8
        keep[..., 0, :] = False  # a fully blocked row
        q, kw = q * 3, {**kw, "softcap": 0.7, "mask": keep, "bias": randn(1, 4, 37, 53)}
    elif case == "causal-gqa":
        kw = {**kw, "causal": True}
    elif case == "huge":  # scores in the hundreds before a cap of 5
        q, kw = q * 30, {**kw, "causal": True}
    elif case == "natural":  # a bias far from 0 (row shift)
        bias = randn(2, 4, 37, 53)
        bias[:, :, 3] -= 1e9  # an additive padding row
        kw = {**kw, "bias": bias, "causal": True}
    elif case == "dropout":
        dtype, kw = torch.float64, {**kw, "window": (5, 3), "dropout_p": 0.3, "seed": 7}
    elif case == "blocks":
        sizes = {"rows": 16, "cols": 16}
        kw = {**kw, "causal": True}
    else:
        dtype = torch.bfloat16
    bias = kw.pop("bias", None)
    with flash.block_sizes(**sizes):
        check_against_golden("flash", dtype, q, k, v, bias=bias, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_blocked_rows_with_sinks_give_zero_output_and_lse_sink(backend: str) -> None:
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 1, 5, 6, 8))
    sk = randn(2).requires_grad_()
    keep = torch.zeros(1, 1, 5, 6, dtype=torch.bool)
    keep[..., 3, :2] = True
    out, lse = az.attention(q, k, v, mask=keep, sinks=sk, backend=backend, return_lse=True)
    blocked = [0, 1, 2, 4]
    assert torch.equal(out[:, :, blocked], torch.zeros_like(out[:, :, blocked]))
    torch.testing.assert_close(lse[0, :, blocked], sk.detach().view(2, 1).expand(2, 4))
    out.sum().backward()
    for t in (q, k, v, sk):
        assert t.grad is not None and torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :, blocked], torch.zeros_like(q.grad[:, :, blocked]))  # type: ignore[index]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sink_of_minus_infinity_is_no_sink(backend: str) -> None:
    q, k, v = qkv(1, 2, 2, 9, 9, 8)
    keep = torch.rand(1, 1, 9, 9) < 0.5
    keep[..., 2, :] = False
    a = az.attention(q, k, v, mask=keep, backend=backend, return_lse=True)
    no_sink = torch.full((2,), -math.inf, dtype=torch.float64)
    b = az.attention(q, k, v, mask=keep, sinks=no_sink, backend=backend, return_lse=True)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_gradient_passes_gradcheck(backend: str) -> None:
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 1, 6, 7, 4))
    for sk in (randn(2), randn(1, 2, 6)):
        sk.requires_grad_()

        def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            return az.attention(q, k, v, causal=True, softcap=1.5, sinks=s, backend=backend)  # type: ignore[return-value]

        assert torch.autograd.gradcheck(f, (q, k, v, sk))


def test_sinks_fold_is_the_sink_as_one_more_key() -> None:
    """sinks.fold on an attention's (out, lse) equals the reference's softmax with the sink inside."""
    q, k, v = qkv(2, 3, 3, 11, 13, 8)
    sk = randn(2, 3, 11)
    out, lse = az.attention(q, k, v, backend="reference", return_lse=True)
    want = az.attention(q, k, v, sinks=sk, backend="reference", return_lse=True)
    got = sinks_mod.fold(out, lse, sk)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y)


def test_attention_weights_with_softcap_and_sinks() -> None:
    q, k, _ = qkv(1, 2, 2, 7, 9, 8)
    sk = randn(2)
    w = az.attention_weights(q, k, causal=True, softcap=3.0, sinks=sk)
    keep = dense_keep(7, 9, causal=True)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    s = 3.0 * torch.tanh(s / 3.0)
    s = s.masked_fill(~keep, -math.inf)
    col = sk.view(1, 2, 1, 1).expand(1, 2, 7, 1)
    p = torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]
    torch.testing.assert_close(w, p)
    assert (w.sum(-1) < 1).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_calls_take_softcap_and_sinks(backend: str) -> None:
    q, k, v = (t.float().requires_grad_() for t in qkv(1, 2, 1, 16, 16, 8))
    sk = randn(2).float().requires_grad_()

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return az.attention(q, k, v, causal=True, softcap=4.0, sinks=s, backend=backend)  # type: ignore[return-value]

    eager = f(q, k, v, sk)
    g_eager = torch.autograd.grad(eager.sum(), (q, k, v, sk))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, sk)
    g_comp = torch.autograd.grad(compiled.sum(), (q, k, v, sk))
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_keys_with_sinks(backend: str) -> None:
    q = randn(1, 2, 3, 4).requires_grad_()
    k, v = randn(1, 2, 0, 4), randn(1, 2, 0, 4)
    sk = randn(2).requires_grad_()
    out, lse = az.attention(q, k, v, sinks=sk, backend=backend, return_lse=True)
    assert torch.equal(out, torch.zeros(1, 2, 3, 4, dtype=torch.float64))
    torch.testing.assert_close(lse, sk.detach().view(1, 2, 1).expand(1, 2, 3))


@pytest.mark.parametrize(
    ("kw", "error", "words"),
    [
        ({"softcap": 0.0}, ValueError, "softcap"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"softcap": math.inf}, ValueError, "softcap"),
        ({"softcap": 1e39}, ValueError, "softcap: expected a float in float32's normal range"),  # inf in float32: NaN
        ({"softcap": 1e-46}, ValueError, "softcap: expected a float in float32's normal range"),  # 0: no cap at all
        ({"softcap": True}, TypeError, "softcap"),
        ({"softcap": "1"}, TypeError, "softcap"),
        ({"sinks": [0.0, 0.0]}, TypeError, "sinks"),
        ({"sinks": torch.zeros(3)}, ValueError, "(Hq,)"),
        ({"sinks": torch.zeros(2, dtype=torch.int64)}, TypeError, "sinks"),
        ({"sinks": torch.zeros(1, 2, 4)}, ValueError, "(B, Hq, Lq)"),
    ],
)
def test_bad_softcap_and_sinks_are_refused(kw: dict[str, object], error: type[Exception], words: str) -> None:
    q, k, v = qkv(1, 2, 2, 5, 5, 4)
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        az.attention(q, k, v, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cap", [1e-30, 1e38], ids=["tiny", "huge"])
def test_caps_at_float32s_ends(backend: str, cap: float) -> None:
    """The largest and smallest caps taken: no NaN, the golden's values and gradients."""
    q, k, v = qkv(1, 2, 2, 7, 9, 8)
    check_against_golden(backend, torch.float32, q, k, v, softcap=cap)


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dims_beyond_256(backend: str) -> None:
    """D = Dv = 512 (and D ≠ Dv beyond 256) on reference and flash, forward and backward."""
    q, k, v = qkv(1, 2, 1, 19, 23, 512)
    check_against_golden(backend, torch.float32, q, k, v, causal=True, softcap=10.0, sinks=randn(2))
    q, k, v = qkv(1, 2, 2, 9, 9, 320, 384)
    check_against_golden(backend, torch.float32, q, k, v)


def test_triton_refuses_head_dims_beyond_its_tiles() -> None:
    need("triton")
    q, k, v = qkv(1, 1, 1, 4, 4, 512)
    with pytest.raises(ValueError, match="head dims up to 256"):
        az.attention(q.float(), k.float(), v.float(), backend="triton")


def test_the_split_kv_decode_path_takes_softcap_and_sinks() -> None:
    """One query against many keys without gradients takes the triton backend's split-KV decode
    kernel (``functional.choose``); the sinks are added after its merge of the splits."""
    need("triton")
    from attnzero.kernels import triton_backend as tb

    q, k, v = (t.float() for t in qkv(1, 4, 2, 1, tb.DECODE_MIN_LK + 37, 8))
    assert az.functional.choose("triton", q, k, needs_grad=False) == "triton_decode"
    for sk in (randn(4).float(), randn(1, 4, 1).float()):
        got = az.attention(q, k, v, softcap=3.0, sinks=sk, backend="triton", return_lse=True)
        want = az.attention(q.double(), k.double(), v.double(), softcap=3.0, sinks=sk.double(), backend="reference",
                            return_lse=True)  # fmt: skip
        torch.testing.assert_close(got[0].double(), want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1].double(), want[1], rtol=1e-5, atol=1e-5)
