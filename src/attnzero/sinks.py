"""Attention sinks (gpt-oss): a virtual key of value 0 whose logit ``sink`` joins every softmax.

With a sink, a row's probabilities are ``p_ij = exp(s_ij) / (exp(sink) + Σ_j exp(s_ij))``: the
weights of the real keys sum to less than 1, and a row may put its weight "nowhere". Nothing about
the real keys changes, so the sink can be added after any attention that returns its log-sum-exp —
exactly as two halves of the keys are merged (docs/MATH.md, "Merging"):

* ``lse₂ = log(exp(lse) + exp(sink))`` — the sink is one more key in the denominator;
* ``O₂ = O · exp(lse − lse₂)`` — its value is 0, so it only shrinks the output.

A row with no kept key has ``lse = −inf``: it gets ``O₂ = 0`` and ``lse₂ = sink``. The backward of
any backend, given ``(O₂, lse₂)``, already returns the right dq, dk, dv and dbias (it recomputes
``P = exp(s − lse₂)``, and ``Δ = rowsum(dO ∘ O₂)``); the sink's own gradient is
``dsink = −Σ_rows exp(sink − lse₂) · Δ`` (``grad``). The reference backend computes sinks inside its
softmax instead (``reference.probabilities``), so the tests compare two derivations.

Shapes: ``sinks`` is ``(Hq,)`` (one per head) or ``(B, Hq, Lq)`` (one per query); ``lse`` is
``(B, Hq, Lq)`` and ``out`` ``(B, Hq, Lq, Dv)``. Inputs are trusted (``functional.py`` checked them).
"""

from __future__ import annotations

import torch
from torch import Tensor

NEG_INF = float("-inf")


def expand(sinks: Tensor, dtype: torch.dtype) -> Tensor:
    """``sinks`` as a tensor that broadcasts against an lse (B, Hq, Lq): (1, Hq, 1) for per-head
    sinks, (B, Hq, Lq) for per-query ones; in ``dtype``."""
    s = sinks.view(1, -1, 1) if sinks.ndim == 1 else sinks  # (1, Hq, 1) or (B, Hq, Lq)
    return s.to(dtype)


def fold(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """``(O₂, lse₂)``: the attention ``(out (B, Hq, Lq, Dv), lse (B, Hq, Lq))`` with the sink added to
    every row's softmax, in out's and lse's dtypes. The factor ``exp(lse − lse₂)`` is computed as
    ``sigmoid(lse − sink)`` (one rounding of a difference, not of two logs) and in float64, so that
    O₂ is rounded once, like any output."""
    sink = expand(sinks, torch.float64)  # (1, Hq, 1) or (B, Hq, Lq)
    lse64 = lse.to(torch.float64)  # (B, Hq, Lq)
    lse2 = torch.logaddexp(lse64, sink)  # −inf only where both are −inf
    factor = torch.where(lse2 == NEG_INF, 0.0, torch.sigmoid(lse64 - sink))  # exp(lse − lse₂), in [0, 1]
    # in place on the float64 copy: one temporary of out's size, not two (two such buffers, 8 MB each
    # at B=1, H=8, L=2048, D=64, were mapped and page-faulted afresh on every call: 6 ms against 0.3)
    out2 = out.to(torch.float64).mul_(factor.unsqueeze(-1)).to(out.dtype)  # (B, Hq, Lq, Dv)
    return out2, lse2.to(lse.dtype)


def grad(dout: Tensor, out2: Tensor, lse2: Tensor, sinks: Tensor) -> Tensor:
    """``dsinks`` (sinks' shape and dtype) from the sink-folded ``out2`` and ``lse2``:
    ``−Σ exp(sink − lse₂) · rowsum(dO ∘ O₂)`` over the rows each sink serves."""
    acc = lse2.dtype
    delta = (dout.to(acc) * out2.to(acc)).sum(dim=-1)  # Δ = rowsum(dO ∘ O₂): (B, Hq, Lq)
    return grad_of_rows(delta, lse2, sinks)


def grad_of_rows(delta: Tensor, lse2: Tensor, sinks: Tensor) -> Tensor:
    """``−Σ exp(sink − lse₂) · Δ`` over the rows each sink serves, in sinks' shape and dtype, for a
    row term ``Δ`` (B, Hq, Lq): rowsum(dO ∘ O₂) (``grad``), or −dlse for the lse's own gradient
    (∂lse₂/∂sink = exp(sink − lse₂), ``lse_grad.py``)."""
    sink = expand(sinks, lse2.dtype)  # (1, Hq, 1) or (B, Hq, Lq)
    p_sink = torch.where(lse2 == NEG_INF, 0.0, torch.exp(sink - lse2))  # the sink's probability: (B, Hq, Lq)
    d = -(p_sink * delta.to(lse2.dtype))  # (B, Hq, Lq)
    if sinks.ndim == 1:
        d = d.sum(dim=(0, 2))  # (Hq,)
    return d.to(sinks.dtype)


__all__ = ["expand", "fold", "grad", "grad_of_rows"]
