"""backend="triton" with a score_mod: Triton code generated from the user's function (kernels/codegen.py)
in the forward, backward and split-KV kernels, against the float64 golden (conftest's tolerance rule),
the captured tensors' gradients against the reference's, errors that name an operation that cannot be
generated, and "auto" running such a mod elsewhere.

Under Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1) tiles are 16×16: lengths of 17-30
cross query and key blocks and ragged last blocks; shapes stay tiny because the interpreter is slow.
``grid_kernel`` runs a generated function alone on one block, against the vmapped mod and autograd:
the ops one by one, fast.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import check_against_golden, qkv, torch_semantics_mods
from torch import Tensor

import attnzero as az
from attnzero import functional, mods

if os.environ.get("CI") == "true":
    import triton  # CI installs triton: its absence must fail, not skip
else:
    triton = pytest.importorskip("triton", reason="backend='triton' needs `pip install triton`")

import triton.language as tl

from attnzero.kernels import codegen
from attnzero.kernels import triton_backend as tb

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F32, BF16 = torch.float32, torch.bfloat16
H, L = 4, 24  # the heads and the longest length the captured tables below are made for


# ---------------------------------------------------------------------------------------------
# One generated function on one block


@triton.jit
def grid_kernel(S, DY, Y, DX, b, h, CAP, CAP_GRAD, MOD: tl.constexpr, BWD: tl.constexpr, R: tl.constexpr,
                C: tl.constexpr):  # fmt: skip
    """Y = MOD(S), DX = BWD(S, DY) on one (R, C) block of pairs q_idx = row, kv_idx = column."""
    i = tl.arange(0, R)[:, None]
    j = tl.arange(0, C)[None, :]
    s = tl.load(S + i * C + j)
    dy = tl.load(DY + i * C + j)
    tl.store(Y + i * C + j, MOD(s, b, h, i, j, CAP))
    tl.store(DX + i * C + j, BWD(s, b, h, i, j, dy, CAP, CAP_GRAD, True))


def run_on_grid(mod: mods.ScoreMod, b: int = 1, h: int = 2, R: int = 16, C: int = 16) -> None:
    """The generated forward and backward of ``mod`` on one block equal the vmapped mod and
    autograd's derivative (score and captured tensors), to float32 rounding."""
    gen = codegen.score_mod(mod, DEVICE, grads=True)
    s = torch.randn(R, C, device=DEVICE) * 3
    dy = torch.randn(R, C, device=DEVICE)
    y, dx = torch.empty_like(s), torch.empty_like(s)
    bufs = tuple(torch.zeros(t.shape, dtype=F32, device=DEVICE) for t in gen.tensors)
    grid_kernel[(1,)](s, dy, y, dx, b, h, gen.tensors or (s,), bufs or (s,), MOD=gen.fwd, BWD=gen.bwd, R=R, C=C)
    x = s.clone().requires_grad_()
    want = mods.score_block(mod, x.view(1, 1, R, C), batches=(b, b + 1), heads=(h, h + 1), rows=(0, R),
                            cols=(0, C)).view(R, C)  # fmt: skip
    captured = mods.captured_tensors(mod)
    wrt = [x, *[t for t in captured if t.requires_grad]]
    got = torch.autograd.grad(want, wrt, dy, allow_unused=True)
    torch.testing.assert_close(y, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, torch.zeros_like(s) if got[0] is None else got[0], rtol=1e-5, atol=1e-5)
    wants = dict(zip([id(t) for t in wrt[1:]], got[1:]))
    for buf, j in zip(bufs, gen.grad_of):
        if j is not None:
            w = wants[id(captured[j])]
            torch.testing.assert_close(buf, torch.zeros_like(buf) if w is None else w, rtol=1e-5, atol=1e-4)


slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE, requires_grad=True)
table = torch.randn(H, 2 * L - 1, device=DEVICE, requires_grad=True)
temperature = torch.tensor(1.5, device=DEVICE, requires_grad=True)
doc = torch.tensor([0] * 7 + [1] * 9 + [2] * 8, device=DEVICE)  # (L,) document ids


GRID_MODS: dict[str, Callable[..., Tensor]] = {
    "alibi": lambda s, b, h, i, j: s - slopes[h] * (i - j).abs(),
    "rel_table": lambda s, b, h, i, j: s + table[h, i - j + L - 1],
    "row_of_table": lambda s, b, h, i, j: s * table[h][j] + table[:, 3][h],
    "temperature": lambda s, b, h, i, j: s / temperature + temperature ** 2,
    "softcap": lambda s, b, h, i, j: 2.0 * torch.tanh(s / 2.0),
    "int_div_where": lambda s, b, h, i, j: torch.where((i - 9) // 4 == (j - 3) % 5 - 2, s, s * 0.5 - 1.0),
    "div_modes": lambda s, b, h, i, j: s + torch.div(i - 7, 3, rounding_mode="trunc") + torch.div(j - 7, 3,
                                                                                                   rounding_mode="floor"),
    "clamp_min_max": lambda s, b, h, i, j: torch.clamp(s, -1.0, 2.0) + torch.maximum(s, (j * 0.1).float())
    - torch.minimum(s * s, torch.ones_like(s)),
    "unary": lambda s, b, h, i, j: torch.sigmoid(s) + torch.exp(-s.abs()) + torch.log1p(s * s) * 0 + torch.sqrt(
        s * s + 1.0) + torch.rsqrt(s * s + 2.0) + torch.sin(s) * torch.cos(s) + s.pow(3) + 2.0 ** (s * 0.1),
    "casts_logic": lambda s, b, h, i, j: s + ((i > j) & ~(j == 3) | (h == 2)).float() + (i ^ j).float() * 0.01
    + (b + h).to(torch.float16).float() + s.detach() * 0.5,
    "documents": lambda s, b, h, i, j: torch.where(doc[i] == doc[j], s, -float("inf")),
    "float64_sqrt": lambda s, b, h, i, j: s + ((j + 1).double().sqrt() * s.double()).float(),  # (sqrt_rn: float32 only)
    "exp2_log2": lambda s, b, h, i, j: torch.exp2(s * 0.3) * temperature + torch.log2(s * s + 1.0) / temperature,
}  # fmt: skip
GRID_MODS.update(torch_semantics_mods(DEVICE))  # where C and torch differ (conftest)


@triton.jit
def mask_grid_kernel(Y, b, h, CAP, MOD: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    i = tl.arange(0, R)[:, None]
    j = tl.arange(0, C)[None, :]
    tl.store(Y + i * C + j, MOD(b, h, i, j, CAP).to(tl.int8))


def test_a_generated_mask_mod_equals_the_mask_mod() -> None:
    """A prefix-LM within documents (ids captured), as a predicate on one block (the kernels' hook)."""

    def prefix_docs(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return (doc[i] == doc[j]) & ((j < 3) | (j <= i)) | (h == 3)

    gen = codegen.mask_mod(prefix_docs, DEVICE)
    n = 16  # (the ids of positions 0..15: three documents)
    for h in (1, 3):
        y = torch.empty(n, n, dtype=torch.int8, device=DEVICE)
        mask_grid_kernel[(1,)](y, 0, h, gen.tensors, MOD=gen.fwd, R=n, C=n)
        want = mods.mask_block(prefix_docs, batches=(0, 1), heads=(h, h + 1), rows=(0, n), cols=(0, n), device=DEVICE)
        assert torch.equal(y.bool(), want.view(n, n))
        assert h == 3 or not bool(want.all())  # (the test sees blocked pairs)


@pytest.mark.parametrize("name", [n for n in GRID_MODS if n != "unary"] + ["unary_no_log1p"])
def test_generated_code_equals_the_mod_and_its_derivative(name: str) -> None:
    if name == "unary_no_log1p":

        def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return (torch.sigmoid(s) + torch.exp(-s.abs()) + torch.sqrt(s * s + 1.0) + torch.rsqrt(s * s + 2.0)
                    + torch.sin(s) * torch.cos(s) + s.pow(3) + 2.0 ** (s * 0.1) + torch.log(s * s + 1.0))  # fmt: skip

        run_on_grid(mod)
    else:
        run_on_grid(GRID_MODS[name])


def test_a_wrong_translation_fails_the_grid_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grid test can fail: one operator translated wrongly (sub as +) is caught."""
    monkeypatch.setitem(codegen._BINARY, "sub", "+")
    monkeypatch.setattr(codegen, "_GENERATED", {})  # (the code generated before is kept by fingerprint)
    codegen._MODULES.clear()
    with pytest.raises(AssertionError):
        run_on_grid(GRID_MODS["alibi"])
    codegen._MODULES.clear()


# ---------------------------------------------------------------------------------------------
# The kernels with generated mods, against the golden


def _alibi(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return s - slopes[h] * (i - j).abs() + (b * 0.1).to(s.dtype)


def _rel(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return s + table[h, i - j + L - 1]


def _softcap(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return 1.5 * torch.tanh(s / 1.5)


def _int_div(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return torch.where(i // 5 >= j // 5, s, -float("inf"))  # block-causal in blocks of 5: whole rows kept


CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "alibi_causal": (_alibi, {"causal": True}),
    "rel_table": (_rel, {}),
    "softcap_mod_window": (_softcap, {"window": (9, 2)}),
    "int_div_with_softcap": (_int_div, {"softcap": 2.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_triton_runs_a_score_mod_against_the_golden(case: str) -> None:
    """out, lse and the gradients of q, k, v: GQA (4 query heads on 2), Lq != Lk, float32."""
    mod, kw = CASES[case]
    q, k, v = (t.to(DEVICE) for t in qkv(1, 4, 2, 17, 23, 16))
    check_against_golden("triton", F32, q, k, v, score_mod=mod, **kw)


def test_bf16_and_a_bias_with_a_mod() -> None:
    q, k, v = (t.to(DEVICE) for t in qkv(1, 2, 1, 20, 20, 16))
    bias = torch.randn(1, 2, 20, 20, dtype=torch.float64, device=DEVICE)
    check_against_golden("triton", BF16, q, k, v, bias=bias, score_mod=_alibi, causal=True)


@pytest.mark.parametrize("sinks_shape", ["per_head", "per_query"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_a_score_mod_with_attention_sinks(
    sinks_shape: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A score_mod with sinks runs on the Triton kernels, the sinks folded in their Function (before:
    refused by backend="triton", flash.py on "auto"): out, lse and the gradients of q, k, v and the
    sinks against the golden, causal, GQA, Lq != Lk; and the split-KV kernel without gradients."""
    q, k, v = (t.to(DEVICE) for t in qkv(1, 4, 2, 17, 23, 16))
    sinks = torch.randn(4, dtype=torch.float64) if sinks_shape == "per_head" else torch.randn(1, 4, 17).double()
    check_against_golden("triton", dtype, q, k, v, score_mod=_rel, causal=True, sinks=sinks.to(DEVICE))
    monkeypatch.setattr(tb, "DECODE_MIN_LK", 32)
    calls: list[int] = []
    real = tb._decode
    monkeypatch.setattr(tb, "_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    qd, kd, vd = (t.to(DEVICE, F32) for t in qkv(1, 4, 2, 2, 45, 16))
    sd = sinks[..., :2] if sinks_shape == "per_query" else sinks
    with torch.no_grad(), tb.decode_splits(3):
        got = az.attention(qd, kd, vd, score_mod=_rel, sinks=sd.to(DEVICE, F32), backend="triton", return_lse=True)
    want = az.attention(qd.double(), kd.double(), vd.double(), score_mod=_rel, sinks=sd.to(DEVICE), backend="reference",
                        return_lse=True)  # fmt: skip
    assert calls
    torch.testing.assert_close(got[0], want[0].float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], want[1].float(), rtol=1e-4, atol=1e-4)


def test_captured_tensors_get_the_references_gradients() -> None:
    """ALiBi slopes and a relative-position table, both Parameters-like leaves: the dK/dV kernel's
    atomics equal autograd through the reference (float32, GQA, Lq != Lk, a mask from a mod)."""
    sl = slopes.detach().clone().requires_grad_()
    rel = table.detach().clone().requires_grad_()

    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s + rel[h, i - j + L - 1] - sl[h] * (i - j).abs()

    q, k, v = (t.to(DEVICE, F32).requires_grad_() for t in qkv(2, 4, 2, 19, 22, 16))
    prefix = az.masks.from_mod(lambda b, h, i, j: (j < 5) | (j <= i + 3), 1, 1, 19, 22, block_size=8)
    grads = {}
    for backend in ("reference", "triton"):
        out = az.attention(q, k, v, score_mod=mod, mask=prefix, backend=backend)  # type: ignore[arg-type]
        grads[backend] = torch.autograd.grad(out.square().sum(), (q, k, v, sl, rel))
    for got, want in zip(grads["triton"], grads["reference"]):
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)


def test_a_deterministic_backward_counts_captured_gradients_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the separate dQ kernel, the table's gradient still comes from the dK/dV kernel alone."""
    monkeypatch.setattr(tb, "DETERMINISTIC", True)
    sl = slopes.detach().clone().requires_grad_()

    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s - sl[h] * (i - j).abs()

    q, k, v = (t.to(DEVICE, F32).requires_grad_() for t in qkv(1, 4, 4, 18, 18, 16))
    got = [torch.autograd.grad(az.attention(q, k, v, score_mod=mod, backend=be).sum(), (q, sl))  # type: ignore[arg-type]
           for be in ("reference", "triton")]  # fmt: skip
    for a, b in zip(got[1], got[0]):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)


def test_the_split_kv_kernel_runs_the_mod(monkeypatch: pytest.MonkeyPatch) -> None:
    """Few queries, no gradient: functional takes the split-KV kernel (shape limits lowered so that
    the interpreter stays fast), three splits merged, per-row query heads (GQA) seen by the mod."""
    monkeypatch.setattr(tb, "DECODE_MIN_LK", 32)
    calls = []
    real = tb._decode
    monkeypatch.setattr(tb, "_decode", lambda *a, **kw: calls.append(kw.get("score_gen")) or real(*a, **kw))
    q, k, v = (t.to(DEVICE, F32) for t in qkv(1, 4, 2, 3, 45, 16))
    with torch.no_grad(), tb.decode_splits(3):
        got = az.attention(q, k, v, score_mod=_rel, backend="triton", return_lse=True)
    want = az.attention(q.double(), k.double(), v.double(), score_mod=_rel, backend="reference", return_lse=True)
    assert len(calls) == 1 and calls[0] is not None
    torch.testing.assert_close(got[0], want[0].float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], want[1].float(), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# What cannot be generated


def _dot(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return s + torch.dot(table[h], table[h]) * 0.01


def _cumsum(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return s + table[h].cumsum(0)[j]


@pytest.mark.parametrize(("mod", "op"), [(_dot, "aten.dot"), (_cumsum, "aten.cumsum")], ids=["dot", "cumsum"])
def test_backend_triton_names_an_op_it_cannot_generate(mod: Any, op: str) -> None:
    q, k, v = (t.to(DEVICE, F32) for t in qkv(1, 4, 4, 5, 5, 16))
    with pytest.raises(ValueError, match=rf"score_mod: cannot generate Triton code for {op}.*backend='flash'"):
        az.attention(q, k, v, score_mod=mod, backend="triton")


def test_a_16_bit_constant_compared_with_an_index_is_refused() -> None:
    # torch compares in float16 (kv_idx 2049 rounds to 2048); the constant made in the mod was taken
    # as a Python number, and the generated comparison was float32's
    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return torch.where(torch.tensor(2049.0, dtype=torch.float16) < j, s - 5.0, s)

    q, k, v = (t.to(DEVICE, F32) for t in qkv(1, 1, 1, 2, 2060, 8))
    with pytest.raises(ValueError, match=r"score_mod: cannot generate Triton code for .*comparison of torch.float16"):
        az.attention(q, k, v, score_mod=mod, backend="triton")


@pytest.mark.parametrize("dtype", [torch.float16, BF16], ids=["f16", "bf16"])
def test_a_16_bit_value_in_a_mod_is_refused_and_a_table_read_as_float32_runs(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Computing 16-bit values as torch does takes its rounding op by op: tl.exp refused them (Triton's
    # math takes float32 / 64) and the interpreter multiplied bfloat16 as raw bits (lse ~1e36).
    # Refused by name on "triton", run by flash.py on "auto"; `.float()` reads are generated.
    temp = (torch.rand(4, device=DEVICE) + 0.5).to(dtype)
    slope = slopes.detach().to(dtype).requires_grad_()

    def sixteen(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s * torch.exp(temp[h] - 1) - slope[h] * (i - j).abs()

    def read_as_float(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s * torch.exp(temp[h].clone().float() - 1) - slope[h].float() * (i - j).abs()  # (clone: the value)

    q, k, v = (t.to(DEVICE) for t in qkv(1, 4, 2, 17, 23, 16))
    with pytest.raises(ValueError, match=rf"score_mod: cannot generate Triton code for .*{dtype}.*float32"):
        az.attention(q.to(dtype), k.to(dtype), v.to(dtype), score_mod=sixteen, backend="triton")
    monkeypatch.setattr(functional, "_auto", lambda q, v: "triton")
    ran: list[str] = []
    real = functional._flash_with_mod
    monkeypatch.setattr(functional, "_flash_with_mod", lambda *a, **kw: ran.append("flash") or real(*a, **kw))
    check_against_golden("auto", dtype, q, k, v, score_mod=sixteen, causal=True)
    assert ran and set(ran) == {"flash"}
    check_against_golden("triton", dtype, q, k, v, score_mod=read_as_float, causal=True)
    grads = {}
    for backend in ("reference", "triton"):
        out = az.attention(q.float(), k.float(), v.float(), score_mod=read_as_float, causal=True, backend=backend)
        grads[backend] = torch.autograd.grad(out.square().sum(), slope)[0]  # type: ignore[union-attr]
    assert grads["reference"].abs().sum() > 0
    torch.testing.assert_close(grads["triton"].float(), grads["reference"].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, BF16], ids=["f16", "bf16"])
def test_a_float64_table_cast_to_16_bits_rounds_as_torch_and_a_cast_chain_is_refused(dtype: torch.dtype) -> None:
    # torch rounds float64 to float32, then to 16 bits (values just past a tie: once would round up);
    # a whole table cast twice kept only the last cast (T.half().float() read T as float32)
    tie = 1.0 + 2.0 ** (-11 if dtype == torch.float16 else -8)
    t64 = torch.tensor([tie + 2.0**-40, 1e-40, -tie - 2.0**-40, 3.0] * 6, dtype=torch.float64, device=DEVICE)

    def rounded(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s + 4.0 * t64[j].to(dtype).float()

    def chain(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s + t64.to(dtype).float()[j]

    q, k, v = (t.to(DEVICE, F32) for t in qkv(1, 2, 2, 9, 23, 16))
    got = az.attention(q, k, v, score_mod=rounded, backend="triton")
    want = az.attention(q, k, v, score_mod=rounded, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="a second cast"):
        az.attention(q, k, v, score_mod=chain, backend="triton")


def test_auto_runs_a_mod_it_cannot_generate_on_flash_and_one_it_can_on_triton(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA "auto" picks triton (``functional._auto``; made to here): with a mod that can be
    generated it runs the Triton kernels, with one that cannot, flash.py — the same answer."""
    monkeypatch.setattr(functional, "_auto", lambda q, v: "triton")
    ran: list[str] = []
    real_fwd, real_flash = tb._forward, functional._flash_with_mod
    monkeypatch.setattr(tb, "_forward", lambda *a, **kw: ran.append("triton") or real_fwd(*a, **kw))
    monkeypatch.setattr(functional, "_flash_with_mod", lambda *a, **kw: ran.append("flash") or real_flash(*a, **kw))
    q, k, v = (t.to(DEVICE, F32) for t in qkv(1, 4, 4, 5, 7, 16))
    for mod, backend in ((_dot, "flash"), (_alibi, "triton")):
        ran.clear()
        got = az.attention(q, k, v, score_mod=mod)
        want = az.attention(q.double(), k.double(), v.double(), score_mod=mod, backend="reference")
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)
        assert ran == [backend]


def test_a_mod_with_python_control_flow_on_a_value_is_refused() -> None:
    def branchy(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s if bool(i > j) else -s

    with pytest.raises(codegen.NotGenerable, match="score_mod"):
        codegen.score_mod(branchy, DEVICE, grads=False)


def test_flex_attention_takes_the_same_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """attnzero.flex goes through az.attention's "auto": on CUDA (``_auto`` made to say so here) a
    score_mod with a block mask runs the Triton kernels with the generated mod, torch's results."""
    from attnzero.flex import create_block_mask, flex_attention

    monkeypatch.setattr(functional, "_auto", lambda q, v: "triton")
    ran: list[bool] = []
    real = tb._forward
    monkeypatch.setattr(tb, "_forward", lambda *a, **kw: ran.append(kw.get("score_gen") is not None) or real(*a, **kw))
    q, k, v = (t.to(DEVICE, F32) for t in qkv(1, 4, 4, 20, 20, 16))
    block_mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, 20, 20, device=str(DEVICE), BLOCK_SIZE=8)
    got = flex_attention(q, k, v, score_mod=_alibi, block_mask=block_mask)
    want = az.attention(q.double(), k.double(), v.double(), score_mod=_alibi, causal=True, backend="reference")
    assert ran == [True]
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# A mask_mod (``az.masks.from_mod``, a BlockMask) as a generated predicate in every kernel


docs = torch.tensor([[0] * 5 + [1] * 11 + [2] * 13, [0] * 14 + [1] * 15], device=DEVICE)  # (2, 29) ids


def _prefix_lm(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return (j < 5) | (j <= i)


def _documents(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return (docs[b, i] == docs[b, j]) & (j <= i)  # causal within documents: ids captured, per batch


def _window_per_head(Lq: int, Lk: int) -> Callable[..., Tensor]:
    off = Lk - Lq

    def window(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return (j <= i + off) & (j >= i + off - 3 - 2 * h)  # bottom-right, a wider window per query head

    return window


def _holes(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return (i % 5 != 2) & (j <= i + 4)  # rows 2, 7, 12, ... keep no key at all


# name: (mask_mod, mask's (B, H), (B, Hq, Hkv, Lq, Lk), attention kwargs)
MASK_CASES: dict[str, tuple[Any, tuple[int, int], tuple[int, ...], dict[str, Any]]] = {
    "prefix_lm": (_prefix_lm, (1, 1), (1, 4, 2, 23, 23), {}),
    "documents_captured": (_documents, (2, 1), (2, 2, 2, 29, 29), {}),
    "window_gqa_lq_ne_lk": (_window_per_head(17, 29), (1, 4), (1, 4, 2, 17, 29), {}),
    "heads_broadcast": (_window_per_head(17, 29), (1, 1), (1, 4, 2, 17, 29), {}),  # H = 1: every head is h = 0
    "with_a_score_mod": (_window_per_head(18, 22), (1, 4), (1, 4, 2, 18, 22), {"score_mod": _rel}),
    "fully_masked_rows": (_holes, (1, 1), (1, 2, 1, 19, 21), {"softcap": 2.0}),
}


@pytest.fixture
def no_dense(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The dense path fails the test (``_materialise`` raises); each kernel call is recorded as
    ``kernel:generated`` (a generated predicate and no dense mask) or ``kernel:other``."""
    calls: list[str] = []

    def refuse(mask: Any, device: Any) -> Tensor:
        raise AssertionError(f"the mask {mask!r} was materialised")

    monkeypatch.setattr(tb, "_materialise", refuse)
    for name, at in (("_forward", 3), ("_backward", 6), ("_decode", 3)):
        real = getattr(tb, name)

        def spy(*a: Any, _real: Any = real, _name: str = name, _at: int = at, **kw: Any) -> Any:
            ok = kw.get("mask_gen") is not None and a[_at] is None
            calls.append(f"{_name[1:]}:{'generated' if ok else 'other'}")
            return _real(*a, **kw)

        monkeypatch.setattr(tb, name, spy)
    return calls


@pytest.mark.parametrize("case", list(MASK_CASES))
def test_triton_runs_a_from_mod_mask_generated_against_the_golden(case: str, no_dense: list[str]) -> None:
    """out, lse, dq, dk, dv of backend="triton" with ``mask=from_mod(...)`` against the float64
    golden, the mask never materialised: the forward and the backward kernels ran the predicate."""
    mod, (mb, mh), (B, Hq, Hkv, Lq, Lk), kw = MASK_CASES[case]
    mask = az.masks.from_mod(mod, mb, mh, Lq, Lk, block_size=8, device=DEVICE)
    q, k, v = (t.to(DEVICE) for t in qkv(B, Hq, Hkv, Lq, Lk, 16))
    _, res = check_against_golden("triton", F32, q, k, v, mask=mask, **kw)
    assert no_dense == ["forward:generated", "backward:generated"]
    if case == "fully_masked_rows":  # rows with no key: output 0, lse -inf, no NaN, no gradient
        empty = torch.arange(Lq, device=DEVICE) % 5 == 2
        assert torch.isfinite(res.out).all() and not res.grads["q"].isnan().any()
        assert (res.out[:, :, empty] == 0).all() and (res.lse[:, :, empty] == float("-inf")).all()
        assert (res.grads["q"][:, :, empty] == 0).all()
        assert (res.out[:, :, ~empty] != 0).any()


def test_the_deterministic_backward_runs_the_generated_mask(
    monkeypatch: pytest.MonkeyPatch, no_dense: list[str]
) -> None:
    """The separate dQ kernel evaluates the predicate too (documents: per-batch captured ids)."""
    monkeypatch.setattr(tb, "DETERMINISTIC", True)
    mask = az.masks.from_mod(_documents, 2, 1, 29, 29, block_size=8, device=DEVICE)
    q, k, v = (t.to(DEVICE) for t in qkv(2, 2, 1, 29, 29, 16))
    check_against_golden("triton", F32, q, k, v, mask=mask)
    assert no_dense == ["forward:generated", "backward:generated"]


@pytest.mark.parametrize("with_score_mod", [False, True], ids=["mask_only", "with_score_mod"])
def test_the_split_kv_kernel_runs_the_generated_mask(
    monkeypatch: pytest.MonkeyPatch, no_dense: list[str], with_score_mod: bool
) -> None:
    """Few queries, no gradient: the split-KV kernel (three splits) with a per-head window whose
    query rows are G heads × Lq (the predicate sees each row's own query head), Lq != Lk."""
    monkeypatch.setattr(tb, "DECODE_MIN_LK", 32)
    Lq, Lk = 3, 45
    mask = az.masks.from_mod(_window_per_head(Lq, Lk), 1, 4, Lq, Lk, block_size=8, device=DEVICE)
    q, k, v = (t.to(DEVICE, F32) for t in qkv(1, 4, 2, Lq, Lk, 16))
    kw: dict[str, Any] = {"score_mod": _rel} if with_score_mod else {}
    with torch.no_grad(), tb.decode_splits(3):
        got = az.attention(q, k, v, mask=mask, backend="triton", return_lse=True, **kw)
    want = az.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference", return_lse=True, **kw)
    assert no_dense == ["decode:generated"]
    torch.testing.assert_close(got[0], want[0].float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], want[1].float(), rtol=1e-4, atol=1e-4)


def test_the_backend_interface_runs_the_generated_mask(no_dense: list[str]) -> None:
    """``forward`` / ``backward`` (what the ring calls with a from_mod Mask per piece): the same
    results as the kernels reading the same mask as a dense tensor."""
    mask = az.masks.from_mod(_prefix_lm, 1, 1, 17, 20, block_size=8, device=DEVICE)
    q, k, v = (t.to(DEVICE, F32) for t in qkv(1, 2, 1, 17, 20, 16))
    dout = torch.randn(1, 2, 17, 16, device=DEVICE)
    kw: dict[str, Any] = {"bias": None, "causal": False, "window": None, "scale": 0.25, "dropout_p": 0.0,
                          "dropout_seed": 0}  # fmt: skip
    out, lse = tb.forward(q, k, v, mask=mask, **kw)
    grads = tb.backward(dout, q, k, v, out, lse, **{**kw, "mask": mask})
    assert no_dense == ["forward:generated", "backward:generated"]
    dense = mask.to_tensor(DEVICE)
    out_d, lse_d = tb.forward(q, k, v, mask=dense, **kw)
    grads_d = tb.backward(dout, q, k, v, out_d, lse_d, **{**kw, "mask": dense})
    torch.testing.assert_close(out, out_d, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_d, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads[:3], grads_d[:3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_wrong_translation_of_the_mask_mod_fails_the_golden_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests above can fail: ``<=`` generated as ``<`` (the prefix-LM loses its diagonal) is caught."""
    monkeypatch.setitem(codegen._COMPARE, "le", "<")
    monkeypatch.setattr(codegen, "_GENERATED", {})  # (the code generated before is kept by fingerprint)
    codegen._MODULES.clear()
    try:
        mask = az.masks.from_mod(_prefix_lm, 1, 1, 23, 23, block_size=8, device=DEVICE)
        q, k, v = (t.to(DEVICE) for t in qkv(1, 2, 1, 23, 23, 16))
        with pytest.raises(AssertionError):
            check_against_golden("triton", F32, q, k, v, mask=mask, grads=False)
    finally:
        codegen._MODULES.clear()


def _cumsum_mask(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return docs[0].cumsum(0)[j] <= docs[0].cumsum(0)[i]  # a cumsum: no Triton code for it


def test_a_mask_mod_that_cannot_be_generated_and_a_combination_run_densely(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not generable (a cumsum), or combined by ``and_``: the Triton kernels read the materialised
    mask (backend="triton" does not refuse: the mask is data), the golden's results."""
    dense: list[str] = []
    real = tb._materialise
    monkeypatch.setattr(tb, "_materialise", lambda m, d: dense.append(m.name) or real(m, d))
    q, k, v = (t.to(DEVICE) for t in qkv(1, 2, 2, 20, 20, 16))
    with pytest.raises(codegen.NotGenerable, match="cumsum"):
        codegen.mask_mod(_cumsum_mask, DEVICE)
    for mask in (
        az.masks.from_mod(_cumsum_mask, 1, 1, 20, 20, block_size=8, device=DEVICE),
        az.masks.from_mod(_prefix_lm, 1, 1, 20, 20, block_size=8) & az.masks.padding([17], 20),
    ):
        dense.clear()
        check_against_golden("triton", F32, q, k, v, mask=mask, grads=False)
        assert dense == [mask.name]


def test_flex_attention_runs_a_block_mask_gated_by_its_table(
    monkeypatch: pytest.MonkeyPatch, no_dense: list[str]
) -> None:
    """attnzero.flex on "auto" (CUDA's choice, made here): a BlockMask's mask_mod generated with its
    block table in front. The mask_mod is swapped for one that keeps every pair, so only the table
    decides what is kept (blocks the table does not list stay blocked) — torch's compiled Flex semantics."""
    from attnzero.flex import create_block_mask, flex_attention, to_mask

    monkeypatch.setattr(functional, "_auto", lambda q, v: "triton")
    q, k, v = (t.to(DEVICE, F32) for t in qkv(1, 2, 2, 20, 20, 16))
    block_mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, 20, 20, device=str(DEVICE), BLOCK_SIZE=8)
    block_mask.mask_mod = lambda b, h, i, j: j >= 0
    got = flex_attention(q, k, v, block_mask=block_mask)
    assert no_dense == ["forward:generated"]
    mask = to_mask(block_mask, 1, 2, 20, 20)
    want = az.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    blockwise = torch.arange(20).view(-1, 1) // 8 >= torch.arange(20).view(1, -1) // 8  # what the table keeps
    assert torch.equal(mask.to_tensor()[0, 0], blockwise)
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Generated code is kept per mods.fingerprint: a mod met again is not traced again


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Count the traces (codegen._trace) from an empty cache of generated mods."""
    calls: list[str] = []
    real = codegen._trace
    monkeypatch.setattr(codegen, "_GENERATED", {})
    monkeypatch.setattr(codegen, "_trace", lambda fn, name, device: calls.append(name) or real(fn, name, device))
    return calls


def _alibi_mod(slopes: Tensor) -> mods.ScoreMod:
    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s + slopes[h] * (j - i)

    return mod


def _capped_mod(cap: float) -> mods.ScoreMod:
    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return cap * torch.tanh(s / cap)

    return mod


def test_a_mod_met_again_is_not_traced_again_and_reads_this_calls_tensors(traces: list[str]) -> None:
    """Two closures of one code over different slopes (same shape): one trace, and each call's output
    is its own slopes' (the cached code reads the call's tensors); a captured number that differs
    (softcap 20 against 30) is another key: traced again, and each right."""
    q, k, v = (t.to(DEVICE, torch.float32) for t in qkv(1, 2, 1, 20, 24, 16))
    for slopes in (torch.tensor([0.5, 0.25]), torch.tensor([2.0, -1.0]), torch.tensor([0.5, 0.25])):
        mod = _alibi_mod(slopes.to(DEVICE))
        got = az.attention(q, k, v, score_mod=mod, causal=True, backend="triton")
        want = az.attention(q.double(), k.double(), v.double(), score_mod=_alibi_mod(slopes.double().to(DEVICE)),
                            causal=True, backend="reference")  # fmt: skip
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)
    assert traces == ["score_mod"]
    for cap in (20.0, 30.0, 20.0):
        got = az.attention(q, k, v, score_mod=_capped_mod(cap), backend="triton")
        want = az.attention(q.double(), k.double(), v.double(), score_mod=_capped_mod(cap), backend="reference")
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)
    assert traces == ["score_mod"] * 3


def test_a_block_mask_met_again_is_not_traced_again(traces: list[str]) -> None:
    """One BlockMask (documents from captured ids) as attnzero.flex turns it into a Mask, three calls:
    one trace of its predicate; another BlockMask over other ids of the same shape reuses the code
    with its ids."""
    from attnzero import flex

    L = 40
    q, k, v = (t.to(DEVICE, torch.float32) for t in qkv(1, 2, 2, L, L, 16))
    outs = []
    for cut in (13, 13, 13, 29):
        ids = (torch.arange(L) >= cut).to(DEVICE)

        def documents(b: Tensor, h: Tensor, i: Tensor, j: Tensor, ids: Tensor = ids) -> Tensor:
            return (ids[i] == ids[j]) & (j <= i)

        bm = flex.create_block_mask(documents, None, None, L, L, device=str(DEVICE), BLOCK_SIZE=16)
        outs.append(az.attention(q, k, v, mask=flex.to_mask(bm, 1, 2, L, L), backend="triton"))
        keep = (ids[:, None] == ids[None, :]) & torch.ones(L, L, dtype=torch.bool, device=DEVICE).tril()
        want = az.attention(q.double(), k.double(), v.double(), mask=keep, backend="reference")
        torch.testing.assert_close(outs[-1], want.float(), rtol=1e-4, atol=1e-4)
    assert traces == ["mask_mod"]


# ---------------------------------------------------------------------------------------------
# A generated mask's block table: the kernels visit only the blocks some head keeps


@pytest.mark.parametrize("by_keys", [False, True], ids=["query_rows", "key_rows"])
def test_table_ranges_by_brute_force(by_keys: bool) -> None:
    """``_table_ranges``: for each batch and block of rows, the first to the last column of any block
    some head does not SKIP — against the table spread to pairs, on random tables and awkward sizes."""
    g = torch.Generator().manual_seed(7)
    for _ in range(40):
        B, H = (int(x) for x in torch.randint(1, 3, (2,), generator=g))
        bq, bk, block = (int(x) for x in torch.randint(1, 9, (3,), generator=g))
        Lq, Lk = (int(x) for x in torch.randint(0, 40, (2,), generator=g))  # (empty sides too)
        nq, nk = -(-Lq // bq), -(-Lk // bk)
        kinds = torch.randint(0, 3, (B, H, nq, nk), generator=g, dtype=torch.int8)
        kinds[torch.rand(kinds.shape, generator=g) < 0.5] = tb.BLOCK_SKIP
        got = tb._table_ranges(kinds, bq, bk, B, Lq, Lk, block, by_keys)
        kept = (kinds != tb.BLOCK_SKIP).any(1)  # (B, nq, nk)
        pairs = kept.repeat_interleave(bq, 1)[:, :Lq].repeat_interleave(bk, 2)[:, :, :Lk]  # (B, Lq, Lk)
        if by_keys:
            pairs = pairs.transpose(1, 2)
        rows = pairs.shape[1]
        for b in range(B):
            for r in range(-(-rows // block)):
                seen = pairs[b, r * block : (r + 1) * block].any(0).nonzero().flatten()
                want = [int(seen.min()), int(seen.max()) + 1] if len(seen) else [0, 0]
                assert got[b, r].tolist() == want, (B, H, bq, bk, block, Lq, Lk, b, r)


def test_a_block_masks_skipped_blocks_are_not_visited(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two documents as a BlockMask (no causal): each query block of one document visits no key block
    of the other (before, every key block; the mask_mod blocked them pair by pair) — forward and
    split-KV decode, from their records — and every kernel, the backward ones included, gives the
    golden's results."""
    from attnzero import flex, trace

    L, cut = 64, 32
    ids = (torch.arange(L) >= cut).to(DEVICE)

    def documents(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return ids[i] == ids[j]

    bm = flex.create_block_mask(documents, None, None, L, L, device=str(DEVICE), BLOCK_SIZE=16)
    mask = flex.to_mask(bm, 1, 2, L, L)
    q, k, v = (t.to(DEVICE) for t in qkv(1, 2, 1, L, L, 16))
    check_against_golden("triton", F32, q, k, v, mask=mask)
    with trace.recording() as rec:
        az.attention(q.float(), k.float(), v.float(), mask=mask, backend="triton")
    programs = rec.of("triton.program")
    assert programs
    for e in programs:
        hi = e["rows"][1]
        doc_blocks = set(range(0, cut // 16)) if hi <= cut else set(range(cut // 16, L // 16))
        assert set(e["key_blocks"]) == doc_blocks, (e["rows"], e["key_blocks"])
    # decode: two queries at the end (bottom-right: positions 62, 63, in the second document)
    monkeypatch.setattr(tb, "DECODE_MIN_LK", 32)
    bm2 = flex.create_block_mask(lambda b, h, i, j: ids[i + L - 2] == ids[j], None, None, 2, L, device=str(DEVICE),
                                 BLOCK_SIZE=16)  # fmt: skip
    mask2 = flex.to_mask(bm2, 1, 2, 2, L)
    with torch.no_grad(), tb.decode_splits(4), trace.recording() as rec:
        got = az.attention(q[:, :, -2:].float(), k.float(), v.float(), mask=mask2, backend="triton")
    splits = rec.of("decode.split")
    assert splits and all(set(e["key_blocks"]) <= set(range(cut // 16, L // 16)) for e in splits)
    want = az.attention(q[:, :, -2:], k, v, mask=mask2, backend="reference")
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("side", ["keys", "queries"])
def test_a_mask_of_length_one_broadcasts_its_block_over_the_whole_side(
    side: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A from_mod Mask of shape (B, H, Lq, 1) or (B, H, 1, Lk) broadcasts along that side: its one table
    block covers the whole side, so no key (query) past the table's block size is left out of the
    ranges (a sweep found out, dQ, dK, dV and the split-KV decode wrong, errors up to 4.8)."""
    B, H, Lq, Lk = 1, 2, 20, 40
    if side == "keys":
        mask = az.masks.from_mod(lambda b, h, i, j: i % 3 != 0, B, H, Lq, 1, block_size=8, device=DEVICE)
    else:
        mask = az.masks.from_mod(lambda b, h, i, j: j % 3 != 0, B, H, 1, Lk, block_size=8, device=DEVICE)
    q, k, v = (t.to(DEVICE) for t in qkv(B, H, H, Lq, Lk, 16))
    check_against_golden("triton", F32, q, k, v, mask=mask)
    if side == "keys":  # the split-KV path: two queries, every key of a kept row
        monkeypatch.setattr(tb, "DECODE_MIN_LK", 32)
        mask2 = az.masks.from_mod(lambda b, h, i, j: i >= 0, B, H, 2, 1, block_size=8, device=DEVICE)
        with torch.no_grad(), tb.decode_splits(2):
            got = az.attention(q[:, :, :2].float(), k.float(), v.float(), mask=mask2, backend="triton")
        want = az.attention(q[:, :, :2], k, v, mask=mask2, backend="reference")
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


def test_a_mod_that_cannot_be_generated_is_not_kept_alive_by_the_cache() -> None:
    """The cache of generated code keeps a refusal as its message: the exception it kept held, in its
    traceback, the frames that held the mod — and the model it is a method of, parameters and all."""
    import gc
    import weakref

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.big = torch.nn.Parameter(torch.randn(64, 64))

        def mod(self, s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return s + torch.atan(self.big[0, 0] * (i - j))  # atan: no Triton for it here

    m = Model()
    with pytest.raises(codegen.NotGenerable):
        codegen.score_mod(m.mod, torch.device("cpu"), grads=True)
    alive = weakref.ref(m)
    del m
    gc.collect()
    assert alive() is None


def _round_trip(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return s.to(torch.bfloat16).to(s.dtype)


def _used_twice(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    x = (s * 1.5).to(torch.float16)  # one 16-bit value, two uses: its gradient the rounded sum of two rounded shares
    return x.to(s.dtype) + 0.3 * x.to(s.dtype)


@pytest.mark.parametrize("mod", [_round_trip, _used_twice], ids=["round_trip", "used_twice"])
def test_the_gradient_through_a_16_bit_value_is_rounded_as_torch_rounds_it(mod: Any) -> None:
    """torch's autograd holds a float16 / bfloat16 value's gradient in that dtype: the gradient that
    reaches the score through ``score.to(bfloat16).to(score.dtype)`` is rounded to bfloat16. The
    generated backward held it in float32 unrounded (dq off by 1.5e-3 here, up to 2.5e-2 in the
    random-mod fuzzer). Small-integer q, k and a scale of 1/2 make every score exact in 16 bits, so
    the forward's rounding is exact and only the backward's differs; against the float64 formula."""
    torch.manual_seed(0)
    q = torch.randint(-2, 3, (1, 2, 5, 4)).float()
    k = torch.randint(-2, 3, (1, 2, 7, 4)).float()
    v, dout = torch.randn(1, 2, 7, 4), torch.randn(1, 2, 5, 4)
    grads = []
    for dtype, backend in ((F32, "triton"), (torch.float64, "reference")):
        x = [t.to(dtype).to(DEVICE).requires_grad_() for t in (q, k, v)]
        out = az.attention(*x, score_mod=mod, backend=backend, scale=0.5)
        grads.append(torch.autograd.grad(out, x, dout.to(dtype).to(DEVICE)))
    for got, want in zip(*grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_a_16_bit_tables_gradient_is_summed_before_its_rounding() -> None:
    """A read of a bfloat16 captured table: torch sums the gradient of a read that vmap broadcasts in
    float32 and rounds it to the table's dtype once. Rounding each pair's share (the first version of
    the 16-bit adjoint rounding above) put a table's gradient 1.4 % off at L = 64 (−2.234 against
    −2.2656), 6 % at L = 256, as the shares cancel."""
    torch.manual_seed(0)
    tab16 = (torch.randn(2) * 3).to(torch.bfloat16).to(DEVICE).requires_grad_()

    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s * tab16[h].to(s.dtype)

    q, k, v, dout = (torch.randn(1, 2, 64, 16, device=DEVICE) for _ in range(4))
    grads = []
    for backend in ("triton", "reference"):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out = az.attention(*x, score_mod=mod, backend=backend)
        grads.append(torch.autograd.grad(out, [tab16], dout)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=8e-3, atol=0)  # (one bfloat16 ulp)
