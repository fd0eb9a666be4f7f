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
contents exactly as they were. The cache is made for inference (decoding under ``torch.no_grad()``
or ``torch.inference_mode()``), where each step writes into the same storage. It also works with
autograd: a step taken while gradients are recorded, the step after it, and any step while the
storage carries a graph write into a new copy of the storage instead (O(T) each) — an earlier
step's attention may have saved the views it was given for its backward, and each step's keys and
values stay as that attention saw them. Gradients reach every k and v appended while gradients were
recorded, as through ``torch.cat`` of them; ``reset`` starts again from storage without a graph.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import checks
from .persistent import outside_inference_mode


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
        with outside_inference_mode():  # (so that steps outside it may write in place)
            self.k: Tensor = torch.zeros(shape, dtype=dtype, device=device)
            self.v: Tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.dtype: torch.dtype = dtype
        self.device: torch.device = self.k.device
        self._len = 0
        self._recorded = False  # the storage was handed to a step that recorded gradients
        self._graph_from: int | None = None  # the first row appended with a gradient (None: no row)

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
        self.truncate(0)

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
        recording = torch.is_grad_enabled()
        if recording or self._recorded or self.k.requires_grad or self.v.requires_grad:
            # a step recording gradients (this one, or the one before) may have saved the views it
            # was given: writing into them would change what its backward reads (autograd raises
            # "modified by an inplace operation"), so the new rows go into a copy of the storage.
            # The copy keeps the graph of the rows already stored, whatever the mode, and cuts that
            # of the rows it overwrites (written in place, they would pass their gradient on to the
            # tokens once appended there); the new rows bring theirs only while gradients are recorded.
            if not recording and (k.requires_grad or v.requires_grad):  # (a forward-mode tangent is kept)
                k, v = k.detach(), v.detach()
            with outside_inference_mode(), torch.enable_grad():
                self.k = self.k.slice_scatter(k, dim=2, start=start, end=end)
                self.v = self.v.slice_scatter(v, dim=2, start=start, end=end)
            if k.requires_grad or v.requires_grad:
                self._graph_from = start if self._graph_from is None else self._graph_from
        else:
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v
        self._len = end
        self._recorded = recording
        return self.keys(), self.values()

    def _save(self, start: int, end: int) -> tuple[Any, ...]:
        """What an ``update`` of rows [start, end) may change, for ``_restore``: MultiHeadAttention
        puts it back when attention refuses the call that appended."""
        rows = (self.k[:, :, start:end].detach().clone(), self.v[:, :, start:end].detach().clone())
        return self.k, self.v, self._len, self._recorded, self._graph_from, rows

    def _restore(self, saved: tuple[Any, ...]) -> None:
        k, v, n, recorded, graph_from, (k_rows, v_rows) = saved
        if self.k is k:  # written in place: the rows put back
            with torch.no_grad():
                self.k[:, :, n : n + k_rows.shape[2]], self.v[:, :, n : n + v_rows.shape[2]] = k_rows, v_rows
        # (else a copy was made: the storage before it, untouched)
        self.k, self.v, self._len, self._recorded, self._graph_from = k, v, n, recorded, graph_from

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` tokens (0 <= length <= len(cache)): drop the rest, e.g. to
        undo a step or to rewind to a shared prompt. (Rewound to before every token appended with a
        gradient, the storage is then new, without a graph: a later step's backward does not run
        into the graphs of the dropped tokens, which their own backward may have freed. Rewound into
        such tokens, it keeps its graph, as a slice of ``torch.cat`` of them would.)"""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self._len:
            raise ValueError(f"length: expected an int in [0, {self._len}], got {length!r}")
        self._len = length
        if self._graph_from is not None and self._graph_from >= length:  # no kept row has a gradient
            self._graph_from = None
            if self.k.requires_grad or self.v.requires_grad:
                # the values as stored, in new storage (earlier steps saved views of the old)
                with outside_inference_mode():
                    self.k, self.v = self.k.detach().clone(), self.v.detach().clone()
                self._recorded = False

