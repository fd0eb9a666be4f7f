"""Argument checks for the public entry points.

Each check raises ``TypeError`` (wrong kind of thing, wrong dtype) or ``ValueError`` (wrong shape or
value) with a message that names the argument, what was expected and what was given. Checks never
modify anything, so a failed call leaves every tensor, module and cache as it was.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .masks import Mask

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def tensor(name: str, x: Any, ndim: int | None = None, layout: str = "") -> Tensor:
    """``x`` is a non-empty floating-point tensor (with ``ndim`` dims when given)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(
            f"{name}: expected {ndim} dims {layout}, got {x.ndim} dims of shape {tuple(x.shape)}".replace("  ", " ")
        )
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a floating dtype (float16, bfloat16, float32, float64), got {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty tensor, got shape {tuple(x.shape)}")
    return x


def same_kind(name: str, x: Tensor, ref_name: str, ref: Tensor) -> None:
    """``x`` has ``ref``'s dtype and device."""
    if x.dtype != ref.dtype:
        raise TypeError(f"{name}: dtype {x.dtype} does not match {ref_name}'s {ref.dtype}")
    if x.device != ref.device:
        raise ValueError(f"{name}: device {x.device} does not match {ref_name}'s {ref.device}")


def qkv(q: Any, k: Any, v: Any | None) -> tuple[int, int, int, int, int]:
    """q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv). Returns (B, Hq, Hkv, Lq, Lk)."""
    layout = "(B, H, L, D)"
    q = tensor("q", q, 4, layout)
    k = tensor("k", k, 4, layout)
    same_kind("k", k, "q", q)
    B, Hq, Lq, D = q.shape
    if k.shape[0] != B:
        raise ValueError(f"k: batch {k.shape[0]} does not match q's {B}")
    if k.shape[3] != D:
        raise ValueError(f"k: head dim {k.shape[3]} does not match q's {D}")
    Hkv, Lk = k.shape[1], k.shape[2]
    if Hq % Hkv != 0:
        raise ValueError(
            f"k: expected a number of key/value heads that divides q's {Hq} heads, got {Hkv}"
        )
    if v is not None:
        v = tensor("v", v, 4, layout)
        same_kind("v", v, "q", q)
        if v.shape[0] != B:
            raise ValueError(f"v: batch {v.shape[0]} does not match q's {B}")
        if v.shape[1] != Hkv:
            raise ValueError(f"v: {v.shape[1]} heads do not match k's {Hkv}")
        if v.shape[2] != Lk:
            raise ValueError(f"v: length {v.shape[2]} does not match k's {Lk}")
    return B, Hq, Hkv, Lq, Lk


def _broadcastable(name: str, shape: tuple[int, ...], full: tuple[int, int, int, int]) -> None:
    ok = len(shape) <= 4 and all(s in (1, f) for s, f in zip(reversed(shape), reversed(full)))
    if not ok:
        raise ValueError(
            f"{name}: shape {tuple(shape)} is not broadcastable to (B, Hq, Lq, Lk) = {full}"
        )


def mask(x: Any, full: tuple[int, int, int, int], device: torch.device) -> Tensor | Mask | None:
    """A keep-mask (True / non-zero = may attend): a tensor of any dtype or an ``az.masks.Mask``,
    broadcastable to ``full``. Tensors come back as 4-D bool."""
    if x is None:
        return None
    if isinstance(x, Mask):
        _broadcastable("mask", x.shape, full)
        return x
    if not isinstance(x, Tensor):
        raise TypeError(f"mask: expected a torch.Tensor or an attnzero Mask, got {type(x).__name__}")
    _broadcastable("mask", tuple(x.shape), full)
    if x.device != device:
        raise ValueError(f"mask: device {x.device} does not match q's {device}")
    keep = x if x.dtype == torch.bool else x != 0
    return keep.reshape((1,) * (4 - x.ndim) + tuple(x.shape))  # (B|1, H|1, Lq|1, Lk|1)


def bias(x: Any, full: tuple[int, int, int, int], device: torch.device) -> Tensor | None:
    """A float additive term broadcastable to ``full``; comes back 4-D."""
    if x is None:
        return None
    if not isinstance(x, Tensor):
        raise TypeError(f"bias: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"bias: expected a floating dtype (a keep-mask goes to mask=), got {x.dtype}"
        )
    _broadcastable("bias", tuple(x.shape), full)
    if x.device != device:
        raise ValueError(f"bias: device {x.device} does not match q's {device}")
    return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))  # (B|1, H|1, Lq|1, Lk|1)


def flag(name: str, x: Any) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name}: expected a bool, got {x!r}")
    return x


def window(x: Any) -> tuple[int | None, int | None] | None:
    """None, an int ``w`` (= (w, 0)), or (left, right) with each None or an int >= 0."""
    if x is None:
        return None
    pair = (x, 0) if isinstance(x, int) and not isinstance(x, bool) else x
    if not isinstance(pair, tuple | list) or len(pair) != 2:
        raise TypeError(f"window: expected None, an int or a (left, right) pair, got {x!r}")
    for side, w in zip(("left", "right"), pair):
        if w is not None and (isinstance(w, bool) or not isinstance(w, int)):
            raise TypeError(f"window: expected {side} to be None or an int, got {w!r}")
        if w is not None and w < 0:
            raise ValueError(f"window: expected {side} >= 0 (or None), got {w}")
    return (pair[0], pair[1])


def scale(x: Any, head_dim: int) -> float:
    """``None`` → 1/sqrt(D); otherwise a finite real number."""
    if x is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise TypeError(f"scale: expected None or a real number, got {x!r}")
    if not math.isfinite(x):
        raise ValueError(f"scale: expected a finite number, got {x}")
    return float(x)


def dropout_p(x: Any, name: str = "dropout_p") -> float:
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise TypeError(f"{name}: expected a float in [0, 1), got {x!r}")
    if not 0.0 <= x < 1.0:
        raise ValueError(f"{name}: expected a float in [0, 1), got {x}")
    return float(x)


def choice(name: str, x: Any, options: tuple[str, ...]) -> str:
    if x not in options:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, options))}, got {x!r}")
    return str(x)
