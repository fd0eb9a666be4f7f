"""The lse that ``return_lse=True`` gives is differentiable on every backend, as the reference's is
(``lse_grad.py``): a loss of the output and the lse gets the reference's gradients in q, k, v, bias,
sinks and a score_mod's captured tensors — the compiled CPU kernel's lse and flash.py's — over
masks, windows, GQA, softcap, dropout and fully blocked rows. (Before, only the reference's lse
had a gradient: the others' dropped its term silently.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import flash_py, need_kernel, qkv
from torch import Tensor

import attnzero as az
from attnzero import reference, testing

F64 = torch.float64


def _grads(backend: str, dtype: torch.dtype, q: Tensor, k: Tensor, v: Tensor, extra: dict[str, Tensor],
           kw: dict[str, Any], loss: Callable[[Tensor, Tensor], Tensor]) -> list[Tensor]:  # fmt: skip
    """Gradients of ``loss(out, lse)`` in q, k, v and the tensors in ``extra`` (bias, sinks, a
    captured table), with the inputs in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    more = {name: t.detach().to(dtype if name != "table" else t.dtype).requires_grad_() for name, t in extra.items()}
    call = dict(kw)
    args = {name: t for name, t in more.items() if name != "table"}
    if "table" in more:
        table = more["table"]
        call["score_mod"] = lambda s, b, h, i, j: s + table[h, i - j + 15].to(s.dtype)
    torch.manual_seed(7)  # the same dropout seed for every backend
    out, lse = az.attention(*leaves, **args, **call, backend=backend, return_lse=True)
    assert lse.requires_grad
    return list(torch.autograd.grad(loss(out, lse), [*leaves, *more.values()]))


CASES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "plain": ({}, []),
    "causal_bias": ({"causal": True}, ["bias"]),
    "window_softcap_gqa": ({"window": (5, 2), "softcap": 3.0}, []),
    "mask_with_blocked_rows": ({"mask": "rows"}, ["bias"]),
    "document": ({"mask": "document"}, []),
    "sinks": ({"causal": True}, ["sinks"]),
    "score_mod": ({"causal": True}, ["table"]),
    "dropout": ({"dropout_p": 0.3}, []),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("path", ["kernel", "flash_py"])
def test_a_loss_of_the_lse_gets_the_references_gradients(case: str, path: str) -> None:
    if path == "kernel":
        need_kernel()  # (skipped in the ATTNZERO_NO_BUILD=1 run; flash_py is this test's other half)
    kw, names = CASES[case]
    kw = dict(kw)
    B, Hq, Hkv, L, D = 2, 4, 2, 16, 8
    q, k, v = qkv(B, Hq, Hkv, L, L, D)
    if kw.get("mask") == "rows":
        keep = torch.rand(B, 1, L, L) < 0.6
        keep[:, :, 3] = False  # a fully blocked row: lse −inf, zero gradients
        kw["mask"] = keep
    elif kw.get("mask") == "document":
        kw["mask"] = az.masks.document(torch.tensor([0] * 5 + [1] * 7 + [2] * 4))
    extra = {
        "bias": torch.randn(B, 1, L, L, dtype=F64),
        "sinks": torch.randn(Hq, dtype=F64),
        "table": torch.randn(Hq, 31, dtype=torch.float32),
    }
    extra = {name: extra[name] for name in names}

    def loss(out: Tensor, lse: Tensor) -> Tensor:
        lse = torch.where(torch.isfinite(lse), lse, 0.0)
        return (out.double() * torch.linspace(-1, 1, out.shape[-1], dtype=F64)).sum() + (lse.double() ** 2).sum()

    want = _grads("reference", F64, q, k, v, extra, kw, loss)
    if path == "kernel":
        got = _grads("flash", torch.float32, q, k, v, extra, kw, loss)
    else:
        with flash_py():
            got = _grads("flash", torch.float32, q, k, v, extra, kw, loss)
    for g, w in zip(got, want):
        assert not torch.isnan(g).any()
        torch.testing.assert_close(g.double(), w.double(), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("how", ["compile", "func"])
def test_the_lse_keeps_its_gradient_under_compile_and_torch_func(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile a call whose lse may take a gradient runs the backend's op, whose backward
    adds the lse's share (``lse_grad.of_lse``) — not the reference's O(L²) formula; under torch.func
    it runs the reference's. A loss of the lse gets its gradient either way (before: dropped
    silently), with sinks too."""
    q, k, v = (t.float() for t in qkv(1, 4, 2, 9, 11, 8))
    bias, sinks = torch.randn(1, 1, 9, 11), torch.randn(4)

    def loss(q: Tensor) -> Tensor:
        out, lse = az.attention(q, k, v, bias=bias, sinks=sinks, causal=True, return_lse=True)
        return out.sum() + (lse**2).sum()

    x = q.clone().requires_grad_()
    want = torch.autograd.grad(
        (lambda o: o[0].sum() + (o[1] ** 2).sum())(
            az.attention(x, k, v, bias=bias, sinks=sinks, causal=True, return_lse=True, backend="reference")
        ),
        x,
    )[0]
    if how == "compile":
        monkeypatch.setattr(reference, "attention", lambda *a, **kw: pytest.fail("the reference ran"))
        torch._dynamo.reset()
        y = q.clone().requires_grad_()
        got = torch.autograd.grad(torch.compile(loss, backend="aot_eager")(y), y)[0]
        torch._dynamo.reset()
    else:
        got = torch.func.grad(loss)(q)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shapes", [((2, 2, 0, 4), (2, 2, 5, 4)), ((2, 2, 3, 4), (2, 2, 0, 4))], ids=["Lq0", "Lk0"])
def test_zero_sizes_with_an_lse_under_compile(shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    """A compiled call with zero queries or keys that returns its lse still goes through the op that
    answers zero sizes (the reference's traced formula serves the others): out 0-sized or 0, lse −inf."""
    q = torch.randn(*shapes[0], requires_grad=True)
    k, v = torch.randn(*shapes[1]), torch.randn(*shapes[1])
    torch._dynamo.reset()
    out, lse = torch.compile(lambda x: az.attention(x, k, v, return_lse=True), backend="aot_eager")(q)
    torch._dynamo.reset()
    assert out.shape == (*shapes[0][:3], 4) and lse.shape == shapes[0][:3]
    assert not out.any() and bool((lse == float("-inf")).all())


@pytest.mark.parametrize("extra", ["plain", "bias_sinks", "score_mod"])
@pytest.mark.parametrize("backend", ["auto", "flash"])
def test_second_order_through_the_lse(extra: str, backend: str) -> None:
    """create_graph=True through a loss of the lse (and of out): the lse's own backward computed
    numbers only, so a second derivative lost its share — or failed, with the lse alone in the loss
    (found by a sweep). Now through the formula's lse, as the output's backward does; equal to the
    reference's, first and second order, the bias, sinks and a captured table included."""
    q0, k0, v0 = qkv(1, 2, 2, 5, 7, 4)
    dl = torch.randn(1, 2, 5, dtype=F64)
    bias0, sinks0, table0 = torch.randn(1, 2, 5, 7, dtype=F64), torch.randn(2, dtype=F64), torch.randn(2, 16, dtype=F64)
    res = {}
    for name in (backend, "reference"):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        leaves = [q, k, v]
        kw: dict[str, Any] = {"causal": True}
        if extra == "bias_sinks":
            kw["bias"], kw["sinks"] = bias0.clone().requires_grad_(), sinks0.clone().requires_grad_()
            leaves += [kw["bias"], kw["sinks"]]
        elif extra == "score_mod":
            table = table0.clone().requires_grad_()
            kw["score_mod"] = lambda s, b, h, i, j, table=table: s + table[h, i - j + 8]
            leaves.append(table)
        out, lse = az.attention(q, k, v, backend=name, return_lse=True, **kw)  # type: ignore[arg-type]
        for loss in ((lse * dl).sum(), (lse * dl).sum() + out.square().sum()):
            first = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
            pen = sum((g.square().sum() for g in first if g is not None), torch.zeros((), dtype=F64))
            second = torch.autograd.grad(pen, leaves, allow_unused=True, retain_graph=True)
            res.setdefault(name, []).extend([*(g.detach() for g in first if g is not None),
                                             *(g for g in second if g is not None)])  # fmt: skip
    assert len(res[backend]) == len(res["reference"])
    for got, want in zip(res[backend], res["reference"]):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("path", ["kernel", "flash_py"])
def test_a_16_bit_lse_gradient_is_not_rounded_to_16_bits(path: str) -> None:
    """The lse's gradient enters its backward as float32 (the accumulator), as the reference's does:
    rounded to bfloat16 first, a float32 tensor the score_mod captures got an error of 0.08 where the
    bfloat16 reference's was 0 (one key, so its gradient is the lse's alone)."""
    if path == "kernel":
        need_kernel()
    torch.manual_seed(0)
    q, k, v = qkv(1, 2, 1, 17, 1, 40)
    slopes, dlse = torch.rand(2), torch.randn(1, 2, 17, dtype=F64)

    def grad_of_slopes(backend: str, dtype: torch.dtype) -> Tensor:
        s = slopes.clone().requires_grad_()
        args = (q.to(dtype), k.to(dtype), v.to(dtype))
        _, lse = az.attention(*args, score_mod=lambda x, b, h, i, j: x - s[h] * (i - j), backend=backend,
                              return_lse=True)  # fmt: skip
        (lse.double() * dlse).sum().backward()
        assert s.grad is not None
        return s.grad

    golden, ref = grad_of_slopes("reference", F64), grad_of_slopes("reference", torch.bfloat16)
    if path == "kernel":
        got = grad_of_slopes("flash", torch.bfloat16)
    else:
        with flash_py():
            got = grad_of_slopes("flash", torch.bfloat16)
    v = testing.verdict(got, ref, golden, kind="grad", name="slopes' gradient")  # float32 slopes: its floor
    assert v.ok, v.message
