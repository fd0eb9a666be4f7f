"""The formula, materialised: ``softmax(Q Kᵀ · scale + bias) V`` — the golden of every test.

Read it next to the seeds (scores → scale → bias/mask → softmax → weighted sum). It differs from
them only where they go wrong:

* a query row whose keys are all blocked gets probabilities 0, output 0, lse −inf and zero
  gradients, where ``masked_fill(-inf)`` + ``softmax`` gives NaN;
* two things modern models add: ``softcap`` squashes each score into (−softcap, softcap) with
  ``tanh`` (Gemma 2), and ``sinks`` add a virtual key of value 0 to every row's softmax (gpt-oss);
* the softmax subtracts the row maximum, and for float16/bfloat16 inputs the scores and the
  softmax statistics are float32 (only P is rounded back before P·V);
* GQA/MQA: the G = Hq / Hkv query heads that share a key/value head are stacked along the
  sequence axis, so one matmul serves the whole group and K/V are never copied.

Letters: B batch, Hq / Hkv query / key-value heads, G = Hq // Hkv, Lq / Lk query / key length,
D head dim of q and k, Dv head dim of v. Inputs are trusted: ``functional.py`` validated them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import dropout, mods
from .masks import Mask, keep_block


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores and softmax statistics: float32 for 16- and 32-bit inputs, float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def probabilities(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | Mask | None,
    bias: Tensor | None,
    causal: bool,
    window: tuple[int | None, int | None] | None,
    scale: float,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    score_mod: mods.ScoreMod | None = None,
) -> tuple[Tensor, Tensor]:
    """P = softmax(scale · Q Kᵀ + bias, blocked → 0) and its log-sum-exp, in the accumulator dtype.
    Returns ``p (B, Hq, Lq, Lk)`` and ``lse (B, Hq, Lq)``. ``softcap``: each score becomes
    ``softcap · tanh(score / softcap)`` before the bias. ``sinks`` ((Hq,) or (B, Hq, Lq)): one more
    term ``exp(sink)`` in each row's denominator (and in the lse); a row with no kept key then has
    P = 0 and lse = sink. ``score_mod(score, b, h, q_idx, kv_idx)`` rewrites each scaled score first
    (``mods.py``)."""
    Hq, Lq, Hkv, Lk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]  # q (B, Hq, Lq, D), k (B, Hkv, Lk, D)
    G = Hq // Hkv
    acc = accum_dtype(q.dtype)

    # 1. scores = Q Kᵀ · scale. Group g of key/value head n is query head n·G + g (k broadcast over g).
    q_grouped = q.unflatten(1, (Hkv, G))  # (B, Hkv, G, Lq, D)
    s = q_grouped.to(acc) @ k.to(acc).unsqueeze(2).transpose(-2, -1)  # (B, Hkv, G, Lq, Lk)
    s = s.flatten(1, 2) * scale  # (B, Hq, Lq, Lk)
    if score_mod is not None:
        s = mods.score_grid(score_mod, s)  # the user's function of (score, b, h, q_idx, kv_idx)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)  # soft-capped into (−softcap, softcap)

    # 2. bias, then blocked pairs → −inf (mask, causal and window together).
    if bias is not None:
        s = s + bias.to(acc)
    keep = keep_block(mask, causal, window, Lq, Lk, (0, Lq), (0, Lk), q.device)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))

    # 3. softmax with the row max subtracted. A row with any kept key has sum l >= 1 (its max
    #    contributes exp(0) = 1); a fully blocked row has l = 0, and m = −inf is replaced by 0 so
    #    that exp never sees −inf − (−inf). A sink is one more logit in the row (of value 0).
    m = s.amax(dim=-1, keepdim=True).detach()  # (B, Hq, Lq, 1); softmax does not depend on m
    sink = None
    if sinks is not None:
        sink = (sinks.view(1, Hq, 1, 1) if sinks.ndim == 1 else sinks.unsqueeze(-1)).to(acc)  # (B|1, Hq, Lq|1, 1)
        m = torch.maximum(m, sink.detach())
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    l = e.sum(dim=-1, keepdim=True)  # (B, Hq, Lq, 1)
    if sink is not None:
        l = l + torch.exp(sink - m)  # the sink's term: its probability exp(sink − lse) goes nowhere
    l_safe = l.clamp_min(1.0)  # = l for every row that has a key or a sink (>= 1); 1 for blocked rows
    p = e / l_safe  # blocked rows: 0 / 1 = 0
    lse = torch.where(l != 0, m + torch.log(l_safe), float("-inf")).squeeze(-1)  # (B, Hq, Lq); NaN l: NaN
    return p, lse


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | Mask | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    scale: float,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | Tensor = 0,
    score_mod: mods.ScoreMod | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out (B, Hq, Lq, Dv), lse (B, Hq, Lq))`` of softmax(scale · Q Kᵀ + bias) V (``softcap``,
    ``sinks`` and ``score_mod`` as in :func:`probabilities`)."""
    p, lse = probabilities(
        q, k, mask=mask, bias=bias, causal=causal, window=window, scale=scale, softcap=softcap, sinks=sinks,
        score_mod=score_mod,
    )  # fmt: skip
    B, Hq, Lq, Lk = p.shape
    Hkv = v.shape[1]  # v (B, Hkv, Lk, Dv)

    # 4. dropout on the probabilities, rescaled by 1 / (1 - p) (dropout.py says which entries).
    if dropout_p > 0.0:
        kept = dropout.keep_mask(dropout_seed, dropout_p, (B, Hq, Lq, Lk), device=q.device)
        p = p * kept / (1.0 - dropout_p)

    # 5. weighted sum of values, one matmul per key/value head (broadcast over its G query heads).
    p_grouped = p.to(v.dtype).unflatten(1, (Hkv, Hq // Hkv))  # (B, Hkv, G, Lq, Lk)
    out = (p_grouped @ v.unsqueeze(2)).flatten(1, 2)  # (B, Hq, Lq, Dv)
    return out, lse


def needs_graph(dout: Tensor) -> bool:
    """Whether a backend's backward must be :func:`backward_with_graph` rather than its own, which
    computes numbers only: a graph of the gradients is asked for (``create_graph=True``, and every
    ``torch.func`` gradient transform), or ``dout`` comes batched by ``torch.func.vmap`` (a vmapped
    backward, ``gradcheck(check_batched_grad=True)``), which in-place kernels cannot take."""
    ft = torch._C._functorch  # autograd.grad(is_grads_batched=True) batches with the legacy vmap
    return torch.is_grad_enabled() or ft.is_functorch_wrapped_tensor(dout) or ft.is_legacy_batchedtensor(dout)


def _apart(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, sinks: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Each input as a view of itself, so that one tensor passed twice (``attention(x, x, x)``, k is v)
    gets each slot's gradient from ``autograd.grad``, not the sum of all its uses in every slot (autograd
    then adds the slots: twice or three times the gradient). The views stay differentiable functions of
    the inputs, so the gradients keep their graph."""
    b, s = (None if t is None else t.view_as(t) for t in (bias, sinks))
    return q.view_as(q), k.view_as(k), v.view_as(v), b, s


def backward_with_graph(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    needs: tuple[bool, ...],
    sinks: Tensor | None = None,
    **options: Any,
) -> tuple[Tensor | None, ...]:
    """``(dq, dk, dv, dbias[, dsinks])`` as differentiable functions of the inputs and ``dout``:
    autograd through the formula above. What the other backends' backward returns when autograd
    asks for a graph of the gradients (``create_graph=True``: a gradient penalty, double backward) —
    their own backward computes numbers only. ``needs`` says which of (q, k, v, bias[, sinks]) want
    a gradient (dsinks comes back when ``needs`` has five entries); ``options`` are
    :func:`attention`'s (the same dropout seed drops the same entries)."""
    with torch.enable_grad():
        q, k, v, bias, sinks = _apart(q, k, v, bias, sinks)
        out, _ = attention(q, k, v, bias=bias, sinks=sinks, **options)
    inputs = (q, k, v, bias, sinks)[: len(needs)]
    wrt = [t for t, n in zip(inputs, needs) if n and t is not None and t.requires_grad]
    got = iter(torch.autograd.grad(out, wrt, dout, create_graph=True, allow_unused=True) if wrt else ())
    grads: list[Tensor | None] = []
    for t, n in zip(inputs, needs):
        g = next(got) if n and t is not None and t.requires_grad else None
        grads.append(torch.zeros_like(t) if g is None and n and t is not None else g)
    return tuple(grads)


def function_backward_with_graph(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, sink: Tensor | None, needs: tuple[bool, ...],
    options: dict[str, Any], captured: list[Tensor],
) -> tuple[Tensor | None, ...]:
    """:func:`mod_backward_with_graph` for the autograd Functions that take ``(q, k, v, bias, sink,
    options, *captured)`` — flash.py's and the compiled kernels' with a score_mod: their gradients, in
    that order (``needs`` is the Function's ``needs_input_grad``)."""
    g = mod_backward_with_graph(
        dout, q, k, v, bias, (*needs[:4], *needs[5:]), options, captured, sinks=sink, sinks_need=needs[4]
    )  # (dq, dk, dv, dbias, None, *captured[, dsink])
    return (*g[:4], None, *g[4:]) if sink is None else (*g[:4], g[-1], *g[4:-1])


def mod_backward_with_graph(
    dout: Tensor | None, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, needs: tuple[bool, ...],
    options: dict[str, Any], captured: list[Tensor], sinks: Tensor | None = None, sinks_need: bool = False,
    dlse: Tensor | None = None,
) -> tuple[Tensor | None, ...]:
    """:func:`backward_with_graph` for a backend whose autograd Function takes ``(q, k, v, bias,
    options, *captured)``, ``captured`` the tensors a ``score_mod`` (in ``options``) reads — none
    without one: the gradients of those, the captured tensors' included (``needs`` lists all of
    them, the options' slot too). With ``sinks`` (the Function's own input, ``sinks_need`` whether it
    wants a gradient) its gradient comes last. ``dlse``: the lse's gradient too (``lse_grad.py``'s
    double backward; ``dout`` may then be None)."""
    originals = [q, k, v, bias, sinks]
    with torch.enable_grad():
        q, k, v, bias, sinks = _apart(q, k, v, bias, sinks)
    inputs = [q, k, v, bias, *captured]
    wrt = [t for t, n in zip(inputs[:4], needs[:4]) if t is not None and n]
    wrt += [t for t, n in zip(captured, needs[5:]) if n and t.requires_grad]
    wrt += [sinks] if sinks is not None and sinks_need else []
    with torch.enable_grad():
        out, lse = attention(q, k, v, bias=bias, sinks=sinks, **options)
        ys, dys = zip(*[(y, dy) for y, dy in ((out, dout), (lse, dlse)) if dy is not None])
        got = iter(torch.autograd.grad(ys, wrt, dys, create_graph=True, allow_unused=True))
    res: list[Tensor | None] = [next(got) if t is not None and n else None for t, n in zip(inputs[:4], needs[:4])]
    rest = [next(got) if n and t.requires_grad else None for t, n in zip(captured, needs[5:])]
    dsinks = next(got) if sinks is not None and sinks_need else None
    # A captured tensor that is also an input, or one an input is computed from (the mod reads x, and
    # x is passed as q, or bias = f(x)): its gradient above holds the paths through that input's slot as
    # well, which autograd adds again from the slot's own gradient: take them out (the slot's gradient
    # carried back to the captured tensor; itself when they are one tensor).
    with torch.enable_grad():
        for j, t in enumerate(captured):
            total = rest[j]
            for o, g in zip(originals, [*res, dsinks]):
                if total is None or o is None or g is None or not o.requires_grad:
                    continue
                (back,) = torch.autograd.grad(o, t, g, create_graph=True, allow_unused=True)
                total = total if back is None else total - back
            rest[j] = total
    if sinks is None:
        return (*res, None, *rest)
    return (*res, None, *rest, dsinks)
