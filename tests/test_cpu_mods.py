"""A score_mod in the compiled CPU kernel (cpu_mods.py): C++ generated from the user's function, built
into a library of its own and called on each row of scores, against the vmapped mod and autograd
(one row at a time), against the float64 golden (conftest's tolerance rule, forward and backward),
the captured tensors' gradients against the reference's, its float32 math functions against
float64 over dense grids, what still runs on flash.py (a mod that cannot be generated, a build that
fails), and the cache that keeps a mod met again from being traced or compiled again."""

from __future__ import annotations

import collections
import ctypes
import functools
import gc
import math
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import check_against_golden, need_kernel, qkv, torch_semantics_mods
from torch import Tensor

import attnzero as az
from attnzero import cpu_kernel, cpu_mods, functional, mods
from attnzero.kernels import codegen

F32, BF16 = torch.float32, torch.bfloat16
H, L = 4, 40  # the heads and the longest length the captured tables below are made for


@pytest.fixture(autouse=True)
def _kernel() -> None:
    need_kernel()


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[Any]:
    """An empty cache directory and no mod built in this process yet."""
    monkeypatch.setenv("ATTNZERO_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_mods, "_CACHE", {})
    monkeypatch.setattr(cpu_mods, "_warned", set())
    yield tmp_path


FWD = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_void_p)  # fmt: skip
BWD = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The generated functions alone, row by row


def run_on_rows(mod: mods.ScoreMod, b: int = 1, h: int = 2, R: int = 13, C: int = 37, j0: int = 2) -> None:
    """The generated forward and backward of ``mod`` on rows q_idx = 0..R-1 and keys j0..j0+C-1
    equal the vmapped mod and autograd's derivative (score and captured tensors), to float32
    rounding."""
    built, reached = cpu_mods._get(mod, True)
    assert built is not None
    captured = mods.captured_tensors(mod)
    bound = cpu_mods._bind(built, reached)
    s = torch.randn(R, C) * 3
    dy = torch.randn(R, C)
    y, dx = s.clone(), dy.clone()
    src = built.source
    grad = torch.zeros(max(src.total, 1), dtype=torch.float64)
    tmp = torch.zeros(max(src.tmp * C, 1))
    fwd, bwd = FWD(built.fwd), BWD(built.bwd)
    for i in range(R):
        assert fwd(y[i].data_ptr(), C, b, h, i, j0, bound.caps.data_ptr()) == 0  # (no index out of range)
        bwd(s[i].data_ptr(), dx[i].data_ptr(), C, b, h, i, j0, bound.caps.data_ptr(), grad.data_ptr(), tmp.data_ptr())
    x = s.clone().requires_grad_()
    want = mods.score_block(mod, x.view(1, 1, R, C), batches=(b, b + 1), heads=(h, h + 1), rows=(0, R),
                            cols=(j0, j0 + C)).view(R, C)  # fmt: skip
    wrt = [x, *[t for t in captured if t.requires_grad]]
    got = torch.autograd.grad(want, wrt, dy, allow_unused=True)
    torch.testing.assert_close(y, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, torch.zeros_like(s) if got[0] is None else got[0], rtol=1e-5, atol=1e-5)
    wants = dict(zip([id(t) for t in wrt[1:]], got[1:]))
    for _slot, j, start in src.grads:
        t = captured[j]
        w = wants[id(t)]
        mine = grad[start : start + t.numel()].view(t.shape).float()
        torch.testing.assert_close(mine, torch.zeros_like(mine) if w is None else w, rtol=1e-5, atol=1e-4)


slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], requires_grad=True)
table = torch.randn(H, 2 * L - 1, requires_grad=True)
temperature = torch.tensor(1.5, requires_grad=True)
doc = torch.tensor([0] * 7 + [1] * 19 + [2] * 14)  # (L,) document ids
flags = torch.tensor([True, False, True, True])  # (H,) bool


ROW_MODS: dict[str, Callable[..., Tensor]] = {
    "alibi": lambda s, b, h, i, j: s - slopes[h] * (i - j).abs(),
    "rel_table": lambda s, b, h, i, j: s + table[h, i - j + L - 1],
    "row_of_table": lambda s, b, h, i, j: s * table[h][j] + table[:, 3][h],
    "temperature": lambda s, b, h, i, j: s / temperature + temperature ** 2,
    "softcap": lambda s, b, h, i, j: 2.0 * torch.tanh(s / 2.0),
    "int_div_where": lambda s, b, h, i, j: torch.where((i - 9) // 4 == (j - 3) % 5 - 2, s, s * 0.5 - 1.0),
    "div_modes": lambda s, b, h, i, j: s + torch.div(i - 7, 3, rounding_mode="trunc")
    + torch.div(j - 17, 3, rounding_mode="floor") + torch.fmod(j - 20, 7) + torch.remainder(s, 1.5),
    "clamp_min_max": lambda s, b, h, i, j: torch.clamp(s, -1.0, 2.0) + torch.maximum(s, (j * 0.1).float())
    - torch.minimum(s * s, torch.ones_like(s)),
    "unary": lambda s, b, h, i, j: torch.sigmoid(s) + torch.exp(-s.abs()) + torch.sqrt(s * s + 1.0)
    + torch.rsqrt(s * s + 2.0) + torch.sin(s) * torch.cos(s) + s.pow(3) + 2.0 ** (s * 0.1)
    + torch.log(s * s + 1.0) + torch.log2(s * s + 2.0) + torch.exp2(-s * s),
    "casts_logic": lambda s, b, h, i, j: s + ((i > j) & ~(j == 3) | (h == 2)).float() + (i ^ j).float() * 0.01
    + (b + h).to(torch.float64).float() + s.detach() * 0.5 + flags[h].float(),
    "documents": lambda s, b, h, i, j: torch.where(doc[i] == doc[j], s, -float("inf")),
    "negative_index_wraps": lambda s, b, h, i, j: s + table[h, i - j] + table[h, j - 40],
}  # fmt: skip
ROW_MODS.update(torch_semantics_mods(torch.device("cpu")))  # where C and torch differ (conftest)


@pytest.mark.parametrize("name", list(ROW_MODS))
def test_generated_code_equals_the_mod_and_its_derivative(name: str) -> None:
    run_on_rows(ROW_MODS[name])


def test_a_wrong_translation_fails_the_row_test(monkeypatch: pytest.MonkeyPatch, fresh: Any) -> None:
    """The row test can fail: one operator translated wrongly (sub as +) is caught."""
    monkeypatch.setitem(codegen._BINARY, "sub", "+")
    with pytest.raises(AssertionError):
        run_on_rows(ROW_MODS["alibi"])


def _grid() -> Tensor:
    return torch.cat([
        torch.linspace(-120.0, 120.0, 400_001), torch.logspace(-44, 38, 20_000), -torch.logspace(-44, 38, 20_000),
        torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, 88.72, 89.0, -103.9, -104.0, -150.0, 128.0]),
    ])  # fmt: skip


@pytest.mark.parametrize(
    ("name", "fn", "ref"),
    [
        ("tanh", torch.tanh, np.tanh),
        ("exp", torch.exp, np.exp),
        ("exp2", torch.exp2, np.exp2),
        ("log", torch.log, np.log),
        ("log2", torch.log2, np.log2),
        ("sigmoid", torch.sigmoid, lambda x: 1.0 / (1.0 + np.exp(-x))),
    ],
)
def test_the_float32_math_is_within_3_ulp_of_float64(name: str, fn: Any, ref: Any) -> None:
    """The prelude's exp, exp2, log, log2, tanh and sigmoid (what the compiler vectorises in place of
    libm's calls) on a dense grid and the edges: within 3 float32 ulp of float64 where the result is
    a normal float, and the same zeros, infinities and NaNs."""
    built, _ = cpu_mods._get(lambda s, b, h, i, j: fn(s), False)
    assert built is not None
    x = _grid()
    y = x.clone()
    FWD(built.fwd)(y.data_ptr(), y.numel(), 0, 0, 0, 0, torch.zeros(1, dtype=torch.int64).data_ptr())
    with np.errstate(all="ignore"):
        want = torch.from_numpy(ref(x.double().numpy()))
    w32 = want.float()
    assert torch.equal(y.isnan(), w32.isnan())
    assert torch.equal(y[w32.isinf()], w32[w32.isinf()])
    assert torch.equal(y[w32 == 0] == 0, torch.ones_like(y[w32 == 0], dtype=torch.bool))
    normal = w32.isfinite() & (w32.abs() >= torch.finfo(F32).tiny)
    ulp = torch.from_numpy(np.spacing(w32.abs().numpy())).double()
    err = ((y.double() - want).abs() / ulp)[normal]
    assert float(err.max()) <= 3.0, f"{name}: {float(err.max()):.2f} ulp"


# ---------------------------------------------------------------------------------------------
# The kernel with a generated mod, against the golden


def _alibi(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return s - slopes[h] * (i - j).abs() + (b * 0.1).to(s.dtype)


def _rel(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return s + table[h, i - j + L - 1]


def _softcap(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return 1.5 * torch.tanh(s / 1.5)


def _int_div(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return torch.where(i // 5 >= j // 5, s, -float("inf"))  # block-causal in blocks of 5


def _late_rows_blocked(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return torch.where(i >= 15, -float("inf"), s)  # rows 15.. have no kept key: output 0, no NaN


CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "alibi_causal": (_alibi, {"causal": True}),
    "rel_table": (_rel, {}),
    "softcap_mod_window": (_softcap, {"window": (9, 2)}),
    "int_div_with_softcap": (_int_div, {"softcap": 2.0}),
    "rows_blocked_by_the_mod": (_late_rows_blocked, {}),
    "alibi_dropout": (_alibi, {"dropout_p": 0.3}),
}


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each call ran the kernel with a generated mod (True) or gave up to flash.py (False)."""
    calls: list[bool] = []
    real = cpu_mods.attention

    def spy(*a: Any, **kw: Any) -> Any:
        got = real(*a, **kw)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(cpu_mods, "attention", spy)
    return calls


@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_runs_a_score_mod_against_the_golden(case: str, ran: list[bool]) -> None:
    """out, lse and the gradients of q, k, v: GQA (4 query heads on 2), Lq != Lk, float32."""
    mod, kw = CASES[case]
    q, k, v = qkv(2, 4, 2, 23, 37, 16)
    check_against_golden("flash", F32, q, k, v, score_mod=mod, seed=3, **kw)
    assert ran and all(ran)


def test_an_index_past_a_tables_end_raises_as_torch_indexing_does(ran: list[bool]) -> None:
    """A mod reading a captured tensor out of range: torch's indexing raises IndexError, and so do
    flash.py and the reference; the generated code read 0 there and went on — a different result
    where the kernel is built than where it is not (IndexError). The row function now reports it
    and the kernel raises IndexError, with and without gradients; indices within range (negative
    ones wrap) raise nothing."""
    t = torch.randn(20)
    q, k, v = qkv(1, 2, 2, 16, 24, 8)

    def over(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s + t[j]  # keys 20..23: past t's end

    def inside(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s + t[j - 20] * t[i]  # keys 0..19: −20..−1, wrapped

    for grad in (False, True):
        qq = q.float().requires_grad_(grad)
        k32, v32 = k.float(), v.float()
        for backend in ("auto", "flash"):
            with pytest.raises(IndexError, match="score_mod: an index into a tensor it reads is out of bounds"):
                az.attention(qq, k32, v32, score_mod=over, backend=backend)
        with pytest.raises(IndexError, match="out of bounds"):
            az.attention(qq, k32, v32, score_mod=over, backend="reference")
    built, reached = cpu_mods._get(over, False)
    assert built is not None
    bound = cpu_mods._bind(built, reached)  # (holds the pointers' tensors)
    fwd = FWD(built.fwd)
    row = torch.zeros(24)
    assert fwd(row.data_ptr(), 20, 0, 0, 0, 0, bound.caps.data_ptr()) == 0  # keys 0..19
    assert fwd(row.data_ptr(), 4, 0, 0, 0, 18, bound.caps.data_ptr()) == 1  # keys 18..21
    check_against_golden("flash", F32, q, k, v, score_mod=inside)
    assert ran and all(ran)


def test_a_table_cast_twice_is_left_to_flash_py(ran: list[bool]) -> None:
    # the generated read kept only a whole table's last cast: t.half().float()[j] read t as float32
    t = torch.randn(37, dtype=torch.float64) * 3

    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s + t.half().float()[j] + t.int().float()[j] * 0.5

    q, k, v = qkv(1, 2, 2, 9, 37, 16)
    check_against_golden("flash", F32, q, k, v, score_mod=mod)
    assert ran and not any(ran)


def test_a_table_rebound_to_another_dtype_is_read_as_that_dtype(ran: list[bool]) -> None:
    # the mod's key holds each tensor's dtype: without it the code built for a float32 table read an
    # int32 / int64 one's bits as floats (NaN)
    box = {"t": torch.randn(37)}

    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s + box["t"][j]

    q, k, v = qkv(1, 2, 2, 9, 37, 16)
    for dtype in (torch.float32, torch.int32, torch.int64):
        box["t"] = (torch.randn(37) * 3).to(dtype)
        check_against_golden("flash", F32, q, k, v, score_mod=mod)
    assert ran and all(ran)


def test_a_mod_built_without_gradients_is_built_again_for_them(fresh: Any) -> None:
    # a call under no_grad builds the forward only; the next call wanting the table's gradient must
    # not take that build (keyed by the fingerprint alone, it did: no gradient reached w)
    w = torch.randn(37, requires_grad=True)

    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s * w[j]

    q, k, v = (t.float() for t in qkv(1, 2, 2, 9, 37, 16))
    with torch.no_grad():
        az.attention(q, k, v, score_mod=mod)
    (got,) = torch.autograd.grad(az.attention(q, k, v, score_mod=mod).square().sum(), w)
    (want,) = torch.autograd.grad(az.attention(q, k, v, score_mod=mod, backend="reference").square().sum(), w)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_16_bit_constant_made_in_the_mod_compares_in_16_bits(ran: list[bool]) -> None:
    # torch compares kv_idx with a float16 0-d tensor in float16 (2049 rounds to 2048); the generated
    # comparison took the constant as a Python number and compared in float32. The C++ has no float16
    # values: flash.py runs it
    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return torch.where(torch.tensor(2049.0, dtype=torch.float16) < j, s - 5.0, s)

    q, k, v = qkv(1, 1, 1, 2, 2060, 8)
    check_against_golden("flash", F32, q, k, v, score_mod=mod)
    assert ran and not any(ran)


@pytest.mark.parametrize(("Lq", "Lk", "D"), [(1, 1, 8), (17, 113, 40), (113, 17, 64), (130, 600, 96)])
def test_awkward_sizes(Lq: int, Lk: int, D: int, ran: list[bool]) -> None:
    """Rows and key blocks cut anywhere (the kernel's 512-key blocks: 600 keys are two of them)."""
    big = torch.randn(H, 2 * 700, requires_grad=True)

    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s + big[h, i - j + 650] - slopes[h] * (i - j).abs()

    q, k, v = qkv(1, 4, 1, Lq, Lk, D)
    check_against_golden("flash", F32, q, k, v, score_mod=mod, causal=True)
    assert ran and all(ran)


def test_bf16_a_bias_and_a_mask_from_a_mod_with_a_mod(ran: list[bool]) -> None:
    q, k, v = qkv(1, 2, 1, 40, 40, 16)
    bias = torch.randn(1, 2, 40, 40, dtype=torch.float64)
    prefix = az.masks.from_mod(lambda b, h, i, j: (j < 9) | (j <= i), 1, 1, 40, 40, block_size=8)
    check_against_golden("flash", BF16, q, k, v, bias=bias, score_mod=_alibi, mask=prefix)
    check_against_golden("flash", F32, q, k, v, bias=bias, score_mod=_rel, mask=prefix, softcap=3.0)
    assert ran and all(ran)


def test_captured_tensors_get_the_references_gradients(ran: list[bool]) -> None:
    """ALiBi slopes and a relative-position table, both leaves: the per-thread float64 sums equal
    autograd through the reference (float32, GQA, Lq != Lk, a mask from a mod, two threads)."""
    sl = slopes.detach().clone().requires_grad_()
    rel = table.detach().clone().requires_grad_()

    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s + rel[h, i - j + L - 1] - sl[h] * (i - j).abs()

    q, k, v = (t.to(F32).requires_grad_() for t in qkv(2, 4, 2, 37, 40, 16))
    prefix = az.masks.from_mod(lambda b, h, i, j: (j < 5) | (j <= i + 3), 1, 1, 37, 40, block_size=8)
    grads = {}
    for backend in ("reference", "flash"):
        out = az.attention(q, k, v, score_mod=mod, mask=prefix, backend=backend)  # type: ignore[arg-type]
        grads[backend] = torch.autograd.grad(out.square().sum(), (q, k, v, sl, rel))
    for got, want in zip(grads["flash"], grads["reference"]):
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    assert ran == [True]


def test_a_mod_that_blocks_everything_gives_zeros_and_zero_gradients(ran: list[bool]) -> None:
    q, k, v = (t.to(F32).requires_grad_() for t in qkv(1, 2, 2, 9, 9, 8))
    out, lse = az.attention(q, k, v, score_mod=lambda s, b, h, i, j: s - math.inf, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())
    for g in torch.autograd.grad(out.sum(), (q, k, v)):
        assert torch.equal(g, torch.zeros_like(g))
    assert ran == [True]


def test_double_backward_goes_through_the_formula(ran: list[bool]) -> None:
    q, k, v = (t.to(F32).requires_grad_() for t in qkv(1, 2, 2, 6, 7, 8))
    sl = slopes.detach().clone().requires_grad_()

    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s - sl[h] * (i - j).abs()

    (gq,) = torch.autograd.grad(az.attention(q, k, v, score_mod=mod).sum(), q, create_graph=True)
    (gsl,) = torch.autograd.grad(gq.square().sum(), sl)
    (wq,) = torch.autograd.grad(az.attention(q, k, v, score_mod=mod, backend="reference").sum(), q, create_graph=True)
    (wsl,) = torch.autograd.grad(wq.square().sum(), sl)
    torch.testing.assert_close(gsl, wsl, rtol=1e-4, atol=1e-5)
    assert ran == [True]


# ---------------------------------------------------------------------------------------------
# What runs on flash.py instead


def _dot(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return s + torch.dot(table[h], table[h]) * 0.01


half_table = torch.randn(H, 2 * L - 1).to(torch.float16)


def _half(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return s + half_table[h, i - j + L - 1].float()


@pytest.mark.parametrize("mod", [_dot, _half], ids=["dot", "float16_table"])
def test_a_mod_that_cannot_be_generated_runs_on_flash(
    mod: Any, ran: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    flash_calls: list[int] = []
    real = functional._flash_with_mod
    monkeypatch.setattr(functional, "_flash_with_mod", lambda *a, **kw: flash_calls.append(1) or real(*a, **kw))
    q, k, v = (t.to(F32) for t in qkv(1, 4, 4, 5, 7, 16))
    got = az.attention(q, k, v, score_mod=mod)
    want = az.attention(q.double(), k.double(), v.double(), score_mod=mod, backend="reference")
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)
    assert ran == [False] and flash_calls == [1]


@pytest.mark.parametrize("how", ["no_compiler", "failing_compiler", "unwritable_cache"])
def test_a_build_that_fails_warns_once_and_runs_on_flash(
    how: str, fresh: Any, monkeypatch: pytest.MonkeyPatch, ran: list[bool]
) -> None:
    if how == "no_compiler":
        monkeypatch.setenv("CXX", "/nonexistent/c++")
    elif how == "failing_compiler":
        monkeypatch.setenv("CXX", "false")
    else:  # a file where the directory should be: no one, root included, can make it
        (fresh / "file").write_text("")
        monkeypatch.setenv("ATTNZERO_CACHE", str(fresh / "file"))
    q, k, v = (t.to(F32) for t in qkv(1, 2, 2, 6, 9, 8))
    want = az.attention(q.double(), k.double(), v.double(), score_mod=_rel, backend="reference")
    with pytest.warns(RuntimeWarning, match="score_mod cannot run in the CPU kernel .* flash.py"):
        got = az.attention(q, k, v, score_mod=_rel)
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the same reason is not said again
        az.attention(q, k, v, score_mod=_softcap)
    assert ran == [False, False]


# ---------------------------------------------------------------------------------------------
# The cache: traced and built once per mod and what it reads


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch, fresh: Any) -> list[int]:
    count: list[int] = []
    real = codegen._trace
    monkeypatch.setattr(codegen, "_trace", lambda *a, **kw: count.append(1) or real(*a, **kw))
    return count


def test_a_mod_met_again_is_not_traced_again(traces: list[int], ran: list[bool]) -> None:
    q, k, v = (t.to(F32) for t in qkv(1, 4, 2, 8, 8, 8))
    for _ in range(3):
        az.attention(q, k, v, score_mod=_rel)
    def scaled(w: float) -> mods.ScoreMod:
        return lambda s, b, h, i, j: s * w

    for _ in range(3):  # a function made anew each call, with the same code and closure: the same key
        az.attention(q, k, v, score_mod=scaled(0.5))
    assert len(traces) == 2 and ran == [True] * 6


def test_what_the_mod_reads_is_read_now(traces: list[int], ran: list[bool]) -> None:
    """A captured tensor changed in place, replaced by another of the same shape (no new trace), a
    Python number it reads changed (traced in: a new trace): each call gives the mod's answer now."""
    q, k, v = (t.to(F32) for t in qkv(1, 4, 2, 8, 8, 8))
    state: dict[str, Any] = {"t": torch.randn(H, 2 * L - 1), "c": 0.5}

    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s * state["c"] + state["t"][h, i - j + L - 1]

    def check() -> None:
        got = az.attention(q, k, v, score_mod=mod)
        want = az.attention(q.double(), k.double(), v.double(), score_mod=mod, backend="reference")
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)

    check()
    state["t"].mul_(3.0)
    check()
    state["t"] = torch.randn(H, 2 * L - 1)
    check()
    assert len(traces) == 1
    state["c"] = 2.0
    check()
    assert len(traces) == 2 and ran == [True] * 4


def test_fingerprint_tells_apart_what_changes_the_trace() -> None:
    t = torch.randn(3)
    c = 1.0

    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s * c + t[h]

    key = mods.fingerprint(mod)[0]
    assert mods.fingerprint(mod)[0] == key
    t = torch.randn(3)  # same shape, another tensor: the same graph
    assert mods.fingerprint(mod)[0] == key
    t = torch.randn(4)
    assert mods.fingerprint(mod)[0] != key
    t = torch.randn(3, requires_grad=True)
    assert mods.fingerprint(mod)[0] != key
    t, c = torch.randn(3), 2.0
    assert mods.fingerprint(mod)[0] != key
    assert cpu_kernel.available()


def test_fingerprint_sees_a_config_objects_field() -> None:
    class Config:
        def __init__(self) -> None:
            self.cap = 30.0

    cfg = Config()

    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return cfg.cap * torch.tanh(s / cfg.cap)

    key = mods.fingerprint(mod)[0]
    cfg.cap = 20.0  # traced in as a constant: a new key, so a new trace
    assert mods.fingerprint(mod)[0] != key


class _Cfg:  # a config class: its attributes are read by the mod below as Cfg.alpha
    alpha = 0.5

    @classmethod
    def scaled(cls) -> float:  # read through a classmethod: cls.alpha
        return cls.alpha


_cfg_module = types.ModuleType("attnzero_test_config")  # a config module: cfg.alpha
_cfg_module.alpha = 0.5
_cfg_array = np.array([0.5])


class _Holder:
    def __init__(self) -> None:
        self.alpha = 0.5
        self.step = 0  # not read by any mod


_cfg_object = _Holder()


def _alpha_of(holder: _Holder) -> float:  # a global function reading a field of what it is given
    return holder.alpha


@pytest.mark.parametrize(
    ("mod", "set_alpha"),
    [
        (lambda s, b, h, i, j: s * _Cfg.alpha, lambda x: setattr(_Cfg, "alpha", x)),
        (lambda s, b, h, i, j: s * _cfg_module.alpha, lambda x: setattr(_cfg_module, "alpha", x)),
        (lambda s, b, h, i, j: s * float(_cfg_array[0]), lambda x: _cfg_array.__setitem__(0, x)),
        (lambda s, b, h, i, j: s * _Cfg.scaled(), lambda x: setattr(_Cfg, "alpha", x)),
        (lambda s, b, h, i, j: s * _alpha_of(_cfg_object), lambda x: setattr(_cfg_object, "alpha", x)),
    ],
    ids=["class", "module", "numpy", "classmethod", "helper"],
)
def test_a_number_read_through_a_class_a_module_or_an_array_is_read_now(
    mod: mods.ScoreMod, set_alpha: Callable[[float], None], traces: list[int], ran: list[bool]
) -> None:
    """A number the mod reads as a class's or a module's attribute, or from a numpy array, is traced
    in as a constant: changed, it makes a new key (a new trace), never the old code's answer."""
    q, k, v = (t.to(F32) for t in qkv(1, 4, 2, 8, 8, 8))
    try:
        for alpha in (0.5, 3.0, 0.5):
            set_alpha(alpha)
            got = az.attention(q, k, v, score_mod=mod)
            want = az.attention(q, k, v, scale=alpha / math.sqrt(8))  # s · alpha: the scale times alpha
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        set_alpha(0.5)
    assert len(traces) == 2 and ran == [True] * 3  # 0.5 met again: its code is kept


def test_a_tensor_in_a_config_object_is_read_now(traces: list[int], ran: list[bool]) -> None:
    """A table held by a plain object's attribute, replaced by another of the same shape: the same
    generated code (no new trace) reads the new one."""

    class Config:
        def __init__(self) -> None:
            self.table = torch.randn(H, 2 * L - 1)

    cfg = Config()

    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s + cfg.table[h, i - j + L - 1]

    q, k, v = (t.to(F32) for t in qkv(1, 4, 2, 8, 8, 8))
    for _ in range(2):
        got = az.attention(q, k, v, score_mod=mod)
        want = az.attention(q.double(), k.double(), v.double(), score_mod=mod, backend="reference")
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)
        cfg.table = torch.randn(H, 2 * L - 1) * 3
    assert len(traces) == 1 and ran == [True, True]


def _closure(a: Any, b: Any, c: Any) -> Any:
    def mod(s: Tensor, bb: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s * a + b * i + c * j

    return mod


def _over(obj: Any) -> Any:
    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s * obj.alpha

    return mod


class _Slots:
    __slots__ = ("alpha",)

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha


class _ClassAlpha:
    alpha = 1.0


def _with_attr(x: float) -> Any:
    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s * mod.alpha  # type: ignore[attr-defined]

    mod.alpha = x  # type: ignore[attr-defined]
    return mod


_t1, _t2 = torch.randn(4), torch.randn(4)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (lambda: _closure(1, 1, 2), lambda: _closure(1, 2, 2)),  # small ints are one object each
        (lambda: _closure(True, True, False), lambda: _closure(True, False, False)),
        (lambda: _closure(_t1, _t1, _t2), lambda: _closure(_t1, _t2, _t2)),  # which slot holds which tensor
        (lambda: _closure(0.0, 1, 1), lambda: _closure(-0.0, 1, 1)),
        (lambda: _closure({"a": 1, "b": 2}, 1, 1), lambda: _closure({"b": 1, "a": 2}, 1, 1)),  # a dict's keys
        (lambda: functools.partial(_closure, a=1.0), lambda: functools.partial(_closure, c=1.0)),
        (lambda: _closure({1}, 1, 1), lambda: _closure({1, 2}, 1, 1)),
        (lambda: _over(_Slots(1.0)), lambda: _over(_Slots(5.0))),
        (lambda: _with_attr(1.0), lambda: _with_attr(5.0)),  # the function's own attribute
        (lambda: _closure(torch.exp, 1, 1), lambda: _closure(torch.log, 1, 1)),
    ],
    ids=["ints", "flags", "tensor_slots", "signed_zero", "dict_keys", "partial_names", "set", "slots", "fn_attr",
         "builtins"],
)  # fmt: skip
def test_fingerprint_tells_apart_what_a_flat_key_merged(a: Any, b: Any) -> None:
    """Keys that were equal for mods that trace to different graphs (found by a sweep: the cached code
    of the first gave the second wrong results, errors up to 3.5): values met twice, which slot holds
    which tensor, names, -0.0, sets, slots, a function's attributes, builtins."""
    mod_a = a()
    ka, kb = mods.fingerprint(mod_a)[0], mods.fingerprint(b())[0]
    assert ka is not None and kb is not None and ka != kb
    assert mods.fingerprint(mod_a)[0] == ka  # met again: the same key (kept)


def test_fingerprint_sees_a_class_attribute_read_through_an_instance() -> None:
    obj = _ClassAlpha()
    key = mods.fingerprint(_over(obj))[0]
    _ClassAlpha.alpha = 5.0
    try:
        assert mods.fingerprint(_over(obj))[0] != key
    finally:
        _ClassAlpha.alpha = 1.0


def test_fingerprint_refuses_nesting_deeper_than_it_follows() -> None:
    deep: Any = 1.0
    for _ in range(40):
        deep = [deep]
    assert mods.fingerprint(_closure(deep, 1, 1))[0] is None


@pytest.mark.parametrize(
    "read",
    [lambda t: t.item(), lambda t: float(np.asarray(t)), lambda t: complex(t).real, lambda t: float(f"{t:.3f}"),
     lambda t: float(str(t)[7:-1]), lambda t: 2.0 if torch.equal(t, torch.tensor(5.0)) else 1.0,
     lambda t: 2.0 if t.allclose(torch.tensor(5.0)) else 1.0],
    ids=["item", "numpy", "complex", "format", "str", "equal", "allclose"],
)
def test_a_mod_that_reads_a_tensors_value_is_traced_at_every_call(
    read: Callable[[Tensor], float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``t.item()``, ``np.asarray(t)``, ``complex(t)``, ``f"{t}"`` while tracing put the value in the
    graph: such code is not kept (the same fingerprint with another value traced again), and each
    call gets its own value's result (np.asarray and complex had reused the first value's code)."""
    traces: list[str] = []
    real = codegen._trace
    monkeypatch.setattr(codegen, "_trace", lambda fn, name, device: traces.append(name) or real(fn, name, device))
    monkeypatch.setattr(cpu_mods, "_CACHE", {})

    def make(t: Tensor) -> Any:
        def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return s + read(t) * 0.3 * j

        return mod

    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    for value in (1.0, 5.0):
        got = az.attention(q, k, v, score_mod=make(torch.tensor(value)), backend="flash")
        want = az.attention(q.double(), k.double(), v.double(), score_mod=make(torch.tensor(value)),
                            backend="reference")  # fmt: skip
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)
    assert len(traces) == 2


class _RelativeAttention(torch.nn.Module):
    """FlexAttention's usual style: the score_mod a lambda made in ``forward``, reading ``self``."""

    def __init__(self) -> None:
        super().__init__()
        self.rel = torch.nn.Parameter(torch.randn(H))

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = az.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + self.rel[h])
        assert isinstance(out, Tensor)
        return out


def test_a_lambda_over_self_made_in_forward_is_traced_once(traces: list[int], ran: list[bool]) -> None:
    """The walk from ``self`` reaches forward's globals (``az``); attnzero's own functions are not
    walked further (it reached the whole package and its caches: no key, a trace on every call)."""
    m = _RelativeAttention()
    q, k, v = (t.to(F32) for t in qkv(1, 4, 2, 8, 8, 8))
    with torch.no_grad():
        for _ in range(3):
            m(q, k, v)
    assert len(traces) == 1 and ran == [True] * 3
    assert len(mods._walk(lambda s, b, h, i, j: s + m.rel[h])[0]) < 200


class _Softcap:
    def __init__(self, cap: float) -> None:
        self.cap = cap
        self.payload = torch.zeros(1000)  # what a mod object may carry besides its configuration

    def __call__(self, s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return self.cap * torch.tanh(s / self.cap)


def test_a_callable_object_made_per_call_is_neither_kept_nor_traced_again(traces: list[int], ran: list[bool]) -> None:
    """An object hashed by identity is told apart by its fields, not held in the key: a new instance
    per call with the same fields is the same code, and is freed after the call (the cache held
    every instance, and all it held, and traced each one)."""
    q, k, v = (t.to(F32) for t in qkv(1, 4, 2, 8, 8, 8))
    gone = []
    with torch.no_grad():
        for _ in range(3):
            mod = _Softcap(20.0)
            gone.append(weakref.ref(mod))
            az.attention(q, k, v, score_mod=mod)
            del mod
        az.attention(q, k, v, score_mod=_Softcap(5.0))  # another field: another trace
    gc.collect()
    assert all(r() is None for r in gone)
    assert len(traces) == 2 and ran == [True] * 4


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sub = torch.nn.Module()
        self.sub.alpha = 1.0  # a submodule's plain field
        self.big = torch.nn.Linear(64, 64)  # not named by the mod: not walked
        self.slopes = torch.tensor([0.5, 0.25], requires_grad=True)  # a plain tensor field, not a Parameter

    def mod(self, s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s * self.sub.alpha + self.slopes[h] * (j - i)


def test_a_modules_method_keys_what_it_names_and_its_plain_tensor_gets_a_gradient() -> None:
    """A mod that is a module's method: a submodule's field it reads changes the key, a layer it does
    not name does not; its unregistered tensor field is captured, so it gets the reference's gradient."""
    m = _Scaled()
    key = mods.fingerprint(m.mod)[0]
    m.big.weight.data.zero_()
    assert mods.fingerprint(m.mod)[0] == key
    m.sub.alpha = 2.0
    assert mods.fingerprint(m.mod)[0] != key
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    grads = []
    for backend in ("flash", "reference"):
        m.slopes.grad = None
        az.attention(q, k, v, score_mod=m.mod, backend=backend).square().sum().backward()
        assert m.slopes.grad is not None
        grads.append(m.slopes.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-4)


class _Helper(torch.nn.Module):
    BETA = 1.0  # a class constant read by a helper method

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.layers[0].gain = 1.0  # a child's field in a ModuleList
        self.tables = {"rel": torch.randn(4)}  # a tensor held in a dict field

    def scale(self) -> float:
        return self.BETA * getattr(self, "gamma", 1.0)

    def forward(self, s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s * self.scale() * self.layers[0].gain + self.tables["rel"][h]


def test_a_module_mod_keys_what_its_helpers_read_and_captures_its_dict_tensors() -> None:
    """A module as the mod: a class constant and a getattr'd field read by a helper method, a
    ModuleList child's field all change the key (a sweep found each kept stale); a tensor in a dict
    field is captured (read at the call, not traced in), so rebinding it gives the new table's result,
    and a parameter added beside it does not move which tensor the kept code reads."""
    m = _Helper()
    key = mods.fingerprint(m)[0]
    for change, undo in (
        (lambda: setattr(_Helper, "BETA", 2.0), lambda: setattr(_Helper, "BETA", 1.0)),
        (lambda: setattr(m, "gamma", 3.0), lambda: delattr(m, "gamma")),
        (lambda: setattr(m.layers[0], "gain", 2.0), lambda: setattr(m.layers[0], "gain", 1.0)),
    ):
        change()
        assert mods.fingerprint(m)[0] != key
        undo()
        assert mods.fingerprint(m)[0] == key
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    for step in range(3):
        if step == 1:
            m.tables["rel"] = torch.randn(4)  # rebound: same key, the new values
        if step == 2:
            m.unused = torch.nn.Parameter(torch.randn(4))  # registered before nothing: the key changes
        got = az.attention(q, k, v, score_mod=m, backend="flash")
        want = az.attention(q.double(), k.double(), v.double(), score_mod=m, backend="reference")
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)


_DATA = [float(i) for i in range(100_000)]  # data a module's unrelated method reads


class _WithData(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.slopes = torch.tensor([0.5, 0.25], requires_grad=True)

    def forward(self, s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s + self.slopes[h] * (j - i)

    def total(self) -> float:
        return sum(_DATA)


def test_a_mod_that_reaches_big_data_is_not_kept_and_still_captures_its_tensors() -> None:
    """A container longer than the walk follows (here a method's global list of 100k floats) is not
    walked: the key is None (traced at every call), quickly, and the module's tensor is still captured."""
    m = _WithData()
    t0 = time.perf_counter()
    key, tensors = mods.fingerprint(m)
    assert key is None and time.perf_counter() - t0 < 0.05
    assert any(t is m.slopes for t in tensors)


class _Scales(collections.UserDict):  # type: ignore[type-arg]
    """A library container subclassed: its ``data`` field is read by the library's ``__getitem__``."""


class _Scaler:
    def __init__(self) -> None:
        self.alpha = 0.5

    def __float__(self) -> float:  # read by float(obj): a special method, named by no code
        return self.alpha


_scales = _Scales(alpha=0.5)
_scaler = _Scaler()
_table = {"alpha": 0.5}
_get = _table.get  # a builtin's method bound to the data


class _Tagged(list):  # type: ignore[type-arg]
    pass


_tagged = _Tagged([1.0])
_tagged.alpha = 0.5  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("mod", "set_alpha"),
    [
        (lambda s, b, h, i, j: s * _scales["alpha"], lambda x: _scales.__setitem__("alpha", x)),
        (lambda s, b, h, i, j: s * float(_scaler), lambda x: setattr(_scaler, "alpha", x)),
        (lambda s, b, h, i, j: s * getattr(_scaler, "al" + "pha"), lambda x: setattr(_scaler, "alpha", x)),
        (lambda s, b, h, i, j: s * _get("alpha"), lambda x: _table.__setitem__("alpha", x)),
        (lambda s, b, h, i, j: s * _tagged.alpha, lambda x: setattr(_tagged, "alpha", x)),
    ],
    ids=["library_container", "special_method", "computed_name", "bound_builtin", "list_subclass_field"],
)
def test_values_read_where_no_code_names_them_are_read_now(
    mod: mods.ScoreMod, set_alpha: Callable[[float], None], traces: list[int], ran: list[bool]
) -> None:
    """Every field of what the mod reaches keys its code, named by its code or not (a walk of the
    named fields only kept the first value's code for each of these; a bound builtin's data and a
    list subclass's fields were never walked)."""
    q, k, v = (t.to(F32) for t in qkv(1, 4, 2, 8, 8, 8))
    try:
        for alpha in (0.5, 3.0):
            set_alpha(alpha)
            got = az.attention(q, k, v, score_mod=mod)
            torch.testing.assert_close(got, az.attention(q, k, v, scale=alpha / math.sqrt(8)), rtol=1e-5, atol=1e-5)
    finally:
        set_alpha(0.5)
    assert len(traces) == 2


def test_a_tensors_layout_type_and_attributes_key_the_code() -> None:
    """What a trace may read of a captured tensor besides its values: strides, its type, attributes."""
    t = torch.randn(4, 4)

    def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return s * (2.0 if t.is_contiguous() else 1.0) * getattr(t, "gain", 1.0)

    key = mods.fingerprint(mod)[0]
    t = torch.randn(4, 4).t()
    assert mods.fingerprint(mod)[0] != key
    t = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
    assert mods.fingerprint(mod)[0] != key
    t = torch.randn(4, 4)
    t.gain = 3.0  # type: ignore[attr-defined]
    assert mods.fingerprint(mod)[0] != key


def test_a_modules_hooks_key_its_code() -> None:
    m = torch.nn.Module()
    m.forward = lambda s, b, h, i, j: s  # type: ignore[method-assign]
    key = mods.fingerprint(m)[0]
    m.register_forward_hook(lambda mod, args, out: out * 2.0)
    assert mods.fingerprint(m)[0] != key


class _Slotted:
    """Slots and a __getattr__ that raises KeyError: hasattr() let it escape from the walk."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values = {"alpha": 0.5}

    def __getattr__(self, name: str) -> float:
        return self.values[name]  # KeyError for an unknown name (as some config classes do)


class _Child:
    def __init__(self, parent: Any) -> None:
        self.parent = weakref.proxy(parent)  # dead once the parent is collected; the mod never reads it
        self.t = torch.rand(2)


@pytest.mark.parametrize("case", ["getattr_raises", "dead_proxy"])
def test_the_walk_does_not_fail_a_call_the_mod_runs(case: str) -> None:
    """The walk only keys the cache: an object whose attribute lookup raises, or a dead weak proxy
    beside what the mod reads, made every backend raise (KeyError, ReferenceError)."""
    if case == "getattr_raises":
        cfg = _Slotted()

        def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return s * cfg.alpha

    else:

        class Parent:
            pass

        child = _Child(Parent())
        gc.collect()

        def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return s + child.t[0]

    q, k, v = (t.to(F32) for t in qkv(1, 2, 2, 8, 8, 8))
    torch.testing.assert_close(az.attention(q, k, v, score_mod=mod), az.attention(q, k, v, score_mod=mod,
                               backend="reference"), rtol=1e-5, atol=1e-6)  # fmt: skip


def test_parameters_behind_a_long_dict_a_deque_or_a_bound_slot_get_their_gradients() -> None:
    """Tensors the walk reached but did not capture got no gradient on the kernel and flash.py (the
    reference's autograd gave it): a dict of more than _BIG entries (dict(model.named_parameters())),
    a deque, a mappingproxy, ``(p,).__getitem__``."""
    p = torch.nn.Parameter(torch.tensor([0.5, -0.25]))
    params = {f"x{n}": torch.zeros(1) for n in range(mods._BIG + 5)} | {"slopes": p}
    holders: list[Callable[[int], Tensor]] = [
        lambda h: params["slopes"][h],
        lambda h, d=collections.deque([p]): d[0][h],
        lambda h, m=types.MappingProxyType({"p": p}): m["p"][h],
        lambda h, g=(p,).__getitem__: g(0)[h],
    ]
    q, k, v = (t.to(F32) for t in qkv(1, 2, 2, 6, 6, 8))
    for read in holders:

        def mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor, read: Any = read) -> Tensor:
            return s + read(h) * (j - i)

        grads = []
        for backend in ("auto", "reference"):
            p.grad = None
            az.attention(q, k, v, score_mod=mod, backend=backend).sum().backward()
            assert p.grad is not None, backend
            grads.append(p.grad.clone())
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)


def test_an_object_keyed_by_its_fields_is_not_held_whatever_its_hash() -> None:
    """A frozen dataclass (hashable by value, its hash over a tensor's id) was held in the key with
    all it holds, one cache entry per instance."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Config:
        table: Tensor
        gain: float = 1.0

    q, k, v = (t.to(F32) for t in qkv(1, 2, 2, 6, 6, 8))
    gone = []
    for _ in range(3):
        cfg = Config(torch.randn(2))
        gone.append(weakref.ref(cfg.table))
        az.attention(q, k, v, score_mod=lambda s, b, h, i, j, c=cfg: s * c.gain + c.table[h])
        del cfg
    gc.collect()
    assert all(r() is None for r in gone)


def _attend_with_a_new_mod() -> None:
    from attnzero import trace

    torch.set_num_threads(1)  # as a DataLoader worker (OpenMP's threads do not survive a fork)
    q = torch.randn(1, 2, 32, 16)
    with trace.recording():
        az.attention(q, q, q, score_mod=lambda s, b, h, i, j: s * 3.25 - 1.0)


def test_a_process_forked_while_a_thread_builds_a_mod_builds_its_own() -> None:
    """A DataLoader worker (fork) made while another thread of the parent held the build's lock —
    and attnzero.trace's — gets locks of its own: its first new score_mod ran into the copy of a lock
    no thread of the child would release, and waited forever."""
    need_kernel()
    import multiprocessing
    import threading

    from attnzero import trace

    held, release = threading.Event(), threading.Event()

    def builder() -> None:  # a thread of the parent in the middle of a build (and of a trace note)
        with cpu_mods._lock, trace._LOCK:
            held.set()
            release.wait(60)

    t = threading.Thread(target=builder)
    t.start()
    held.wait(10)
    try:
        child = multiprocessing.get_context("fork").Process(target=_attend_with_a_new_mod)
        child.start()
        child.join(60)
        hung = child.is_alive()
        if hung:
            child.kill()
    finally:
        release.set()
        t.join()
    assert not hung and child.exitcode == 0, "the forked child waited on its parent's lock"
