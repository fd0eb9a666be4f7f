"""Under ``torch.autocast`` attnzero does what autocast does to torch's scaled_dot_product_attention
(ATen lists it as ``lower_precision_fp`` on CPU and CUDA): every floating tensor argument on the
autocast device except float64 is cast to the autocast dtype, bool masks and float64 stay — and then
every backend computes in those dtypes, so all give the same dtype and the same numbers as a call
on inputs cast by hand."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from conftest import absent

import attnzero as az

BF16 = torch.bfloat16
BACKENDS = ["reference", "flash", "triton"]


@pytest.fixture(autouse=True)
def _cpu_autocast_off_after() -> Iterator[None]:
    yield
    assert not torch.is_autocast_enabled("cpu")


def _need(backend: str) -> None:
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        absent("backend='triton' needs `pip install triton`")


def _qkv(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(2, 4, 9, 16, dtype=dtype)  # (B, Hq, Lq, D)
    return q, torch.randn(2, 2, 11, 16, dtype=dtype), torch.randn(2, 2, 11, 8, dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_under_autocast_is_attention_on_cast_inputs(backend: str) -> None:
    _need(backend)
    q, k, v = _qkv()
    bias = torch.randn(1, 4, 9, 11)  # float32: cast too
    keep = torch.rand(9, 11) < 0.8  # bool: as it is
    kw = dict(mask=keep, bias=bias, causal=True, backend=backend, return_lse=True)
    with torch.autocast("cpu", dtype=BF16):
        out, lse = az.attention(q, k, v, **kw)  # type: ignore[arg-type]
    by_hand, lse_by_hand = az.attention(q.to(BF16), k.to(BF16), v.to(BF16), **{**kw, "bias": bias.to(BF16)})  # type: ignore[arg-type]
    assert out.dtype == BF16 and lse.dtype == torch.float32
    assert torch.equal(out, by_hand) and torch.equal(lse, lse_by_hand)


def test_every_backend_gives_torchs_dtype_and_result() -> None:
    q = torch.randn(2, 2, 11, 16)  # (B, H, L, D); Lq == Lk: torch's is_causal is attnzero's causal
    _, k, v = _qkv()
    with torch.autocast("cpu", dtype=BF16):
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ours = [az.attention(q, k, v, causal=True, backend=b) for b in ("reference", "flash")]
        dropin = az.scaled_dot_product_attention(q, k, v, is_causal=True)
    for o in (*ours, dropin):
        assert o.dtype == theirs.dtype == BF16
        torch.testing.assert_close(o, theirs, atol=2e-2, rtol=2e-2)  # bf16 inputs: a few roundings apart
    torch.testing.assert_close(ours[1], ours[0], atol=8e-3, rtol=8e-3)


def test_mixed_dtypes_work_under_autocast_as_in_torch() -> None:
    """bf16 q with float32 k, v: autocast makes them one dtype; without it, a dtype mismatch
    (RuntimeError in torch, and in attnzero)."""
    q, k, v = _qkv()
    q = q[:, :2].to(BF16)
    with torch.autocast("cpu", dtype=BF16):
        theirs = F.scaled_dot_product_attention(q, k, v)
        ours = az.scaled_dot_product_attention(q, k, v)
        ours_attention = az.attention(q, k, v)
    assert ours.dtype == theirs.dtype == ours_attention.dtype == BF16
    torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)
    for fn in (F.scaled_dot_product_attention, az.scaled_dot_product_attention, az.attention):
        with pytest.raises(RuntimeError):
            fn(q, k, v)


def test_float_masks_follow_autocast() -> None:
    """A float32 attn_mask is cast with the rest; a float64 one is not, and does not match
    (torch refuses it too); float64 inputs are never cast."""
    q, k, v = (x[:, :2] for x in _qkv())
    mask32 = torch.randn(9, 11)
    with torch.autocast("cpu", dtype=BF16):
        ours = az.scaled_dot_product_attention(q, k, v, attn_mask=mask32)
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask32)
        assert ours.dtype == theirs.dtype == BF16
        torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)
        for fn in (F.scaled_dot_product_attention, az.scaled_dot_product_attention):
            with pytest.raises(RuntimeError):
                fn(q, k, v, attn_mask=mask32.double())
        q64, k64, v64 = (x.double() for x in (q, k, v))
        out64 = az.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask32.double())
        assert out64.dtype == F.scaled_dot_product_attention(q64, k64, v64).dtype == torch.float64


@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_gradients_under_autocast(backend: str) -> None:
    """The float32 leaves get float32 gradients through the casts, equal to those of a call on
    inputs cast by hand."""
    q, k, v = (x.requires_grad_() for x in _qkv())
    with torch.autocast("cpu", dtype=BF16):
        out = az.attention(q, k, v, backend=backend)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    qb, kb, vb = (x.detach().to(BF16).requires_grad_() for x in (q, k, v))
    by_hand = torch.autograd.grad(az.attention(qb, kb, vb, backend=backend).float().sum(), (qb, kb, vb))  # type: ignore[union-attr]
    for g, h in zip(grads, by_hand):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, h.float())


def test_modules_under_autocast_agree_across_backends() -> None:
    torch.manual_seed(0)
    mha = az.MultiHeadAttention(32, 4, num_kv_heads=2, dropout=0.0).eval()
    x = torch.randn(2, 7, 32)
    outs = {}
    with torch.autocast("cpu", dtype=BF16):
        for b in ("reference", "flash"):
            mha.backend = b
            outs[b] = mha(x, causal=True)
        w_out, weights = mha(x, causal=True, need_weights=True)
    assert outs["reference"].dtype == outs["flash"].dtype == w_out.dtype == BF16
    torch.testing.assert_close(outs["flash"], outs["reference"], atol=8e-3, rtol=8e-3)
    assert weights.dtype == BF16


def test_modules_take_autocasts_activations_as_torchs_do() -> None:
    """Under autocast a Linear gives bfloat16, and the next attention layer (or a cross-attention's
    encoder states) takes it as torch's nn.MultiheadAttention does: the modules refused a dtype
    other than their weights'. The result equals the float32 input's (autocast casts both)."""
    torch.manual_seed(0)
    mha = az.MultiHeadAttention(32, 4, num_kv_heads=2, dropout=0.0).eval()
    sdpa = az.ScaledDotProductAttention()
    x = torch.randn(2, 7, 32)
    with torch.autocast("cpu", dtype=BF16):
        torch.testing.assert_close(mha(x.to(BF16), causal=True), mha(x, causal=True))
        torch.testing.assert_close(mha(x, x.to(BF16), x.to(BF16)), mha(x))
        q = torch.randn(2, 5, 8)
        out, w = sdpa(q, q.to(BF16), q)
        want, want_w = sdpa(q, q, q)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(w, want_w)
    with pytest.raises(az.ArgumentTypeError, match=r"query: dtype torch\.bfloat16 does not match W_q\.weight's"):
        mha(x.to(BF16))  # outside autocast: refused, naming the argument


@pytest.mark.parametrize("cache_dtype", [torch.float32, BF16], ids=["f32", "bf16"])
def test_decoding_with_a_cache_under_autocast_is_the_full_causal_call(cache_dtype: torch.dtype) -> None:
    """A cache of the weights' dtype or of autocast's takes autocast's keys and values (stored in its
    own dtype); token by token equals the whole sequence at once."""
    torch.manual_seed(0)
    mha = az.MultiHeadAttention(32, 4, num_kv_heads=2, dropout=0.0, rope=True).eval()
    x = torch.randn(2, 6, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        full = mha(x, causal=True)
        cache = az.KVCache(2, 6, 2, 8, dtype=cache_dtype)
        steps = torch.cat([mha(x[:, t : t + 1], cache=cache) for t in range(6)], dim=1)
    assert steps.dtype == full.dtype == BF16
    torch.testing.assert_close(steps, full, atol=2e-2, rtol=2e-2)


def test_a_cache_takes_torchs_default_dtype() -> None:
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert az.KVCache(1, 4, 1, 8).dtype == torch.float64
    finally:
        torch.set_default_dtype(before)
    assert az.KVCache(1, 4, 1, 8).dtype == before
