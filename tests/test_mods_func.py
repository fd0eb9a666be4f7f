"""torch.func with score_mod: ``az.attention(..., score_mod=...)`` on the reference backend and
``attnzero.flex.flex_attention`` under vmap (an extra batch-like dim), grad, vjp, jacrev,
functional_call and gradcheck with batched gradients — each against the plain call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as TF
from torch.func import functional_call, grad, jacrev, vjp, vmap

import attnzero as az
from attnzero import flex

Tensor = torch.Tensor
SLOPES = torch.tensor([0.5, 0.25], dtype=torch.float64)


def alibi(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return s - SLOPES[h] * (q - kv).abs()


def _az(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    out = az.attention(q, k, v, score_mod=alibi, causal=True, backend="reference")
    assert isinstance(out, Tensor)
    return out


BM = TF.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 6, 6, device="cpu", BLOCK_SIZE=4)


def _flex(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    out = flex.flex_attention(q, k, v, score_mod=alibi, block_mask=BM)
    assert isinstance(out, Tensor)
    return out


FNS = {"az.attention": _az, "flex_attention": _flex}


def _inputs(n: int | None = None) -> list[Tensor]:
    lead = () if n is None else (n,)
    return [torch.randn(*lead, 1, 2, 6, 3, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("name", list(FNS))
def test_vmap_over_an_extra_dim(name: str) -> None:
    fn = FNS[name]
    q, k, v = _inputs(3)
    got = vmap(fn)(q, k, v)
    torch.testing.assert_close(got, torch.stack([fn(q[i], k[i], v[i]) for i in range(3)]))


@pytest.mark.parametrize("name", list(FNS))
def test_grad_vjp_jacrev(name: str) -> None:
    fn = FNS[name]
    q, k, v = _inputs()
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    (fn(qq, kk, vv) ** 2).sum().backward()
    gq = grad(lambda x: (fn(x, k, v) ** 2).sum())(q)
    torch.testing.assert_close(gq, qq.grad)
    out, pull = vjp(fn, q, k, v)
    _, dk, dv = pull(2 * out)
    torch.testing.assert_close(dk, kk.grad)
    torch.testing.assert_close(dv, vv.grad)
    jac = jacrev(lambda x: fn(x, k, v).sum(dim=-1))(q)  # (1, 2, 6) × (1, 2, 6, 3)
    torch.testing.assert_close(jac.sum(dim=(0, 1, 2)), torch.autograd.functional.jacobian(
        lambda x: fn(x, k, v).sum(dim=-1), q).sum(dim=(0, 1, 2)))  # fmt: skip


@pytest.mark.parametrize("name", list(FNS))
def test_gradcheck_with_batched_grads(name: str) -> None:
    fn = FNS[name]
    q, k, v = (t.requires_grad_() for t in _inputs())
    assert torch.autograd.gradcheck(fn, (q, k, v), check_batched_grad=True)


def test_functional_call_of_a_module_with_a_learnable_score_mod() -> None:
    class Slopes(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.slopes = torch.nn.Parameter(torch.tensor([0.5, 0.1]))

        def forward(self, s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
            return s - self.slopes[h] * (q - kv).abs()

    torch.manual_seed(0)
    mha = az.MultiHeadAttention(8, 2, dropout=0.0, score_mod=Slopes(), backend="reference")
    x = torch.randn(2, 5, 8)
    params = {n: p.detach().clone() for n, p in mha.named_parameters()}
    params["score_mod.slopes"] = torch.tensor([1.0, 2.0])
    got = functional_call(mha, params, (x,), {"causal": True})
    with torch.no_grad():
        mha.score_mod.slopes.copy_(torch.tensor([1.0, 2.0]))  # type: ignore[union-attr, operator]
    torch.testing.assert_close(got, mha(x, causal=True))
    g = grad(lambda p: functional_call(mha, p, (x,), {"causal": True}).sum())(params)
    assert g["score_mod.slopes"].abs().sum() > 0
