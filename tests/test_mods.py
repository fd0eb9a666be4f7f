"""score_mod on ``az.attention`` (mods.py, DESIGN.md "Programmable attention"): applied to the scaled
score before softcap and bias, called as torch's Flex calls it (vmapped over 0-d int32 indices, so
reductions, integer division and autograd.Functions inside work), gradients into captured tensors,
−inf blocking a pair, refusals of wrong shapes and dtypes, and no silent run on a backend that
cannot take it."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from conftest import absent, check_against_golden, need_kernel, qkv

import attnzero as az
from attnzero import cpu_kernel, flex, mods, reference

Tensor = torch.Tensor


def _rel_bias(rel: Tensor, Lq: int, Lk: int) -> Tensor:
    """The dense (1, H, Lq, Lk) bias of ``rel[h, i - j + Lk - 1]``."""
    d = torch.arange(Lq).view(-1, 1) - torch.arange(Lk).view(1, -1) + Lk - 1  # (Lq, Lk)
    return rel[:, d].unsqueeze(0)


def test_a_relative_bias_table_equals_its_dense_bias_and_gets_its_gradient() -> None:
    B, H, Lq, Lk = 2, 4, 7, 9
    q, k, v = (t.requires_grad_() for t in qkv(B, H, 2, Lq, Lk, 8))
    rel = torch.randn(H, Lq + Lk - 1, dtype=torch.float64, requires_grad=True)

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + rel[h, q_idx - kv_idx + Lk - 1]

    out = az.attention(q, k, v, score_mod=score_mod, backend="reference")
    gq, gk, gv, grel = torch.autograd.grad(out.sum() + out.pow(2).sum(), (q, k, v, rel))
    rel2 = rel.detach().clone().requires_grad_()
    want = az.attention(q, k, v, bias=_rel_bias(rel2, Lq, Lk), backend="reference")
    wq, wk, wv, wrel = torch.autograd.grad(want.sum() + want.pow(2).sum(), (q, k, v, rel2))
    for a, b in ((out, want), (gq, wq), (gk, wk), (gv, wv), (grel, wrel)):
        torch.testing.assert_close(a, b)
    assert grel.abs().sum() > 0


def test_the_mod_comes_before_softcap_and_bias() -> None:
    """bias + cap(fn(scale·q·k)): doubling the score in the mod is doubling the scale."""
    q, k, v = qkv(1, 2, 2, 5, 6, 4)
    bias = torch.randn(1, 2, 5, 6, dtype=torch.float64)
    got = az.attention(q, k, v, bias=bias, softcap=1.5, scale=0.3, score_mod=lambda s, b, h, i, j: 2 * s)
    want = az.attention(q, k, v, bias=bias, softcap=1.5, scale=0.6)
    torch.testing.assert_close(got, want)


def test_indices_are_int32_query_heads_and_unshifted_positions() -> None:
    """GQA: ``h`` is the query head; positions are 0-based in q and k (no bottom-right shift)."""
    seen: dict[str, Any] = {}

    def score_mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        seen["dtypes"] = {b.dtype, h.dtype, i.dtype, j.dtype}
        seen["shapes"] = {b.shape, h.shape, i.shape, j.shape}
        return s + 1000.0 * b + 100.0 * h + 10.0 * i + j  # fills the grid with its own indices

    B, Hq, Hkv, Lq, Lk = 2, 4, 2, 3, 5
    s = torch.zeros(B, Hq, Lq, Lk, dtype=torch.float64)
    grid = mods.score_grid(score_mod, s)
    assert seen["dtypes"] == {torch.int32} and seen["shapes"] == {torch.Size([])}
    b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in (B, Hq, Lq, Lk)), indexing="ij")
    torch.testing.assert_close(grid, (1000 * b + 100 * h + 10 * i + j).double())
    # and through attention: the same mod as a bias, with GQA
    q, k, v = qkv(B, Hq, Hkv, Lq, Lk, 4)
    got = az.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + 0.1 * h - 0.2 * i + 0.3 * j + 0.5 * b)
    bias = (0.1 * h - 0.2 * i + 0.3 * j + 0.5 * b).double()
    torch.testing.assert_close(got, az.attention(q, k, v, bias=bias))


class _Square(torch.autograd.Function):
    """x² with its own backward and a vmap rule: what a Flex user may call inside a mod."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return x * x

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor], output: Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * g


def test_mods_that_only_run_vmapped_run() -> None:
    """What Flex's vmapped call allows and a broadcast call would get wrong or refuse: torch.dot and
    sum over captured tensors, h.new_zeros(h.shape), integer division, an autograd.Function."""
    q, k, v = qkv(1, 3, 3, 6, 6, 4)
    w = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)

    def score_mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        bump = torch.dot(w[h], w[h]) + w[h].sum() + h.new_zeros(h.shape)
        return _Square.apply(s) + bump * ((i // 2) == (j // 2))

    out = az.attention(q, k, v, score_mod=score_mod)
    same = ((torch.arange(6) // 2).view(-1, 1) == (torch.arange(6) // 2).view(1, -1)).double()  # (6, 6)
    wd = w.detach()
    bump = (wd * wd).sum(1) + wd.sum(1)  # (3,)
    scale = 4**-0.5
    s = (q @ k.transpose(-2, -1)) * scale
    bias = bump.view(1, 3, 1, 1) * same - s + s * s  # so that bias + s = s² + bump·same
    torch.testing.assert_close(out, az.attention(q, k, v, bias=bias))
    (gw,) = torch.autograd.grad(out.sum(), w)
    assert torch.isfinite(gw).all() and gw.abs().sum() > 0


def test_minus_inf_blocks_a_pair_and_a_blocked_row_is_zero() -> None:
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 4, 4, 4))

    def score_mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return torch.where((j <= i) & (i != 2), s, float("-inf"))  # causal, and row 2 blocked

    out, lse = az.attention(q, k, v, score_mod=score_mod, return_lse=True)
    keep = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    keep[2] = False
    want, wlse = az.attention(q, k, v, mask=keep, return_lse=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, wlse)
    assert (out[:, :, 2] == 0).all() and (lse[:, :, 2] == float("-inf")).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize(
    ("mod", "message"),
    [
        (lambda s, b, h, i, j: s.to(torch.float16), "dtype"),
        (lambda s, b, h, i, j: torch.stack([s, s]), "0-d"),
        (lambda s, b, h, i, j: 1.0, "torch.Tensor"),
    ],
)
def test_a_mod_that_changes_the_shape_or_dtype_is_refused(mod: Any, message: str) -> None:
    q, k, v = qkv(1, 1, 1, 3, 3, 4)
    with pytest.raises((mods.ModError, RuntimeError, ValueError), match=message):
        az.attention(q, k, v, score_mod=mod)


def test_a_score_mod_must_be_callable() -> None:
    q, k, v = qkv(1, 1, 1, 3, 3, 4)
    with pytest.raises(TypeError, match="score_mod: expected None or a function"):
        az.attention(q, k, v, score_mod=3)  # type: ignore[arg-type]


def test_triton_refuses_a_score_mod_it_cannot_generate_by_the_op_name() -> None:
    """backend="triton" runs a score_mod as generated Triton code (tests/test_triton_mods.py); one it
    cannot generate (a reduction over a captured tensor) is refused naming the op, never run elsewhere."""
    if importlib.util.find_spec("triton") is None:
        absent("backend='triton' needs `pip install triton`")
    q, k, v = (t.float() for t in qkv(1, 1, 1, 3, 3, 4))
    table = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"score_mod: cannot generate Triton code for aten\.sum"):
        az.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + table[i].sum(), backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize("case", ["plain", "causal", "softcap", "mask", "bias", "dropout"])
def test_flash_runs_a_score_mod_against_the_golden(dtype: torch.dtype, case: str) -> None:
    """flash.py's tiles apply the mod per block (before the cap and the bias) and take its derivative
    in their own backward: out, lse and the gradients of q, k, v and the bias within the tolerance
    rule of the float64 golden, on small blocks (skipped, partial and whole ones), GQA, Lq != Lk."""
    from attnzero import flash

    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def alibi(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s - slopes[h].to(s.dtype) * (i - j).abs() + (b * 0.1).to(s.dtype)

    q, k, v = qkv(2, 4, 2, 29, 37, 16)
    kw: dict[str, Any] = {
        "plain": {}, "causal": {"causal": True}, "softcap": {"softcap": 1.5, "window": (9, 2)},
        "mask": {"mask": az.masks.causal(29, 37) & az.masks.padding([37, 20])},
        "bias": {"bias": torch.randn(1, 4, 29, 37, dtype=torch.float64)}, "dropout": {"dropout_p": 0.2, "seed": 3},
    }[case]  # fmt: skip
    with flash.block_sizes(rows=8, cols=8):
        check_against_golden("flash", dtype, q, k, v, score_mod=alibi, **kw)


def test_flash_gives_captured_tensors_their_gradients() -> None:
    """A relative-position table and ALiBi slopes as Parameters: flash's own backward sums their
    gradients over the blocks it visits, equal to the reference's autograd."""
    from attnzero import flash

    H, L = 4, 23
    rel = torch.randn(H, 2 * L - 1, dtype=torch.float64, requires_grad=True)
    slopes = torch.rand(H, dtype=torch.float64, requires_grad=True)

    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s + rel[h, i - j + L - 1] - slopes[h] * (i - j).abs()

    q, k, v = (t.requires_grad_() for t in qkv(2, H, 2, L, L, 8))
    grads = {}
    for backend in ("reference", "flash"):
        with flash.block_sizes(rows=8, cols=8):
            out = az.attention(q, k, v, score_mod=mod, causal=True, backend=backend)  # type: ignore[arg-type]
        grads[backend] = torch.autograd.grad(out.square().sum(), (q, k, v, rel, slopes))
    for got, want in zip(grads["flash"], grads["reference"]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("sinks_shape", ["per_head", "per_query"])
@pytest.mark.parametrize("path", ["kernel", "flash.py"])
def test_a_score_mod_with_attention_sinks_runs_tiled_against_the_golden(
    dtype: torch.dtype, sinks_shape: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A score_mod with sinks (gpt-oss's virtual key) runs on the compiled kernel (the mod as C++) or
    flash.py's tiles, the sinks folded in their Functions (they once sent the call to the reference's
    O(L²) formula): out, lse and the gradients of q, k, v and the sinks within the tolerance rule,
    causal, GQA, Lq != Lk, small blocks."""
    from attnzero import flash, functional

    ran: list[int] = []
    if path == "flash.py":
        monkeypatch.setattr(functional, "_takes_kernel", lambda q: False)
    else:
        need_kernel()
        kernel_forward = cpu_kernel.forward
        monkeypatch.setattr(cpu_kernel, "forward", lambda *a, **kw: (ran.append(1), kernel_forward(*a, **kw))[1])

    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def alibi(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s - slopes[h].to(s.dtype) * (i - j).abs()

    q, k, v = qkv(2, 4, 2, 29, 37, 16)
    sinks = torch.randn(4, dtype=torch.float64) if sinks_shape == "per_head" else torch.randn(2, 4, 29).double()
    calls: list[str] = []
    real = reference.attention

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append("reference")
        return real(*args, **kwargs)

    with flash.block_sizes(rows=8, cols=8):
        check_against_golden("flash", dtype, q, k, v, score_mod=alibi, causal=True, sinks=sinks)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(reference, "attention", spy)
            x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
            az.attention(*x, score_mod=alibi, causal=True, sinks=sinks.to(dtype), backend="flash").sum().backward()
    assert calls == []  # not the reference
    assert bool(ran) == (path == "kernel")


def test_captured_tensors_and_sinks_get_their_gradients_on_flash_with_create_graph() -> None:
    """The captured tensors' and the sinks' gradients through flash.py's Function (and its lse's)
    equal the reference's, also with create_graph=True (autograd through the formula, sinks included)."""
    H, L = 4, 13
    rel = torch.randn(H, 2 * L - 1, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(H, dtype=torch.float64, requires_grad=True)

    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s + rel[h, i - j + L - 1]

    q, k, v = (t.requires_grad_() for t in qkv(2, H, 2, L, L, 8))
    for create_graph in (False, True):
        grads = {}
        for backend in ("reference", "flash"):
            out, lse = az.attention(q, k, v, score_mod=mod, causal=True, sinks=sinks, backend=backend,  # type: ignore[arg-type]
                                    return_lse=True)
            loss = out.square().sum() + lse.sin().sum()  # the lse's gradient too (lse_grad.py)
            grads[backend] = torch.autograd.grad(loss, (q, k, v, rel, sinks), create_graph=create_graph)
        for got, want in zip(grads["flash"], grads["reference"]):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        if create_graph:  # a gradient penalty differentiates through them
            assert all(g.requires_grad for g in grads["flash"])


def test_auto_runs_the_score_mod_never_without_it() -> None:
    q, k, v = qkv(1, 2, 2, 5, 5, 4)
    got = az.attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 0.0)
    torch.testing.assert_close(got, v.mean(dim=2, keepdim=True).expand_as(got))


class _Tables:  # a class holding a table the mod reads as _Tables.rel
    rel = torch.randn(2, 15)


def test_a_tensor_reached_by_a_default_argument_an_object_or_a_class_gets_its_gradient() -> None:
    """Besides closures and globals a mod reaches its tensors through default arguments (the
    ``t=t`` idiom), a plain object's attribute and a class's: every backend gives them the
    reference's gradient (the CPU kernel's generated code, flash.py's backward, autograd)."""
    from attnzero import flash

    class Holder:
        pass

    holder = Holder()
    rel = torch.randn(2, 15, requires_grad=True)  # float32: the score's dtype in the float32 calls
    holder.rel = torch.randn(2, 15, requires_grad=True)
    _Tables.rel.requires_grad_(True)
    ways = {
        "default": (lambda s, b, h, i, j, t=rel: s + t[h, i - j + 7], rel),
        "object": (lambda s, b, h, i, j: s + holder.rel[h, i - j + 7], holder.rel),
        "class": (lambda s, b, h, i, j: s + _Tables.rel[h, i - j + 7], _Tables.rel),
    }
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 8, 8, 4))
    for name, (mod, table) in ways.items():
        assert [id(t) for t in mods.captured_tensors(mod)] == [id(table)], name
        grads = {}
        for dtype, backend in ((torch.float64, "reference"), (torch.float32, "flash"), (torch.float64, "flash")):
            x = [t.to(dtype) for t in (q, k, v)]
            with flash.block_sizes(rows=4, cols=4):
                out = az.attention(*x, score_mod=mod, backend=backend)  # float32: the CPU kernel where built
            grads[(dtype, backend)] = torch.autograd.grad(out.square().sum(), (table,))[0]
        want = grads[(torch.float64, "reference")]
        torch.testing.assert_close(grads[(torch.float64, "flash")], want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grads[(torch.float32, "flash")], want, rtol=1e-4, atol=1e-4)


def test_a_captured_tensor_it_does_not_use_gets_none() -> None:
    q, k, v = (t.requires_grad_() for t in qkv(1, 1, 1, 3, 3, 4))
    unused = torch.ones(2, dtype=torch.float64, requires_grad=True)
    used = torch.ones(1, dtype=torch.float64, requires_grad=True)
    out = az.attention(q, k, v, score_mod=lambda s, b, h, i, j: s * used[0] + 0 * unused.detach()[0])
    g_used, g_unused = torch.autograd.grad(out.sum(), (used, unused), allow_unused=True)
    assert g_used is not None and g_unused is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_alibi_slopes_against_the_golden(dtype: torch.dtype) -> None:
    slopes = az.masks.alibi_slopes(4)  # float32: promotes no score (float32, or float64 in the golden)

    def alibi(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s - slopes[h] * (i + 3 - j).abs()  # bottom-right positions, Lk - Lq = 3

    q, k, v = qkv(2, 4, 2, 13, 16, 8)
    check_against_golden("reference", dtype, q, k, v, score_mod=alibi, causal=True)
    got = az.attention(q, k, v, score_mod=alibi, causal=True)
    torch.testing.assert_close(got, az.attention(q, k, v, bias=az.masks.alibi(4, 13, 16), causal=True))


def test_multi_head_attention_trains_a_score_mod_module() -> None:
    class Alibi(torch.nn.Module):
        def __init__(self, heads: int) -> None:
            super().__init__()
            self.slopes = torch.nn.Parameter(torch.linspace(0.1, 1.0, heads))

        def forward(self, s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return s - self.slopes[h] * (i - j).abs()

    torch.manual_seed(0)
    mha = az.MultiHeadAttention(16, 4, dropout=0.0, score_mod=Alibi(4))
    assert any(n == "score_mod.slopes" for n, _ in mha.named_parameters())
    x = torch.randn(2, 5, 16)
    out, weights = mha(x, need_weights=True, causal=True)
    out.sum().backward()
    slopes = mha.score_mod.slopes  # type: ignore[union-attr]
    assert slopes.grad is not None and slopes.grad.abs().sum() > 0
    # the same as the dense ALiBi bias
    plain = az.MultiHeadAttention(16, 4, dropout=0.0)
    plain.load_state_dict({k: v for k, v in mha.state_dict().items() if not k.startswith("score_mod")})
    d = (torch.arange(5).view(-1, 1) - torch.arange(5).view(1, -1)).abs()
    bias = -slopes.detach().view(1, 4, 1, 1) * d
    q = plain._split_heads(plain.W_q(x), 4)
    k = plain._split_heads(plain.W_k(x), 4)
    torch.testing.assert_close(weights, az.attention_weights(q, k, bias=bias, causal=True))


@pytest.mark.parametrize("backend", ["auto", "flash", "reference"])
def test_multi_head_attention_score_mod_parameter_gets_the_gradient_of_its_bias(backend: str) -> None:
    """MultiHeadAttention(score_mod=a module with a relative-bias table Parameter), GQA, causal,
    padding: output and every gradient (the input, the projections, the table) equal the same
    weights run with the table's bias written out densely (``bias=``, reference backend)."""

    class RelBias(torch.nn.Module):
        def __init__(self, heads: int, n: int) -> None:
            super().__init__()
            self.n = n
            self.table = torch.nn.Parameter(torch.randn(heads, 2 * n - 1, dtype=torch.float64))

        def forward(self, s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return s + self.table[h, i - j + self.n - 1]

    torch.manual_seed(0)
    B, L, H = 2, 7, 4
    mha = az.MultiHeadAttention(16, H, dropout=0.0, num_kv_heads=2, score_mod=RelBias(H, L), backend=backend).double()
    x = torch.randn(B, L, 16, dtype=torch.float64, requires_grad=True)
    pad = torch.ones(B, L, dtype=torch.bool)
    pad[1, 5:] = False
    out = mha(x, causal=True, key_padding_mask=pad)
    assert isinstance(out, Tensor)

    def written_out(x: Tensor) -> Tensor:
        table = mha.score_mod.table  # type: ignore[union-attr]
        d = torch.arange(L).view(-1, 1) - torch.arange(L).view(1, -1)  # (L, L): i - j
        bias = table[:, d + L - 1].unsqueeze(0)  # (1, H, L, L)
        q = mha._split_heads(mha.W_q(x), H)
        k, v = mha._split_heads(mha.W_k(x), 2), mha._split_heads(mha.W_v(x), 2)
        o = az.attention(q, k, v, bias=bias, mask=pad.view(B, 1, 1, L), causal=True, backend="reference")
        assert isinstance(o, Tensor)
        return mha.W_o(o.transpose(1, 2).reshape(B, L, 16))

    want = written_out(x)
    torch.testing.assert_close(out, want)
    dout = torch.randn_like(out)
    leaves = [x, *mha.parameters()]
    names = ["x", *(n for n, _ in mha.named_parameters())]
    assert "score_mod.table" in names
    for g, w, name in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(want, leaves, dout), names):
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"d {name}: {m}")


TABLE = torch.randn(3, 9, dtype=torch.float64, requires_grad=True)  # a global a mod reads


def test_score_block_backward_summed_over_blocks_is_autograds() -> None:
    """What a tiled backend's backward calls per block: the scores' gradient and the captured
    tensors' (found by captured_tensors in closures, globals, modules), summed over a tiling."""
    scale = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    unused = torch.ones(2, dtype=torch.float64, requires_grad=True)

    def score_mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s * scale + TABLE[h, i - j + 4]

    found = mods.captured_tensors(score_mod)
    assert any(t is TABLE for t in found) and any(t is scale for t in found) and not any(t is unused for t in found)
    module = torch.nn.Linear(2, 2)
    assert {id(t) for t in mods.captured_tensors(module)} == {id(p) for p in module.parameters()}

    s = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    g = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    x = s.clone().requires_grad_()
    want = torch.autograd.grad(mods.score_grid(score_mod, x), [x, TABLE, scale], g)
    ds = torch.zeros_like(s)
    sums: list[Tensor] = [torch.zeros_like(TABLE), torch.zeros_like(scale)]
    for r0 in (0, 2):
        for c0 in (0, 3):
            rows, cols = (r0, 5 if r0 else 2), (c0, 5 if c0 else 3)
            blk = (slice(None), slice(None), slice(*rows), slice(*cols))
            d, grads = mods.score_block_backward(
                score_mod, s[blk], g[blk], [TABLE, scale], batches=(0, 2), heads=(0, 3), rows=rows, cols=cols
            )
            ds[blk] = d
            sums = [a + (0 if b is None else b) for a, b in zip(sums, grads)]
    torch.testing.assert_close(ds, want[0])
    torch.testing.assert_close(sums[0], want[1])
    torch.testing.assert_close(sums[1], want[2])


def test_score_mod_and_a_mask_from_a_mod_trace_under_torch_compile_fullgraph() -> None:
    q, k, v = (t.float().requires_grad_() for t in qkv(1, 2, 2, 24, 24, 8))
    rel = torch.randn(2, 47)
    mask = az.masks.from_mod(lambda b, h, i, j: (j < 5) | (j <= i), 1, 1, 24, 24, block_size=8)

    def fn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = az.attention(q, k, v, mask=mask, score_mod=lambda s, b, h, i, j: s + rel[h, i - j + 23])
        assert isinstance(out, Tensor)
        return out

    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend="eager")(q, k, v)  # dynamo's tracing, no inductor build
    torch.testing.assert_close(got, fn(q, k, v))
    got.sum().backward()
    assert q.grad is not None


def test_a_mod_over_a_python_int_that_compile_makes_dynamic_runs_on_its_next_values() -> None:
    """A mod closing over an int (a decode step's offset, a window) that changes between calls: dynamo
    makes it a SymInt on its second value, and vmap's scalar wrapping of ``w * x``, ``x - w``, ``x / w``
    could not take one."""
    q, k, v = (t.float() for t in qkv(1, 2, 2, 24, 24, 8))
    table = torch.arange(0, 240, 10, dtype=torch.uint8)  # (24,)

    def fn(q: Tensor, k: Tensor, v: Tensor, w: int) -> Tensor:
        def score_mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            with_w = s - 0.1 * w * (i - j).abs() + (i + w) / (j + 1) - torch.mul(j, w) / 100 + (i - w) * 0.01
            with_w = with_w + table[j] / w * 30 + (table[j] + w) % 7  # an int table: / by w's value, + wraps
            # and numbers that are constants (the mode's change must not break them): //, %, **, 1 / x,
            # an int beyond int32's (wrapped as eager wraps it)
            plain = (i // 4 == j // 4) + 2.0 ** -(i - j).abs() + 1 / (i + 1) + (i * 3000000000) % 7 * 0.01
            return with_w + plain + s**2 * 1e-3 + 40 % (j + 1)

        def mask_mod(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return (i // w == j // w) | (j <= i - w)

        out = az.attention(q, k, v, score_mod=score_mod, mask=az.masks.from_mod(mask_mod, 1, 1, 24, 24))
        assert isinstance(out, Tensor)
        return out

    def flex_fn(q: Tensor, k: Tensor, v: Tensor, w: int) -> Tensor:
        return flex.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * w + (i < w))

    for f in (fn, flex_fn):
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, backend="eager")
        for w in (2, 3, 300, 2**32 + 5):  # (3: traced again, w a SymInt; 300, 2**32 + 5: beyond uint8's, int32's range)
            torch.testing.assert_close(compiled(q, k, v, w), f(q, k, v, w))


def test_a_disabled_call_keeps_the_eager_path_inside_a_compiled_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """README: under torch.compile a score_mod call is traced as the reference's formula; through
    ``torch.compiler.disable(az.attention)`` it runs eagerly (one graph break) — on CPU the compiled
    kernel with the mod as C++ where it is built, else flash.py — with the same result and gradients."""
    q, k, v = (t.float().requires_grad_() for t in qkv(1, 2, 2, 40, 40, 16))
    rel = torch.randn(2, 79, requires_grad=True)
    traced: list[str] = []
    real = reference.attention

    def spy(*args: Any, **kw: Any) -> Any:
        traced.append("reference")
        return real(*args, **kw)

    monkeypatch.setattr(reference, "attention", spy)
    eager_attention = torch.compiler.disable(az.attention)

    def fn(attend: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attend(q * 2.0, k, v, causal=True, score_mod=lambda s, b, h, i, j: s + rel[h, i - j + 39]) + 1.0

    torch._dynamo.reset()
    got = torch.compile(lambda *x: fn(eager_attention, *x), backend="eager")(q, k, v)
    assert traced == []  # not the formula: the eager path ran
    want = fn(az.attention, q, k, v)
    torch.testing.assert_close(got, want)
    g_got = torch.autograd.grad(got.sum(), (q, rel))
    g_want = torch.autograd.grad(want.sum(), (q, rel))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()
    torch.compile(lambda *x: fn(az.attention, *x), backend="eager")(q, k, v)
    assert traced  # without disable: the formula, traced


@pytest.mark.parametrize("how", ["x_is_q_k_v", "x_is_v", "bias_from_x"])
def test_a_mod_that_reads_an_input_with_create_graph(how: str) -> None:
    """A score_mod that reads a tensor also passed as q, k or v (or one the bias is computed from),
    differentiated with create_graph=True: the formula's gradient of the captured tensor held that
    input's path too, and autograd added it again from the input's slot (found by a sweep). First
    and second order on flash.py and the kernel equal the reference's."""
    B, H, L, D = 1, 2, 6, 4
    x0, y0 = randn_like_qkv(B, H, L, D), randn_like_qkv(B, H, L, D)
    res = {}
    for backend in ("auto", "flash", "reference"):
        x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()

        def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor, x: Tensor = x) -> Tensor:
            return s + 0.3 * x[b, h, i, j % D]

        if how == "x_is_q_k_v":
            out = az.attention(x, x, x, score_mod=mod, causal=True, backend=backend)  # type: ignore[arg-type]
        elif how == "x_is_v":
            out = az.attention(y, y, x, score_mod=mod, backend=backend)  # type: ignore[arg-type]
        else:
            bias = x.sum(dim=-1, keepdim=True) * 0.1  # (B, H, L, 1): computed from x
            out = az.attention(y, y, y, bias=bias, score_mod=mod, backend=backend)  # type: ignore[arg-type]
        gx, gy = torch.autograd.grad(out.square().sum(), (x, y), create_graph=True, allow_unused=True)
        gy = torch.zeros_like(y) if gy is None else gy
        second = torch.autograd.grad(gx.square().sum() + gy.square().sum(), (x, y), allow_unused=True)
        res[backend] = (gx.detach(), gy.detach(), *(torch.zeros_like(x0) if s is None else s for s in second))
    for backend in ("auto", "flash"):
        for got, want in zip(res[backend], res["reference"]):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def randn_like_qkv(B: int, H: int, L: int, D: int) -> Tensor:
    return torch.randn(B, H, L, D, dtype=torch.float64)


@pytest.mark.parametrize("backend", ["auto", "flash", "triton", "reference"])
def test_a_mod_that_returns_a_python_number_is_refused_by_what_it_returned(backend: str) -> None:
    """Every backend says what the reference says; the generated paths blamed "a captured tensor of
    another dtype" (make_fx had made the number a float64 / int64 tensor)."""
    _triton_ok(backend)
    q = torch.randn(1, 2, 16, 8)
    for number, kind in ((1.0, "float"), (2, "int")):
        with pytest.raises(mods.ModError, match=f"expected a 0-d torch.Tensor score per pair, got {kind}$"):
            az.attention(q, q, q, score_mod=lambda s, b, h, i, j, x=number: x, backend=backend)  # type: ignore[arg-type,misc]


def _triton_ok(backend: str) -> None:
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        absent("backend='triton' needs `pip install triton`")


# the kernel with generated C++ (float32), flash.py (float64), the Triton kernels (interpreted on CPU)
PATHS = [("auto", torch.float32), ("auto", torch.float64), ("triton", torch.float32)]


@pytest.mark.parametrize(("backend", "dtype"), PATHS, ids=["kernel", "flash_py", "triton"])
def test_a_mod_made_in_a_loop_gets_the_gradients_its_forward_computed(backend: str, dtype: torch.dtype) -> None:
    """Two layers, each a mod made in a loop that reads the loop variable (bound when the mod runs):
    the backward, which calls the mod again, reads what the forward read (``mods.pin``) — not the
    loop's last table for every layer (errors of 1e3 before, and the first table got no gradient)."""
    _triton_ok(backend)
    torch.manual_seed(0)
    B, H, L, E = 1, 2, 12, 8
    x0 = torch.randn(B, H, L, E, dtype=torch.float64)
    tables0 = [torch.randn(H, 2 * L - 1, dtype=torch.float64) for _ in range(2)]

    def grads(name: str, dt: torch.dtype) -> list[Tensor]:
        x = x0.to(dt).requires_grad_()
        tables = [t.to(dt).requires_grad_() for t in tables0]
        y = x
        for i in range(2):

            def rel(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
                return s * (1 + tables[i][h, qi - kv + L - 1])  # noqa: B023 (the late binding is the point)

            out = az.attention(y, y, y, causal=True, score_mod=rel, backend=name)  # type: ignore[arg-type]
            assert isinstance(out, Tensor)
            y = out
        return list(torch.autograd.grad(y.pow(2).sum(), [x, *tables]))

    want = grads("reference", torch.float64)
    for g, w in zip(grads(backend, dtype), want):
        torch.testing.assert_close(g.double(), w, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(("backend", "dtype"), PATHS, ids=["kernel", "flash_py", "triton"])
def test_a_captured_tensor_changed_in_place_before_the_backward_is_refused(backend: str, dtype: torch.dtype) -> None:
    """As autograd refuses a saved tensor changed in place (torch's Flex saves what its score_mod
    captures): before, the backward read the new values and gave other gradients, silently."""
    _triton_ok(backend)
    q, k, v = (t.to(dtype).requires_grad_() for t in qkv(1, 2, 2, 10, 10, 8))
    scale = (torch.rand(2, dtype=dtype) + 0.5).requires_grad_()
    out = az.attention(q, k, v, score_mod=lambda s, b, h, i, j: s * scale[h], backend=backend)  # type: ignore[arg-type]
    assert isinstance(out, Tensor)
    with torch.no_grad():
        scale.mul_(3.0)  # an optimiser step, an EMA update
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def _grads_unless_refused(out: Tensor, wrt: tuple[Tensor, ...]) -> tuple[Tensor | None, ...] | None:
    """The gradients of ``out.pow(2).sum()``, or None where the backward refuses a mod whose tensors
    changed since its forward (``mods.ModError``, naming why)."""
    try:
        return torch.autograd.grad(out.pow(2).sum(), wrt, allow_unused=True)
    except mods.ModError as e:
        assert "changed between this call's forward and its backward" in str(e)
        return None


@pytest.mark.parametrize(("backend", "dtype"), PATHS, ids=["kernel", "flash_py", "triton"])
def test_a_mod_whose_tensors_are_rebound_before_the_backward_is_refused_or_right(
    backend: str, dtype: torch.dtype
) -> None:
    """A field the mod reads is given another tensor between the forward and the backward: a backend
    whose backward calls the mod again refuses (it would differentiate another function); one that
    keeps the forward's tensors (the generated kernels) gives the forward's gradients — never the
    gradients of the new table."""
    _triton_ok(backend)

    class Holder:
        table: Tensor

    q, k, v = (t.to(dtype).requires_grad_() for t in qkv(1, 2, 2, 10, 10, 8))
    first = torch.randn(2, 19, dtype=dtype, requires_grad=True)
    holder = Holder()
    holder.table = first
    out = az.attention(
        q, k, v, score_mod=lambda s, b, h, i, j: s + holder.table[h, i - j + 9], backend=backend  # type: ignore[arg-type]
    )
    assert isinstance(out, Tensor)
    holder.table = torch.randn(2, 19, dtype=dtype, requires_grad=True)
    got = _grads_unless_refused(out, (q, first))
    if got is None:
        return
    holder.table = first
    want = az.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + holder.table[h, i - j + 9], backend="reference")
    assert isinstance(want, Tensor)
    for g, w in zip(got, torch.autograd.grad(want.pow(2).sum(), (q, first))):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("backend", "dtype"), PATHS, ids=["kernel", "flash_py", "triton"])
def test_a_module_that_rebinds_a_field_its_mod_does_not_read_keeps_its_gradients(
    backend: str, dtype: torch.dtype
) -> None:
    """The mod is a module's bound method and the module's forward rebinds another tensor field after
    the call (``self.last = out.detach()``): the backward reaches a tensor the forward did not, which
    the mod never reads — it gives the forward's gradients (it used to refuse on flash.py). One that
    rebinds the field the mod reads is still refused, or right, as above."""
    _triton_ok(backend)

    class Relative(torch.nn.Module):
        def __init__(self, rebind: str) -> None:
            super().__init__()
            self.table, self.rebind = torch.nn.Parameter(torch.randn(2, 19, dtype=dtype)), rebind

        def mod(self, s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return s + self.table[h, i - j + 9]

        def forward(self, q: Tensor, k: Tensor, v: Tensor, backend: str) -> Tensor:
            out = az.attention(q, k, v, score_mod=self.mod, backend=backend)
            assert isinstance(out, Tensor)
            if self.rebind == "last":
                self.last = out.detach()
            else:
                self.table = torch.nn.Parameter(self.table.detach() * 2)
            return out

    q, k, v = (t.to(dtype).requires_grad_() for t in qkv(1, 2, 2, 10, 10, 8))
    model = Relative("last")
    want = torch.autograd.grad(model(q, k, v, "reference").pow(2).sum(), (q, model.table))
    for _ in range(2):  # the first call adds the field, the second rebinds it
        got = torch.autograd.grad(model(q, k, v, backend).pow(2).sum(), (q, model.table))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    model = Relative("table")
    table = model.table
    got = _grads_unless_refused(model(q, k, v, backend), (q, table))
    if got is None:
        return
    model.table = table
    for g, w in zip(got, torch.autograd.grad(model(q, k, v, "reference").pow(2).sum(), (q, table))):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("change", ["buffer", "hook", "submodule buffer", "counter", "field"])
def test_a_closure_over_a_model_whose_forward_adds_state_keeps_its_gradients(change: str) -> None:
    """A score_mod closure reading ``model.alibi.slopes``; the model's forward registers a buffer or a
    hook, or sets a field, after the call (flash.py's backward, float64): the walk's key shifts where
    the new entry lands, but the table the mod reads did not change — its gradients are the forward's
    (a buffer or hook was refused: every tensor after the first difference counted as moved)."""

    class Alibi(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.slopes = torch.nn.Parameter(torch.rand(2, dtype=torch.float64))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.alibi, self.calls = Alibi(), 0

        def forward(self, q: Tensor, k: Tensor, v: Tensor, backend: str) -> Tensor:
            model = self

            def mod(score: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
                return score - model.alibi.slopes[h] * (i - j).abs()

            out = az.attention(q, k, v, score_mod=mod, backend=backend)
            assert isinstance(out, Tensor)
            if change == "buffer":
                self.register_buffer("last", out.detach())
            elif change == "hook":
                self.register_forward_hook(lambda *args: None)
            elif change == "submodule buffer":
                self.alibi.register_buffer("seen", out.detach())
            elif change == "counter":
                self.calls += 1
            else:
                self.last_out = out.detach()
            return out

    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    got_model, want_model = Model(), Model()
    want_model.load_state_dict(got_model.state_dict())
    got = torch.autograd.grad(got_model(q, k, v, "auto").sum(), (q, got_model.alibi.slopes))
    want = torch.autograd.grad(want_model(q, k, v, "reference").sum(), (q, want_model.alibi.slopes))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize(
    "how",
    ["swap", "pick another", "reverse a list", "swap dict values", "reorder nested dicts", "point elsewhere",
     "reorder a dict read by position", "keys alike"],
)  # fmt: skip
@pytest.mark.parametrize(("backend", "dtype"), PATHS, ids=["kernel", "flash_py", "triton"])
def test_a_mod_whose_fields_swap_tensors_before_the_backward_is_refused_or_right(
    backend: str, dtype: torch.dtype, how: str
) -> None:
    """Between the forward and the backward the mod's field comes to hold another tensor that the
    forward's walk also reached (two fields swapped; ``self.cur = self.tables[1]``): a backward that
    calls the mod again refuses (it gave the gradients of the other table, silently, once it probed
    only tensors the forward never met); one that keeps the forward's tensors is right."""
    _triton_ok(backend)

    class Holder:
        pass

    q, k, v = (t.to(dtype).requires_grad_() for t in qkv(1, 2, 2, 10, 10, 8))
    # (tables of two shapes: a walk's key then differs where they trade places, not only its tensors)
    a, b = (torch.randn(2, n, dtype=dtype, requires_grad=True) for n in (19, 21))
    holder = Holder()
    if how == "swap":
        holder.a, holder.b = a, b  # type: ignore[attr-defined]
    elif how == "pick another":
        holder.tables, holder.a = [a, b], a  # type: ignore[attr-defined]
    tables, named = [a, b], {"first": a, "second": b}
    nested = {"cfg": {"x": {"w": a}, "y": {"w": b}}}
    layers = [Holder(), Holder()]
    layers[0].t, layers[1].t = a, b  # type: ignore[attr-defined]
    pointer = {"layers": layers, "cur": layers[0]}

    alike = (torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))  # keys of the same repr
    by_key = {alike[0]: a, alike[1]: b}

    # one mod per case, each closing over what it reads only (the walk meets its tensors there first)
    mod = {
        "reorder a dict read by position": lambda s, bb, h, i, j: s + list(named.values())[1][h, i - j + 9] * 1e3,
        "keys alike": lambda s, bb, h, i, j: s + by_key[alike[1]][h, i - j + 9] * 1e3,
        "reorder nested dicts": lambda s, bb, h, i, j: s + nested["cfg"]["x"]["w"][h, i - j + 9] * 1e3,
        "point elsewhere": lambda s, bb, h, i, j: s + pointer["cur"].t[h, i - j + 9] * 1e3,  # type: ignore[attr-defined]
        "reverse a list": lambda s, bb, h, i, j: s + tables[1][h, i - j + 9] * 1e3,
        "swap dict values": lambda s, bb, h, i, j: s + named["second"][h, i - j + 9] * 1e3,
    }.get(how, lambda s, bb, h, i, j: s + holder.a[h, i - j + 9] * 1e3)  # type: ignore[attr-defined]

    out = az.attention(q, k, v, score_mod=mod, backend=backend)  # type: ignore[arg-type]
    assert isinstance(out, Tensor)
    if how == "reorder a dict read by position":
        named["first"] = named.pop("first")  # the same keys and tensors, another order
    elif how == "keys alike":
        by_key[alike[0]], by_key[alike[1]] = b, a
    elif how == "reorder nested dicts":  # the same inner dicts, inserted in the other order
        inner = nested["cfg"]
        nested["cfg"] = {"y": inner["x"], "x": inner["y"]}
    elif how == "point elsewhere":
        pointer["cur"] = layers[1]
    elif how == "reverse a list":
        tables.reverse()
    elif how == "swap dict values":
        named["first"], named["second"] = b, a
    else:
        holder.a = b  # type: ignore[attr-defined]
    if how == "swap":
        holder.b = a  # type: ignore[attr-defined]
    got = _grads_unless_refused(out, (q, a, b))
    if got is None:
        return
    holder.a, tables[:], named["first"], named["second"] = a, [a, b], a, b  # type: ignore[attr-defined]
    nested["cfg"], pointer["cur"] = {"x": {"w": a}, "y": {"w": b}}, layers[0]
    named.clear()
    named.update(first=a, second=b)
    by_key[alike[0]], by_key[alike[1]] = a, b
    want = az.attention(q, k, v, score_mod=mod, backend="reference")  # type: ignore[arg-type]
    assert isinstance(want, Tensor)
    for g, w in zip(got, torch.autograd.grad(want.pow(2).sum(), (q, a, b), allow_unused=True)):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("backend", "dtype"), PATHS, ids=["kernel", "flash_py", "triton"])
def test_a_mask_made_in_a_loop_stays_the_mask_it_was_made_as(backend: str, dtype: torch.dtype) -> None:
    """``az.masks.from_mod`` keeps its mask_mod's closure as it is when the Mask is made: a backward
    that evaluates the mask again sees each layer's, not the loop's last (masks.from_mod,
    mods.own_closure)."""
    _triton_ok(backend)
    torch.manual_seed(0)
    n = 24
    q0 = torch.randn(1, 2, n, 8, dtype=torch.float64)

    def two_layers(name: str, dt: torch.dtype) -> Tensor:
        q = q0.to(dt).requires_grad_()
        y = q
        for w in (0, 5):
            mm = lambda b, h, i, j: (i - j).abs() <= w  # noqa: B023, E731 (the late binding is the point)
            out = az.attention(y, y, y, mask=az.masks.from_mod(mm, 1, 1, n, n, block_size=8), backend=name)  # type: ignore[arg-type]
            assert isinstance(out, Tensor)
            y = out
        (grad,) = torch.autograd.grad(y.pow(2).sum(), q)
        return grad

    torch.testing.assert_close(two_layers(backend, dtype).double(), two_layers("reference", torch.float64),
                               rtol=1e-3, atol=1e-3)  # fmt: skip


@pytest.mark.parametrize("backend", ["auto", "flash", "triton", "reference"])
def test_a_mod_of_another_arity_is_refused_by_the_arguments_name(backend: str) -> None:
    """Python's own "takes 4 positional arguments but 5 were given" named neither score_mod nor
    mask_mod; a TypeError raised inside a mod of the right arity stays the mod's own."""
    _triton_ok(backend)
    q = torch.randn(1, 2, 8, 8)
    with pytest.raises(mods.ModError, match=r"score_mod: expected a function score_mod\(score, b, h, q_idx, kv_idx\)"):
        az.attention(q, q, q, score_mod=lambda s, b, h, i: s, backend=backend)  # type: ignore[arg-type,misc]
    with pytest.raises(mods.ModError, match=r"mask_mod: expected a function mask_mod\(b, h, q_idx, kv_idx\)"):
        az.masks.from_mod(lambda b, h, i: i >= 0, 1, 2, 8, 8)  # type: ignore[arg-type,misc]

    def own_error(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        raise TypeError("the mod's own")

    with pytest.raises((TypeError, ValueError), match="the mod's own"):  # (triton: cannot trace it, and why)
        az.attention(q, q, q, score_mod=own_error, backend=backend)  # type: ignore[arg-type]


@pytest.mark.parametrize(("backend", "dtype"), PATHS, ids=["kernel", "flash_py", "triton"])
def test_a_table_named_by_a_computed_getattr_on_a_config_module_or_class(backend: str, dtype: torch.dtype) -> None:
    """``getattr(cfg, f"table_{i}")`` on a user's module or class: the walk followed only the names in
    the code, so the table was neither captured (no gradient) nor in the generated code's key (a
    rebound table gave the first table's result on the kernel: 3.0 off). Every attribute of a user's
    own module or class is walked when the code calls getattr."""
    import types

    _triton_ok(backend)
    q, k, v = (t.to(dtype) for t in qkv(1, 2, 2, 8, 8, 16))
    cfg = types.ModuleType("cfg")
    cfg.table_0 = torch.randn(8, dtype=dtype, requires_grad=True)  # type: ignore[attr-defined]
    index = 0

    class Config:
        table_0 = cfg.table_0  # type: ignore[attr-defined]

    for holder in (cfg, Config):

        def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor, holder: Any = holder) -> Tensor:
            return s + getattr(holder, f"table_{index}")[j]  # type: ignore[no-any-return]

        for _ in range(2):
            table = holder.table_0
            got = az.attention(q, k, v, score_mod=mod, backend=backend)  # type: ignore[arg-type]
            want = az.attention(q, k, v, score_mod=mod, backend="reference")  # type: ignore[arg-type]
            assert isinstance(got, Tensor) and isinstance(want, Tensor)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            (g,) = torch.autograd.grad(got.sum(), (table,))
            (w,) = torch.autograd.grad(want.sum(), (table,))
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
            holder.table_0 = torch.randn(8, dtype=dtype, requires_grad=True) * 10  # rebound


def test_a_numpy_array_is_keyed_by_its_values_not_held_by_the_key() -> None:
    """A numpy array beside a bound-method mod is part of its key by its values — a digest of them:
    the key held a copy of each array's bytes, one per distinct content, in a cache of 512 keys."""
    import numpy as np

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.log = np.zeros(100_000)  # bookkeeping the mod never reads

        def mod(self, s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return s * 0.5

    m = Model()
    key, _ = mods.fingerprint(m.mod)
    assert key is not None
    same, _ = mods.fingerprint(m.mod)
    m.log[7] = 1.0
    other, _ = mods.fingerprint(m.mod)
    assert key == same and key != other
    sizes = [len(x) for part in key if isinstance(part, tuple) for x in part if isinstance(x, bytes)]
    assert sizes and max(sizes) <= 64, sizes
    objects = np.array([1.5, "a"], dtype=object)  # its bytes are addresses: what it holds may change unseen
    assert mods.fingerprint(lambda s, b, h, i, j: s * objects[0])[0] is None


def test_a_call_with_a_score_mod_leaves_no_cycle_holding_what_it_read() -> None:
    """The walk's functions reached one another through their cells: every call with a score_mod left
    a cycle holding the mod and its tensors (a bound method's module) until the cycle collector ran —
    unbounded with gc disabled or frozen, as servers do."""
    import gc
    import weakref

    def call(grad: bool, dtype: torch.dtype) -> weakref.ref[Tensor]:  # (float64: flash.py, float32: the kernel)
        q = torch.randn(1, 2, 16, 8, dtype=dtype)
        table = torch.randn(2, dtype=dtype, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            out = az.attention(q, q, q, score_mod=lambda s, b, h, i, j: s + table[h])
            if grad:
                out.sum().backward()
        return weakref.ref(table)

    cases = [(grad, dtype) for grad in (False, True) for dtype in (torch.float32, torch.float64)]
    for grad, dtype in cases:
        call(grad, dtype)  # the mod's first call builds it (torch's tracer leaves cycles of its own, once)
    gc.collect()
    gc.disable()
    try:
        for grad, dtype in cases:
            assert call(grad, dtype)() is None, f"grad={grad}, {dtype}: the mod's table outlived the call"
    finally:
        gc.enable()


_T = torch.randn(8, 9)
IGNORING: dict[str, Any] = {  # mods whose result does not read the score, or some index
    "keys_only": lambda s, b, h, i, j: (j * 0.1).to(s.dtype),
    "batch_only_on_flash": lambda s, b, h, i, j: (b.float().to(torch.bfloat16).float() * 0.1).to(s.dtype),
    "constant_on_flash": lambda s, b, h, i, j: torch.zeros_like(s).to(torch.bfloat16).to(s.dtype),
    "a_table_not_the_score": lambda s, b, h, i, j: _T[i, j].to(s.dtype),
    "a_table_not_the_score_on_flash": lambda s, b, h, i, j: _T[i, j].half().float().to(s.dtype),
}  # ("on_flash": a 16-bit round trip, which the CPU kernel's C++ leaves to flash.py)


@pytest.mark.parametrize("backend", ["flash", "auto"])
@pytest.mark.parametrize("name", list(IGNORING))
def test_a_mod_that_ignores_the_score_or_an_index(name: str, backend: str) -> None:
    """The random-mod fuzzer's findings: vmap hands back a mod's result expanded (stride 0) along
    what it does not read, and flash.py wrote into it ("more than one element of the written-to
    tensor refers to a single memory location"; a batch-only mod: "view size is not compatible"),
    in the forward and in the backward of the lse; and a mod that reads no score (nor a tensor with
    a gradient) has no graph, which the backward asked autograd to differentiate ("element 0 of
    tensors does not require grad"). Out, lse and the gradients of a loss on both, against the
    float64 reference."""
    torch.manual_seed(0)
    fn = IGNORING[name]
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 8)
    dout, dlse = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5)
    results = []
    for dtype, be in ((torch.float32, backend), (torch.float64, "reference")):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = az.attention(*x, score_mod=fn, backend=be, return_lse=True)
        loss = (out * dout.to(dtype)).sum() + (lse * dlse.to(dtype)).sum()
        grads = torch.autograd.grad(loss, x, allow_unused=True)
        results.append([out, lse, *(torch.zeros_like(t) if g is None else g for t, g in zip(x, grads))])
    for got, want in zip(*results):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
