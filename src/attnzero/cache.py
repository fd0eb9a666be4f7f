"""A preallocated key/value cache for autoregressive decoding.

Letters: B batch, Hkv key/value heads, T ``max_len`` (capacity), D head dim, L new tokens, n tokens
stored (``len(cache)``).

A decoder computes the keys and values of each token once. The cache keeps them in two tensors of
fixed size (B, Hkv, T, D) allocated up front, so a decode step writes L new rows and reads the
first n rows, with no reallocation and no concatenation::

    cache = az.KVCache(B, max_len=T, num_kv_heads=Hkv, head_dim=D)
    k_all, v_all = cache.update(k_new, v_new)   # k_new (B, Hkv, L, D) → k_all (B, Hkv, n + L, D)
    out = az.attention(q_new, k_all, v_all, causal=True)   # bottom-right: the last query sees all

Every argument is checked before anything is written: a call that raises leaves the length and the
contents exactly as they were. The cache is made for inference (decoding under ``torch.no_grad()``),
where each step writes into the same storage. It also works with autograd: while gradients are
recorded, a step writes into a new copy of the storage instead (each step's keys and values stay as
its attention saw them, and gradients reach every k and v given), at the cost of that copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import checks


class KVCache:
    """Keys and values of the tokens seen so far, in preallocated (B, Hkv, max_len, D) storage.

    Args:
        batch_size: B. max_len: T, the most tokens it can hold. num_kv_heads: Hkv. head_dim: D.
        dtype: a floating dtype (the dtype of the keys and values it will store; default: torch's
            default dtype, ``torch.get_default_dtype()``).
        device: where the storage lives (default: torch's default device).

    Attributes:
        k, v: the storage, (B, Hkv, T, D); only ``[:, :, :len(cache)]`` holds tokens.
        batch_size, max_len, num_kv_heads, head_dim, dtype, device: as given.

    ``len(cache)`` is the number of tokens stored, which is also the position of the next token.
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        for name, val in (
            ("batch_size", batch_size), ("max_len", max_len), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)
        ):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name}: expected a positive int, got {val!r}")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in checks.FLOAT_DTYPES:
            raise TypeError(f"dtype: expected a floating dtype (float16, bfloat16, float32, float64), got {dtype!r}")
        self.batch_size = batch_size
        self.max_len = max_len
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (batch_size, num_kv_heads, max_len, head_dim)  # (B, Hkv, T, D)
        self.k: Tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.v: Tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.dtype: torch.dtype = dtype
        self.device: torch.device = self.k.device
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return (
            f"KVCache(len={self._len}, max_len={self.max_len}, batch_size={self.batch_size}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, device={self.device})"
        )

    @property
    def remaining(self) -> int:
        """How many more tokens fit."""
        return self.max_len - self._len

    def reset(self) -> None:
        """Forget every token (length 0). The storage is kept, not cleared: rows past the length are
        never read."""
        self._len = 0

    def keys(self) -> Tensor:
        """The stored keys, a view (B, Hkv, n, D)."""
        return self.k[:, :, : self._len]

    def values(self) -> Tensor:
        """The stored values, a view (B, Hkv, n, D)."""
        return self.v[:, :, : self._len]

    def check(self, k: Any, v: Any) -> None:
        """Raise ``TypeError``/``ValueError`` if ``update(k, v)`` would fail; change nothing."""
        for name, x in (("k", k), ("v", v)):
            checks.tensor(name, x, 4, "(B, Hkv, L, D)", empty_ok=True)
            expected = (self.batch_size, self.num_kv_heads, x.shape[2], self.head_dim)
            for what, axis in (("batch", 0), ("heads", 1), ("head dim", 3)):
                if x.shape[axis] != expected[axis]:
                    raise ValueError(
                        f"{name}: expected {what} {expected[axis]} (the cache's), got {x.shape[axis]} "
                        f"in shape {tuple(x.shape)}"
                    )
            if x.dtype != self.dtype:
                raise TypeError(f"{name}: expected dtype {self.dtype} (the cache's), got {x.dtype}")
            if x.device != self.device:
                raise ValueError(f"{name}: expected device {self.device} (the cache's), got {x.device}")
        if v.shape[2] != k.shape[2]:
            raise ValueError(f"v: expected length {k.shape[2]} (k's), got {v.shape[2]}")
        self.check_room(k.shape[2])

    def check_room(self, n_new: int) -> None:
        """Raise ``ValueError`` if ``n_new`` more tokens do not fit."""
        if self._len + n_new > self.max_len:
            raise ValueError(
                f"cache: {n_new} new tokens do not fit: it holds {self._len} of max_len "
                f"{self.max_len} ({self.remaining} free)"
            )

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k, v (B, Hkv, L, D)`` and return every stored key and value, views
        ``(B, Hkv, n + L, D)`` of the storage (valid until the next ``update`` or ``reset``).

        Everything is checked first (shape against the cache, dtype, device, room): on error,
        nothing is written and the length is unchanged.
        """
        self.check(k, v)
        start, end = self._len, self._len + k.shape[2]
        if self._tracked(k, v):
            # autograd saved the views an earlier step returned: writing into them would make its
            # backward fail ("modified by an inplace operation"), so the new rows go into a copy of
            # the storage (O(T) per step, only while gradients are being recorded)
            self.k = self.k.slice_scatter(k, dim=2, start=start, end=end)
            self.v = self.v.slice_scatter(v, dim=2, start=start, end=end)
        else:
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v
        self._len = end
        return self.keys(), self.values()

    def _tracked(self, k: Tensor, v: Tensor) -> bool:
        """Whether autograd records this update: the storage holds rows with a gradient, or the new
        rows have one and gradients are being recorded."""
        new_grad = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
        return new_grad or self.k.requires_grad or self.v.requires_grad

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` tokens (0 <= length <= len(cache)): drop the rest, e.g. to
        undo a step or to rewind to a shared prompt."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self._len:
            raise ValueError(f"length: expected an int in [0, {self._len}], got {length!r}")
        self._len = length
