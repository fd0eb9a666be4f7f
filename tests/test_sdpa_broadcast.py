"""The drop-in broadcasts the leading dims of query, key, value (and attn_mask) as torch's SDPA does.

torch's ``scaled_dot_product_attention`` broadcasts every dim before (L, E): a key/value with 1 head
against 4 query heads, a query of batch 1 against keys of batch 2, a 3-D query against 4-D keys —
with ``enable_gqa`` the heads are grouped instead and only the batch dims broadcast. litgpt's
multi-query decoding (``n_query_groups=1``) passes exactly that at its first cached decode step.
Checked here against a float64 golden written from that rule alone (every input expanded to the
broadcast shape, grouped heads repeated), outputs and gradients — a broadcast input's gradient is
the sum over what it was broadcast to — on every backend, and against torch itself; K/V are read
without a copy; what torch refuses is refused, with torch's error class and phrase.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import BACKENDS, absent

import attnzero as az
from attnzero import functional
from attnzero.testing import assert_close_to_golden


@contextmanager
def auto_is(name: str) -> Iterator[None]:
    """The drop-in's ``backend="auto"`` made to choose ``name`` (the drop-in has no backend argument)."""
    if name == "triton":
        if importlib.util.find_spec("triton") is None:  # a dev extra: under CI its absence fails
            absent("backend='triton' needs `pip install triton`")
    old = functional._auto
    functional._auto = lambda q, v: name  # type: ignore[assignment]
    try:
        yield
    finally:
        functional._auto = old  # type: ignore[assignment]


def golden_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, gqa: bool
) -> torch.Tensor:
    """torch's SDPA as documented, in float64: leading dims broadcast (with ``gqa`` the key/value
    heads repeated to the query's first), bool mask True = attend, float mask added, ``causal``
    top-left; a row with every key blocked gives 0."""
    if gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q, k, v = (x.expand(*lead, *x.shape[-2:]) for x in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (..., Lq, Lk)
    keep = torch.ones_like(s, dtype=torch.bool)
    if causal:
        keep = keep & torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    if mask is not None and mask.dtype == torch.bool:
        keep = keep & mask
    elif mask is not None:
        s = s + mask
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s.masked_fill(~keep.any(-1, keepdim=True), 0.0), dim=-1) * keep.any(-1, keepdim=True)
    return p @ v


# (query, key, value) shapes torch accepts; the flag says enable_gqa.
SHAPES: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]] = [
    ((2, 4, 3, 16), (2, 1, 8, 16), (2, 1, 8, 16), False),  # MQA without enable_gqa: the litgpt decode step
    ((1, 4, 3, 16), (2, 4, 8, 16), (2, 4, 8, 16), False),  # a query of batch 1 against keys of batch 2
    ((2, 1, 3, 16), (2, 4, 8, 16), (2, 4, 8, 16), False),  # one query head against 4 key heads
    ((2, 4, 3, 16), (1, 4, 8, 8), (2, 4, 8, 16), False),  # key of batch 1, value of batch 2
    ((2, 4, 3, 16), (2, 1, 8, 16), (2, 4, 8, 16), False),  # one key head, 4 value heads
    ((4, 3, 16), (2, 4, 8, 16), (2, 4, 8, 16), False),  # a 3-D query against 4-D keys
    ((3, 16), (2, 8, 16), (2, 8, 16), False),  # a 2-D query against 3-D keys
    ((3, 1, 4, 3, 16), (1, 2, 1, 8, 16), (1, 2, 1, 8, 16), False),  # 5-D, every dim broadcast
    ((2, 4, 3, 16), (2, 2, 8, 16), (2, 1, 8, 16), True),  # GQA with key and value of other head counts
    ((1, 4, 3, 16), (2, 2, 8, 16), (2, 2, 8, 16), True),  # GQA with a broadcast batch
    ((3, 2, 6, 3, 16), (3, 1, 2, 8, 16), (1, 2, 3, 8, 16), True),  # GQA, 5-D, heads 2 and 3 of 6
]


def _fix_head_dims(shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    q, k, v = shapes
    return q, (*k[:-1], q[-1]), v  # the key's head dim is the query's (a value's may differ)


def _masks(lead: tuple[int, ...], Lq: int, Lk: int) -> list[torch.Tensor | None]:
    """No mask, a bool mask and a float mask, broadcast from smaller shapes."""
    boolean = torch.rand(Lq, Lk) > 0.3
    boolean[0] = False  # a row with every key blocked
    floats = torch.randn(*lead[-1:], 1, Lk, dtype=torch.float64) if lead else torch.randn(Lq, Lk, dtype=torch.float64)
    return [None, boolean, floats]


def _run(fn: Any, inputs: list[torch.Tensor], dout: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    wrt = [x for x in leaves if x.requires_grad]
    grads = torch.autograd.grad(out, wrt, dout.to(out.dtype))
    return out.detach(), [g.detach() for g in grads]


def _shape_id(case: int) -> str:
    q, k, v, gqa = SHAPES[case]
    return f"{q}-{k}-{v}-gqa{gqa}".replace(" ", "")


# Triton's interpreter is slow on CPU: three of the shapes there (MQA, one query head, GQA).
CASES = [(b, c) for b in BACKENDS for c in range(len(SHAPES))] + [("triton", c) for c in (0, 2, 8)]


@pytest.mark.parametrize(("backend", "case"), CASES, ids=[f"{b}-{_shape_id(c)}" for b, c in CASES])
def test_broadcast_matches_golden_forward_and_backward(backend: str, case: int) -> None:
    """Every shape torch broadcasts, with no/bool/float masks and causal: output and the gradient of
    every input (a broadcast one summed over its broadcast) against the float64 golden, and the
    float32 run within the tolerance rule of the reference in float32 (triton runs float64 on the
    flash backend: there only float32 is its own)."""
    qs, ks, vs, gqa = SHAPES[case]
    qs, ks, vs = _fix_head_dims((qs, ks, vs))
    q, k, v = (torch.randn(*s, dtype=torch.float64) for s in (qs, ks, vs))
    lead = tuple(torch.broadcast_shapes(qs[:-2], ks[:-2], vs[:-2])) if not gqa else (*torch.broadcast_shapes(
        qs[:-3], ks[:-3], vs[:-3]), qs[-3])  # fmt: skip
    Lq, Lk = qs[-2], ks[-2]
    for mask in [*_masks(lead, Lq, Lk), None]:
        causal = mask is None and bool(torch.rand(()) < 0.5)
        _check_case(backend, [q, k, v] if mask is None else [q, k, v, mask], causal, gqa, (*lead, Lq, vs[-1]))


def _check_case(backend: str, inputs: list[torch.Tensor], causal: bool, gqa: bool, out_shape: tuple[int, ...]) -> None:
    def call(dtype: torch.dtype, fn: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        xs = [x.to(dtype) if x.is_floating_point() else x for x in inputs]
        dout = torch.randn(*out_shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
        return _run(lambda *a: fn(*a[:3], a[3] if len(a) > 3 else None), xs, dout)

    def drop_in(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        return az.scaled_dot_product_attention(q_, k_, v_, attn_mask=m, is_causal=causal, enable_gqa=gqa)

    gold_out, gold_grads = call(torch.float64, lambda *a: golden_sdpa(*a, causal=causal, gqa=gqa))
    with auto_is(backend if backend != "triton" else "flash"):
        out, grads = call(torch.float64, drop_in)
    assert out.shape == gold_out.shape == out_shape
    torch.testing.assert_close(out, gold_out, rtol=1e-10, atol=1e-12)
    for g, want in zip(grads, gold_grads):
        assert g.shape == want.shape
        torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-11)
    # float32: within the rule of the reference backend in float32
    with auto_is("reference"):
        ref_out, ref_grads = call(torch.float32, drop_in)
    with auto_is(backend):
        out32, grads32 = call(torch.float32, drop_in)
    assert_close_to_golden(out32, ref_out, gold_out, name="out")
    # A gradient's floor is sized by the terms it sums (conftest.grad_units, bounded here for all of
    # them at once): |dO|·|v| per ds, times |q| or |k| for dk / dq, over up to Lq rows.
    q, k, v = inputs[:3]
    dout = torch.randn(*out_shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    terms = float(dout.abs().max()) * (float(v.abs().max()) + 1) * (float(q.abs().max()) + float(k.abs().max()) + 1)
    for i, (g, r, want) in enumerate(zip(grads32, ref_grads, gold_grads)):
        size = float(want.abs().max()) + terms * q.shape[-2]
        assert_close_to_golden(g, r, want, kind="grad", name=f"grad {i}", size=size)


@pytest.mark.parametrize("case", range(len(SHAPES)), ids=_shape_id)
def test_broadcast_matches_torch(case: int) -> None:
    """The same shapes against torch's own SDPA, float64, forward and backward."""
    qs, ks, vs, gqa = SHAPES[case]
    qs, ks, vs = _fix_head_dims((qs, ks, vs))
    q, k, v = (torch.randn(*s, dtype=torch.float64) for s in (qs, ks, vs))
    for mask in [None, torch.rand(qs[-2], ks[-2]) > 0.2]:
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        ours = az.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_litgpt_multi_query_decode_step() -> None:
    """litgpt's cached decoding with n_query_groups=1 (Gemma-2B, Falcon-7B): after the prompt, each
    step attends one query per head (B, n_head, 1, hs) to the cache's single key/value head
    (B, 1, T, hs) with a bool mask row (B, 1, 1, T) — no enable_gqa — and must equal torch's."""
    torch.manual_seed(0)
    B, n_head, hs, T, prompt = 2, 8, 16, 12, 5
    wq, wk, wv = (torch.randn(32, n, dtype=torch.float64) * 0.2 for n in (n_head * hs, hs, hs))
    cache_k = torch.zeros(B, 1, T, hs, dtype=torch.float64)
    cache_v = torch.zeros(B, 1, T, hs, dtype=torch.float64)
    x = torch.randn(B, prompt + 4, 32, dtype=torch.float64)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for pos in range(prompt + 4):
        xt = x[:, pos : pos + 1]  # (B, 1, C)
        q = (xt @ wq).view(B, 1, n_head, hs).transpose(1, 2)  # (B, n_head, 1, hs)
        cache_k[:, :, pos] = (xt @ wk).view(B, 1, hs)
        cache_v[:, :, pos] = (xt @ wv).view(B, 1, hs)
        mask = causal[pos : pos + 1].view(1, 1, 1, T).expand(B, 1, 1, T)  # (B, 1, 1, T): keys 0..pos
        ours = az.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=mask)
        theirs = F.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=mask)
        assert ours.shape == (B, n_head, 1, hs)
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_key_value_are_not_copied(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key/value of one head (MQA) or of batch 1 reaches the backend as the caller's memory: the
    same storage, the single head kept (GQA's grouping) and the batch stretched with stride 0."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = functional._backend

    def spy(name: str) -> Any:
        fn = real(name)

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
            seen.append((k, v))
            return fn(q, k, v, **kw)

        return run

    monkeypatch.setattr(functional, "_backend", spy)
    with auto_is(backend):
        k, v = torch.randn(1, 1, 64, 16), torch.randn(1, 1, 64, 16)
        az.scaled_dot_product_attention(torch.randn(4, 8, 3, 16), k, v)
    (k_in, v_in), = seen
    for given, got in ((k, k_in), (v, v_in)):
        assert got.data_ptr() == given.data_ptr()
        assert got.shape == (4, 1, 64, 16) and got.stride(0) == 0


@pytest.mark.parametrize(
    ("shapes", "gqa"),
    [
        (((2, 4, 3, 16), (2, 2, 8, 16), (2, 2, 8, 16)), False),  # 2 heads against 4, no GQA
        (((2, 4, 3, 16), (3, 4, 8, 16), (3, 4, 8, 16)), False),  # batch 2 against 3
        (((2, 4, 3, 16), (2, 3, 8, 16), (2, 3, 8, 16)), True),  # 3 heads do not divide 4
        (((2, 1, 3, 16), (3, 1, 8, 16), (3, 1, 8, 16)), False),
    ],
)
def test_refuses_what_torch_refuses(shapes: tuple[tuple[int, ...], ...], gqa: bool) -> None:
    """Leading dims that do not broadcast: torch raises RuntimeError, and so does the drop-in, with
    torch's phrase in its message."""
    q, k, v = (torch.randn(*s) for s in shapes)
    with pytest.raises(RuntimeError) as theirs:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    with pytest.raises(RuntimeError) as ours:
        az.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    phrase = "Number of heads in key and value must divide" if gqa else "must match the size of tensor b"
    assert phrase in str(theirs.value) and phrase in str(ours.value)


def test_broadcast_mask_beyond_query_batch() -> None:
    """A mask may carry the broadcast batch that only the keys have (query of batch 1)."""
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    mask = torch.rand(2, 1, 3, 8) > 0.3
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ours = az.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


T = torch.randn


def _causal_lower_right(L: int, S: int) -> Any:
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(L, S)


# Misuse that torch refuses too: (call arguments, torch's phrase). Each must raise an exception that
# ``except <torch's class>`` catches and whose message contains torch's phrase, beside attnzero's own
# words naming the argument (checked in test_validation.py).
TORCH_ERRORS: list[tuple[str, Any, str]] = [
    ("mask_with_causal", lambda: (T(2, 4, 5, 8), T(2, 4, 7, 8), T(2, 4, 7, 8), torch.ones(5, 7, dtype=torch.bool), 0.0,
                                  True), "Explicit attn_mask should not be set when is_causal=True"),
    ("causal_bias_with_causal", lambda: (T(2, 4, 5, 8), T(2, 4, 5, 8), T(2, 4, 5, 8), _causal_lower_right(5, 5), 0.0,
                                         True), "CausalBias should not be used with causal=True"),
    ("query_not_tensor", lambda: ([1.0], T(2, 3), T(2, 3)), "argument 'query' (position 1) must be Tensor, not list"),
    ("one_dim", lambda: (T(3), T(2, 3), T(2, 3)), "Expected query, key, and value to all be  at least 2 dimensional"),
    ("dtypes", lambda: (T(2, 5, 8), T(2, 7, 8, dtype=torch.float64), T(2, 7, 8)),
     "Expected query, key, and value to have the same dtype, but got query.dtype: float key.dtype: double"),
    ("mask_dtype", lambda: (T(2, 5, 8), T(2, 7, 8), T(2, 7, 8), torch.zeros(5, 7, dtype=torch.float16)),
     "Expected attn_mask dtype to be bool or float or to match query dtype, but got attn_mask.dtype: c10::Half"),
    ("mask_shape", lambda: (T(2, 4, 5, 8), T(2, 4, 7, 8), T(2, 4, 7, 8), torch.ones(3, 7, dtype=torch.bool)),
     "The size of tensor a (5) must match the size of tensor b (3) at non-singleton dimension 2"),
    ("head_dim", lambda: (T(2, 4, 5, 8), T(2, 4, 7, 6), T(2, 4, 7, 8)),
     "Expected size for first two dimensions of batch2 tensor to be: [8, 8] but got: [8, 6]."),
    ("heads", lambda: (T(2, 4, 3, 16), T(2, 2, 8, 16), T(2, 2, 8, 16)),
     "The size of tensor a (4) must match the size of tensor b (2) at non-singleton dimension 1"),
    ("dropout_range", lambda: (T(2, 5, 8), T(2, 7, 8), T(2, 7, 8), None, 2.0),
     "dropout probability has to be between 0 and 1, but got 2"),
    ("dropout_type", lambda: (T(2, 5, 8), T(2, 7, 8), T(2, 7, 8), {"dropout_p": "a"}),
     "argument 'dropout_p' must be float, not str"),  # by keyword: torch names no position then
    ("causal_type", lambda: (T(2, 5, 8), T(2, 7, 8), T(2, 7, 8), {"is_causal": "a"}),
     "argument 'is_causal' must be bool, not str"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "args", "phrase"), TORCH_ERRORS, ids=[c[0] for c in TORCH_ERRORS])
def test_errors_carry_torchs_phrase(case: str, args: Any, phrase: str) -> None:
    """What torch raises for a misuse, the drop-in raises too: an exception of a class that catches
    torch's (attnzero's errors are RuntimeError and ValueError / TypeError at once), whose message
    contains torch's text, as code written against torch matches it (``assertRaisesRegex``; torch's
    fused CPU kernel lets an attn_mask beside is_causal through, its math path refuses it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    a = args()
    kw = a[-1] if isinstance(a[-1], dict) else {}
    a = a[:-1] if kw else a
    with pytest.raises(Exception) as theirs, sdpa_kernel(SDPBackend.MATH):  # torch's tests check its math path
        F.scaled_dot_product_attention(*a, **kw)
    assert phrase in str(theirs.value)
    with pytest.raises(type(theirs.value)) as ours:
        az.scaled_dot_product_attention(*a, **kw)
    assert phrase in str(ours.value)


@pytest.mark.parametrize("seed", range(20))
def test_fuzz_broadcast_shapes(seed: int) -> None:
    """Random broadcasts: an output's leading dims drawn, then each of query/key/value drops some
    leading dims and sets others to 1 (with enable_gqa: key/value heads drawn among the divisors);
    a bool or float mask of a random broadcast shape; against the float64 golden on a random backend,
    forward and backward."""
    g = torch.Generator().manual_seed(5000 + seed)

    def pick(options: list[Any]) -> Any:
        return options[int(torch.randint(len(options), (), generator=g))]

    def coin(p: float = 0.5) -> bool:
        return bool(torch.rand((), generator=g) < p)

    backend = pick(BACKENDS)
    gqa = coin(0.3)
    lead = [pick([1, 2, 3]) for _ in range(pick([0, 1, 2, 3]))]
    Hq = pick([2, 4, 6]) if gqa else None
    Lq, Lk, E, Ev = pick([1, 3, 9]), pick([1, 4, 9]), pick([4, 8]), pick([4, 8])

    def operand(last: int, heads: int | None) -> tuple[int, ...]:
        dims = [d if not coin(0.3) else 1 for d in lead]
        dims = dims[pick(list(range(len(dims) + 1))) :] if heads is None else dims
        return (*dims, *(() if heads is None else (heads,)), last, 0)  # 0: the head dim, filled in below

    if gqa:
        assert Hq is not None
        divisors = [d for d in range(1, Hq + 1) if Hq % d == 0]
        qs, ks, vs = operand(Lq, Hq), operand(Lk, pick(divisors)), operand(Lk, pick(divisors))
        out_lead = (*torch.broadcast_shapes(tuple(lead), qs[:-3], ks[:-3], vs[:-3]), Hq)
    else:
        qs, ks, vs = operand(Lq, None), operand(Lk, None), operand(Lk, None)
        out_lead = tuple(torch.broadcast_shapes(qs[:-2], ks[:-2], vs[:-2]))
    q = torch.randn(*qs[:-1], E, dtype=torch.float64, generator=g)
    k = torch.randn(*ks[:-1], E, dtype=torch.float64, generator=g)
    v = torch.randn(*vs[:-1], Ev, dtype=torch.float64, generator=g)
    inputs = [q, k, v]
    causal = False
    kind = pick(["none", "bool", "float", "causal"])
    full = (*out_lead, Lq, Lk)
    if kind in ("bool", "float"):
        shape = [d if not coin(0.5) else 1 for d in full][pick(list(range(len(full) - 1))) :]
        m = torch.rand(*shape, generator=g)
        inputs.append(m > 0.3 if kind == "bool" else m.to(torch.float64))
    causal = kind == "causal"
    _check_case(backend, inputs, causal, gqa, (*out_lead, Lq, Ev))
