"""MultiHeadAttention's ``softcap=`` (Gemma 2) and ``sinks=`` (gpt-oss): constructor, forward,
need_weights, gradients, the KV-cache decode path — against a formula written out here in float64."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from conftest import BACKENDS
from torch import nn

import attnzero as az

backends = pytest.mark.parametrize("backend", BACKENDS)


def formula(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, weights) of one attention with every head's K/V spelled out (q, k, v (B, H, L, d)).

    Scores s = q·k / sqrt(d); with softcap c, s = c·tanh(s / c); blocked pairs −inf; with sinks a
    column holding sink[h] is appended, the softmax taken over Lk + 1 columns and the sink's column
    dropped (its value is 0). A row with nothing to attend (no key, no sink) gives 0."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, Lq, Lk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if keep is not None:
        s = s.masked_fill(~keep.expand_as(s), float("-inf"))
    if sinks is not None:
        col = sinks.view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)  # (B, H, Lq, 1)
        w = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]  # (B, H, Lq, Lk)
    else:
        w = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no key: NaN -> 0
    return w @ v, w


def manual(
    m: az.MultiHeadAttention, q_in: torch.Tensor, kv_in: torch.Tensor, keep: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    B, Lq, _ = q_in.shape
    Lk = kv_in.shape[1]
    H, Hkv, dk = m.num_heads, m.num_kv_heads, m.d_k
    q = m.W_q(q_in).view(B, Lq, H, dk).transpose(1, 2)  # (B, H, Lq, dk)
    k = m.W_k(kv_in).view(B, Lk, Hkv, dk).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)  # (B, H, Lk, dk)
    v = m.W_v(kv_in).view(B, Lk, Hkv, dk).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)  # (B, H, Lk, dk)
    out, w = formula(q, k, v, keep, m.softcap, m.sinks)
    return m.W_o(out.transpose(1, 2).reshape(B, Lq, H * dk)), w  # (B, Lq, d_model), (B, H, Lq, Lk)


def module(backend: str = "auto", num_kv_heads: int | None = None, **kw: Any) -> az.MultiHeadAttention:
    m = az.MultiHeadAttention(32, 4, 0.0, num_kv_heads=num_kv_heads, backend=backend, **kw).double().eval()
    if m.sinks is not None:
        with torch.no_grad():
            m.sinks.copy_(torch.randn(4, dtype=torch.float64) * 2)  # not the zeros it starts from
    return m


# ---------------------------------------------------------------------------------------------
# Constructor


def test_sinks_parameter_and_softcap_attribute() -> None:
    plain = az.MultiHeadAttention(32, 4)
    assert plain.softcap is None and plain.sinks is None and "sinks" not in plain.state_dict()
    m = az.MultiHeadAttention(32, 4, softcap=30, sinks=True)
    assert m.softcap == 30.0 and isinstance(m.softcap, float)
    assert isinstance(m.sinks, nn.Parameter) and m.sinks.shape == (4,) and m.sinks.requires_grad
    assert torch.equal(m.sinks, torch.zeros(4))  # gpt-oss style: exp(0) = one key's worth of weight
    assert any(p is m.sinks for p in m.parameters()) and "sinks" in m.state_dict()
    assert m.double().sinks is not None and m.sinks.dtype == torch.float64  # moves with the module
    assert "softcap=30.0" in repr(m) and "sinks=True" in repr(m)
    # A state dict with sinks loads into a module made with sinks=True, not into one without.
    other = az.MultiHeadAttention(32, 4, softcap=30, sinks=True).double()
    other.load_state_dict(m.state_dict())
    assert torch.equal(other.sinks, m.sinks)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="sinks"):
        az.MultiHeadAttention(32, 4).double().load_state_dict(m.state_dict())


@pytest.mark.parametrize(
    ("over", "exc", "msg"),
    [
        ({"softcap": 0.0}, ValueError, r"softcap: expected a finite float > 0 \(or None\), got 0\.0"),
        ({"softcap": -1}, ValueError, r"softcap: expected a finite float > 0 \(or None\), got -1"),
        ({"softcap": float("nan")}, ValueError, r"softcap: .*got nan"),
        ({"softcap": float("inf")}, ValueError, r"softcap: .*got inf"),
        ({"softcap": 10**400}, ValueError, r"softcap: expected a finite float > 0"),
        ({"softcap": True}, TypeError, r"softcap: expected None or a float > 0, got True"),
        ({"softcap": "30"}, TypeError, r"softcap: expected None or a float > 0, got '30'"),
        ({"softcap": torch.tensor(30.0)}, TypeError, r"softcap: expected None or a float > 0"),
        ({"sinks": 1}, TypeError, r"sinks: expected a bool, got 1"),
        ({"sinks": "yes"}, TypeError, r"sinks: expected a bool, got 'yes'"),
        ({"sinks": torch.zeros(4)}, TypeError, r"sinks: expected a bool"),
        ({"sinks": None}, TypeError, r"sinks: expected a bool, got None"),
        ({"bias": "no"}, TypeError, r"bias: expected a bool, got 'no'"),  # (was taken: a truthy string)
        ({"bias": None}, TypeError, r"bias: expected a bool, got None"),  # (was taken as False)
    ],
    ids=[
        *("cap0", "cap_neg", "cap_nan", "cap_inf", "cap_huge_int", "cap_bool", "cap_str", "cap_tensor"),
        *("sinks_int", "sinks_str", "sinks_tensor", "sinks_none", "bias_str", "bias_none"),
    ],
)
def test_constructor_refuses_bad_softcap_and_sinks(over: dict[str, Any], exc: type[Exception], msg: str) -> None:
    with pytest.raises(exc, match=msg):
        az.MultiHeadAttention(32, 4, **over)


def test_new_arguments_are_keyword_only() -> None:
    with pytest.raises(TypeError, match="positional"):
        az.MultiHeadAttention(32, 4, 0.0, 30.0)  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# Forward, weights and gradients against the formula


@backends
@pytest.mark.parametrize("num_kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize(("softcap", "sinks"), [(2.0, False), (None, True), (1.5, True)], ids=["cap", "sinks", "both"])
def test_matches_formula(backend: str, num_kv_heads: int | None, softcap: float | None, sinks: bool) -> None:
    m = module(backend, num_kv_heads, softcap=softcap, sinks=sinks)
    x = torch.randn(3, 17, 32, dtype=torch.float64) * 3  # large scores: the cap bites
    want, want_w = manual(m, x, x, None)
    torch.testing.assert_close(m(x), want, rtol=1e-12, atol=1e-12)
    # Causal with a blocked row (padding mask): with sinks its weights are 0 (the sink takes all).
    keep = torch.ones(3, 1, 17, 17, dtype=torch.bool).tril()
    keep[1, :, 4] = False
    out, w = m(x, mask=keep, need_weights=True)
    want, want_w = manual(m, x, x, keep)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w, want_w, rtol=1e-12, atol=1e-12)
    assert not w[1, :, 4].any() and not out.isnan().any()
    rows = w.sum(-1)  # (B, H, Lq)
    if sinks:
        assert (rows < 1).all()  # the sink takes the rest
    else:
        torch.testing.assert_close(rows[0], torch.ones(4, 17, dtype=torch.float64))


@backends
def test_cross_attention_lq_ne_lk(backend: str) -> None:
    m = az.MultiHeadAttention(24, 3, 0.0, kdim=10, vdim=10, backend=backend, softcap=3.0, sinks=True).double().eval()
    with torch.no_grad():
        m.sinks.copy_(torch.tensor([-1.0, 0.5, 2.0]))  # type: ignore[union-attr]
    x, mem = torch.randn(2, 1, 24, dtype=torch.float64), torch.randn(2, 113, 10, dtype=torch.float64)
    kpm = torch.ones(2, 113, dtype=torch.bool)
    kpm[1, 7:] = False
    out, w = m(x, mem, mem, key_padding_mask=kpm, need_weights=True)
    want, want_w = manual(m, x, mem, kpm.view(2, 1, 1, 113))
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w, want_w, rtol=1e-12, atol=1e-12)


def test_default_sinks_take_one_key_of_weight() -> None:
    """sinks=True starts at 0: each row's weights sum to Σe^s / (1 + Σe^s)."""
    m = az.MultiHeadAttention(16, 2, 0.0, sinks=True).double().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    _, w = m(x, need_weights=True)
    _, w_plain = manual(m, x, x, None)  # the formula with the zero sinks
    torch.testing.assert_close(w, w_plain, rtol=1e-12, atol=1e-12)
    q = m.W_q(x).view(2, 5, 2, 8).transpose(1, 2)  # (B, H, L, d_k)
    k = m.W_k(x).view(2, 5, 2, 8).transpose(1, 2)  # (B, H, L, d_k)
    z = torch.exp(q @ k.transpose(-1, -2) / math.sqrt(8)).sum(-1)  # (B, H, L)
    torch.testing.assert_close(w.sum(-1), z / (1 + z), rtol=1e-12, atol=1e-12)


@backends
@pytest.mark.parametrize("num_kv_heads", [None, 2], ids=["mha", "gqa"])
def test_gradients_match_formula(backend: str, num_kv_heads: int | None) -> None:
    """dsinks, dW_* and dx against autograd through the formula, with a blocked row and a softcap."""
    m = module(backend, num_kv_heads, softcap=2.5, sinks=True)
    x = torch.randn(2, 9, 32, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    keep[0, :, 3] = False
    g = torch.randn(2, 9, 32, dtype=torch.float64)
    params = [x, *m.parameters()]
    out = m(x, mask=keep)
    assert isinstance(out, torch.Tensor)
    got = torch.autograd.grad(out, params, g)
    want = torch.autograd.grad(manual(m, x, x, keep)[0], params, g)
    names = ["x", *(n for n, _ in m.named_parameters())]
    assert "sinks" in names
    for n, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda s, n=n: f"d{n}: {s}")
    assert got[names.index("sinks")].abs().min() > 0  # every head's sink moves


def test_sinks_gradient_by_finite_differences() -> None:
    m = module("reference", 2, softcap=4.0, sinks=True)
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    assert m.sinks is not None
    assert torch.autograd.gradcheck(lambda s: torch.func.functional_call(m, {"sinks": s}, (x,)),
                                    (m.sinks.detach().clone().requires_grad_(True),))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The KV-cache decode path


@backends
@pytest.mark.parametrize(("softcap", "sinks"), [(2.0, False), (None, True), (1.5, True)], ids=["cap", "sinks", "both"])
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
def test_decode_with_cache_equals_one_causal_call(backend: str, softcap: float | None, sinks: bool, rope: bool) -> None:
    """Prefill 5 tokens, then decode 4 one by one: the same outputs as one causal call over all 9
    (the cache path passes softcap and sinks too), and the formula's."""
    m = module(backend, 2, softcap=softcap, sinks=sinks, rope=rope)
    x = torch.randn(2, 9, 32, dtype=torch.float64) * 3
    whole = m(x, causal=True)
    assert isinstance(whole, torch.Tensor)
    if not rope:
        torch.testing.assert_close(whole, manual(m, x, x, torch.ones(9, 9, dtype=torch.bool).tril())[0])
    cache = az.KVCache(2, 16, 2, 8, dtype=torch.float64)
    with torch.no_grad():
        parts = [m(x[:, :5], cache=cache)]
        parts += [m(x[:, i : i + 1], cache=cache) for i in range(5, 9)]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=1e-10, atol=1e-10)  # type: ignore[arg-type]
    # need_weights on a decode step: the formula's weights over everything cached.
    cache.truncate(8)
    with torch.no_grad():
        _, w = m(x[:, 8:], cache=cache, need_weights=True)
        _, w_all = m(x, causal=True, need_weights=True)
    torch.testing.assert_close(w, w_all[:, :, 8:], rtol=1e-10, atol=1e-10)


class RelativeBias(torch.nn.Module):
    """A learned bias per head and distance q_idx − kv_idx (T5-like), read from a table."""

    def __init__(self, heads: int, reach: int = 16) -> None:
        super().__init__()
        self.reach = reach
        self.table = torch.nn.Parameter(torch.randn(heads, 2 * reach - 1, dtype=torch.float64))

    def forward(self, score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                kv_idx: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return score + self.table[h, q_idx - kv_idx + self.reach - 1]


@backends
def test_decode_with_a_score_mod_sees_the_tokens_positions(backend: str) -> None:
    """With a cache the score_mod's q_idx is the new token's position (len(cache) + i), as kv_idx is
    the cached key's: decoding with a relative-bias table equals one causal call (it read q_idx from
    0 on every step, the bias of another distance)."""
    m = module(backend, 2, score_mod=RelativeBias(4))
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    whole = m(x, causal=True)
    cache = az.KVCache(2, 16, 2, 8, dtype=torch.float64)
    with torch.no_grad():
        parts = [m(x[:, :5], cache=cache)]
        parts += [m(x[:, i : i + 1], cache=cache) for i in range(5, 9)]
        cache.truncate(8)
        _, w = m(x[:, 8:], cache=cache, need_weights=True)
        _, w_all = m(x, causal=True, need_weights=True)
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=1e-10, atol=1e-10)  # type: ignore[arg-type]
    torch.testing.assert_close(w, w_all[:, :, 8:], rtol=1e-10, atol=1e-10)


@backends
def test_dropout_in_training_with_sinks_and_softcap(backend: str) -> None:
    """Training-mode dropout with sinks and softcap: the same seed gives the same output, another
    than in eval mode, never NaN."""
    m = az.MultiHeadAttention(16, 2, dropout=0.5, sinks=True, softcap=5.0, backend=backend).double().train()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    torch.manual_seed(3)
    a = m(x)
    torch.manual_seed(3)
    b = m(x)
    assert isinstance(a, torch.Tensor) and torch.equal(a, b) and not a.isnan().any()
    m.eval()
    assert not torch.allclose(a, m(x))  # type: ignore[arg-type]


@pytest.mark.parametrize(("q_len", "k_len", "batch"), [(0, 3, 2), (3, 3, 0), (3, 0, 2)], ids=["Lq0", "B0", "Lk0"])
def test_modules_take_zero_size_inputs(q_len: int, k_len: int, batch: int) -> None:
    """Empty inputs give empty outputs, no key gives zeros (DESIGN; torch's modules take them too):
    both modules refused them."""
    m = module("auto")
    q, kv = torch.randn(batch, q_len, 32, dtype=torch.float64), torch.randn(batch, k_len, 32, dtype=torch.float64)
    out = m(q, kv)
    assert isinstance(out, torch.Tensor) and out.shape == (batch, q_len, 32) and not out.isnan().any()
    o, w = az.ScaledDotProductAttention()(q, kv, kv)
    assert o.shape == (batch, q_len, 32) and w.shape == (batch, q_len, k_len)
    assert not o.any() or k_len > 0
