"""The backends as torch custom ops: one opaque node per attention call for ``torch.compile`` and
``torch.export``, and the one place that answers zero-size problems.

Letters: B batch, Hq / Hkv query / key-value heads (G = Hq // Hkv), Lq / Lk query / key length,
D head dim of q and k, Dv head dim of v.

Why ops. Traced by dynamo, a backend's Python breaks the graph at each host-side decision: the flash
backend's read-backs and per-block Python loops, the dropout seed's ``.item()``.
So each backend ``name`` is registered as two ops, ``attnzero::{name}_attention`` and
``attnzero::{name}_attention_backward`` (``torch.library.custom_op``): a fake implementation gives the output
shapes, ``register_autograd`` ties the backward op to the forward one, and the compiled program runs
the backend's own eager code inside each op. An op's arguments are what a schema can hold: the mask
a bool tensor (``functional.py`` densifies an ``az.masks.Mask``), the window sides ints with -1 for
unbounded, the dropout seed a 0-d int64 tensor — drawn in the graph from torch's RNG exactly as
eager calls draw it, and read only here.

The backends. Each implementation (``NAMES``) is a ``Backend`` of three functions with one
interface (``BACKENDS``): ``attention``, the eager differentiable entry that ``functional.py``
calls (it takes ``need_lse``: with False the lse may come back as None, where a backend can save
computing it); ``forward(q, k, v, *, mask, bias, causal, window, scale, dropout_p, dropout_seed) -> (out,
lse)``, a plain function; and ``backward(dout, q, k, v, out, lse, *, <the same>, bias_grad) ->
(dq, dk, dv, dbias)``, a plain function that recomputes P = exp(s − lse) from the ``out`` and
``lse`` it is given — also those of the same queries over more keys than these, such as the ring's
global ones (``distributed.py``), which then get exactly these keys' share of the gradients.
Which implementation runs is decided once, in ``functional.choose`` (``"triton_decode"`` is the
triton backend's split-KV path, taken only without gradients; float64 on ``backend="triton"``
runs ``"flash"``); nothing here re-dispatches.

``"cpu_kernel"`` is the compiled CPU kernel (``cpu_kernel.py``), which ``choose`` takes for
``backend="flash"`` / ``"auto"`` on CPU where it is built.

The backward ops: ``flash``, ``cpu_kernel`` and ``triton`` use their backend's ``backward`` (``flash.backward``; the
kernel op ``attnzero::triton_bwd``); the reference's is MATH.md's backward with every matrix
materialised (``reference_backward`` below, from the P and Z its forward op kept; the reference's
eager backward is autograd through the formula, which cannot run inside an op).

Zero sizes (DESIGN.md). B, Hq or Lq = 0: empty output. Lk = 0: every row is fully blocked (output
0, lse −inf). D = 0: every score is 0 (uniform weights over the kept keys, plus any bias).
Dv = 0: an empty output, and the lse of the scores. No backend sees them: empty problems are
answered here, and D = 0 / Dv = 0 run with one column of zeros in q and k / in v. Gradients are
zero where the output does not depend on an input. Eager calls come here only for zero sizes
(``functional.py`` calls a backend directly otherwise); a compiled program always does, and a size
that depends on data (``x[keep]`` under ``torch.export``) is only known here, when it runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import cpu_kernel, dropout, lse_grad, reference
from . import sinks as _sinks
from .masks import Mask, unchanged, version_of
from .reference import accum_dtype

NAMES = ("reference", "flash", "cpu_kernel", "triton", "triton_decode")
# A window side without a bound, in an op's int arguments. Internal window sides may be any int
# (functional.py folds a mask's band into the window: torch's top-left causal is a negative right
# side), so the sentinel lies outside every side a check lets through (|side| < 2**62).
UNBOUNDED = -(2**63)

Window = tuple[int | None, int | None] | None


def without_autocast(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Autocast off for ``device``'s type while a backend runs: backends choose their dtypes on
    purpose (float32 scores for 16-bit inputs), and autocast would cast their matmuls again."""
    if torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def sides(window: Window) -> tuple[int, int]:
    """``(left, right)`` as op arguments: ints, -1 for an unbounded side."""
    if window is None:
        return UNBOUNDED, UNBOUNDED
    left, right = window
    return (UNBOUNDED if left is None else left), (UNBOUNDED if right is None else right)


def window_of(left: int, right: int) -> Window:
    """The window of ``sides``' ints back."""
    if left == UNBOUNDED and right == UNBOUNDED:
        return None
    return (None if left == UNBOUNDED else left), (None if right == UNBOUNDED else right)


# ---------------------------------------------------------------------------------------------
# Each backend as a forward and a backward function of trusted, non-empty inputs. A forward
# returns ``(out, lse, kept)``: ``kept`` is what its backward needs besides the output and the lse —
# for the reference, P (B, Hq, Lq, Lk) and the dropout keep-mask Z, which its eager backward
# (autograd) keeps too; for the others, nothing (empty tensors).

Kept = tuple[Tensor, Tensor]


def nothing(q: Tensor) -> Kept:
    """The ``kept`` of a backend that keeps nothing for its backward (every one but the reference)."""
    return q.new_empty(0), q.new_empty(0, dtype=torch.bool)


def _reference_forward(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | Mask | None, bias: Tensor | None, causal: bool,
    window: Window, scale: float, softcap: float | None, dropout_p: float, dropout_seed: int,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Kept]:
    """``reference.attention``'s steps, keeping P and Z: P and the lse by ``reference.probabilities``,
    then dropout and P·V as ``reference.attention`` computes them (the same numbers)."""
    p, lse = reference.probabilities(
        q, k, mask=mask, bias=bias, causal=causal, window=window, scale=scale, softcap=softcap, sinks=sinks
    )
    B, Hq, Lq, Lk = p.shape
    Hkv, Dv = v.shape[1], v.shape[3]
    z = nothing(q)[1]
    p_kept = p
    if dropout_p > 0.0:
        z = dropout.keep_mask(dropout_seed, dropout_p, (B, Hq, Lq, Lk), device=q.device)  # (B, Hq, Lq, Lk)
        p_kept = p * z / (1.0 - dropout_p)
    p_grouped = p_kept.to(v.dtype).reshape(B, Hkv, (Hq // Hkv) * Lq, Lk)  # (B, Hkv, G·Lq, Lk)
    out = (p_grouped @ v).view(B, Hq, Lq, Dv)  # (B, Hq, Lq, Dv)
    return out, lse, (p, z)




@torch.no_grad()
def reference_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    mask: Tensor | Mask | None,
    bias: Tensor | None,
    causal: bool,
    window: Window,
    scale: float,
    softcap: float | None = None,
    dropout_p: float,
    dropout_seed: int,
    bias_grad: bool = True,
    kept: Kept | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dv, dbias)`` of ``reference.attention``: MATH.md's backward with every matrix
    materialised, in the accumulator dtype. From the forward's P and Z (``kept``, what the
    reference's op keeps; then rowsum(P ∘ dP) is rowsum(dO ∘ O)); without them P = exp(s − lse) is
    recomputed for the ``lse`` given, Z drawn again from ``dropout_seed``, and Δ = rowsum(dO ∘ O)
    taken from the ``out`` given (the backend interface: a ring passes its global out and lse, and
    an lse with a sink folded in — ``sinks.py`` — gives the gradients with the sink).
    With ``softcap``, dS is the gradient of the capped score (what the bias gets) and the products
    for dQ / dK take it through the cap: ``dS · (1 − tanh²(x / softcap))`` with x = scale · q · k."""
    acc = accum_dtype(q.dtype)
    delta: Tensor | None = None  # Δ = rowsum(dO ∘ O): (B, Hq, Lq, 1)
    if kept is None:
        p_own, lse_own = reference.probabilities(
            q, k, mask=mask, bias=bias, causal=causal, window=window, scale=scale, softcap=softcap
        )  # (B, Hq, Lq, Lk), (B, Hq, Lq)
        # exp(s − lse) = P_own · exp(lse_own − lse); a row with no kept key here has P_own = 0
        ratio = torch.where(lse_own == float("-inf"), 0.0, torch.exp(lse_own - lse.to(acc)))  # (B, Hq, Lq)
        p = p_own * ratio.unsqueeze(-1)
        z = nothing(q)[1]
        if dropout_p > 0.0:
            B, Hq, Lq, Lk = p.shape
            z = dropout.keep_mask(dropout_seed, dropout_p, (B, Hq, Lq, Lk), device=q.device)  # (B, Hq, Lq, Lk)
        delta = (dout.to(acc) * out.to(acc)).sum(dim=-1, keepdim=True)
    else:
        p, z = kept  # (B, Hq, Lq, Lk) each; mask & co. are in P already
    B, Hq, _, Lk = p.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    k_h = k.to(acc).repeat_interleave(G, dim=1)  # (B, Hq, Lk, D): the key/value head of each query head
    v_h = v.to(acc).repeat_interleave(G, dim=1)  # (B, Hq, Lk, Dv)
    do = dout.to(acc)  # (B, Hq, Lq, Dv)
    dp = do @ v_h.transpose(-2, -1)  # dP = dO Vᵀ: (B, Hq, Lq, Lk)
    p_kept = p
    if dropout_p > 0.0:  # O = (P ∘ Z / (1 - p)) V: the same Z on both sides
        z_scaled = z.to(acc) / (1.0 - dropout_p)
        p_kept, dp = p * z_scaled, dp * z_scaled
    dv_h = p_kept.transpose(-2, -1) @ do  # dV = P̃ᵀ dO: (B, Hq, Lk, Dv)
    if delta is None:
        delta = (p * dp).sum(dim=-1, keepdim=True)  # rowsum(P ∘ dP) = rowsum(dO ∘ O)
    ds = p * (dp - delta)  # dS = P ∘ (dP − Δ): (B, Hq, Lq, Lk)
    ds_raw = ds
    if softcap is not None:  # through the cap: d(softcap · tanh(x / softcap)) / dx = 1 − tanh²
        t = torch.tanh((q.to(acc) @ k_h.transpose(-2, -1)) * (scale / softcap))  # (B, Hq, Lq, Lk)
        ds_raw = ds * (1.0 - t * t)
    dq = (ds_raw @ k_h) * scale  # (B, Hq, Lq, D)
    dk_h = (ds_raw.transpose(-2, -1) @ q.to(acc)) * scale  # (B, Hq, Lk, D)
    # The G query heads of a group add into their key/value head.
    dk = dk_h.view(B, Hkv, G, Lk, -1).sum(dim=2)  # (B, Hkv, Lk, D)
    dv = dv_h.view(B, Hkv, G, Lk, -1).sum(dim=2)  # (B, Hkv, Lk, Dv)
    dbias = ds.sum_to_size(bias.shape).to(bias.dtype) if bias is not None and bias_grad else None
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias


# ---------------------------------------------------------------------------------------------
# The backends behind one interface. The modules of flash and triton are imported on first use
# (triton may be missing); the kernel's module (cpu_kernel.py: its build waits for the first call)
# comes with this one. Their functions are looked up at each call.

Attention = Callable[..., tuple[Tensor, Tensor | None]]
Forward = Callable[..., tuple[Tensor, Tensor]]
Backward = Callable[..., tuple[Tensor, Tensor, Tensor, Tensor | None]]


class Backend(NamedTuple):
    """One implementation: its eager differentiable entry, and its plain forward and backward (see
    the module docstring for their arguments)."""

    attention: Attention
    forward: Forward
    backward: Backward


def _reference_attention(q: Tensor, k: Tensor, v: Tensor, *, need_lse: bool = True, **kw: Any) -> tuple[Tensor, Tensor]:
    return reference.attention(q, k, v, **kw)  # the lse comes with the probabilities; sinks inside the softmax


def _reference_plain(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        return reference.attention(q, k, v, **kw)


def _flash() -> Any:
    from . import flash

    return flash


def _kernel_attention(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | Mask | None, bias: Tensor | None, causal: bool,
    window: Window, scale: float, softcap: float | None, sinks: Tensor | None = None, dropout_p: float,
    dropout_seed: int, need_lse: bool = True,
) -> tuple[Tensor, Tensor | None]:
    # (the arguments by name, not through **kw: collecting and spreading a dict of them costs
    # ~1 µs, a tenth of a tiny call)
    if sinks is not None:
        return _with_sinks(
            "cpu_kernel", q, k, v, sinks, mask=mask, bias=bias, causal=causal, window=window, scale=scale,
            softcap=softcap, dropout_p=dropout_p, dropout_seed=dropout_seed, need_lse=need_lse,
        )  # fmt: skip
    return cpu_kernel.attention(
        q, k, v, mask=mask, bias=bias, causal=causal, window=window, scale=scale, softcap=softcap,
        dropout_p=dropout_p, dropout_seed=dropout_seed, need_lse=need_lse,
    )  # fmt: skip


def _kernel_forward(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> tuple[Tensor, Tensor]:
    return cpu_kernel.forward(q, k, v, **kw)


def _kernel_backward(*args: Tensor, **kw: Any) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    return cpu_kernel.backward(*args, **kw)


def _triton() -> Any:
    from .kernels import triton_backend  # raises a clear ImportError when triton is missing

    return triton_backend


def _flash_attention(
    q: Tensor, k: Tensor, v: Tensor, *, sinks: Tensor | None = None, **kw: Any
) -> tuple[Tensor, Tensor | None]:
    if sinks is not None:
        return _with_sinks("flash", q, k, v, sinks, **kw)
    return _flash().attention(q, k, v, **kw)  # type: ignore[no-any-return]


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> tuple[Tensor, Tensor]:
    return _flash().forward(q, k, v, **kw)  # type: ignore[no-any-return]


def _flash_backward(*args: Tensor, **kw: Any) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    return _flash().backward(*args, **kw)  # type: ignore[no-any-return]


def _triton_attention(
    q: Tensor, k: Tensor, v: Tensor, *, need_lse: bool = True, sinks: Tensor | None = None, **kw: Any
) -> tuple[Tensor, Tensor]:
    if sinks is not None:
        return _with_sinks("triton", q, k, v, sinks, **kw)
    return _triton().attention(q, k, v, **kw)  # type: ignore[no-any-return]


def _triton_forward(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> tuple[Tensor, Tensor]:
    return _triton().forward(q, k, v, **kw)  # type: ignore[no-any-return]


def _triton_decode(
    q: Tensor, k: Tensor, v: Tensor, *, need_lse: bool = True, sinks: Tensor | None = None, out_f32: bool = False,
    **kw: Any,
) -> tuple[Tensor, Tensor]:
    if sinks is None:
        return _triton().decode(q, k, v, out_f32=out_f32, **kw)  # type: ignore[no-any-return]
    out32, lse = _triton().decode(q, k, v, out_f32=True, **kw)
    out, lse = _sinks.fold(out32, lse, sinks)  # folded in float32, then rounded once
    return (out if out_f32 else out.to(q.dtype)), lse


def _triton_backward(*args: Tensor, **kw: Any) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    return _triton().backward(*args, **kw)  # type: ignore[no-any-return]


BACKENDS: dict[str, Backend] = {
    "reference": Backend(_reference_attention, _reference_plain, reference_backward),
    "flash": Backend(_flash_attention, _flash_forward, _flash_backward),
    # the compiled CPU kernel (cpu_kernel.py, csrc/attention.cpp): flash's function in C++
    "cpu_kernel": Backend(_kernel_attention, _kernel_forward, _kernel_backward),
    "triton": Backend(_triton_attention, _triton_forward, _triton_backward),
    # split-KV decode: no backward of its own (chosen only without gradients); its (out, lse) are the
    # forward kernel's, so the triton backward would apply
    "triton_decode": Backend(_triton_decode, _triton_decode, _triton_backward),
}


class _WithSinks(torch.autograd.Function):
    """A backend's plain forward with the sinks folded into its result (``sinks.fold``), and its
    plain backward from the folded out and lse, plus the sinks' own gradient (``sinks.grad``): how
    the backends without sinks of their own (flash, triton) compute them, forward and backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, sinks: Tensor, name: str,
        options: dict[str, Any],
    ) -> tuple[Tensor, Tensor]:
        unrounded = {"out_f32": True} if name in _UNROUNDED else {}  # (the backward's D from O unrounded)
        out, lse = backend(name).forward(q, k, v, bias=bias, **options, **unrounded)
        out2, lse2 = _sinks.fold(out, lse, sinks)
        ctx.save_for_backward(q, k, v, bias, sinks, out2, lse2)
        ctx.name, ctx.options, ctx.mask_seen = name, options, version_of(options["mask"])
        ctx.mark_non_differentiable(lse2)
        return out2.to(q.dtype), lse2

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        del dlse  # the lse is not differentiable
        q, k, v, bias, sk, out2, lse2 = ctx.saved_tensors
        unchanged(ctx.mask_seen)  # (autograd's check of saved tensors, for the mask)
        needs = tuple(ctx.needs_input_grad[:5])
        if reference.needs_graph(dout):  # create_graph=True, or a batched dout: autograd through the formula
            return (*reference.backward_with_graph(dout, q, k, v, bias, needs, sinks=sk, **ctx.options), None, None)
        dq, dk, dv, dbias = backend(ctx.name).backward(
            dout, q, k, v, out2, lse2, bias=bias, bias_grad=needs[3], **ctx.options
        )
        dsinks = _sinks.grad(dout, out2, lse2, sk) if needs[4] else None
        return dq, dk, dv, dbias, dsinks, None, None


def _with_sinks(
    name: str, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, *, bias: Tensor | None, need_lse: bool = True,
    **options: Any,
) -> tuple[Tensor, Tensor]:
    """Backend ``name`` with sinks (see ``_WithSinks``)."""
    out, lse = _WithSinks.apply(q, k, v, bias, sinks, name, options)
    return out, lse


def backend(name: str) -> Backend:
    """The implementation ``name`` (one of ``NAMES``, as ``functional.choose`` returns it)."""
    return BACKENDS[name]


# The backends whose forward gives a 16-bit call's O in float32 (``out_f32``), for a backward's D
_UNROUNDED = ("cpu_kernel", "flash", "triton", "triton_decode")


def _keeps_out(name: str, q: Tensor, v: Tensor, keep_out: bool) -> bool:
    """Whether backend ``name``'s op keeps O in float32 for its backward (``keep_out``: a 16-bit call
    that will take one), as the eager Functions do (MATH.md, section 4)."""
    return keep_out and name in _UNROUNDED and q.dtype in (torch.float16, torch.bfloat16) and (
        q.shape[3] > 0 and v.shape[3] > 0
    )


def _forward_kept(
    name: str, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None = None, keep_out: bool = False, **kw: Any
) -> tuple[Tensor, Tensor, Kept]:
    """A backend's forward inside an op: the reference keeps P and Z for its backward op (and
    computes sinks in its softmax); the others' results get the sinks folded in (``sinks.py``), and
    keep O in float32 where ``_keeps_out``."""
    if name == "reference":
        return _reference_forward(q, k, v, sinks=sinks, **kw)
    kept_out = _keeps_out(name, q, v, keep_out)
    unrounded = kept_out or (sinks is not None and _keeps_out(name, q, v, True))  # (sinks: folded, then rounded once)
    out, lse = backend(name).forward(q, k, v, **kw, **({"out_f32": True} if unrounded else {}))
    if sinks is not None:
        out, lse = _sinks.fold(out, lse, sinks)
    if kept_out:
        return out.to(q.dtype), lse, (out, q.new_empty(0, dtype=torch.bool))
    return out.to(q.dtype), lse, nothing(q)


def _backward_kept(name: str, *args: Tensor, kept: Kept, **kw: Any) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """A backend's backward inside an op, from what ``_forward_kept`` kept (O in float32: in out's place)."""
    if name == "reference":
        return reference_backward(*args, kept=kept, **kw)
    if kept[0].dim() == 4:  # (dout, q, k, v, out, lse)
        args = (*args[:4], kept[0], *args[5:])
    return backend(name).backward(*args, **kw)


def _kept_shapes(name: str, q: Tensor, v: Tensor, Lk: Any, dropout_p: float, keep_out: bool) -> Kept:
    """Empty tensors of the shapes and dtypes of backend ``name``'s ``kept`` (for the fakes, and
    for the zero-size answers)."""
    B, Hq, Lq, _ = q.shape
    if _keeps_out(name, q, v, keep_out):
        return q.new_zeros(B, Hq, Lq, v.shape[3], dtype=torch.float32), q.new_empty(0, dtype=torch.bool)
    if name != "reference":
        return nothing(q)
    p = q.new_zeros(B, Hq, Lq, Lk, dtype=accum_dtype(q.dtype))
    z = q.new_zeros((B, Hq, Lq, Lk) if dropout_p > 0.0 else (0,), dtype=torch.bool)
    return p, z


# ---------------------------------------------------------------------------------------------
# Zero sizes answered, then the backend


def _zero_column(x: Tensor) -> Tensor:
    """(..., 0) → (..., 1) of zeros: a head dim of 0 as one that contributes 0 to every product."""
    return x.new_zeros(*x.shape[:-1], 1)


def forward(
    name: str, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None = None, keep_out: bool = False, **kw: Any
) -> tuple[Tensor, Tensor, Kept]:
    """``(out (B, Hq, Lq, Dv), lse (B, Hq, Lq), kept)`` of backend ``name``, zero sizes answered
    here."""
    B, Hq, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    if B * Hq * Lq == 0 or Lk == 0:  # nothing to compute, or no key to attend to: 0 and −inf (or the sink)
        out = q.new_zeros(B, Hq, Lq, Dv)
        lse = torch.full((B, Hq, Lq), float("-inf"), dtype=accum_dtype(q.dtype), device=q.device)
        if sinks is not None:
            lse = torch.logaddexp(lse, _sinks.expand(sinks, lse.dtype))  # a row with no key: lse = sink
        return out, lse, _kept_shapes(name, q, v, Lk, kw["dropout_p"], keep_out)
    keep_out = _keeps_out(name, q, v, keep_out)  # (before the head dims of 0 become 1)
    if D == 0:  # every score is 0 (+ bias)
        q, k = _zero_column(q), _zero_column(k)
    out, lse, kept = _forward_kept(name, q, k, v if Dv else _zero_column(v), sinks, keep_out, **kw)
    return (out if Dv else q.new_zeros(B, Hq, Lq, 0)), lse, kept


def backward(
    name: str, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, **kw: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dv, dbias)`` of backend ``name`` (dbias None unless ``bias_grad``), zero sizes
    answered here. ``kw`` holds the forward's arguments and its ``kept``."""
    B, Hq, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    bias = kw["bias"]
    if B * Hq * Lq == 0 or Lk == 0 or Dv == 0:  # the output is empty, or does not depend on the inputs
        dbias = torch.zeros_like(bias) if bias is not None and kw["bias_grad"] else None
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dbias
    if D == 0:  # the scores do not depend on q and k (empty): only v and bias get gradients
        _, _, dv, dbias = _backward_kept(name, dout, _zero_column(q), _zero_column(k), v, out, lse, **kw)
        return torch.zeros_like(q), torch.zeros_like(k), dv, dbias
    return _backward_kept(name, dout, q, k, v, out, lse, **kw)


# ---------------------------------------------------------------------------------------------
# torch.library registration


def _register(name: str) -> Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]:
    """``attnzero::{name}_attention`` and ``attnzero::{name}_attention_backward``, with fakes and
    the autograd rule; returns the forward op."""

    @torch.library.custom_op(f"attnzero::{name}_attention", mutates_args=())
    def fwd(
        q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, causal: bool, left: int,
        right: int, scale: float, softcap: float, sinks: Tensor | None, dropout_p: float, seed: Tensor,
        lse_grad: bool = False, keep_out: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(out, lse, *kept): kept for the backward op, empty unless the backend keeps something.
        ``softcap`` 0.0 = none. ``lse_grad``: the lse is differentiable (the caller asked for it, with
        a gradient), else a by-product. ``keep_out``: a 16-bit call that will take a backward, which
        then takes O unrounded from ``kept`` (``_keeps_out``)."""
        del lse_grad  # (read by setup_context)
        with torch.no_grad(), without_autocast(q.device):
            out, lse, kept = forward(
                name, q, k, v, sinks, keep_out, mask=mask, bias=bias, causal=causal, window=window_of(left, right),
                scale=scale, softcap=softcap or None, dropout_p=dropout_p, dropout_seed=int(seed.item()),
            )  # fmt: skip
        return out.contiguous(), lse.contiguous(), kept[0].contiguous(), kept[1].contiguous()  # the fakes' layout

    @fwd.register_fake
    def _(q, k, v, mask, bias, causal, left, right, scale, softcap, sinks, dropout_p, seed, lse_grad=False,  # type: ignore[no-untyped-def]
          keep_out=False):  # fmt: skip
        B, Hq, Lq, _ = q.shape
        out, lse = q.new_empty(B, Hq, Lq, v.shape[3]), q.new_empty(B, Hq, Lq, dtype=accum_dtype(q.dtype))
        return out, lse, *_kept_shapes(name, q, v, k.shape[2], dropout_p, keep_out)

    @torch.library.custom_op(f"attnzero::{name}_attention_backward", mutates_args=())
    def bwd(
        dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, p: Tensor, z: Tensor,
        mask: Tensor | None, bias: Tensor | None, causal: bool, left: int, right: int, scale: float, softcap: float,
        sinks: Tensor | None, dropout_p: float, seed: Tensor, bias_grad: bool, sinks_grad: bool,
        dlse: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(dq, dk, dv, dbias, dsinks); dbias / dsinks are empty when not asked for. ``dlse``: the lse's
        gradient, whose share (``lse_grad.of_lse``: flash.py's backward of P) is added."""
        with torch.no_grad(), without_autocast(q.device):
            window = window_of(left, right)
            dq, dk, dv, dbias = backward(
                name, dout, q, k, v, out, lse, kept=(p, z), mask=mask, bias=bias, causal=causal, window=window,
                scale=scale, softcap=softcap or None, dropout_p=dropout_p, dropout_seed=int(seed.item()),
                bias_grad=bias_grad,
            )  # fmt: skip
            o = p if name != "reference" and p.dim() == 4 else out  # (O unrounded where it was kept)
            ds = _sinks.grad(dout, o, lse, sinks) if sinks is not None and sinks_grad else q.new_empty(0)
            if dlse is not None and lse.numel() and k.shape[2]:  # (no row or no key: no score)
                D = q.shape[3]  # D = 0: every score is 0 (+ bias), as the forward computed it
                lq, lk, lb, ls = lse_grad.of_lse(
                    dlse, *((q, k) if D else (_zero_column(q), _zero_column(k))), lse, bias=bias, sinks=sinks,
                    bias_grad=bias_grad, sinks_grad=sinks_grad, mask=mask, causal=causal, window=window,
                    scale=scale, softcap=softcap or None,
                )  # fmt: skip
                if D:
                    dq, dk = dq + lq.to(dq.dtype), dk + lk.to(dk.dtype)
                dbias = dbias if lb is None or dbias is None else dbias + lb.to(dbias.dtype)
                ds = ds if ls is None else ds + ls.to(ds.dtype)
            elif dlse is not None and sinks is not None and sinks_grad:  # no key: lse = the sink
                ds = ds + _sinks.grad_of_rows(-dlse, lse, sinks).to(ds.dtype)
        db = dbias.contiguous() if dbias is not None else q.new_empty(0)
        return dq.contiguous(), dk.contiguous(), dv.contiguous(), db, ds.contiguous()

    @bwd.register_fake
    def _(dout, q, k, v, out, lse, p, z, mask, bias, causal, left, right, scale, softcap, sinks, dropout_p, seed,  # type: ignore[no-untyped-def]
          bias_grad, sinks_grad, dlse=None):  # fmt: skip
        dbias = bias.new_empty(bias.shape) if bias_grad and bias is not None else q.new_empty(0)
        dsinks = sinks.new_empty(sinks.shape) if sinks_grad and sinks is not None else q.new_empty(0)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias, dsinks

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        q, k, v, mask, bias, causal, left, right, scale, softcap, sinks, dropout_p, seed, *rest = inputs
        out, lse, p, z = output
        ctx.save_for_backward(q, k, v, out, lse, p, z, mask, bias, sinks, seed)
        ctx.args = (causal, left, right, scale, softcap)
        ctx.dropout_p = dropout_p
        ctx.bias_grad = bias is not None and ctx.needs_input_grad[4]
        ctx.sinks_grad = sinks is not None and ctx.needs_input_grad[10]
        ctx.lse_grad = bool(rest and rest[0])
        # by-products, as in every backend (the lse too, unless the caller asked for its gradient)
        ctx.mark_non_differentiable(p, z, *(() if ctx.lse_grad else (lse,)))

    def grad(ctx: Any, dout: Tensor, dlse: Tensor | None, *unused: Tensor | None) -> tuple[Tensor | None, ...]:
        del unused  # the gradients of p, z: not differentiable
        q, k, v, out, lse, p, z, mask, bias, sinks, seed = ctx.saved_tensors
        causal, left, right, scale, softcap = ctx.args
        empty = 0 in (q.numel(), k.numel(), v.numel())  # (no score: gradients that depend on no input)
        if reference.needs_graph(dout) and not empty:  # create_graph=True: the formula's graph
            options = {
                "mask": mask, "causal": causal, "window": window_of(left, right), "scale": scale,
                "softcap": softcap or None, "dropout_p": ctx.dropout_p, "dropout_seed": int(seed.item()),
            }  # fmt: skip
            needs = (*ctx.needs_input_grad[:3], ctx.bias_grad, False)
            g = reference.mod_backward_with_graph(
                dout, q, k, v, bias, needs, options, [], sinks=sinks, sinks_need=ctx.sinks_grad,
                dlse=dlse if ctx.lse_grad else None,
            )  # fmt: skip
            dsk = g[-1] if sinks is not None else None
            return g[0], g[1], g[2], None, g[3], None, None, None, None, None, dsk, None, None, None, None
        with torch.no_grad():  # (numbers: with create_graph, an empty problem's gradients depend on no input)
            dq, dk, dv, dbias, dsinks = bwd(
                dout, q, k, v, out, lse, p, z, mask, bias, causal, left, right, scale, softcap, sinks, ctx.dropout_p,
                seed, ctx.bias_grad, ctx.sinks_grad, dlse if ctx.lse_grad else None,
            )  # fmt: skip
        db = dbias if ctx.bias_grad else None
        dsk = dsinks if ctx.sinks_grad else None
        return dq, dk, dv, None, db, None, None, None, None, None, dsk, None, None, None, None

    fwd.register_autograd(grad, setup_context=setup_context)
    return fwd


_OPS: dict[str, Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]] = {name: _register(name) for name in NAMES}


def attention(
    name: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None,
    bias: Tensor | None,
    causal: bool,
    window: Window,
    scale: float,
    softcap: float | None,
    sinks: Tensor | None,
    dropout_p: float,
    dropout_seed: Tensor,
    lse_grad: bool = False,
    keep_out: bool = False,
) -> tuple[Tensor, Tensor]:
    """Backend ``name`` through its ops: ``(out (B, Hq, Lq, Dv), lse (B, Hq, Lq))``, differentiable
    in q, k, v, bias and sinks (the lse too with ``lse_grad``). ``mask`` a bool tensor broadcastable to
    (B, Hq, Lq, Lk), ``dropout_seed`` a 0-d int64 tensor; ``keep_out``: the call will take a
    backward (a 16-bit one keeps O in float32 for it)."""
    left, right = sides(window)
    cap = 0.0 if softcap is None else softcap
    out, lse, _, _ = _OPS[name](
        q, k, v, mask, bias, causal, left, right, scale, cap, sinks, dropout_p, dropout_seed, lse_grad, keep_out
    )
    return out, lse
