"""One backend interface (ops.Backend) and one choice of backend (functional.choose).

Every backend has a plain ``forward -> (out, lse)`` and a ``backward(dout, q, k, v, out, lse, ...)``
that recomputes P from the ``out`` and ``lse`` it is given — so a caller that splits the keys (the
ring of ``distributed.py``) gets each part's share of the gradients from the GLOBAL out and lse.
Which implementation runs is decided once, in ``functional.choose``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
import torch
from conftest import kernel_built, need_kernel, qkv

import attnzero as az
from attnzero import functional, ops, reference
from attnzero.distributed import _merge

NAMES = ["reference", "flash", "cpu_kernel", "triton"]
# what backend="flash" runs on CPU: the compiled kernel where it is built, else flash.py
FLASH_CPU = "cpu_kernel" if kernel_built() else "flash"


def _runnable(name: str) -> None:
    if name == "cpu_kernel":
        need_kernel()
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            pytest.skip("backend='triton' needs `pip install triton`")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("backend='triton' runs on CUDA or under TRITON_INTERPRET=1")


def _device(name: str) -> torch.device:
    return torch.device("cuda" if name == "triton" and torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_from_a_global_out_and_lse(name: str, causal: bool) -> None:
    """Keys split in two parts: each part's forward, merged by lse, is the whole forward; each
    part's backward from the merged (global) out and lse adds up to the whole backward."""
    _runnable(name)
    dev = _device(name)
    dtype = torch.float32 if name in ("triton", "cpu_kernel") else torch.float64
    q, k, v = (t.to(dev, dtype) for t in qkv(2, 4, 2, 19, 19, 16))
    dout = torch.randn(2, 4, 19, 16, dtype=dtype, device=dev)
    be = ops.backend(name)
    kw: dict[str, Any] = {"mask": None, "bias": None, "window": None, "scale": 0.3, "dropout_p": 0.0, "dropout_seed": 0}
    whole_out, whole_lse = be.forward(q, k, v, causal=causal, **kw)
    whole = be.backward(dout, q, k, v, whole_out, whole_lse, causal=causal, **kw)

    # keys [0, 11) and [11, 19); under causal each part's keep-mask is the global one's columns
    # (query i sees key j <= i), so rows that see no key of a part occur too
    def part_mask(cols: slice) -> torch.Tensor | None:
        if not causal:
            return None
        j = torch.arange(cols.start, cols.stop, device=dev)
        return (j <= torch.arange(19, device=dev).unsqueeze(1)).view(1, 1, 19, -1)

    parts = [slice(0, 11), slice(11, 19)]
    acc = whole_lse.dtype
    out = torch.zeros(2, 4, 19, 16, dtype=acc, device=dev)
    lse = torch.full((2, 4, 19), float("-inf"), dtype=acc, device=dev)
    for cols in parts:
        o, s = be.forward(q, k[:, :, cols], v[:, :, cols], causal=False, **{**kw, "mask": part_mask(cols)})
        _merge(out, lse, o, s)
    torch.testing.assert_close(out.to(dtype), whole_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-5)

    out_g = out.to(dtype)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for cols in parts:
        dq_p, dk_p, dv_p, db = be.backward(
            dout, q, k[:, :, cols].contiguous(), v[:, :, cols].contiguous(), out_g, lse, causal=False,
            **{**kw, "mask": part_mask(cols)},
        )  # fmt: skip
        assert db is None
        dq += dq_p
        dk[:, :, cols] += dk_p
        dv[:, :, cols] += dv_p
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    for got, want in zip((dq, dk, dv), whole[:3]):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_reference_backward_with_dropout_from_out_and_lse() -> None:
    """The reference's interface backward (no kept P/Z) draws the forward's dropout entries again
    and equals autograd through the formula."""
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 2, 1, 9, 13, 8))
    kw: dict[str, Any] = {"mask": None, "bias": None, "causal": True, "window": (4, None), "scale": 0.4,
                          "dropout_p": 0.3, "dropout_seed": 1234}
    out, lse = reference.attention(q, k, v, **kw)
    dout = torch.randn_like(out)
    want = torch.autograd.grad(out, (q, k, v), dout)
    got = ops.backend("reference").backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, **kw)
    for a, b in zip(got[:3], want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# The choice, made once


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the implementations that functional.py runs (eager calls)."""
    names: list[str] = []
    real = functional._backend

    def spy(name: str):  # type: ignore[no-untyped-def]
        names.append(name)
        return real(name)

    monkeypatch.setattr(functional, "_backend", spy)
    return names


def test_choose_names_what_runs_on_cpu() -> None:
    tiny, big = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 200, 8)
    assert functional.choose("auto", tiny, tiny, needs_grad=True) == FLASH_CPU
    assert functional.choose("auto", big, big, needs_grad=False) == FLASH_CPU
    assert functional.choose("auto", big.half(), big.half(), needs_grad=False) == FLASH_CPU
    assert functional.choose("auto", big.double(), big.double(), needs_grad=True) == "flash"  # float64: flash.py
    assert functional.choose("flash", big, big, needs_grad=True) == FLASH_CPU
    assert functional.choose("reference", big, big, needs_grad=True) == "reference"
    # (any bias runs on the kernel, an additive mask's -1e9 rows too: only a backward whose rows need a
    # shifted lse runs on flash.py, cpu_kernel.backward — test_flash.py)
    assert set(ops.NAMES) == set(ops.BACKENDS)


def test_attention_runs_the_chosen_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    names = _spy(monkeypatch)
    q = torch.randn(1, 2, 9, 8, dtype=torch.float64)
    az.attention(q, q, q)
    az.attention(q, q, q, backend="reference")
    az.attention(q.float(), q.float(), q.float())
    assert names == ["flash", "reference", FLASH_CPU]
    monkeypatch.setattr(functional, "choose", lambda name, q, k, *, needs_grad, v=None, bias=None: "flash")
    az.attention(q, q, q, backend="reference")
    assert names[-1] == "flash"  # a patched choice is honoured


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_float64_on_triton_is_routed_by_functional(monkeypatch: pytest.MonkeyPatch) -> None:
    """backend="triton" with float64: functional.choose picks the flash backend (same answer, with
    gradients); the triton backend never sees float64, in eager and in compiled calls."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("backend='triton' runs on CUDA or under TRITON_INTERPRET=1")
    from attnzero.kernels import triton_backend as tb

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q, k, v = (t.to(dev).requires_grad_(True) for t in qkv(1, 2, 1, 9, 12, 8))
    assert functional.choose("triton", q, k, needs_grad=True) == "flash"
    assert functional.choose("triton", q.float(), k.float(), needs_grad=True) == "triton"
    assert not hasattr(tb, "_float64")

    names = _spy(monkeypatch)
    seen: list[torch.dtype] = []
    for fn in ("attention", "forward", "backward", "decode"):
        real = getattr(tb, fn)

        def record(*args: Any, _real: Any = real, **kw: Any) -> Any:
            seen.extend(a.dtype for a in args if isinstance(a, torch.Tensor))
            return _real(*args, **kw)

        monkeypatch.setattr(tb, fn, record)
    out = az.attention(q, k, v, causal=True, backend="triton")
    assert names == ["flash"]
    want = az.attention(q, k, v, causal=True, backend="reference")
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad(out.sum(), (q, k, v))
    g_ref = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # compiled: the op of the flash backend
    compiled = torch.compile(lambda a, b, c: az.attention(a, b, c, causal=True, backend="triton"), fullgraph=True,
                             backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), want, rtol=1e-12, atol=1e-12)
    assert torch.float64 not in seen


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_choose_takes_decode_only_without_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("backend='triton' runs on CUDA or under TRITON_INTERPRET=1")
    from attnzero.kernels import triton_backend as tb

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q, k = torch.randn(1, 4, 2, 16, device=dev), torch.randn(1, 2, 2048, 16, device=dev)
    assert functional.choose("triton", q, k, needs_grad=False) == "triton_decode"
    assert functional.choose("triton", q, k, needs_grad=True) == "triton"
    assert functional.choose("triton", q, k[:, :, :100], needs_grad=False) == "triton"
    monkeypatch.setattr(tb, "DECODE_MIN_LK", 64)  # the kernel's limits are read at each choice
    assert functional.choose("triton", q, k[:, :, :100], needs_grad=False) == "triton_decode"
    wide = torch.randn(1, 4, 16, 16, device=dev)  # G·Lq = 32 rows per key/value head: still served
    assert functional.choose("triton", wide, k, needs_grad=False) == "triton_decode"
    monkeypatch.setattr(tb, "DECODE_MAX_ROWS", 16)
    assert functional.choose("triton", wide, k, needs_grad=False) == "triton"


@pytest.mark.parametrize("name", NAMES)
def test_a_view_with_the_negative_bit_is_read_as_its_values(name: str) -> None:
    """``torch._neg_view(x)`` — what ``z.conj().imag`` of a complex z gives — shares x's storage and
    carries a sign bit: a backend that reads memory (the CPU kernel, Triton, generated mods) must see
    −x, in q, k, v, the bias, a score_mod's captured table and the output's gradient, as torch does
    (the CPU kernel used to compute with +x: silently wrong)."""
    _runnable(name)
    dev = _device(name)
    backend = {"cpu_kernel": "auto"}.get(name, name)
    q, k, v = (t.to(dev, torch.float32).requires_grad_() for t in qkv(1, 2, 2, 9, 11, 16))
    bias = torch.randn(1, 2, 9, 11, device=dev)
    table = torch.randn(2, 20, device=dev)
    dout = torch.randn(1, 2, 9, 16, device=dev)

    def run(sign: Any) -> list[torch.Tensor]:
        t = sign(table)
        out = az.attention(
            sign(q), sign(k), sign(v), bias=sign(bias), causal=True, backend=backend,
            score_mod=lambda s, b, h, i, j: s + t[h, i - j + 10],
        )  # fmt: skip
        assert isinstance(out, torch.Tensor)
        return [out, *torch.autograd.grad(out, (q, k, v), sign(dout))]

    got = run(torch._neg_view)
    assert torch._neg_view(q).is_neg()
    for g, w in zip(got, run(torch.neg)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["tensor", "from_tensor", "and causal", "sinks", "score_mod", "lse"])
@pytest.mark.parametrize("name", NAMES)
def test_a_mask_changed_in_place_before_the_backward_is_refused_or_right(name: str, kind: str) -> None:
    """A bool mask flipped in place between the forward and the backward: the gradients are the
    forward's (the reference, whose graph holds what it used) or the call refuses as autograd refuses a
    changed saved tensor — the backends that evaluate the mask again gave the new mask's gradients."""
    _runnable(name)
    dev = _device(name)
    backend = {"cpu_kernel": "auto"}.get(name, name)
    dtype = torch.float32 if name in ("cpu_kernel", "triton") else torch.float64  # (float64: flash.py itself)
    q, k, v = (t.to(dev, dtype).requires_grad_() for t in qkv(1, 2, 2, 5, 7, 8))
    mask = torch.rand(1, 2, 5, 7, device=dev) > 0.3
    mask[..., 0] = True

    def run(m: torch.Tensor) -> torch.Tensor:
        kw: dict[str, Any] = {"mask": az.masks.from_tensor(m) if kind == "from_tensor" else m, "backend": backend}
        if kind == "and causal":  # a combination reads its parts' tensors
            kw["mask"] = az.masks.and_(az.masks.from_tensor(m), az.masks.causal(5, 7))
        if kind == "sinks":
            kw["sinks"] = torch.zeros(2, device=dev, dtype=dtype)
        if kind == "score_mod":
            kw["score_mod"] = lambda s, b, h, i, j: s * 0.5
        if kind == "lse":
            return az.attention(q, k, v, return_lse=True, **kw)[1]  # type: ignore[index, no-any-return]
        return az.attention(q, k, v, **kw)  # type: ignore[return-value]

    wrt = (q, k) if kind == "lse" else (q, k, v)  # (the lse does not depend on v)
    want = torch.autograd.grad(run(mask.clone()).sum(), wrt)
    out = run(mask)
    mask.logical_not_()
    mask[..., 0] = True
    try:
        got = torch.autograd.grad(out.sum(), wrt)
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
        return
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
