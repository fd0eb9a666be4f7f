"""The public functions: validate once, then hand trusted inputs to one backend.

Letters used in shapes: B batch, Hq query heads, Hkv key/value heads (Hq % Hkv == 0), Lq query
length, Lk key length, D head dim of q and k, Dv head dim of v.

A backend is a function with one signature::

    backend(q, k, v, *, mask, bias, causal, window, scale, dropout_p, dropout_seed)
        -> (out (B, Hq, Lq, Dv), lse (B, Hq, Lq))

where ``mask`` is a 4-D bool tensor or an ``az.masks.Mask`` (True = may attend), ``bias`` a 4-D
float tensor (both broadcastable to (B, Hq, Lq, Lk)), ``window`` a ``(left, right)`` pair, ``scale``
a float and ``dropout_seed`` the seed of ``dropout.keep_mask``.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from . import checks, dropout, reference
from .masks import Mask
from .masks import causal as causal_mask

log = logging.getLogger("attnzero")

Backend = Callable[..., tuple[Tensor, Tensor]]
BackendName = Literal["auto", "reference", "flash", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "flash", "triton")


def _backend(name: str) -> Backend:
    """The backend function for a concrete name (imported on first use)."""
    if name == "reference":
        return reference.attention
    if name == "flash":
        from . import flash

        return flash.attention
    from .kernels import triton_backend  # raises a clear ImportError when triton is missing

    return triton_backend.attention


def _check_triton(device: torch.device) -> None:
    """backend="triton" can run here: triton is installed (else a clear ImportError) and the tensors
    are on CUDA, or on CPU under TRITON_INTERPRET=1."""
    from .kernels import triton_backend  # ImportError: "... needs the `triton` package: pip install triton ..."

    reason = triton_backend.unsupported_device_reason(device)
    if reason is not None:
        raise ValueError(f"backend: {reason}")


def _auto(q: Tensor, k: Tensor) -> str:
    """The fastest correct backend for these inputs (see docs/benchmarks.md for the measurements).
    Whether gradients are needed does not change the choice: the triton backend itself takes its
    split-KV decode path only when no input requires grad."""
    # Tiny problems: the materialised reference has the fewest ops (the flash loop's per-block
    # overhead dominates below ~128 × 128 scores per head). Otherwise flash, on any device.
    name = "flash" if q.shape[2] * k.shape[2] > 128 * 128 else "reference"
    if q.is_cuda and q.dtype != torch.float64 and importlib.util.find_spec("triton") is not None:
        name = "triton"  # the Triton kernels (kernels/), for every size on CUDA
    log.debug("backend='auto' chose %r for q %s, k %s on %s", name, tuple(q.shape), tuple(k.shape), q.device)
    return name


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | Mask | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: BackendName = "auto",
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention ``softmax(scale · Q Kᵀ + bias) V`` over kept pairs.

    Args:
        q: (B, Hq, Lq, D). k: (B, Hkv, Lk, D). v: (B, Hkv, Lk, Dv). Query head ``h`` reads
            key/value head ``h // (Hq // Hkv)`` (GQA / MQA).
        mask: keep-mask broadcastable to (B, Hq, Lq, Lk): True / non-zero = may attend. A tensor of
            any dtype, or a builder from ``az.masks``.
        bias: float tensor broadcastable to (B, Hq, Lq, Lk), added to the scaled scores.
        causal: bottom-right aligned — query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq``.
        window: ``(left, right)`` or ``w`` = ``(w, 0)``: query ``i`` at ``p = i + Lk - Lq`` sees
            ``p - left <= j <= p + right``; None on a side = unbounded.
        scale: defaults to ``1 / sqrt(D)``.
        dropout_p: drop probabilities with this chance (and rescale by 1 / (1 - p)); the dropped
            entries follow torch's RNG state.
        backend: "reference", "flash", "triton" or "auto".
        return_lse: also return the natural-log log-sum-exp of the scores, (B, Hq, Lq).

    Returns:
        out (B, Hq, Lq, Dv) in q's dtype, or ``(out, lse)``. A query row with no kept key gives
        output 0, lse −inf and zero gradients — never NaN.
    """
    if v is None:  # checks.qkv treats v=None as "no values" (attention_weights)
        raise TypeError("v: expected a torch.Tensor, got NoneType")
    B, Hq, _, Lq, Lk = checks.qkv(q, k, v)
    full = (B, Hq, Lq, Lk)
    keep = checks.mask(mask, full, q.device)
    add = checks.bias(bias, full, q.device)
    is_causal = checks.flag("causal", causal)
    win = checks.window(window)
    sc = checks.scale(scale, q.shape[-1])
    p = checks.dropout_p(dropout_p)
    name = checks.choice("backend", backend, BACKENDS)
    want_lse = checks.flag("return_lse", return_lse)

    if name == "auto":
        name = _auto(q, k)
    if name == "triton":
        _check_triton(q.device)
    seed = dropout.draw_seed(q.device) if p > 0.0 else 0
    out, lse = _backend(name)(
        q, k, v, mask=keep, bias=add, causal=is_causal, window=win, scale=sc, dropout_p=p, dropout_seed=seed
    )
    return (out, lse) if want_lse else out


def attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | Mask | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
) -> Tensor:
    """The attention probabilities (B, Hq, Lq, Lk) in q's dtype, for inspection and plots.
    Same arguments as :func:`attention`; fully blocked rows are 0. Materialises Lq × Lk."""
    B, Hq, _, Lq, Lk = checks.qkv(q, k, None)
    full = (B, Hq, Lq, Lk)
    p, _ = reference.probabilities(
        q,
        k,
        mask=checks.mask(mask, full, q.device),
        bias=checks.bias(bias, full, q.device),
        causal=checks.flag("causal", causal),
        window=checks.window(window),
        scale=checks.scale(scale, q.shape[-1]),
    )
    return p.to(q.dtype)


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``, with torch's semantics:
    inputs (..., L, E) with any leading dims (heads at dim -3), a bool ``attn_mask`` keeps True
    entries, a float ``attn_mask`` is added to the scores, ``is_causal`` is top-left aligned
    (query i sees keys 0..i), ``enable_gqa`` lets key/value have fewer heads. Unlike torch, a row
    with every key blocked gives 0 instead of NaN."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        checks.tensor(name, x)
        if x.ndim < 2:
            raise ValueError(f"{name}: expected at least 2 dims (..., L, E), got {x.ndim}")
    if not (query.ndim == key.ndim == value.ndim):
        raise ValueError(
            f"key, value: expected as many dims as query's {query.ndim}, got {key.ndim} and {value.ndim}"
        )
    if not checks.flag("enable_gqa", enable_gqa) and query.ndim >= 3 and key.shape[-3] != query.shape[-3]:
        raise ValueError(
            f"key: {key.shape[-3]} heads do not match query's {query.shape[-3]} (pass enable_gqa=True for GQA)"
        )
    if query.shape[:-3] != key.shape[:-3] or key.shape[:-3] != value.shape[:-3]:
        raise ValueError(
            f"key, value: batch dims {tuple(key.shape[:-3])}, {tuple(value.shape[:-3])} do not match "
            f"query's {tuple(query.shape[:-3])}"
        )
    # The rest of the shape checks, here rather than in attention(), so that messages name this
    # function's arguments (query/key/value/attn_mask, not q/k/v/mask/bias).
    checks.same_kind("key", key, "query", query)
    checks.same_kind("value", value, "query", query)
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key: head dim {key.shape[-1]} does not match query's {query.shape[-1]}")
    if value.shape[-2] != key.shape[-2]:
        raise ValueError(f"value: length {value.shape[-2]} does not match key's {key.shape[-2]}")
    if query.ndim >= 3 and value.shape[-3] != key.shape[-3]:
        raise ValueError(f"value: {value.shape[-3]} heads do not match key's {key.shape[-3]}")
    if query.ndim >= 3 and query.shape[-3] % key.shape[-3] != 0:
        raise ValueError(
            f"key: expected a number of heads that divides query's {query.shape[-3]} (enable_gqa), "
            f"got {key.shape[-3]}"
        )
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"attn_mask: expected a torch.Tensor, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            raise TypeError(f"attn_mask: expected a bool or floating tensor, got {attn_mask.dtype}")
        full = (*query.shape[:-1], key.shape[-2])  # (..., Hq, Lq, Lk)
        if attn_mask.ndim > len(full) or any(
            s not in (1, f) for s, f in zip(reversed(attn_mask.shape), reversed(full))
        ):
            raise ValueError(f"attn_mask: shape {tuple(attn_mask.shape)} is not broadcastable to {full}")
        if attn_mask.device != query.device:
            raise ValueError(f"attn_mask: device {attn_mask.device} does not match query's {query.device}")
    # Bring everything to (B, H, L, E): add missing dims in front, fold extra batch dims together.
    lead = query.shape[:-3]
    Lq, Lk = query.shape[-2], key.shape[-2]

    def to4(x: Tensor) -> Tensor:
        x = x.reshape((1,) * max(0, 4 - x.ndim) + tuple(x.shape))
        return x.reshape(-1, *x.shape[-3:])  # (B, H, L, E)

    q4, k4, v4 = to4(query), to4(key), to4(value)
    mask_arg: Tensor | Mask | None = None
    bias_arg: Tensor | None = None
    if attn_mask is not None:
        m = attn_mask.expand(*lead, q4.shape[1], Lq, Lk) if len(lead) > 1 else attn_mask  # checked above
        m = m.reshape(-1, *m.shape[-3:]) if m.ndim > 4 else m  # (B, H, Lq, Lk)
        if attn_mask.dtype == torch.bool:
            mask_arg = m
        else:
            bias_arg = m
    if checks.flag("is_causal", is_causal):
        top_left = causal_mask(Lq, Lk, align="top_left")
        mask_arg = top_left if mask_arg is None else top_left & mask_arg
    out = attention(q4, k4, v4, mask=mask_arg, bias=bias_arg, scale=scale, dropout_p=dropout_p)
    assert isinstance(out, Tensor)
    return out.reshape(*query.shape[:-1], value.shape[-1])  # (..., Lq, Ev)
