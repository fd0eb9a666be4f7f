"""Tensors an object keeps from one call to the next (a KV cache's storage, a rotary table) are made
outside ``torch.inference_mode``: made inside it they are inference tensors, which a later call
outside it can neither write in place nor save for its backward."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def outside_inference_mode() -> contextlib.AbstractContextManager[Any]:
    """A context that leaves inference mode (grad mode then as before it was entered); elsewhere, and
    under torch.compile (which cannot trace the question), nothing changes."""
    inside = not torch.compiler.is_compiling() and torch.is_inference_mode_enabled()
    return torch.inference_mode(False) if inside else contextlib.nullcontext()
