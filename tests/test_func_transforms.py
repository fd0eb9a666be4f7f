"""attnzero under torch.func: vmap (any dim, nested), grad, vjp, jacrev, jacfwd, functional_call and
gradcheck / gradgradcheck with batched gradients — on every backend (``batching.py``).

Every result is checked against the float64 formula (the reference backend's autograd, which
functorch takes op by op), and a vmapped call against the same call on each slice.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import BACKENDS, absent
from torch.func import functional_call, grad, jacfwd, jacrev, vjp, vmap

import attnzero as az
from attnzero import functional

F64 = torch.float64
ALL = [*BACKENDS, "triton"]


def _need(backend: str) -> None:
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:  # a dev extra: under CI its absence fails
            absent("backend='triton' needs `pip install triton`")


def rand(*shape: int, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64).requires_grad_(grad)


def attend(backend: str, **kw: Any) -> Callable[..., torch.Tensor]:
    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = az.attention(q, k, v, backend=backend, **kw)  # type: ignore[arg-type]
        assert isinstance(out, torch.Tensor)
        return out

    return f


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


OPTIONS: list[dict[str, Any]] = [
    {},
    {"causal": True},
    {"window": (2, 1), "softcap": 2.0},
    {"mask": az.masks.causal(5, 6) & az.masks.window(5, 6, left=3)},
]


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("dim", [0, 1, 3])
def test_vmap_any_dim_equals_each_slice(backend: str, dim: int) -> None:
    """vmap over a batch-like dim in any position (before B, between heads and rows, ...) equals
    the call on each slice, on every backend, with GQA, masks, softcap and causal."""
    _need(backend)
    V = 3
    for opts in OPTIONS[: 2 if backend == "triton" else None]:
        q, k, v = rand(2, 4, 5, 8), rand(2, 2, 6, 8), rand(2, 2, 6, 8)
        qs, ks, vs = (torch.stack([x + i for i in range(V)], dim=dim) for x in (q, k, v))
        f = attend(backend, **opts)
        got = vmap(f, in_dims=dim)(qs, ks, vs)
        want = torch.stack([attend("reference", **opts)(q + i, k + i, v + i) for i in range(V)])
        close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_nested_and_unbatched_inputs(backend: str) -> None:
    """Nested vmaps, and inputs that one vmap batches and the other does not (k, v shared)."""
    q, k, v = rand(3, 2, 1, 4, 5, 8), rand(1, 4, 6, 8), rand(1, 4, 6, 8)
    f = attend(backend, causal=True)
    got = vmap(vmap(f, in_dims=(0, None, None)), in_dims=(0, None, None))(q, k, v)
    want = attend("reference", causal=True)(q.reshape(6, 4, 5, 8), k.expand(6, 4, 6, 8), v.expand(6, 4, 6, 8))
    close(got, want.view(3, 2, 1, 4, 5, 8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_batched_mask_bias_sinks(backend: str) -> None:
    """A vmapped bool mask, a vmapped bias and per-sample sinks are folded like q; a padding Mask
    that differs by batch entry keeps its entries."""
    V, B, H, Lq, Lk, D = 3, 2, 4, 5, 6, 8
    q, k, v = rand(V, B, H, Lq, D), rand(V, B, H, Lk, D), rand(V, B, H, Lk, D)
    mask = torch.rand(V, 1, 1, Lq, Lk) > 0.3
    mask[..., 0, :] = False  # a fully blocked row
    bias = rand(V, 1, H, Lq, Lk)
    sinks = rand(V, H)
    pad = az.masks.padding([4, 6])  # differs by batch entry

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor, b: torch.Tensor, s: torch.Tensor,
          name: str) -> torch.Tensor:  # fmt: skip
        out = az.attention(q, k, v, mask=m & pad.to_tensor() if name else m, bias=b, sinks=s, backend=name or backend)
        assert isinstance(out, torch.Tensor)
        return out

    got = vmap(lambda *a: f(*a, name=backend))(q, k, v, mask, bias, sinks)
    want = torch.stack([f(q[i], k[i], v[i], mask[i], bias[i], sinks[i], name="reference") for i in range(V)])
    close(got, want)
    assert not got.isnan().any()


@pytest.mark.parametrize("backend", ALL)
def test_grad_vjp_jacrev_jacfwd_match_the_formula(backend: str) -> None:
    """grad, vjp, jacrev, jacfwd and the hessian of attention w.r.t. q, k, v, bias and sinks equal
    those of the float64 formula."""
    _need(backend)
    q, k, v, bias, sinks = rand(1, 2, 3, 4), rand(1, 1, 4, 4), rand(1, 1, 4, 4), rand(1, 2, 3, 4), rand(2)

    def f(name: str) -> Callable[..., torch.Tensor]:
        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            out = az.attention(q, k, v, bias=b, sinks=s, causal=True, backend=name)  # type: ignore[arg-type]
            assert isinstance(out, torch.Tensor)
            return out

        return run

    args = (q, k, v, bias, sinks)
    def hessian(name: str) -> torch.Tensor:
        return torch.func.hessian(lambda q: f(name)(q, *args[1:]).sin().sum())(q)

    close(hessian(backend), hessian("reference"))  # second derivatives: the backward's own graph
    for transform in (
        lambda fn: grad(lambda *a: fn(*a).square().sum(), argnums=(0, 1, 2, 3, 4))(*args),
        lambda fn: vjp(fn, *args)[1](torch.ones(1, 2, 3, 4, dtype=F64)),
        lambda fn: jacrev(fn, argnums=(0, 1, 2, 3, 4))(*args),
        lambda fn: jacfwd(fn, argnums=(0, 3))(*args),
    ):
        for got, want in zip(transform(f(backend)), transform(f("reference"))):
            close(got, want)


@pytest.mark.parametrize("backend", ALL)
def test_gradcheck_and_gradgradcheck_with_batched_grad(backend: str) -> None:
    """torch's own checks with check_batched_grad=True (how 8 of PyTorch's SDPA tests call them)."""
    _need(backend)
    q, k, v = rand(1, 2, 3, 4, grad=True), rand(1, 1, 4, 4, grad=True), rand(1, 1, 4, 4, grad=True)
    bias = rand(1, 1, 3, 4, grad=True)

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = az.attention(q, k, v, bias=b, causal=True, backend=backend)  # type: ignore[arg-type]
        assert isinstance(out, torch.Tensor)
        return out

    assert torch.autograd.gradcheck(f, (q, k, v, bias), check_batched_grad=True)
    assert torch.autograd.gradgradcheck(f, (q, k, v, bias), check_batched_grad=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_drop_in_under_gradcheck_vmap_and_jacrev(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDPA drop-in: gradcheck with batched grads (torch's test pattern), vmap over a dim in the
    middle, jacrev — with a float mask and torch's top-left causal."""
    monkeypatch.setattr(functional, "_auto", lambda q, v: backend)
    q, k, v = rand(2, 3, 4, grad=True), rand(2, 5, 4, grad=True), rand(2, 5, 4, grad=True)
    sdpa = az.scaled_dot_product_attention
    assert torch.autograd.gradcheck(lambda q, k, v: sdpa(q, k, v, is_causal=True), (q, k, v), check_batched_grad=True)
    m = rand(3, 5)
    assert torch.autograd.gradcheck(lambda q, k, v: sdpa(q, k, v, attn_mask=m), (q, k, v), check_batched_grad=True)
    qs, ks, vs = rand(2, 4, 3, 4), rand(2, 4, 5, 4), rand(2, 4, 5, 4)
    got = vmap(lambda q, k, v: sdpa(q, k, v, is_causal=True), in_dims=1)(qs, ks, vs)
    want = torch.stack([torch.nn.functional.scaled_dot_product_attention(
        qs[:, i], ks[:, i], vs[:, i], is_causal=True) for i in range(4)])  # fmt: skip
    close(got, want)
    theirs = torch.nn.functional.scaled_dot_product_attention
    k0, v0 = k.detach(), v.detach()
    close(jacrev(lambda q: sdpa(q, k0, v0))(q.detach()), jacrev(lambda q: theirs(q, k0, v0))(q.detach()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_sample_gradients_of_a_module(backend: str) -> None:
    """functional_call + vmap(grad(...)): per-sample gradients of MultiHeadAttention's weights
    equal the gradients of each sample alone."""
    torch.manual_seed(0)
    mha = az.MultiHeadAttention(16, 4, dropout=0.0, backend=backend).double()
    params = {n: p.detach() for n, p in mha.named_parameters()}
    x = rand(3, 5, 16)

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
        return functional_call(mha, p, (xi[None], xi[None], xi[None]), {"causal": True}).square().sum()

    got = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for i in range(3):
        mha.zero_grad()
        ref = az.MultiHeadAttention(16, 4, dropout=0.0, backend="reference").double()
        ref.load_state_dict(mha.state_dict())
        ref(x[i : i + 1], causal=True).square().sum().backward()
        for n, p in ref.named_parameters():
            assert p.grad is not None
            close(got[n][i], p.grad)


def test_dropout_under_vmap() -> None:
    """randomness='different': each sample drops its own entries — those of the batch-folded call
    with the same seed; 'same' cannot be given by a fold and is refused; the default 'error' raises
    torch's own error, as for torch's SDPA."""
    q, k, v = rand(3, 2, 4, 5, 8), rand(3, 2, 4, 6, 8), rand(3, 2, 4, 6, 8)
    f = attend("flash", dropout_p=0.3)
    torch.manual_seed(5)
    got = vmap(f, randomness="different")(q, k, v)
    torch.manual_seed(5)
    want = attend("reference", dropout_p=0.3)(q.reshape(6, 4, 5, 8), k.reshape(6, 4, 6, 8), v.reshape(6, 4, 6, 8))
    close(got, want.view(3, 2, 4, 5, 8))
    with pytest.raises(ValueError, match="randomness='same'"):
        vmap(f, randomness="same")(q, k, v)
    with pytest.raises(RuntimeError, match="randomness"):
        vmap(f)(q, k, v)


@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_grad_with_dropout_equals_the_backward(backend: str) -> None:
    """torch.func.grad runs the formula's backward (a graph of the gradients): with dropout, dV takes
    the kept entries, as the backend's own backward does with the same seed."""
    q, k, v = rand(2, 3, 5, 8), rand(2, 3, 6, 8), rand(2, 3, 6, 8)

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(7)
        return attend(backend, dropout_p=0.4, causal=True)(q, k, v).square().sum()

    got = grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(loss(*leaves), leaves)
    for g, w in zip(got, want):
        close(g, w)


@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_vmap_with_a_mask_that_differs_by_batch(backend: str) -> None:
    """A padding Mask of batch 2 (not vmapped) under vmap over 3 samples: each sample's batch entries
    keep their own keys — the folded call (3·2 batch entries) must not read the Mask at b = 0..5."""
    q, k, v = rand(3, 2, 2, 4, 8), rand(3, 2, 2, 6, 8), rand(3, 2, 2, 6, 8)
    pad = az.masks.padding([3, 6], kv_len=6)
    got = vmap(lambda q, k, v: attend(backend, mask=pad)(q, k, v))(q, k, v)
    want = torch.stack([attend("reference", mask=pad)(q[s], k[s], v[s]) for s in range(3)])
    close(got, want)
    bias = rand(2, 1, 4, 6)  # unbatched, batch 2: stretched over the samples
    got = vmap(lambda q: attend(backend, bias=bias)(q, k[0], v[0]))(q)
    close(got, torch.stack([attend("reference", bias=bias)(q[s], k[0], v[0]) for s in range(3)]))


@pytest.mark.parametrize("seed", range(24))
def test_fuzz_vmapped_calls_against_the_golden(seed: int) -> None:
    """Random vmapped calls (dim position, sizes, GQA, causal/window/softcap/bias/mask, which inputs
    are batched, backend) equal the float64 formula on each slice, forward and per-sample grads."""
    g = torch.Generator().manual_seed(1000 + seed)

    def pick(options: list[Any]) -> Any:
        return options[int(torch.randint(len(options), (), generator=g))]

    backend = pick(BACKENDS)
    V, B = pick([1, 2, 3]), pick([1, 2])
    Hq, Hkv = pick([(1, 1), (2, 1), (4, 2), (3, 3)])
    Lq, Lk, D = pick([1, 3, 17]), pick([1, 5, 17]), pick([4, 8])
    opts: dict[str, Any] = pick([{}, {"causal": True}, {"window": (3, 0)}, {"softcap": 1.5}, {"scale": -0.7}])
    batched = [bool(torch.rand((), generator=g) < 0.7) for _ in range(3)]
    batched[0] = True
    dim = pick([0, 1, 2])
    with_bias = bool(torch.rand((), generator=g) < 0.5)

    def make(shape: tuple[int, ...], is_batched: bool) -> torch.Tensor:
        x = torch.randn(*shape, dtype=F64, generator=g)
        return torch.stack([x * (1 + 0.1 * i) for i in range(V)], dim=dim) if is_batched else x

    q = make((B, Hq, Lq, D), batched[0])
    k = make((B, Hkv, Lk, D), batched[1])
    v = make((B, Hkv, Lk, D), batched[2])
    bias = torch.randn(1, Hq, Lq, Lk, dtype=F64, generator=g) if with_bias else None
    in_dims = tuple(dim if b else None for b in batched)

    def f(name: str) -> Callable[..., torch.Tensor]:
        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = az.attention(q, k, v, bias=bias, backend=name, **opts)  # type: ignore[arg-type]
            assert isinstance(out, torch.Tensor)
            return out

        return run

    def per_slice(fn: Callable[..., Any], i: int) -> Any:
        xs = [x.select(dim, i) if b else x for x, b in zip((q, k, v), batched)]
        return fn(*xs)

    got = vmap(f(backend), in_dims=in_dims)(q, k, v)
    want = torch.stack([per_slice(f("reference"), i) for i in range(V)])
    close(got, want)
    loss = lambda name: (lambda q, k, v: f(name)(q, k, v).square().sum())  # noqa: E731
    got_g = vmap(grad(loss(backend)), in_dims=in_dims)(q, k, v)
    for i in range(V):
        close(got_g[i], per_slice(grad(loss("reference")), i))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_float32_runs_of_every_backend_under_vmap_and_grad(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """In float32 / bfloat16 backend="flash" on CPU is the compiled kernel where it is built: vmap
    folds into it and grad/vjp go through it too; the results equal the slices' within the
    tolerance rule against the float64 formula."""
    from attnzero import cpu_kernel, ops
    from attnzero.testing import assert_close_to_golden

    ran: list[str] = []
    real = ops.forward
    monkeypatch.setattr(ops, "forward", lambda name, *a, **kw: ran.append(name) or real(name, *a, **kw))

    V = 3
    q, k, v = rand(V, 2, 4, 33, 16), rand(V, 2, 2, 40, 16), rand(V, 2, 2, 40, 16)
    xs = [x.to(dtype) for x in (q, k, v)]
    gold = vmap(attend("reference", causal=True))(q, k, v)
    ref = vmap(attend("reference", causal=True))(*xs)
    for backend in ALL[:2]:
        got = vmap(attend(backend, causal=True))(*xs)
        assert got.dtype == dtype
        assert_close_to_golden(got, ref, gold, name=f"{backend} out")
    assert ran[-1] == ("cpu_kernel" if cpu_kernel.available() else "flash")  # the vmap ran the backend itself

    def loss(name: str) -> Callable[..., torch.Tensor]:
        return lambda q, k, v: attend(name, causal=True)(q, k, v).float().square().sum()

    gold_g = vmap(grad(loss("reference"), argnums=(0, 1, 2)))(q, k, v)
    ref_g = vmap(grad(loss("reference"), argnums=(0, 1, 2)))(*xs)
    got_g = vmap(grad(loss("flash"), argnums=(0, 1, 2)))(*xs)
    for g, r, w in zip(got_g, ref_g, gold_g):
        assert_close_to_golden(g, r, w, kind="grad", size=float(w.abs().max()) + 1.0)


@pytest.mark.parametrize("backend", ["auto", "flash"])
@pytest.mark.parametrize("case", ["plain", "causal+bias", "sinks", "score_mod", "requires_grad"])
def test_forward_ad_duals_keep_their_tangent(backend: str, case: str) -> None:
    """``torch.autograd.forward_ad``'s duals are neither wrapped by torch.func nor require grad: the
    float32 kernel's output had silently dropped their tangent (no kernel has a JVP; the call takes
    the formula). The tangent equals jvp of the float64 formula."""
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    table = torch.randn(2)  # a score_mod's captured per-head bias, with a tangent of its own
    tq, tk, tt = torch.randn_like(q), torch.randn_like(k), torch.randn_like(table)
    bias = torch.randn(1, 2, 5, 5)

    def f(q: torch.Tensor, k: torch.Tensor, t: torch.Tensor, name: str) -> torch.Tensor:
        kw: dict[str, Any] = {
            "plain": {},
            "causal+bias": {"causal": True, "bias": bias.to(q.dtype)},
            "sinks": {"sinks": torch.tensor([0.5, -1.0], dtype=q.dtype)},
            "score_mod": {"score_mod": lambda s, b, h, i, j: s + t[h] * (i - j)},
            "requires_grad": {"causal": True},
        }[case]
        out = az.attention(q, k, v.to(q.dtype), backend=name, **kw)  # type: ignore[arg-type]
        assert isinstance(out, torch.Tensor)
        return out

    with fwAD.dual_level():
        qd = fwAD.make_dual(q.requires_grad_(case == "requires_grad"), tq)
        got = fwAD.unpack_dual(f(qd, fwAD.make_dual(k, tk), fwAD.make_dual(table, tt), backend)).tangent
    assert got is not None, "the output lost its tangent"
    primals, tangents = (q.detach().double(), k.double(), table.double()), (tq.double(), tk.double(), tt.double())
    want = torch.func.jvp(lambda a, b, c: f(a, b, c, "reference"), primals, tangents)[1]
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "flash"])
def test_transforms_over_a_score_mods_captured_table_only(backend: str) -> None:
    """grad and vmap over the table a score_mod captures, q, k, v plain: the call takes the formula
    (the table is seen through the transform). The kernel's Function had been given the wrapped
    table: "Cannot access data pointer", or vmap's in-place size error."""
    torch.manual_seed(0)
    H, L = 2, 6
    q, k, v = (torch.randn(1, H, L, 8) for _ in range(3))

    def f(t: torch.Tensor, name: str) -> torch.Tensor:
        out = az.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + t[h, i - j + L - 1], backend=name)
        assert isinstance(out, torch.Tensor)
        return out

    table = torch.randn(H, 2 * L - 1)
    want = grad(lambda t: f(t, "reference").sum())(table)
    torch.testing.assert_close(grad(lambda t: f(t, backend).sum())(table), want)
    tables = torch.randn(3, H, 2 * L - 1)
    want_v = torch.stack([f(t, "reference") for t in tables])
    torch.testing.assert_close(vmap(lambda t: f(t, backend))(tables), want_v, rtol=1e-5, atol=1e-6)
