"""Tensors that are not plain memory, at the public entry points: fake and meta tensors (shape
inference, FakeTensorMode, make_fx), ``__torch_dispatch__`` subclasses, dispatch modes, nested
tensors and torch.jit.trace — each computes as torch's SDPA does, or is refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

import attnzero as az
from attnzero import flex
from attnzero.checks import ArgumentError, ArgumentTypeError


class Logged(torch.Tensor):
    """A wrapper subclass that runs every op on the tensor it wraps (a logging tensor, as DTensor is)."""

    elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, e: torch.Tensor) -> Logged:
        r = torch.Tensor._make_wrapper_subclass(cls, e.shape, strides=e.stride(), dtype=e.dtype, device=e.device)
        r.elem = e
        return r  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(x: Any) -> Any:
            return x.elem if isinstance(x, Logged) else x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda x: Logged(x) if isinstance(x, torch.Tensor) else x, out)


CALLS = {
    "attention": lambda q, k, v: az.attention(q, k, v, causal=True),
    "drop-in": lambda q, k, v: az.scaled_dot_product_attention(q, k, v, is_causal=True),
    "flex": lambda q, k, v: flex.flex_attention(q, k, v),
    "score_mod": lambda q, k, v: az.attention(q, k, v, score_mod=lambda s, b, h, i, j: s - (i - j).abs() * 0.1),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_fake_tensors_give_shapes_forward_and_backward(call: str) -> None:
    """Under FakeTensorMode (what shape inference, torch.export's and make_fx's tracing use) the
    call goes through the custom ops' fake implementations (the CPU kernel was called with no
    memory: "The tensor has a non-zero number of elements, but its data is not allocated yet")."""
    with FakeTensorMode():
        q = torch.randn(1, 2, 4, 8, requires_grad=True)
        k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
        out = CALLS[call](q, k, v)
        (grad,) = torch.autograd.grad(out.sum(), q)
    assert isinstance(out, FakeTensor) and out.shape == (1, 2, 4, 8)
    assert isinstance(grad, FakeTensor) and grad.shape == q.shape


def test_a_module_in_training_infers_shapes_on_fake_and_meta_tensors() -> None:
    """MultiHeadAttention's default dropout drew its seed with .item(), which neither a fake nor a
    meta tensor has; torch's nn.MultiheadAttention gives the shape."""
    with FakeTensorMode():
        model = az.MultiHeadAttention(16, 2, dropout=0.1)
        x = torch.randn(2, 5, 16, requires_grad=True)
        model(x).sum().backward()
        assert isinstance(x.grad, FakeTensor)
    with torch.device("meta"):
        model = az.MultiHeadAttention(16, 2, dropout=0.1)
        out = model(torch.randn(2, 5, 16))
    assert out.is_meta and out.shape == (2, 5, 16)
    q = torch.randn(2, 4, 5, 16, device="meta")
    for got in (az.attention(q, q, q, dropout_p=0.1), az.scaled_dot_product_attention(q, q, q, dropout_p=0.1)):
        assert got.is_meta and got.shape == F.scaled_dot_product_attention(q, q, q, dropout_p=0.1).shape


def test_make_fx_traces_the_call_and_the_graph_computes_it() -> None:
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    for mode in ("fake", "symbolic"):
        graph = make_fx(lambda a, b, c: az.scaled_dot_product_attention(a, b, c, is_causal=True), tracing_mode=mode)(
            q, k, v
        )
        torch.testing.assert_close(graph(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("call", list(CALLS))
def test_a_dispatch_subclass_computes_on_what_it_wraps(call: str) -> None:
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    got = CALLS[call](Logged(q), Logged(k), Logged(v))
    assert isinstance(got, Logged)
    torch.testing.assert_close(got.elem, CALLS[call](q, k, v))


def test_under_a_dispatch_mode_the_call_is_right_and_its_gradients_too() -> None:
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False):
        out = az.attention(q, k, v, causal=True)
        got = torch.autograd.grad(out.sum(), (q, k, v))
    want_out = az.attention(q, k, v, causal=True, backend="reference")
    want = torch.autograd.grad(want_out.sum(), (q, k, v))
    torch.testing.assert_close(out, want_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_nested_tensors_are_refused_by_name() -> None:
    """torch's SDPA takes nested tensors; attnzero refuses them by the argument's name (it failed
    inside the kernel's block sizes, or in a matmul, with no word of what was wrong)."""
    seqs = [torch.randn(2, n, 8) for n in (3, 5)]
    jagged = torch.nested.nested_tensor(seqs, layout=torch.jagged)  # (B, j, H, D) jagged
    with pytest.raises(ArgumentTypeError, match=r"q: expected a dense torch\.Tensor, got a nested tensor"):
        az.attention(jagged, jagged, jagged)
    with pytest.raises(ArgumentTypeError, match=r"query: expected a dense torch\.Tensor, got a nested tensor"):
        az.scaled_dot_product_attention(jagged, jagged, jagged)


def test_torch_jit_trace_is_refused_by_name() -> None:
    q = torch.randn(1, 2, 4, 8)
    for fn in (az.attention, az.scaled_dot_product_attention):
        with pytest.raises(ArgumentError, match=r"torch\.jit\.trace: attnzero cannot be traced to TorchScript"):
            torch.jit.trace(lambda a: fn(a, a, a), (q,))  # noqa: B023 (called at once)


def test_a_double_backward_under_a_dispatch_mode_and_through_zero_sizes() -> None:
    """The custom ops' backward (eager for zero sizes and the tensors above) had no graph of its own:
    create_graph=True failed ("no autograd formula was registered"), where torch's SDPA runs it."""
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    inputs = (q, k, v, bias, sinks)

    def twice(backend: str) -> tuple[torch.Tensor, ...]:
        out, lse = az.attention(q, k, v, causal=True, sinks=sinks, bias=bias, return_lse=True, backend=backend)
        first = torch.autograd.grad((out**2).sum() + (lse**2).sum(), inputs, create_graph=True)
        return torch.autograd.grad(sum((g**2).sum() for g in first), inputs)

    want = twice("reference")
    with FlopCounterMode(display=False):
        got = twice("auto")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    empty_k = torch.randn(1, 2, 0, 8, dtype=torch.float64, requires_grad=True)
    for backend in ("reference", "flash", "auto"):
        out = az.attention(q, empty_k, empty_k, backend=backend)
        (g,) = torch.autograd.grad(out.sum() + (q**3).sum(), (q,), create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), (q,))
        torch.testing.assert_close(gg, 6 * q.detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_call_with_sinks_under_a_dispatch_mode_equals_the_eager_call(dtype: torch.dtype) -> None:
    """Without a gradient, the custom ops folded the sinks into an O already rounded to 16 bits and
    rounded again (a quarter of the elements 1 ulp off the eager call, which rounds once)."""
    q, k, v = (torch.randn(2, 4, 33, 16).to(dtype) for _ in range(3))
    sinks = torch.randn(4)
    want = az.attention(q, k, v, sinks=sinks, causal=True)
    with FlopCounterMode(display=False):
        got = az.attention(q, k, v, sinks=sinks, causal=True)
    assert torch.equal(got, want)


def test_a_dispatch_subclass_as_bias_sinks_or_mask_with_plain_q_k_v() -> None:
    """A wrapper subclass only in the bias, sinks or mask slot (q, k, v plain) reached the compiled
    kernel, which read its unallocated data: sinks 0.16 off, silently, or a crash."""
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    bias, sinks, mask = torch.randn(1, 2, 5, 5), torch.randn(2), torch.rand(1, 2, 5, 5) > 0.3
    for kw in ({"bias": bias}, {"sinks": sinks}, {"mask": mask}):
        want = az.attention(q, k, v, **kw)  # type: ignore[arg-type]
        wrapped = {name: Logged(x) for name, x in kw.items()}
        got = az.attention(q, k, v, **wrapped)  # type: ignore[arg-type]
        torch.testing.assert_close(got.elem if isinstance(got, Logged) else got, want)


class Tagged(torch.Tensor):
    """A ``__torch_function__``-only subclass (no dispatch of its own): torch's ops return it."""


@pytest.mark.parametrize("backend", ["reference", "flash", "auto"])
def test_a_torch_function_subclass_comes_back_as_itself(backend: str) -> None:
    """As ``torch.nn.functional.scaled_dot_product_attention`` does (``__torch_function__``'s
    protocol): the output is the subclass on every backend, its values and gradients the plain call's."""
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    tq, tk, tv = (x.as_subclass(Tagged).requires_grad_() for x in (q, k, v))
    assert type(torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)) is Tagged
    sdpa = az.scaled_dot_product_attention
    for got, want in (
        (az.attention(tq, tk, tv, backend=backend, causal=True), az.attention(q, k, v, backend=backend, causal=True)),
        (sdpa(tq, tk, tv, is_causal=True), sdpa(q, k, v, is_causal=True)),
    ):
        assert type(got) is Tagged
        torch.testing.assert_close(got.as_subclass(torch.Tensor), want)
    out, lse = az.attention(tq, tk, tv, backend=backend, return_lse=True)
    assert type(out) is Tagged and type(lse) is Tagged
    out.sum().backward()
    assert tq.grad is not None and tq.grad.shape == q.shape
    p = torch.nn.Parameter(q)  # (a Parameter's __torch_function__ is turned off: a plain tensor, as torch's)
    assert type(az.attention(p, p, p, backend=backend)) is torch.Tensor


def test_a_torch_function_subclass_in_the_mask_or_under_compile() -> None:
    """torch dispatches on every tensor argument (a subclass only in ``attn_mask`` / ``mask`` comes
    back too; a CausalBias is read, not dispatched); traced by dynamo the subclass's ops are traced as
    they come (fullgraph), as torch's own sdpa is."""
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    keep = (torch.rand(8, 8) > 0.3).as_subclass(Tagged)
    assert type(F.scaled_dot_product_attention(q, k, v, attn_mask=keep)) is Tagged
    assert type(az.scaled_dot_product_attention(q, k, v, attn_mask=keep)) is Tagged
    assert type(az.attention(q, k, v, mask=keep)) is Tagged
    from torch.nn.attention.bias import causal_lower_right

    tq = q.as_subclass(Tagged)
    out = az.scaled_dot_product_attention(tq, k, v, attn_mask=causal_lower_right(8, 8))
    torch.testing.assert_close(out.as_subclass(torch.Tensor), az.attention(q, k, v, causal=True))
    for fn in (az.attention, az.scaled_dot_product_attention):
        torch.compiler.reset()
        got = torch.compile(fn, backend="eager", fullgraph=True)(tq, k, v)  # (aot_eager: torch's own sdpa fails)
        assert type(got) is Tagged
        torch.testing.assert_close(got.as_subclass(torch.Tensor), az.attention(q, k, v))
