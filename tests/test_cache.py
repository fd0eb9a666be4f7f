"""az.KVCache and ``MultiHeadAttention(..., cache=)``: prefill + token-by-token decoding equals one
causal pass (MHA, GQA, MQA; with and without rotary), and a call that raises leaves the cache
exactly as it was."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzero as az
from attnzero import flash, modules
from attnzero.testing import assert_close_to_golden


def snapshot(cache: az.KVCache) -> tuple[int, torch.Tensor, torch.Tensor]:
    return len(cache), cache.k.clone(), cache.v.clone()


def assert_untouched(cache: az.KVCache, snap: tuple[int, torch.Tensor, torch.Tensor]) -> None:
    n, k, v = snap
    assert len(cache) == n
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)  # the whole storage, not only [:n]


def filled(B: int = 2, T: int = 10, H: int = 3, D: int = 8, n: int = 4, **kw: Any) -> az.KVCache:
    cache = az.KVCache(B, T, H, D, **kw)
    dtype = kw.get("dtype", torch.float32)
    cache.update(torch.randn(B, H, n, D, dtype=dtype), torch.randn(B, H, n, D, dtype=dtype))
    return cache


# ---------------------------------------------------------------------------------------------
# The cache on its own


def test_storage_shapes_and_length() -> None:
    cache = az.KVCache(2, 16, 3, 8, dtype=torch.float64)
    assert cache.k.shape == cache.v.shape == (2, 3, 16, 8)
    assert cache.k.dtype == torch.float64 and cache.device == torch.device("cpu")
    assert len(cache) == 0 and cache.remaining == 16
    assert cache.keys().shape == (2, 3, 0, 8)


def test_update_appends_and_returns_views_of_the_filled_part() -> None:
    cache = az.KVCache(2, 16, 3, 8)
    chunks = [(torch.randn(2, 3, n, 8), torch.randn(2, 3, n, 8)) for n in (5, 1, 1, 4)]
    for i, (k, v) in enumerate(chunks):
        k_all, v_all = cache.update(k, v)
        n = sum(c[0].shape[2] for c in chunks[: i + 1])
        assert len(cache) == n and k_all.shape == v_all.shape == (2, 3, n, 8)
        assert k_all.data_ptr() == cache.k.data_ptr()  # a view of the storage, no copy
        torch.testing.assert_close(k_all, torch.cat([c[0] for c in chunks[: i + 1]], dim=2), rtol=0, atol=0)
        torch.testing.assert_close(v_all, torch.cat([c[1] for c in chunks[: i + 1]], dim=2), rtol=0, atol=0)
    assert cache.remaining == 5


def test_update_accepts_non_contiguous_input() -> None:
    cache = az.KVCache(2, 8, 4, 16)
    k = torch.randn(2, 5, 4, 16).transpose(1, 2)  # (2, 4, 5, 16) strided, as a module's head split
    v = torch.randn(2, 5, 4, 16).transpose(1, 2)
    k_all, v_all = cache.update(k, v)
    assert torch.equal(k_all, k) and torch.equal(v_all, v)


def test_reset_and_truncate() -> None:
    cache = filled(n=6)
    k6 = cache.keys().clone()
    cache.truncate(2)
    assert len(cache) == 2 and torch.equal(cache.keys(), k6[:, :, :2])
    with pytest.raises(ValueError, match=r"length: expected an int in \[0, 2\], got 3"):
        cache.truncate(3)
    cache.reset()
    assert len(cache) == 0 and cache.remaining == cache.max_len
    k, v = torch.randn(2, 3, 10, 8), torch.randn(2, 3, 10, 8)
    k_all, _ = cache.update(k, v)  # the whole capacity is available again
    assert torch.equal(k_all, k)


def test_overflow_raises_and_leaves_the_cache_as_it_was() -> None:
    cache = filled(T=10, n=7)
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=r"cache: 4 new tokens do not fit: it holds 7 of max_len 10 \(3 free\)"):
        cache.update(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8))
    assert_untouched(cache, snap)
    cache.update(torch.randn(2, 3, 3, 8), torch.randn(2, 3, 3, 8))  # exactly full is fine
    assert len(cache) == 10 and cache.remaining == 0
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="1 new tokens do not fit"):
        cache.update(torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8))
    assert_untouched(cache, snap)


BAD_UPDATES: list[tuple[str, Callable[[], tuple[Any, Any]], type[Exception], str]] = [
    ("head_dim", lambda: (torch.randn(2, 3, 1, 6), torch.randn(2, 3, 1, 6)), ValueError,
     r"k: expected head dim 8 \(the cache's\), got 6 in shape \(2, 3, 1, 6\)"),
    ("v head_dim", lambda: (torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 4)), ValueError,
     r"v: expected head dim 8 \(the cache's\), got 4"),
    ("batch", lambda: (torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)), ValueError,
     r"k: expected batch 2 \(the cache's\), got 1"),
    ("heads", lambda: (torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8)), ValueError,
     r"k: expected heads 3 \(the cache's\), got 4"),
    ("dtype", lambda: (torch.randn(2, 3, 1, 8, dtype=torch.float64), torch.randn(2, 3, 1, 8)), TypeError,
     r"k: expected dtype torch\.float32 \(the cache's\), got torch\.float64"),
    ("v dtype", lambda: (torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8).half()), TypeError,
     r"v: expected dtype torch\.float32 \(the cache's\), got torch\.float16"),
    ("device", lambda: (torch.randn(2, 3, 1, 8, device="meta"), torch.randn(2, 3, 1, 8, device="meta")), ValueError,
     r"k: expected device cpu \(the cache's\), got meta"),
    ("lengths", lambda: (torch.randn(2, 3, 2, 8), torch.randn(2, 3, 1, 8)), ValueError,
     r"v: expected length 2 \(k's\), got 1"),
    ("ndim", lambda: (torch.randn(2, 3, 8), torch.randn(2, 3, 8)), ValueError, r"k: expected 4 dims \(B, Hkv, L, D\)"),
    ("not a tensor", lambda: ([1.0], torch.randn(2, 3, 1, 8)), TypeError, "k: expected a torch.Tensor, got list"),
    ("integer", lambda: (torch.ones(2, 3, 1, 8, dtype=torch.long),) * 2, TypeError, "k: expected a floating dtype"),
]


@pytest.mark.parametrize(("k_v", "error", "message"), [b[1:] for b in BAD_UPDATES], ids=[b[0] for b in BAD_UPDATES])
def test_bad_update_raises_without_touching_the_cache(
    k_v: Callable[[], tuple[Any, Any]], error: type[Exception], message: str
) -> None:
    cache = filled()
    snap = snapshot(cache)
    k, v = k_v()
    with pytest.raises(error, match=message):
        cache.update(k, v)
    assert_untouched(cache, snap)


def test_bad_construction() -> None:
    for name, args in (
        ("batch_size", (0, 4, 2, 8)), ("max_len", (1, -1, 2, 8)), ("num_kv_heads", (1, 4, 2.0, 8)),
        ("head_dim", (1, 4, 2, True)),
    ):
        with pytest.raises(ValueError, match=f"{name}: expected a positive int"):
            az.KVCache(*args)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"dtype: expected a floating dtype .* got torch\.int64"):
        az.KVCache(1, 4, 2, 8, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes(dtype: torch.dtype) -> None:
    cache = az.KVCache(1, 4, 2, 8, dtype=dtype)
    k = torch.randn(1, 2, 3, 8).to(dtype)
    k_all, _ = cache.update(k, k)
    assert k_all.dtype == dtype and torch.equal(k_all, k)


# ---------------------------------------------------------------------------------------------
# MultiHeadAttention(..., cache=): prefill + decode == one causal pass


def decode_in_pieces(m: az.MultiHeadAttention, x: torch.Tensor, pieces: list[int], cache: az.KVCache) -> torch.Tensor:
    outs, t = [], 0
    for n in pieces:
        out = m(x[:, t : t + n], cache=cache)
        assert isinstance(out, torch.Tensor)
        outs.append(out)
        t += n
    assert t == x.shape[1] and len(cache) == t
    return torch.cat(outs, dim=1)  # (B, L, d_model)


@pytest.mark.parametrize(("Hq", "Hkv"), [(4, 4), (4, 2), (6, 1)], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("rope", ["none", "half", "interleaved"])
@pytest.mark.parametrize("prefill", [1, 9])
def test_prefill_then_decode_equals_one_causal_pass(Hq: int, Hkv: int, rope: str, prefill: int) -> None:
    d_model, B, L = 16 * Hq, 2, 23
    rot = {"none": False, "half": True, "interleaved": az.RotaryEmbedding(16, interleaved=True)}[rope]
    m = az.MultiHeadAttention(d_model, Hq, 0.0, num_kv_heads=Hkv, rope=rot).eval()
    x = torch.randn(B, L, d_model)
    with torch.no_grad():
        full = m(x, causal=True)
        cache = az.KVCache(B, 32, Hkv, 16)
        got = decode_in_pieces(m, x, [prefill] + [1] * (L - prefill), cache)
    assert got.shape == full.shape
    assert float((got - full).abs().max()) < 1e-5


@pytest.mark.parametrize("backend", ["reference", "flash", "auto"])
def test_chunked_prefill_float64_any_backend(backend: str) -> None:
    """Chunks of any size (chunked prefill, speculative verification) all match, in float64 to
    rounding; the long piece goes through auto's choice for long inputs too."""
    m = az.MultiHeadAttention(48, 6, 0.0, num_kv_heads=2, rope=True, backend=backend).double()  # type: ignore[arg-type]
    x = torch.randn(3, 200, 48, dtype=torch.float64)
    full = m(x, causal=True)
    cache = az.KVCache(3, 256, 2, 8, dtype=torch.float64)
    got = decode_in_pieces(m, x, [150, 1, 13, 1, 1, 30, 4], cache)
    torch.testing.assert_close(got, full, rtol=0, atol=1e-12)


@settings(max_examples=10, deadline=None)
@given(
    pieces=st.lists(st.integers(1, 6), min_size=1, max_size=8),
    heads=st.sampled_from([(4, 4), (4, 2), (4, 1)]),
    interleaved=st.booleans(),
    blocks=st.none() | st.tuples(st.integers(3, 8), st.integers(3, 8)),
)
def test_any_split_into_chunks_equals_one_causal_pass(
    pieces: list[int], heads: tuple[int, int], interleaved: bool, blocks: tuple[int, int] | None
) -> None:
    """However the sequence is cut into calls, the outputs are those of one causal pass. With
    ``blocks`` (rows, cols), both run through flash in blocks that small, so that the pieces and
    the causal edge of the cached keys fall across block edges ("auto" takes the reference here)."""
    Hq, Hkv = heads
    torch.manual_seed(len(pieces))
    backend = "auto" if blocks is None else "flash"
    rope = az.RotaryEmbedding(8, interleaved=interleaved)
    m = az.MultiHeadAttention(32, Hq, 0.0, num_kv_heads=Hkv, rope=rope, backend=backend).double()
    x = torch.randn(2, sum(pieces), 32, dtype=torch.float64)
    cache = az.KVCache(2, sum(pieces) + 3, Hkv, 8, dtype=torch.float64)
    rows, cols = blocks if blocks is not None else (None, None)
    with flash.block_sizes(rows=rows, cols=cols):
        torch.testing.assert_close(decode_in_pieces(m, x, pieces, cache), m(x, causal=True), rtol=0, atol=1e-12)


def test_cache_implies_causal_and_mask_spans_the_whole_cache() -> None:
    """With a cache, ``mask`` broadcasts to (B, H, L, len(cache) + L): blocking a cached key for
    one batch row matches the full pass with the same keep-mask."""
    m = az.MultiHeadAttention(32, 4, 0.0).double()
    B, L = 2, 12
    x = torch.randn(B, L, 32, dtype=torch.float64)
    keep = torch.ones(B, 1, 1, L, dtype=torch.bool)
    keep[1, 0, 0, 2] = False  # batch row 1 never attends to token 2
    full = m(x, mask=keep, causal=True)
    cache = az.KVCache(B, L, 4, 8, dtype=torch.float64)
    outs = [m(x[:, :5], mask=keep[..., :5], cache=cache)]  # causal=False by default: the cache makes it causal
    for t in range(5, L):
        outs.append(m(x[:, t : t + 1], mask=keep[..., : t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=0, atol=1e-12)


def test_need_weights_with_cache() -> None:
    m = az.MultiHeadAttention(32, 4, 0.0, rope=True).double()
    x = torch.randn(1, 9, 32, dtype=torch.float64)
    full, w_full = m(x, causal=True, need_weights=True)
    cache = az.KVCache(1, 16, 4, 8, dtype=torch.float64)
    m(x[:, :8], cache=cache)
    out, w = m(x[:, 8:], cache=cache, need_weights=True)
    assert w.shape == (1, 4, 1, 9)
    torch.testing.assert_close(out, full[:, 8:], rtol=0, atol=1e-12)
    torch.testing.assert_close(w, w_full[:, :, 8:], rtol=0, atol=1e-12)


def test_seed_call_style_with_cache() -> None:
    """``mha(x, x, x, cache=c)`` — the seeds' self-attention call — is accepted."""
    m = az.MultiHeadAttention(32, 4, 0.0).double()
    x = torch.randn(1, 3, 32, dtype=torch.float64)
    cache = az.KVCache(1, 8, 4, 8, dtype=torch.float64)
    torch.testing.assert_close(m(x, x, x, cache=cache), m(x, causal=True), rtol=0, atol=1e-12)


def bad_module_calls() -> list[tuple[str, Callable[[az.MultiHeadAttention, az.KVCache], Any], type[Exception], str]]:
    x1 = torch.randn(2, 1, 32)
    return [
        ("overflow", lambda m, c: m(torch.randn(2, 5, 32), cache=c), ValueError,
         r"cache: 5 new tokens do not fit: it holds 4 of max_len 8 \(4 free\)"),
        ("d_model", lambda m, c: m(torch.randn(2, 1, 24), cache=c), ValueError, "query: expected last dim 32, got 24"),
        ("batch", lambda m, c: m(torch.randn(3, 1, 32), cache=c), ValueError,
         r"cache: expected batch_size 3 \(the module's / query's\), got 2"),
        ("heads", lambda m, c: m(x1, cache=az.KVCache(2, 8, 4, 8)), ValueError,
         r"cache: expected num_kv_heads 2 .* got 4"),
        ("head_dim", lambda m, c: m(x1, cache=az.KVCache(2, 8, 2, 16)), ValueError,
         r"cache: expected head_dim 8 .* got 16"),
        ("cache device", lambda m, c: m(x1, cache=az.KVCache(2, 8, 2, 8, device="meta")), ValueError,
         r"cache: expected device cpu \(the module's weights'\), got meta"),
        ("dtype", lambda m, c: m(x1.double(), cache=c), TypeError, "query: dtype torch.float64 does not match"),
        ("device", lambda m, c: m(x1.to("meta"), cache=c), ValueError, "query: device meta does not match"),
        ("mask", lambda m, c: m(x1, mask=torch.ones(2, 1, 1, 3, dtype=torch.bool), cache=c), ValueError,
         r"mask: shape \(2, 1, 1, 3\) is not broadcastable to \(B, Hq, Lq, Lk\) = \(2, 4, 1, 5\)"),
        ("cross", lambda m, c: m(x1, torch.randn(2, 1, 32), cache=c), ValueError,
         r"key: expected None with cache= \(self-attention\)"),
        ("padding", lambda m, c: m(x1, key_padding_mask=torch.ones(2, 5, dtype=torch.bool), cache=c), ValueError,
         "key_padding_mask: expected None with cache="),
        ("not a cache", lambda m, c: m(x1, cache=(c.k, c.v)), TypeError,
         "cache: expected an attnzero KVCache or None, got tuple"),
        ("causal flag", lambda m, c: m(x1, causal=1, cache=c), TypeError, "causal: expected a bool, got 1"),
    ]


@pytest.mark.parametrize(
    ("call", "error", "message"), [b[1:] for b in bad_module_calls()], ids=[b[0] for b in bad_module_calls()]
)
def test_failed_module_call_leaves_the_cache_as_it_was(
    call: Callable[[az.MultiHeadAttention, az.KVCache], Any], error: type[Exception], message: str
) -> None:
    m = az.MultiHeadAttention(32, 4, 0.0, num_kv_heads=2, rope=True)
    cache = az.KVCache(2, 8, 2, 8)
    m(torch.randn(2, 4, 32), cache=cache)
    snap = snapshot(cache)
    with pytest.raises(error, match=message):
        call(m, cache)
    assert_untouched(cache, snap)
    m(torch.randn(2, 1, 32), cache=cache)  # and it still works afterwards
    assert len(cache) == 5


def test_cache_dtype_mismatch_with_module() -> None:
    m = az.MultiHeadAttention(32, 4, 0.0)
    cache = az.KVCache(1, 8, 4, 8, dtype=torch.float64)
    message = r"cache: expected dtype torch\.float32 \(the module's weights'\), got torch\.float64"
    with pytest.raises(TypeError, match=message):
        m(torch.randn(1, 2, 32), cache=cache)
    assert len(cache) == 0


def test_error_inside_attention_rolls_the_append_back(monkeypatch: pytest.MonkeyPatch) -> None:
    m = az.MultiHeadAttention(32, 4, 0.0)
    cache = az.KVCache(1, 8, 4, 8)
    m(torch.randn(1, 3, 32), cache=cache)
    stored = cache.keys().clone()

    def broken(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(modules, "attention", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        m(torch.randn(1, 2, 32), cache=cache)
    assert len(cache) == 3 and torch.equal(cache.keys(), stored)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_low_precision_decode_within_the_tolerance_rule(dtype: torch.dtype) -> None:
    """In float16/bfloat16, decoding step by step is as close to the float64 golden as one causal
    pass in the same dtype is (2× its error plus a floor): the cache adds no error of its own."""
    m64 = az.MultiHeadAttention(64, 4, 0.0, num_kv_heads=2, rope=True).double()
    m_low = az.MultiHeadAttention(64, 4, 0.0, num_kv_heads=2, rope=True)
    m_low.load_state_dict(m64.state_dict())
    m_low = m_low.to(dtype)
    m64.load_state_dict({k: v.to(dtype).double() for k, v in m_low.state_dict().items()})  # same rounded weights
    x = torch.randn(2, 40, 64).to(dtype)
    with torch.no_grad():
        golden = m64(x.double(), causal=True)
        full = m_low(x, causal=True)
        cache = az.KVCache(2, 40, 2, 16, dtype=dtype)
        got = decode_in_pieces(m_low, x, [9] + [1] * 31, cache)
    assert got.dtype == dtype
    assert_close_to_golden(got, full, golden)


def test_a_call_that_attention_refuses_leaves_the_cache_storage_as_it_was() -> None:
    """The module appends before attention runs; when attention then raises (here a score_mod with a
    bug), the rows it wrote are put back, not only the length."""

    def buggy(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a bug in the score_mod")

    m = az.MultiHeadAttention(32, 4, 0.0, num_kv_heads=2, rope=True)
    cache = az.KVCache(2, 8, 2, 8)
    m(torch.randn(2, 4, 32), cache=cache)
    snap = snapshot(cache)
    m.score_mod = buggy
    with pytest.raises(RuntimeError, match="a bug in the score_mod"):
        m(torch.randn(2, 2, 32), cache=cache)
    assert_untouched(cache, snap)


# ---------------------------------------------------------------------------------------------
# With autograd


def test_updates_under_autograd_give_the_gradients_of_concatenated_keys() -> None:
    """Each step's attention saves the views it was given; a later update must not write into them
    (its backward raised "modified by an inplace operation"). Gradients reach every step's k and v,
    as with keys and values concatenated by torch.cat."""
    torch.manual_seed(0)
    B, H, D, steps = 2, 3, 8, [3, 1, 2]
    ks = [torch.randn(B, H, n, D, dtype=torch.float64, requires_grad=True) for n in steps]
    vs = [torch.randn(B, H, n, D, dtype=torch.float64, requires_grad=True) for n in steps]
    qs = [torch.randn(B, H, n, D, dtype=torch.float64) for n in steps]
    cache = az.KVCache(B, 8, H, D, dtype=torch.float64)
    loss = torch.zeros((), dtype=torch.float64)
    seen = []
    for q, k, v in zip(qs, ks, vs):
        k_all, v_all = cache.update(k, v)
        seen.append((k_all, k_all.detach().clone()))
        loss = loss + az.attention(q, k_all, v_all, causal=True).square().sum()
    for view, values in seen:  # what each step's attention read is as it was
        assert torch.equal(view.detach(), values)
    got = torch.autograd.grad(loss, ks + vs)
    want_loss = torch.zeros((), dtype=torch.float64)
    for i, q in enumerate(qs):
        k_all, v_all = torch.cat(ks[: i + 1], dim=2), torch.cat(vs[: i + 1], dim=2)
        want_loss = want_loss + az.attention(q, k_all, v_all, causal=True).square().sum()
    want = torch.autograd.grad(want_loss, ks + vs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    assert len(cache) == sum(steps)


def test_module_decoding_under_autograd_gives_one_causal_pass_gradients() -> None:
    """MultiHeadAttention with a cache, gradients recorded: token by token, the weights' gradients
    are those of one causal pass over the whole sequence; then, gradients off, the same cache goes on
    writing in place."""
    torch.manual_seed(1)
    m = az.MultiHeadAttention(32, 4, 0.0, num_kv_heads=2, rope=True).double()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    cache = az.KVCache(2, 9, 2, 8, dtype=torch.float64)
    decode_in_pieces(m, x, [3, 1, 1, 2], cache).square().sum().backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    m(x, causal=True).square().sum().backward()
    assert got.keys() == {n for n, p in m.named_parameters() if p.grad is not None} and got
    for n, p in m.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=0, atol=1e-10, msg=n)
    with torch.no_grad():  # a copy still (the storage carries the graph of the earlier steps)
        before = cache.k
        out = m(torch.randn(2, 1, 32, dtype=torch.float64), cache=cache)
    assert cache.k is not before and cache.k.requires_grad and not out.requires_grad
    cache.reset()  # storage without a graph: in place again
    with torch.no_grad():
        storage = cache.k
        m(torch.randn(2, 3, 32, dtype=torch.float64), cache=cache)
        m(torch.randn(2, 1, 32, dtype=torch.float64), cache=cache)
    assert cache.k is storage and not storage.requires_grad and len(cache) == 4


def test_a_refused_call_under_autograd_leaves_the_earlier_steps_backward_working() -> None:
    """A call that raises after a recorded step restores the storage that step's graph saved, untouched:
    its backward still runs."""

    def buggy(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a bug in the score_mod")

    m = az.MultiHeadAttention(32, 4, 0.0, num_kv_heads=2)
    cache = az.KVCache(2, 8, 2, 8)
    out = m(torch.randn(2, 4, 32), cache=cache)
    snap = snapshot(cache)
    m.score_mod = buggy
    with pytest.raises(RuntimeError, match="a bug in the score_mod"):
        m(torch.randn(2, 2, 32), cache=cache)
    assert len(cache) == 4 and torch.equal(cache.k.detach(), snap[1]) and torch.equal(cache.v.detach(), snap[2])
    out.sum().backward()
    assert m.W_k.weight.grad is not None


def test_only_the_query_trained_still_keeps_what_each_step_saw() -> None:
    """W_k and W_v frozen: the new keys need no gradient, but attention saved them for dq — a later
    step writing into them in place broke the backward."""
    torch.manual_seed(2)
    m = az.MultiHeadAttention(32, 4, 0.0, num_kv_heads=2).double()
    m.W_k.requires_grad_(False)
    m.W_v.requires_grad_(False)
    x = torch.randn(2, 4, 32, dtype=torch.float64)
    decode_in_pieces(m, x, [2, 1, 1], az.KVCache(2, 8, 2, 8, dtype=torch.float64)).square().sum().backward()
    assert m.W_q.weight.grad is not None
    got = m.W_q.weight.grad.clone()
    m.zero_grad()
    m(x, causal=True).square().sum().backward()
    torch.testing.assert_close(got, m.W_q.weight.grad, rtol=0, atol=1e-10)


def test_reset_and_truncate_under_autograd_start_from_the_kept_tokens_only() -> None:
    """One cache over several sequences, each with its backward: reset drops the earlier sequences'
    graphs (the storage kept them, and a backward ran into the freed ones), and truncate to a prompt
    decoded without gradients keeps only the prompt."""
    torch.manual_seed(3)
    m = az.MultiHeadAttention(32, 4, 0.0, num_kv_heads=2).double()
    cache = az.KVCache(2, 8, 2, 8, dtype=torch.float64)
    for _ in range(3):
        cache.reset()
        x = torch.randn(2, 3, 32, dtype=torch.float64)
        m.zero_grad()
        decode_in_pieces(m, x, [1, 1, 1], cache).square().sum().backward()
        got = m.W_k.weight.grad.clone()  # type: ignore[union-attr]
        m.zero_grad()
        m(x, causal=True).square().sum().backward()
        torch.testing.assert_close(got, m.W_k.weight.grad, rtol=0, atol=1e-10)
    prompt = torch.randn(2, 2, 32, dtype=torch.float64)
    with torch.no_grad():
        cache.reset()
        m(prompt, cache=cache)
    for _ in range(2):
        cache.truncate(2)
        x = torch.randn(2, 1, 32, dtype=torch.float64)
        m.zero_grad()
        m(x, cache=cache).square().sum().backward()
        got = m.W_q.weight.grad.clone()  # type: ignore[union-attr]
        m.zero_grad()
        m(torch.cat([prompt, x], dim=1), causal=True)[:, 2:].square().sum().backward()
        torch.testing.assert_close(got, m.W_q.weight.grad, rtol=0, atol=1e-10)
        assert len(cache) == 3
    cache.reset()
    assert not cache.k.requires_grad and not cache.v.requires_grad


def test_inference_mode_after_a_recorded_step_leaves_a_storage_later_steps_can_write() -> None:
    m = az.MultiHeadAttention(32, 4, 0.0, num_kv_heads=2)
    cache = az.KVCache(1, 8, 2, 8)
    m(torch.randn(1, 2, 32), cache=cache)
    with torch.inference_mode():
        m(torch.randn(1, 1, 32), cache=cache)
    assert not cache.k.is_inference()
    with torch.no_grad():
        m(torch.randn(1, 1, 32), cache=cache)
        m(torch.randn(1, 1, 32), cache=cache)
    assert len(cache) == 5


def test_a_step_without_gradients_keeps_the_earlier_tokens_gradients() -> None:
    """Steps under no_grad or inference_mode between recorded ones: the earlier tokens' gradients
    still arrive (the copy keeps the stored rows' graph), the unrecorded tokens bring none."""
    torch.manual_seed(4)
    F64 = torch.float64
    for mode in (torch.no_grad, torch.inference_mode):
        k1, v1, k3, v3 = (torch.randn(1, 1, 2, 4, dtype=F64, requires_grad=True) for _ in range(4))
        k2, v2 = torch.randn(1, 1, 1, 4, dtype=F64), torch.randn(1, 1, 1, 4, dtype=F64)
        q = torch.randn(1, 1, 1, 4, dtype=F64)
        cache = az.KVCache(1, 8, 1, 4, dtype=F64)
        cache.update(k1, v1)
        with mode():
            cache.update(k2, v2)
        got = torch.autograd.grad(az.attention(q, *cache.update(k3, v3)).sum(), (k1, v1, k3, v3))
        k_all, v_all = torch.cat([k1, k2, k3], dim=2), torch.cat([v1, v2, v3], dim=2)
        want = torch.autograd.grad(az.attention(q, k_all, v_all).sum(), (k1, v1, k3, v3))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_truncate_keeps_the_values_stored_not_the_tensors_given_now() -> None:
    """A learned prefix (parameters) appended with a gradient, then changed in place by an optimizer
    step: the cache holds the values it was given at the time, truncate included."""
    prefix_k, prefix_v = torch.nn.Parameter(torch.randn(1, 1, 2, 4)), torch.nn.Parameter(torch.randn(1, 1, 2, 4))
    cache = az.KVCache(1, 8, 1, 4)
    cache.update(prefix_k, prefix_v)
    stored = cache.keys().detach().clone()
    with torch.no_grad():
        prefix_k.add_(1.0)
    cache.truncate(2)
    assert torch.equal(cache.keys().detach(), stored)


def test_storage_made_or_rebuilt_under_inference_mode_can_be_written_outside_it() -> None:
    with torch.inference_mode():
        made_there = az.KVCache(1, 8, 1, 4)
    with torch.no_grad():
        made_there.update(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4))
    cache = az.KVCache(1, 8, 1, 4)
    cache.update(torch.randn(1, 1, 1, 4, requires_grad=True), torch.randn(1, 1, 1, 4))
    with torch.inference_mode():
        cache.update(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
        cache.reset()
        cache.update(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4))
    with torch.no_grad():
        cache.update(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
    assert len(made_there) == 2 and len(cache) == 3 and not cache.k.is_inference()


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # (torch's forward_ad import)
def test_forward_mode_tangents_pass_through_every_kind_of_step() -> None:
    """no_grad does not stop forward-mode AD: a step under it after a recorded one (a copy of the
    storage) keeps its keys' tangent, as torch.cat does."""
    import torch.autograd.forward_ad as fwAD

    zero, one = torch.zeros(1, 1, 1, 2, dtype=torch.float64), torch.ones(1, 1, 1, 2, dtype=torch.float64)
    cache = az.KVCache(1, 4, 1, 2, dtype=torch.float64)
    with fwAD.dual_level():
        cache.update(fwAD.make_dual(zero, one), zero)
        with torch.no_grad():
            cache.update(fwAD.make_dual(zero, one), zero)
        tangent = fwAD.unpack_dual(cache.keys()).tangent
    assert tangent is not None and torch.equal(tangent, torch.ones(1, 1, 2, 2, dtype=torch.float64))


def test_a_no_grad_step_after_a_recorded_one_does_not_write_into_what_it_saved() -> None:
    """Only q needs a gradient (the storage never has one): the recorded step saved the storage's
    views for dq, so the no_grad step after it still writes into a copy."""
    q = torch.randn(1, 1, 1, 4, dtype=torch.float64, requires_grad=True)
    k1, v1 = torch.randn(1, 1, 2, 4, dtype=torch.float64), torch.randn(1, 1, 2, 4, dtype=torch.float64)
    cache = az.KVCache(1, 8, 1, 4, dtype=torch.float64)
    out = az.attention(q, *cache.update(k1, v1))
    with torch.no_grad():
        cache.update(torch.randn(1, 1, 1, 4, dtype=torch.float64), torch.randn(1, 1, 1, 4, dtype=torch.float64))
    (got,) = torch.autograd.grad(out.sum(), q)
    (want,) = torch.autograd.grad(az.attention(q, k1, v1).sum(), q)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
