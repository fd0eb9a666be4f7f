"""Zero-size inputs (DESIGN.md): B, Hq or Lq = 0 give empty outputs; Lk = 0 makes every row fully
blocked (output 0, lse −inf); D = 0 gives scores 0 (uniform weights over the kept keys, plus any
bias); Dv = 0 gives an empty output and the lse of the scores. On every value of ``backend=``, with
``return_lse``, and with gradients of the right shapes (zero where the output does not depend on an
input). The drop-in is compared with torch in test_sdpa.py."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from conftest import absent

import attnzero as az

BACKENDS = ["reference", "flash", "triton", "auto"]

# name: (B, Hq, Hkv, Lq, Lk, D, Dv)
CASES: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "B=0": (0, 4, 2, 5, 6, 8, 3),
    "Hq=Hkv=0": (2, 0, 0, 5, 6, 8, 3),
    "Hq=0": (2, 0, 2, 5, 6, 8, 3),
    "Lq=0": (2, 4, 2, 0, 6, 8, 3),
    "Lk=0": (2, 4, 2, 5, 0, 8, 3),
    "D=0": (2, 4, 2, 5, 6, 0, 3),
    "Dv=0": (2, 4, 2, 5, 6, 8, 0),
    "D=Dv=0": (2, 4, 2, 5, 6, 0, 0),
    "all=0": (0, 0, 0, 0, 0, 0, 0),
}


def _need(backend: str) -> None:
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        absent("backend='triton' needs `pip install triton`")


def _expected(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, written out for zero sizes: softmax over the kept keys of scale·q·k + bias
    (q·k = 0 for D = 0), a row without keys 0 / −inf."""
    G = q.shape[1] // max(k.shape[1], 1)
    k = k.repeat_interleave(G, dim=1)  # (B, Hq, Lk, D)
    v = v.repeat_interleave(G, dim=1)  # (B, Hq, Lk, Dv)
    scale = 1.0 / q.shape[-1] ** 0.5 if q.shape[-1] else 1.0
    s = (q @ k.transpose(-2, -1)) * scale + bias  # (B, Hq, Lq, Lk)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1) if s.shape[-1] else s.new_full(s.shape[:-1], float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # a row without keys: exp(−inf − (−inf)) → 0
    return p @ v, lse


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_zero_sizes(case: str, backend: str) -> None:
    _need(backend)
    B, Hq, Hkv, Lq, Lk, D, Dv = CASES[case]
    q = torch.randn(B, Hq, Lq, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, Lk, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, Lk, Dv, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, Hq, Lq, Lk, dtype=torch.float64, requires_grad=True)
    keep = torch.rand(B, 1, Lq, Lk) < 0.7
    if Lq and Lk:
        keep[..., 0] = True
        keep[..., -1, :] = False  # and one fully blocked row
    out, lse = az.attention(q, k, v, mask=keep, bias=bias, backend=backend, return_lse=True)  # type: ignore[misc]
    want_out, want_lse = _expected(q.detach(), k.detach(), v.detach(), keep, bias.detach())
    assert out.shape == (B, Hq, Lq, Dv) and out.dtype == q.dtype
    assert lse.shape == (B, Hq, Lq) and lse.dtype == torch.float64
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, bias), dout)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, bias)]
    want = torch.autograd.grad(_expected(*leaves[:3], keep, leaves[3])[0], leaves, dout, allow_unused=True)
    for name, g, w, x in zip("q k v bias".split(), grads, want, (q, k, v, bias)):
        assert g.shape == x.shape, name
        torch.testing.assert_close(g, torch.zeros_like(x) if w is None else w, msg=name)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_gradient_with_zero_sizes_and_sinks(case: str, backend: str) -> None:
    """The lse stays differentiable where the output cannot be: with Lk = 0 it is the sink (∂/∂sink
    = 1), with D = 0 the logsumexp of the bias and the sink (∂/∂bias: the weights)."""
    _need(backend)
    B, Hq, Hkv, Lq, Lk, D, Dv = CASES[case]
    q = torch.randn(B, Hq, Lq, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, Lk, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, Lk, Dv, dtype=torch.float64)
    bias = torch.randn(1, Hq, Lq, Lk, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(Hq, dtype=torch.float64, requires_grad=True)
    _, lse = az.attention(q, k, v, bias=bias, sinks=sinks, backend=backend, return_lse=True)  # type: ignore[misc]

    def want_lse(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        G = Hq // max(Hkv, 1)
        scale = 1.0 / D**0.5 if D else 1.0
        s = (q @ k.repeat_interleave(G, dim=1).transpose(-2, -1)) * scale + bias  # (B, Hq, Lq, Lk)
        sink = sinks.view(1, Hq, 1, 1).expand(B, Hq, Lq, 1)
        return torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)  # (B, Hq, Lq), the sink a key

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, bias, sinks)]
    want = want_lse(*leaves)
    torch.testing.assert_close(lse, want)
    w = torch.randn_like(want)
    got = torch.autograd.grad(lse, (q, k, bias, sinks), w, allow_unused=True)
    expected = torch.autograd.grad(want, leaves, w, allow_unused=True)
    for name, g, e, x in zip(("q", "k", "bias", "sinks"), got, expected, (q, k, bias, sinks)):
        g = torch.zeros_like(x) if g is None else g
        torch.testing.assert_close(g, torch.zeros_like(x) if e is None else e, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_sizes_with_causal_window_and_dropout(backend: str) -> None:
    """The other arguments are accepted with zero sizes too; D = 0 with causal is uniform over the
    kept (causal) keys."""
    _need(backend)
    q, k, v = torch.randn(1, 2, 4, 0), torch.randn(1, 2, 4, 0), torch.arange(8.0).view(1, 2, 4, 1)
    out = az.attention(q, k, v, causal=True, backend=backend)
    cumulative_mean = v.cumsum(dim=2) / torch.arange(1, 5.0).view(1, 1, 4, 1)  # row i: mean of v_0..v_i
    torch.testing.assert_close(out, cumulative_mean)
    for kw in ({"window": (1, 0)}, {"dropout_p": 0.3}, {"scale": 2.5}):
        for shapes in (((0, 2, 4, 8), (0, 2, 4, 8), (0, 2, 4, 8)), ((1, 2, 4, 8), (1, 2, 0, 8), (1, 2, 0, 8))):
            out = az.attention(*(torch.randn(s) for s in shapes), backend=backend, **kw)  # type: ignore[arg-type]
            assert out.shape == (*shapes[0][:3], shapes[2][3]) and not out.any()


@pytest.mark.parametrize("case", [c for c in CASES if c != "Dv=0"])  # weights have no Dv
def test_attention_weights_zero_sizes(case: str) -> None:
    B, Hq, Hkv, Lq, Lk, D, _ = CASES[case]
    q = torch.randn(B, Hq, Lq, D, requires_grad=True)
    k = torch.randn(B, Hkv, Lk, D, requires_grad=True)
    w = az.attention_weights(q, k, causal=True)
    assert w.shape == (B, Hq, Lq, Lk)
    if w.numel():
        assert D == 0  # every kept key equally likely: causal row i keeps i + 1 + (Lk - Lq) keys
        kept = (torch.arange(Lq).view(-1, 1) + Lk - Lq + 1).clamp(0, Lk).to(w.dtype)
        torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))
        torch.testing.assert_close(w.amax(-1), (1 / kept).view(-1).expand_as(w.amax(-1)))
    gq, gk = torch.autograd.grad(w.sum(), (q, k), allow_unused=True)
    for g, x in ((gq, q), (gk, k)):
        assert g is None or (g.shape == x.shape and not g.any())


def test_no_kv_heads_for_some_query_heads_is_refused() -> None:
    """Hq % Hkv with Hkv = 0 has no meaning (torch's SDPA with enable_gqa returns zeros for it;
    attnzero says what is wrong)."""
    kw: dict[str, Any] = {}
    with pytest.raises(ValueError, match="k: expected a number of key/value heads that divides q's 4 heads, got 0"):
        az.attention(torch.randn(1, 4, 3, 8), torch.randn(1, 0, 3, 8), torch.randn(1, 0, 3, 8), **kw)
    with pytest.raises(RuntimeError, match="key: expected a number of heads that divides query's 4"):
        az.scaled_dot_product_attention(
            torch.randn(1, 4, 3, 8), torch.randn(1, 0, 3, 8), torch.randn(1, 0, 3, 8), enable_gqa=True
        )


@pytest.mark.parametrize("case", [c for c in CASES if c != "all=0"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_sizes_with_a_score_mod(case: str, backend: str) -> None:
    """A score_mod changes nothing where there is no pair (B, Hq, Lq or Lk of 0) — Hq = 0 had raised
    ZeroDivisionError on every backend — and modifies the scores of D = 0 (each 0)."""
    _need(backend)
    B, Hq, Hkv, Lq, Lk, D, Dv = CASES[case]
    q, k, v = torch.randn(B, Hq, Lq, D), torch.randn(B, Hkv, Lk, D), torch.randn(B, Hkv, Lk, Dv)
    mod = lambda s, b, h, i, j: s + 0.5 * j  # noqa: E731
    out = az.attention(q, k, v, score_mod=mod, backend=backend)  # type: ignore[arg-type]
    assert isinstance(out, torch.Tensor) and out.shape == (B, Hq, Lq, Dv)
    want = az.attention(q.double(), k.double(), v.double(), score_mod=mod, backend="reference")
    assert isinstance(want, torch.Tensor)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)


def test_an_empty_decode_step_leaves_the_cache_as_it_was() -> None:
    """A step of no tokens through a KVCache returns (B, 0, d_model), as the module does without one
    (and torch's MultiheadAttention); the cache keeps its length, and the next step is unchanged."""
    torch.manual_seed(0)
    m = az.MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    x, nxt = torch.randn(2, 3, 16), torch.randn(2, 1, 16)
    a, b = az.KVCache(2, 10, 2, 4), az.KVCache(2, 10, 2, 4)
    m(x, cache=a)
    m(x, cache=b)
    assert m(x[:, :0], cache=a).shape == (2, 0, 16) and len(a) == 3
    k, _ = a.update(torch.randn(2, 2, 0, 4), torch.randn(2, 2, 0, 4))
    assert k.shape == (2, 2, 3, 4) and len(a) == 3
    torch.testing.assert_close(m(nxt, cache=a), m(nxt, cache=b), rtol=0, atol=0)
