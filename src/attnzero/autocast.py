"""What ``torch.autocast`` does to ``scaled_dot_product_attention``'s arguments, done once at the
entry of ``attention`` and of the drop-in: the tensors are cast as autocast casts torch's, and the
call then runs with autocast off, so that every backend computes in the dtypes it was given."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import ops


def is_causal_bias(x: Any) -> bool:
    """Whether ``x`` is torch's ``CausalBias`` (``torch.nn.attention.bias``, which exists once a
    ``CausalBias`` was made: importing it here would load torch._dynamo with attnzero)."""
    kind = type(x)
    return kind.__name__ == "CausalBias" and kind.__module__ == "torch.nn.attention.bias"


def cast(*xs: Any) -> list[Any]:
    """The arguments as autocast hands them to torch's ``scaled_dot_product_attention``, which
    ATen's autocast lists (``autocast_mode.cpp``) as ``lower_precision_fp`` on CPU and on CUDA:
    inside ``torch.autocast(device_type, dtype)``, every floating tensor on that device type
    except float64 is cast to ``dtype``; float64, bool masks and other devices' tensors stay as
    they are. Anything else (None, a wrong argument for the checks to name) passes through."""
    if not active():
        return list(xs)
    out = []
    for x in xs:
        castable = isinstance(x, Tensor) and not is_causal_bias(x) and x.is_floating_point()
        if castable and x.dtype != torch.float64:
            kind = x.device.type
            if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
                x = x.to(torch.get_autocast_dtype(kind))
        out.append(x)
    return out


def as_given(x: Any) -> contextlib.AbstractContextManager[None]:
    """Autocast off on ``x``'s device while attnzero computes: after ``cast``, every backend
    runs in the dtypes it was given (its float32 internals for 16-bit inputs are deliberate), so
    all backends give the same dtype and the same numbers."""
    if not active() or not isinstance(x, Tensor):
        return _UNCHANGED
    return ops.without_autocast(x.device)


# The context of a call outside autocast: one shared, reentrant nullcontext (a fresh one per call
# is a measurable part of a tiny call).
_UNCHANGED: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


# Whether autocast is on for any device type: one call, where asking per tensor and device costs
# several µs — most of a tiny call's budget (torch's private helper; where it is missing, assume yes).
active: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def on(device: torch.device) -> bool:
    """Whether autocast is on for ``device``'s type: its tensors may come in other floating dtypes than
    a module's weights (autocast casts them in each op, as it does for torch's modules)."""
    return active() and torch.is_autocast_enabled(device.type)


__all__ = ["active", "as_given", "cast", "is_causal_bias", "on"]
