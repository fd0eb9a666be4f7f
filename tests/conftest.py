"""Shared test machinery: the backends under test, input factories, one golden comparison, and an
independent, deliberately naive attention used to check the golden itself.

The tolerance rule (DESIGN.md, "Numerics and tests") lives in ``attnzero.testing``: inputs are
drawn, rounded to dtype X, and the golden is ``backend="reference"`` on those rounded inputs in
float64. A backend run in dtype X passes when ``err(backend_X) <= 2 × err(reference_X) + floor`` for
outputs (3× for gradients), errors being max-abs differences against the golden. NaN never passes.
"""

from __future__ import annotations

import importlib.util
import math
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing in the suite may touch the network
# Without a GPU, backend="triton" runs on CPU tensors under Triton's interpreter, which must be chosen
# before Triton is first imported: attnzero.kernels is imported on first use of the backend, but
# Triton itself may come earlier, with torch._dynamo (importing attnzero loads it), so before attnzero.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attnzero as az
from attnzero.testing import assert_close_to_golden, assert_reference_sane, magnitude

# Every golden test is parametrized over this list: adding a backend is a one-line change here.
BACKENDS: list[str] = ["reference", "flash"]

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
DTYPE_IDS = ["f16", "bf16", "f32", "f64"]


@pytest.fixture(autouse=True, scope="session")
def _offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    """Random inputs per test, reproducible from the test's id; set ATTNZERO_TEST_SEED to draw
    other ones."""
    base = int(os.environ.get("ATTNZERO_TEST_SEED", "0"))
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()) ^ base)


# ---------------------------------------------------------------------------------------------
# Missing dependencies


def absent(message: str) -> None:
    """A dependency is missing: skip on a user's machine, but fail under CI (which installs every
    extra and Chromium), so a broken install step can never pass as a skip."""
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def kernel_off() -> bool:
    """Whether this run turned the compiled CPU kernel off (``ATTNZERO_NO_BUILD=1``: the second run of
    the backend tests, on flash.py)."""
    return os.environ.get("ATTNZERO_NO_BUILD", "") not in ("", "0")


def kernel_built() -> bool:
    """Whether backend="flash" runs the compiled CPU kernel here (built, or loaded from the cache)."""
    from attnzero import cpu_kernel

    return not kernel_off() and cpu_kernel.available()


def need_kernel() -> None:
    """A test of the compiled CPU kernel itself: skipped in the ATTNZERO_NO_BUILD=1 run, otherwise
    a kernel that cannot be built is a missing dependency (``absent``: fails under CI)."""
    from attnzero import cpu_kernel

    if kernel_off():
        pytest.skip("ATTNZERO_NO_BUILD=1: this run tests flash.py without the kernel")
    if not cpu_kernel.available():
        absent(f"the CPU kernel cannot be built here: {cpu_kernel.why()}")


@contextmanager
def flash_py() -> Iterator[None]:
    """In the block, backend="flash" runs flash.py itself rather than the compiled CPU kernel: for
    the tests of flash.py's own workings (its ``COUNTS``, its routes), whatever this run builds."""
    from attnzero import functional

    real = functional._takes_kernel
    functional._takes_kernel = lambda q: False  # type: ignore[assignment]
    try:
        yield
    finally:
        functional._takes_kernel = real


def need(*modules: str) -> None:
    """Python modules of the ``hf`` extra that a test needs (see ``absent``)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        absent(f"not installed: {', '.join(missing)} (pip install -e '.[hf]')")


def falcon_keeps_its_own_table() -> bool:
    """Whether the installed transformers' Falcon still picks its attention class from its own
    table keyed by the implementation name (so attnzero refuses it); 5.25 moved it onto the
    AttentionInterface, and from then on it runs."""
    modeling = importlib.import_module("transformers.models.falcon.modeling_falcon")
    return hasattr(modeling, "FALCON_ATTENTION_CLASSES")


# ---------------------------------------------------------------------------------------------
# Inputs


def randn(*shape: int, dtype: torch.dtype = torch.float64, layout: str = "contiguous") -> torch.Tensor:
    """Standard normal tensor of ``shape``, contiguous or laid out non-contiguously:

    * ``"transpose"``: stored as (B, L, H, D) and viewed as (B, H, L, D) (what a module's head split
      produces);
    * ``"strided"``: an ``as_strided`` view into a larger buffer with padded rows;
    * ``"sliced"``: every other element of a twice-as-wide last dim.
    """
    if layout == "contiguous":
        return torch.randn(*shape, dtype=dtype)
    if layout == "transpose":
        assert len(shape) == 4
        B, H, L, D = shape
        return torch.randn(B, L, H, D, dtype=dtype).transpose(1, 2)  # (B, L, H, D) -> (B, H, L, D)
    if layout == "strided":
        *lead, L, D = shape
        row = D + 3  # 3 unused elements after each row
        n_lead = math.prod(lead)
        buf = torch.randn(n_lead * L * row + 5, dtype=dtype)
        strides: list[int] = []
        acc = L * row
        for s in reversed(lead):
            strides.insert(0, acc)
            acc *= s
        return torch.as_strided(buf, (*lead, L, D), (*strides, row, 1), storage_offset=5)
    if layout == "sliced":
        return torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]
    raise ValueError(layout)


def qkv(
    B: int, Hq: int, Hkv: int, Lq: int, Lk: int, D: int, Dv: int | None = None, *, layout: str = "contiguous"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv)."""
    Dv = D if Dv is None else Dv
    return randn(B, Hq, Lq, D, layout=layout), randn(B, Hkv, Lk, D, layout=layout), randn(B, Hkv, Lk, Dv, layout=layout)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` for the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def random_keep(*shape: int, p_keep: float = 0.7) -> torch.Tensor:
    return torch.rand(*shape) < p_keep


# ---------------------------------------------------------------------------------------------
# An independent attention: explicit repeat of K/V heads, dense masks built from torch.tril/triu,
# torch.softmax. Written differently from reference.py on purpose, so it checks the golden.


def dense_keep(
    Lq: int,
    Lk: int,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
) -> torch.Tensor | None:
    """Combined dense keep-mask; causal and window bottom-right aligned (offset Lk - Lq)."""
    keep: torch.Tensor | None = None if mask is None else (mask != 0)
    off = Lk - Lq
    ones = torch.ones(Lq, Lk, dtype=torch.bool)
    if causal:
        c = ones.tril(diagonal=off)
        keep = c if keep is None else keep & c
    if window is not None:
        left, right = window
        w = ones.clone()
        if right is not None:
            w = w.tril(diagonal=off + right)
        if left is not None:
            w = w.triu(diagonal=off - left)
        keep = w if keep is None else keep & w
    return keep


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    keep: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
    drop_keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of softmax(scale · Q Kᵀ + bias) V with blocked pairs removed, in q's dtype.
    ``softcap``: scores capped by softcap·tanh(s / softcap) before the bias; ``sinks`` ((Hq,) or
    (B, Hq, Lq)): one more always-kept key column of that logit and value 0, dropped after the
    softmax."""
    G = q.shape[1] // k.shape[1]  # query heads per key/value head (GQA; 1 without)
    k = k.repeat_interleave(G, dim=1)  # (B, Hq, Lk, D): query head h reads kv head h // G
    v = v.repeat_interleave(G, dim=1)  # (B, Hq, Lk, Dv)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, Hq, Lq, Lk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if keep is None:
        keep = torch.ones((), dtype=torch.bool)
    keep = keep.expand_as(s)
    if sinks is not None:  # the sink as an extra key column: always kept, value 0
        B, H, Lq, _ = s.shape
        col = (sinks.view(1, H, 1, 1) if sinks.ndim == 1 else sinks.unsqueeze(-1)).expand(B, H, Lq, 1)
        s = torch.cat([s, col.to(s.dtype)], dim=-1)  # (B, Hq, Lq, Lk + 1)
        keep = torch.cat([keep, torch.ones(B, H, Lq, 1, dtype=torch.bool)], dim=-1)
        v = torch.cat([v, torch.zeros(*v.shape[:2], 1, v.shape[-1], dtype=v.dtype)], dim=-2)  # (B, Hq, Lk + 1, Dv)
        if drop_keep is not None:
            ones = torch.ones(B, H, Lq, 1, dtype=drop_keep.dtype)
            drop_keep = torch.cat([drop_keep.expand(B, H, Lq, -1), ones], dim=-1)
    row_any = keep.any(dim=-1, keepdim=True)  # (B, Hq, Lq, 1)
    # Blocked rows: softmax over zeros (harmless), then multiplied by 0, so no NaN in either pass.
    s_safe = torch.where(row_any, s.masked_fill(~keep, float("-inf")), torch.zeros_like(s))
    p = torch.softmax(s_safe, dim=-1) * row_any
    lse = torch.logsumexp(s.detach().masked_fill(~keep, float("-inf")), dim=-1)
    if drop_keep is not None:
        p = p * drop_keep / (1.0 - dropout_p)
    return p @ v, lse


# ---------------------------------------------------------------------------------------------
# One golden comparison: forward (out, lse) and backward (dq, dk, dv, dbias)


@dataclass
class Result:
    out: torch.Tensor
    lse: torch.Tensor
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


def run_attention(
    backend: str,
    dtype: torch.dtype,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor | None,
    *,
    bias: torch.Tensor | None = None,
    seed: int | None = None,
    **kwargs: Any,
) -> Result:
    """az.attention on copies of the inputs cast to ``dtype`` (layout kept: ``.to`` of a
    non-contiguous tensor keeps its strides only when the dtype is unchanged, so strided inputs are
    re-laid-out with the same strides); grads of q, k, v (and bias) w.r.t. ``<out, dout>``."""
    home = q.device
    if backend == "triton" and torch.cuda.is_available() and home.type == "cpu":  # the kernels on the GPU,
        q, k, v, bias, dout = (t if t is None else t.to("cuda") for t in (q, k, v, bias, dout))  # judged here
        kwargs = {n: x.to("cuda") if isinstance(x, torch.Tensor) else x for n, x in kwargs.items()}
    leaves = {"q": q, "k": k, "v": v}
    if bias is not None:
        leaves["bias"] = bias
    sinks = kwargs.pop("sinks", None)
    if sinks is not None:  # a leaf with a gradient, in the run's dtype as the bias
        leaves["sinks"] = sinks
    xs = {n: _cast_keep_strides(t, dtype).requires_grad_(dout is not None) for n, t in leaves.items()}
    if seed is not None:
        torch.manual_seed(seed)
    out, lse = az.attention(
        xs["q"], xs["k"], xs["v"], bias=xs.get("bias"), sinks=xs.get("sinks"), backend=backend, return_lse=True,
        **kwargs,
    )  # fmt: skip
    res = Result(out.detach().to(home), lse.detach().to(home))
    if dout is not None:
        names = list(xs)
        gs = torch.autograd.grad(out, [xs[n] for n in names], dout.to(dtype), allow_unused=True)
        res.grads = {n: (torch.zeros_like(xs[n]) if g is None else g).to(home) for n, g in zip(names, gs)}
    return res


def _cast_keep_strides(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.is_contiguous():
        return t.detach().to(dtype).clone()
    out = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=t.device)  # same (non-contiguous) strides
    out.copy_(t.detach())
    return out


def round_to(dtype: torch.dtype, *ts: torch.Tensor | None) -> list[Any]:
    """Round float64 tensors to ``dtype`` and back (the golden sees exactly the rounded inputs)."""
    return [None if t is None else t.to(dtype).to(torch.float64) for t in ts]


def check_against_golden(
    backend: str,
    dtype: torch.dtype,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    grads: bool = True,
    seed: int | None = None,
    naive: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    **kwargs: Any,
) -> tuple[Result, Result]:
    """Run golden (float64 reference), reference in ``dtype`` and ``backend`` in ``dtype``; apply the
    tolerance rule to out, lse and every gradient. ``naive(q, k, v, bias)`` (float64, on the rounded
    inputs) when given must match the golden to float64 rounding, forward and backward (checked in
    the reference backend's run of each case; the other backends' runs rely on it).
    Returns (golden, backend result)."""
    (br,) = round_to(dtype, bias)
    if kwargs.get("sinks") is not None:  # the golden sees the sinks rounded to dtype, as the bias
        (kwargs["sinks"],) = round_to(dtype, kwargs["sinks"])
    # Round q, k, v to dtype and back, keeping the caller's (possibly non-contiguous) layout.
    qr, kr, vr = (_cast_keep_strides(_cast_keep_strides(t, dtype), torch.float64) for t in (q, k, v))
    dout = None
    if grads:
        Dv = v.shape[-1]
        dout = torch.randn(q.shape[0], q.shape[1], q.shape[2], Dv, dtype=torch.float64).to(dtype).to(torch.float64)
        dout = dout.to(q.device)
    gold = run_attention("reference", torch.float64, qr, kr, vr, dout, bias=br, seed=seed, **kwargs)
    assert gold.lse.dtype == torch.float64

    if naive is not None and backend == "reference":  # a check of the golden itself: once per case
        _check_naive(gold, naive, qr, kr, vr, br, dout)

    ref = (
        gold
        if dtype == torch.float64
        else run_attention("reference", dtype, qr, kr, vr, dout, bias=br, seed=seed, **kwargs)
    )
    res = (
        ref if backend == "reference" else run_attention(backend, dtype, qr, kr, vr, dout, bias=br, seed=seed, **kwargs)
    )

    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for r in (ref, res):
        assert r.out.dtype == dtype and r.out.shape == (*q.shape[:3], v.shape[-1])
        assert r.lse.dtype == lse_dtype and r.lse.shape == q.shape[:3]
    if dtype != torch.float64:
        assert_reference_sane(ref.out, gold.out)
    assert_close_to_golden(res.out, ref.out, gold.out, name="out")
    assert_close_to_golden(res.lse, ref.lse, gold.lse, kind="lse")
    units: dict[str, float] = {}
    if dout is not None:  # Σ_i p_ij of every key (its largest): the golden's dV for dO = 1
        ones = torch.ones_like(dout)
        colsum = float(run_attention("reference", torch.float64, qr, kr, vr, ones, bias=br, seed=seed, **kwargs)
                       .grads["v"].abs().max())  # fmt: skip
        units = grad_units(qr, kr, dout, vr, colsum, kwargs.get("scale"))
    for n, g in gold.grads.items():
        assert res.grads[n].dtype == dtype
        # A gradient through the softmax is a difference of larger terms (dP - rowsum(dO·O)): it may
        # be 0 in the reference exactly yet carry the rounding of those terms in another backend.
        # Its size is theirs, for the reference's sanity check too (softcap's 1 − t² of a saturated
        # tanh is such a difference: 1 − t rounded, times q).
        size = magnitude(g, units.get("ds", 0.0), units.get(n, 0.0))
        if dtype != torch.float64:
            assert_reference_sane(ref.grads[n], g, kind="grad", name=f"d{n}", size=size)
        assert_close_to_golden(res.grads[n], ref.grads[n], g, kind="grad", name=f"d{n}", size=size)
    return gold, res


def grad_units(
    q: torch.Tensor, k: torch.Tensor, dout: torch.Tensor, v: torch.Tensor, colsum: float, scale: float | None
) -> dict[str, float]:
    """The size of the terms each gradient sums (the unit of its floor): ds_ij = p_ij (dp_ij − Δ_i)
    has terms of size |dO|·|v| (dp and Δ = Σ dO·O, O a p-weighted mean of v), so
    dq_i = scale Σ_j ds_ij k_j sums terms of scale·|k|·|dO||v| (Σ_j p_ij = 1),
    dk_j = scale Σ_i ds_ij q_i sums scale·|q|·|dO||v| weighted by Σ_i p_ij (``colsum``, up to the
    number of rows: a single key gets weight 1 from every row, and its dk, exactly 0, is all rounding),
    dv_j = Σ_i p_ij dO_i sums colsum·|dO|, dbias is ds itself."""
    sc = q.shape[-1] ** -0.5 if scale is None else abs(scale)
    ds = float(dout.abs().max()) * float(v.abs().max()) if v.numel() and dout.numel() else 0.0
    return {
        "q": sc * (float(k.abs().max()) if k.numel() else 0.0) * ds,
        "k": sc * (float(q.abs().max()) if q.numel() else 0.0) * ds * colsum,
        "v": (float(dout.abs().max()) if dout.numel() else 0.0) * colsum,
        "bias": ds,
        "ds": ds,  # every gradient's floor is at least this (a difference of such terms)
    }


def _check_naive(
    gold: Result,
    naive: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    dout: torch.Tensor | None,
) -> None:
    leaves = [t.detach().clone().requires_grad_(dout is not None) for t in (q, k, v)]
    b = None if bias is None else bias.detach().clone().requires_grad_(dout is not None)
    out, lse = naive(*leaves, b)  # (sinks, if any, are the naive function's own: their grads are checked elsewhere)
    torch.testing.assert_close(gold.out, out.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gold.lse, lse.detach(), rtol=1e-10, atol=1e-10)
    if dout is not None:
        wrt = [*leaves] + ([b] if b is not None else [])
        gs = torch.autograd.grad(out, wrt, dout, allow_unused=True)
        for name, g in zip(["q", "k", "v", "bias"], gs):
            want = torch.zeros_like(gold.grads[name]) if g is None else g
            if want.shape != gold.grads[name].shape:  # a broadcast bias: naive sums the same way
                want = want.sum_to_size(gold.grads[name].shape)
            torch.testing.assert_close(gold.grads[name], want, rtol=1e-9, atol=1e-9, msg=lambda m, n=name: f"d{n}: {m}")


def shapes_id(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape))


def torch_semantics_mods(device: torch.device) -> dict[str, Callable[..., torch.Tensor]]:
    """Score mods whose generated code (C++, Triton) must compute what torch computes where C's
    operators differ (a sweep found each wrong): float // and % near multiples, fmod exact; clamp
    whose bounds cross (torch: y = hi, its gradient to hi); whole powers above 16 of negative
    numbers (not NaN), a 0-d constant as base or exponent; uint8's 255 as a divisor; a Python int
    beyond int32 wraps as torch casts it; floor / ceil of integers. ``lo`` / ``hi``: learnable clamp
    bounds on ``device``, crossed at 1 and 3."""
    lo = torch.tensor([-1.0, 1.0, 0.5, 2.0], device=device, requires_grad=True)
    hi = torch.tensor([1.0, -1.0, 0.5, 0.0], device=device, requires_grad=True)
    return {
        "float_floor_rem": lambda s, b, h, i, j: s + (j * 0.1 + 1.0) // 0.1 + torch.div(j * 0.1 + 1.0, 0.1,
                                                                                        rounding_mode="floor")
        + 10 * ((j * 0.1 + 1.0) % 0.1) + torch.fmod(j * -0.7, 0.3) + torch.remainder(s, 0.7) + torch.fmod(s, 0.9),
        "clamp_crossed": lambda s, b, h, i, j: torch.clamp(s, min=lo[j % 4], max=hi[j % 4])
        + torch.clamp(torch.rsqrt(s.abs() + 0.5), min=s, max=(i / (i.abs() + 1)).float()),
        "powers": lambda s, b, h, i, j: s + 1e-3 * (s * 0.2) ** 17 + 1e-3 * (s * 0.2) ** 18
        + 0.1 * s ** torch.tensor(2.0) + torch.tensor(2.0) ** (s * 0.1),
        "uint8_255": lambda s, b, h, i, j: s + ((j * 37).to(torch.uint8) // (h.to(torch.uint8) | 255)).float()
        + 0.01 * ((j * 37).to(torch.uint8) % 255).float(),
        "big_ints_floor": lambda s, b, h, i, j: torch.where(i < 2**40, s, 2 * s) + torch.where(i - j < 10**12, s, s - 3)
        + (j // 2).floor().float() + (j // 3).ceil().float(),
    }  # fmt: skip
