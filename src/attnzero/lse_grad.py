"""The gradient of the log-sum-exp that ``return_lse=True`` gives, for the backends whose kernels
return it as a plain value (flash.py, the compiled CPU kernel, Triton).

``lse_i = log Σ_j exp(s_ij)`` (with a sink, ``exp(sink_i)`` joins the sum), so

* ``∂lse_i / ∂s_ij = p_ij`` — the backward of an attention whose values are one column of ones,
  whose output's gradient is ``dlse`` and whose output is taken as 0 (so that ``D_i = rowsum(dO ∘ O)``
  is 0): ``ds_ij = p_ij · (dlse_i · 1 − 0)``. flash.py's backward computes it, on any device, with
  the call's mask, bias, softcap and score_mod, and no dropout (the lse does not depend on it): dq,
  dk, dbias and the gradients of the tensors a score_mod captures;
* ``∂lse_i / ∂sink_i = exp(sink_i − lse_i)``.

``attach`` gives the lse those gradients on top of whatever the output's own Function gives.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import flash, mods, reference
from . import sinks as sinks_
from .masks import unchanged, version_of


class _Lse(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, lse: Tensor, q: Tensor, k: Tensor, bias: Tensor | None, sinks: Tensor | None,
        options: dict[str, Any], *captured: Tensor,
    ) -> Tensor:  # fmt: skip
        # the captured tensors: inputs so that they get gradients, saved so that one changed in place
        # before the backward is refused by autograd (the score_mod reads them itself)
        ctx.save_for_backward(q, k, bias, sinks, lse, *captured)
        ctx.options, ctx.mask_seen = options, version_of(options.get("mask"))
        return lse.clone()

    @staticmethod
    def backward(ctx: Any, dlse: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, bias, sinks, lse, *_ = ctx.saved_tensors  # (unpacked: autograd's check of the captured)
        unchanged(ctx.mask_seen)  # (the same check for the mask)
        needs = ctx.needs_input_grad  # (lse, q, k, bias, sinks, options, *captured)
        if reference.needs_graph(dlse):  # create_graph=True: autograd through the formula's lse
            fn = ctx.options.get("score_mod")
            captured = mods.captured_tensors(fn) if fn is not None else []
            ones = q.new_ones(k.shape[0], k.shape[1], k.shape[2], 1)  # V: the lse does not depend on it
            g = reference.mod_backward_with_graph(
                None, q, k, ones, bias, (needs[1], needs[2], False, needs[3], False, *needs[6:]), ctx.options,
                captured, sinks=sinks, sinks_need=needs[4], dlse=dlse,
            )  # (dq, dk, dv, dbias, None, *captured[, dsinks])
            dsinks = g[-1] if sinks is not None else None
            rest = list(g[5:-1] if sinks is not None else g[5:])
            return None, g[0], g[1], g[3], dsinks, None, *rest
        grads: list[Tensor | None] = []
        dq, dk, dbias, dsinks = of_lse(
            dlse, q, k, lse, bias=bias, sinks=sinks, bias_grad=needs[3], sinks_grad=needs[4], captured_grads=grads,
            **ctx.options,
        )  # fmt: skip
        rest = [g if needs[6 + i] else None for i, g in enumerate(grads)]
        return None, dq if needs[1] else None, dk if needs[2] else None, dbias, dsinks, None, *rest


def of_lse(
    dlse: Tensor, q: Tensor, k: Tensor, lse: Tensor, *, bias: Tensor | None, sinks: Tensor | None,
    bias_grad: bool, sinks_grad: bool, captured_grads: list[Tensor | None] | None = None, **options: Any,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """``(dq, dk, dbias, dsinks)`` of ``<lse, dlse>`` (dbias / dsinks None unless asked for): flash.py's
    backward with V a column of ones, dO = dlse and O = 0, and the sinks' share. ``lse`` is the one
    returned (the sinks folded in); ``options``: the call's mask, causal, window, scale, softcap and
    score_mod (its captured tensors' gradients into ``captured_grads``)."""
    B, Hq, Lq, _ = q.shape
    ones = q.new_ones(k.shape[0], k.shape[1], k.shape[2], 1)  # V: one column of ones (B, Hkv, Lk, 1)
    zeros = q.new_zeros(B, Hq, Lq, 1)  # O taken as 0: D = 0
    dout = dlse.unsqueeze(-1).to(reference.accum_dtype(q.dtype))  # dO = dlse (B, Hq, Lq, 1), not rounded to 16 bits
    dq, dk, _, dbias = flash.backward(
        dout, q, k, ones, zeros, lse, bias=bias, bias_grad=bias is not None and bias_grad, dropout_p=0.0,
        dropout_seed=0, captured_grads=captured_grads, **options,
    )  # fmt: skip
    dsinks = sinks_.grad_of_rows(-dlse, lse, sinks) if sinks is not None and sinks_grad else None  # Σ p_sink·dlse
    return dq, dk, dbias, dsinks


def attach(
    lse: Tensor, q: Tensor, k: Tensor, *, bias: Tensor | None, sinks: Tensor | None, **options: Any
) -> Tensor:
    """``lse`` (B, Hq, Lq), as computed, differentiable in q, k, bias, sinks and the tensors the
    ``score_mod`` in ``options`` captures, where one of them requires grad (else as it is).
    ``options``: the call's ``mask``, ``causal``, ``window``, ``scale``, ``softcap``, ``score_mod``."""
    fn = options.get("score_mod")
    captured = mods.captured_tensors(fn) if fn is not None else []
    inputs = (q, k, bias, sinks, *captured)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)):
        return lse
    out: Tensor = _Lse.apply(lse.detach(), q, k, bias, sinks, options, *captured)
    return out


__all__ = ["attach", "of_lse"]
