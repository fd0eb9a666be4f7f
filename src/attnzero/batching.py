"""Attention under ``torch.func``: vmap, grad, vjp, jacrev, jacfwd, functional_call — on every backend.

Letters: V the size of a vmapped dimension, B batch, Hq / Hkv query / key-value heads, Lq / Lk query /
key length, D / Dv head dims.

The tiled backends compute with in-place and ``out=`` ops inside autograd Functions of the old
style (``forward(ctx, ...)``), which functorch can neither batch nor differentiate. So under a
transform ``functional.py`` hands the call here: ``_Attention`` runs the chosen backend's plain
forward (``ops.forward``) in the style functorch requires (``setup_context``), with a vmap rule
that folds the vmapped dimension into the batch — ``(V, B, H, L, E) → (V·B, H, L, E)``, one call of
the backend for all V, then the result unfolded — so ``vmap`` over any batch-like dimension, in any
position and nested, runs the backend itself. Inputs a vmap does not batch are broadcast over V
(stretched as views where the backend's broadcasting allows, else expanded).

Gradients. A backend's own backward computes numbers only, from unbatched tensors. Where that does
not suffice — a graph of the gradients is asked for (``torch.func.grad`` and ``vjp`` always ask,
as does ``create_graph=True``), or the incoming gradient is itself batched (``vmap`` over a
backward, ``gradcheck(check_batched_grad=True)``) — the gradients are autograd through the formula
(``_formula_backward`` here; ``reference.backward_with_graph`` in the backends' own Functions),
whose ops functorch batches and differentiates (``reference.needs_graph`` decides it). Forward-mode AD (``jvp``,
``jacfwd``) has no fused kernel with a JVP: under it the call runs the formula itself.

Dropout under ``vmap(randomness="different")``: each vmapped sample drops its own entries (the fold
gives it its own batch indices); ``randomness="same"`` with dropout is refused — the fold cannot
give every sample the same entries. Under the default ``randomness="error"`` drawing the seed
raises torch's own error, as torch's SDPA does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd import forward_ad

from . import dropout, ops, reference
from . import sinks as _sinks
from .checks import ArgumentError
from .masks import Mask
from .reference import accum_dtype


def draw_seed(device: torch.device) -> int:
    """``dropout.draw_seed`` under a transform: inside ``vmap(randomness="different")`` torch draws
    one number per sample, and the call takes the first (the fold gives each sample its own batch
    indices, hence its own entries); under ``randomness="error"`` torch's own error is raised."""
    t = dropout.seed_tensor(device)
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)  # (V,) under vmap: one seed per sample
    return int(t.reshape(-1)[0].item())


def wrapped(*xs: Any) -> bool:
    """Whether any of ``xs`` is a tensor seen through a torch.func transform (batched, tracked for
    grad, or dual)."""
    for x in xs:  # (a loop, not any() over a generator: every eager call asks)
        if x is not None and isinstance(x, Tensor) and _is_wrapped(x):
            return True
    return False


_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def dual(*xs: Any) -> bool:
    """Whether any of ``xs`` carries a tangent of ``torch.autograd.forward_ad`` (``make_dual``): such
    a tensor is not wrapped by torch.func and does not require grad, yet a kernel's output would
    silently drop its tangent. Free outside a ``dual_level`` (asked on every eager call)."""
    if forward_ad._current_level < 0:
        return False
    for x in xs:
        if x is not None and isinstance(x, Tensor) and forward_ad.unpack_dual(x).tangent is not None:
            return True
    return False


def forward_mode() -> bool:
    """Whether forward-mode AD is on: a ``torch.func.jvp`` / ``jacfwd`` transform, or a dual level
    of ``torch.autograd.forward_ad``."""
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    jvp = torch._C._functorch.TransformType.Jvp
    if any(i.key() == jvp for i in retrieve_all_functorch_interpreters()):
        return True
    return bool(forward_ad._current_level >= 0)


@dataclass(frozen=True)
class _Spec:
    """What a call fixes besides its tensors: the backend and its options. ``mask`` is a ``Mask``
    (a tensor mask travels as a tensor, so that vmap can batch it)."""

    name: str
    mask: Mask | None
    causal: bool
    window: tuple[int | None, int | None] | None
    scale: float
    softcap: float | None
    dropout_p: float
    dropout_seed: int

    def options(self, mask: Tensor | None) -> dict[str, Any]:
        return {
            "mask": self.mask if mask is None else mask, "causal": self.causal, "window": self.window,
            "scale": self.scale, "softcap": self.softcap, "dropout_p": self.dropout_p,
            "dropout_seed": self.dropout_seed,
        }  # fmt: skip


class _Attention(torch.autograd.Function):
    """``(out, lse)`` of backend ``spec.name``, differentiable in q, k, v, bias and sinks, batchable."""

    @staticmethod
    def forward(  # type: ignore[override]
        q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, sinks: Tensor | None, spec: _Spec
    ) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            out, lse, _ = ops.forward(spec.name, q, k, v, sinks, bias=bias, **spec.options(mask))
        return out, lse

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        q, k, v, mask, bias, sinks, spec = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, mask, bias, sinks, out, lse)
        ctx.spec = spec
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        del dlse  # the lse is not differentiable
        q, k, v, mask, bias, sinks, out, lse = ctx.saved_tensors
        spec: _Spec = ctx.spec
        needs = ctx.needs_input_grad
        options = spec.options(mask)
        if reference.needs_graph(dout):
            dq, dk, dv, dbias, dsinks = _formula_backward(dout, q, k, v, bias, sinks, **options)
            return dq, dk, dv, None, dbias, dsinks, None
        dq, dk, dv, dbias = ops.backward(
            spec.name, dout, q, k, v, out, lse, kept=ops.nothing(q), bias=bias, bias_grad=needs[4], **options
        )
        dsinks = _sinks.grad(dout, out, lse, sinks) if sinks is not None and needs[5] else None
        return dq, dk, dv, None, dbias, dsinks, None

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[int | None, ...], q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
        bias: Tensor | None, sinks: Tensor | None, spec: _Spec,
    ) -> tuple[tuple[Tensor, Tensor], tuple[int, int]]:
        """Fold the vmapped dimension into the batch: (V, B, ...) → (V·B, ...), one call, unfold."""
        V = info.batch_size
        if spec.dropout_p > 0.0 and info.randomness == "same":
            raise ArgumentError(
                "dropout_p: under vmap(randomness='same') every sample would need the same dropped entries, which "
                "attnzero's batched call cannot give; use randomness='different' or dropout_p=0"
            )
        qd, kd, vd, md, bd, sd = in_dims[:6]
        q5, k5, v5 = _front(q, qd, V), _front(k, kd, V), _front(v, vd, V)  # (V, B, H, L, E)
        B = q5.shape[1]
        if spec.mask is not None and spec.mask.shape[0] != 1:  # a mask that differs by batch: as a tensor
            mask, md, spec = spec.mask.to_tensor(q.device), None, _replace_mask(spec)
        folded = _Attention.apply(
            _fold(q5), _fold(k5), _fold(v5), _fold_4d(mask, md, V, B), _fold_4d(bias, bd, V, B),
            _fold_sinks(sinks, sd, V, B, q5.shape[3]), spec,
        )  # fmt: skip
        out, lse = folded  # (V·B, Hq, Lq, Dv), (V·B, Hq, Lq)
        return (out.view(V, B, *out.shape[1:]), lse.view(V, B, *lse.shape[1:])), (0, 0)


def _formula_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, sinks: Tensor | None, *,
    mask: Tensor | Mask | None, causal: bool, window: tuple[int | None, int | None] | None, scale: float,
    softcap: float | None, dropout_p: float, dropout_seed: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """``(dq, dk, dv, dbias, dsinks)``: MATH.md's backward in plain ops of the inputs and ``dout``,
    P recomputed from q and k (never from a saved lse, so that a gradient of these gradients is
    right), every matrix materialised — ops that functorch batches and differentiates, with no
    autograd call inside (a backward under torch.func runs below the level of its saved inputs)."""
    acc = accum_dtype(q.dtype)
    p, lse = reference.probabilities(
        q, k, mask=mask, bias=bias, causal=causal, window=window, scale=scale, softcap=softcap, sinks=sinks
    )  # (B, Hq, Lq, Lk), (B, Hq, Lq); the lse with the sink's term
    B, Hq, Lq, Lk = p.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    k_h = k.to(acc).repeat_interleave(G, dim=1)  # (B, Hq, Lk, D): the key/value head of each query head
    v_h = v.to(acc).repeat_interleave(G, dim=1)  # (B, Hq, Lk, Dv)
    do = dout.to(acc)  # (B, Hq, Lq, Dv)
    dp = do @ v_h.transpose(-2, -1)  # dP = dO Vᵀ: (B, Hq, Lq, Lk)
    p_kept = p
    if dropout_p > 0.0:  # O = (P ∘ Z / (1 − p)) V: the entries the forward dropped
        z = dropout.keep_mask(dropout_seed, dropout_p, (B, Hq, Lq, Lk), device=q.device).to(acc) / (1.0 - dropout_p)
        p_kept, dp = p * z, dp * z
    dv_h = p_kept.transpose(-2, -1) @ do  # dV = P̃ᵀ dO: (B, Hq, Lk, Dv)
    delta = (p * dp).sum(dim=-1, keepdim=True)  # D = rowsum(P ∘ dP) = rowsum(dO ∘ O): (B, Hq, Lq, 1)
    ds = p * (dp - delta)  # dS = P ∘ (dP − D): the gradient of the capped score, what the bias gets
    ds_x = ds
    if softcap is not None:  # through the cap: d(softcap · tanh(x / softcap)) / dx = 1 − tanh²
        t = torch.tanh((q.to(acc) @ k_h.transpose(-2, -1)) * (scale / softcap))  # (B, Hq, Lq, Lk)
        ds_x = ds * (1.0 - t * t)
    dq = (ds_x @ k_h) * scale  # (B, Hq, Lq, D)
    dk = ((ds_x.transpose(-2, -1) @ q.to(acc)) * scale).view(B, Hkv, G, Lk, -1).sum(dim=2)  # (B, Hkv, Lk, D)
    dv = dv_h.view(B, Hkv, G, Lk, -1).sum(dim=2)  # (B, Hkv, Lk, Dv): a group's query heads add up
    dbias = ds.sum_to_size(bias.shape).to(bias.dtype) if bias is not None else None
    dsinks = None
    if sinks is not None:  # −Σ_rows exp(sink − lse) · rowsum(dO ∘ O)
        sink = (sinks.view(1, Hq, 1) if sinks.ndim == 1 else sinks).to(acc)  # (1|B, Hq, 1|Lq)
        d = -(torch.exp(sink - lse) * delta.squeeze(-1))  # (B, Hq, Lq)
        dsinks = (d.sum(dim=(0, 2)) if sinks.ndim == 1 else d).to(sinks.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias, dsinks


def _replace_mask(spec: _Spec) -> _Spec:
    from dataclasses import replace

    return replace(spec, mask=None)


def _front(x: Tensor, dim: int | None, V: int) -> Tensor:
    """``x`` with its vmapped dimension first: (V, ...); an unbatched ``x`` is stretched (a view)."""
    return x.movedim(dim, 0) if dim is not None else x.unsqueeze(0).expand(V, *x.shape)


def _fold(x5: Tensor) -> Tensor:
    return x5.reshape(x5.shape[0] * x5.shape[1], *x5.shape[2:])  # (V, B, ...) → (V·B, ...)


def _fold_4d(x: Tensor | None, dim: int | None, V: int, B: int) -> Tensor | None:
    """A mask or bias broadcastable to (B, Hq, Lq, Lk), folded like q: one that is the same for
    every sample and every batch entry (batch size 1) stays as it is and broadcasts over V·B."""
    if x is None or (dim is None and x.shape[0] == 1):
        return x
    x5 = _front(x, dim, V)  # (V, B|1, H|1, Lq|1, Lk|1)
    if x5.shape[1] != B:
        x5 = x5.expand(V, B, *x5.shape[2:])  # (V, B, H|1, Lq|1, Lk|1)
    return _fold(x5)


def _fold_sinks(s: Tensor | None, dim: int | None, V: int, B: int, Lq: int) -> Tensor | None:
    """Sinks (Hq,) or (B, Hq, Lq), folded like q; per-head sinks the same for every sample stay."""
    if s is None or (dim is None and s.ndim == 1):
        return s
    s_v = _front(s, dim, V)  # (V, Hq) or (V, B, Hq, Lq)
    if s_v.ndim == 2:
        s_v = s_v[:, None, :, None].expand(V, B, s_v.shape[1], Lq)  # (V, B, Hq, Lq): one per query
    return _fold(s_v)


def attention(
    name: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | Mask | None,
    bias: Tensor | None,
    causal: bool,
    window: tuple[int | None, int | None] | None,
    scale: float,
    softcap: float | None,
    sinks: Tensor | None,
    dropout_p: float,
    dropout_seed: int,
) -> tuple[Tensor, Tensor]:
    """Backend ``name`` (not the reference, whose formula functorch takes as it is) under a
    torch.func transform: ``(out (B, Hq, Lq, Dv), lse (B, Hq, Lq))``."""
    spec = _Spec(
        name, mask if isinstance(mask, Mask) else None, causal, window, scale, softcap, dropout_p, dropout_seed
    )
    dense = mask if isinstance(mask, Tensor) else None
    out, lse = _Attention.apply(q, k, v, dense, bias, sinks, spec)
    return out, lse
