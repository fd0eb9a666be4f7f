"""Rotary position embedding (RoPE, Su et al. 2021, "RoFormer").

Each pair of channels of a query or key at position ``p`` is rotated by the angle ``p · θ_i`` with
``θ_i = base^(-2i / D)``, i = 0 .. D/2 - 1. A rotation keeps the norm, and the product of a query
rotated by ``p·θ`` with a key rotated by ``s·θ`` depends on ``p - s`` only: the score sees the
relative position and nothing else.

Two ways of pairing the D channels are in use:

* half-split (Llama, GPT-NeoX; the default): channel ``i`` pairs with ``i + D/2``::

      out = x · cos + rotate_half(x) · sin,   rotate_half([x1, x2]) = [-x2, x1]

  with ``cos = [cos(pθ), cos(pθ)]`` (the D/2 angles written twice);
* interleaved (GPT-J, the RoFormer paper; ``interleaved=True``): channel ``2i`` pairs with
  ``2i + 1``::

      out[2i]   = x[2i] · cos(pθ_i) - x[2i+1] · sin(pθ_i)
      out[2i+1] = x[2i] · sin(pθ_i) + x[2i+1] · cos(pθ_i)

The cos/sin table is built in float64, kept in float32 (float64 for float64 inputs), grown when a
larger position is asked for, and the rotation runs in that precision; the output has x's dtype.
A few positions far past the table (beyond 65536 and sixteen times their number) take their own
angles instead, the same values, so that ``forward`` builds no table of millions of positions for a
handful (``rotate_from``, a decoder's, still holds every position up to its last).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from . import checks
from .persistent import outside_inference_mode


class RotaryEmbedding(nn.Module):
    """``rot(x, positions)``: rotate ``x (..., L, head_dim)`` by the positions ``(L,)``.

    Args:
        head_dim: D, the last dim of the queries/keys to rotate; even.
        base: θ_i = base^(-2i/D). 10000 in RoFormer, Llama 1/2, GPT-NeoX.
        interleaved: False = half-split pairs (i, i + D/2) as Llama/GPT-NeoX and transformers'
            ``apply_rotary_pos_emb``; True = adjacent pairs (2i, 2i+1) as GPT-J.

    The module has no parameters and no state in its ``state_dict``: the cos/sin table is a cache
    (rebuilt for another device, grown for larger positions), so ``module.half()`` cannot lower its
    precision.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, *, interleaved: bool = False) -> None:
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"head_dim: expected a positive even int, got {head_dim!r}")
        if isinstance(base, bool) or not isinstance(base, int | float) or not math.isfinite(base) or base <= 1:
            raise ValueError(f"base: expected a finite number > 1, got {base!r}")
        self.head_dim = head_dim
        self.base = float(base)
        self.interleaved = checks.flag("interleaved", interleaved)
        # The table: angles[p, i] = p · θ_i for p < len, as (cos, sin) of shape (len, D/2), float64.
        self._cos64: Tensor | None = None
        self._sin64: Tensor | None = None
        self._cast: dict[torch.dtype, tuple[Tensor, Tensor]] = {}

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}, interleaved={self.interleaved}"

    def inv_freq(self, device: torch.device | str | None = None) -> Tensor:
        """θ_i = base^(-2i/D), i = 0 .. D/2 - 1, float64 (D/2,)."""
        i = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device)
        return 1.0 / (self.base ** (i / self.head_dim))

    def cos_sin(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin of ``p · θ_i`` for positions p = 0 .. length-1: two (length, D/2) tensors in
        ``dtype`` (float32 or float64) on ``device``. Built once and grown by doubling."""
        cos64 = self._cos64
        with outside_inference_mode(), torch.no_grad():  # (the table outlives the call)
            if not self._covers(length, device):
                size = max(length, 2 * cos64.shape[0] if cos64 is not None and cos64.device == device else 256)
                p = torch.arange(size, dtype=torch.float64, device=device)
                angles = torch.outer(p, self.inv_freq(device))  # (size, D/2)
                self._cos64, self._sin64 = angles.cos(), angles.sin()
                self._cast = {}
            assert self._cos64 is not None and self._sin64 is not None
            if dtype not in self._cast:
                self._cast[dtype] = (self._cos64.to(dtype), self._sin64.to(dtype))
        cos, sin = self._cast[dtype]
        return cos[:length], sin[:length]

    def _covers(self, length: int, device: torch.device) -> bool:
        """Whether the table holds positions 0 .. length-1 on ``device``."""
        return self._cos64 is not None and self._cos64.device == device and self._cos64.shape[0] >= length

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate ``x (..., L, head_dim)`` by integer ``positions (L,)`` (>= 0, on x's device).
        Returns a new tensor of x's shape and dtype."""
        checks.tensor("x", x)
        if x.ndim < 2 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x: expected shape (..., L, {self.head_dim}), got {tuple(x.shape)}")
        _check_positions(positions, x)
        if positions.numel() == 0:
            return x.clone()
        lo, hi = (int(t) for t in torch.aminmax(positions))
        if lo < 0:
            raise ValueError(f"positions: expected integers >= 0, got a minimum of {lo}")
        if not self._covers(hi + 1, x.device) and hi >= max(65536, 16 * positions.numel()):
            # few positions far out: their own angles (the same float64 products and cos / sin as
            # the table's), not a table of every position below them (10⁷ at D = 128: 10 GB)
            angles = positions.to(torch.float64)[:, None] * self.inv_freq(x.device)  # (L, D/2)
            dtype = _table_dtype(x.dtype)
            return self._rotate(x, angles.cos().to(dtype), angles.sin().to(dtype))
        cos, sin = self.cos_sin(hi + 1, x.device, _table_dtype(x.dtype))
        rows = positions.long()  # (torch reads a uint8 index as a boolean mask, and refuses int8 / int16)
        return self._rotate(x, cos[rows], sin[rows])

    def rotate_from(self, x: Tensor, start: int) -> Tensor:
        """``rot(x, arange(start, start + L))`` without a device sync: what a decoder with a KV
        cache of ``start`` tokens needs. Inputs are trusted (the module validated them)."""
        L = x.shape[-2]
        cos, sin = self.cos_sin(start + L, x.device, _table_dtype(x.dtype))
        return self._rotate(x, cos[start:], sin[start:])

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x (..., L, D) rotated by angles whose cos/sin are (L, D/2), in the table's dtype."""
        xf = x.to(cos.dtype)
        if self.interleaved:
            pairs = xf.unflatten(-1, (-1, 2))  # (..., L, D/2, 2): channels (2i, 2i+1)
            even, odd = pairs[..., 0], pairs[..., 1]  # (..., L, D/2) each
            out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)  # (..., L, D/2, 2)
            return out.flatten(-2).to(x.dtype)  # (..., L, D)
        half = self.head_dim // 2
        x1, x2 = xf[..., :half], xf[..., half:]  # (..., L, D/2) each: channel i pairs with i + D/2
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (..., L, D)
        return out.to(x.dtype)


def _table_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_positions(positions: Any, x: Tensor) -> None:
    if not isinstance(positions, Tensor):
        raise TypeError(f"positions: expected an integer torch.Tensor (L,), got {type(positions).__name__}")
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise TypeError(f"positions: expected an integer dtype, got {positions.dtype}")
    if positions.ndim != 1 or positions.shape[0] != x.shape[-2]:
        raise ValueError(f"positions: expected shape (L,) = ({x.shape[-2]},), got {tuple(positions.shape)}")
    if positions.device != x.device:
        raise ValueError(f"positions: device {positions.device} does not match x's {x.device}")


def resolve(rope: Any, head_dim: int) -> RotaryEmbedding | None:
    """A module's ``rope=`` argument: False/None → no rotary, True → ``RotaryEmbedding(head_dim)``,
    or a ``RotaryEmbedding`` whose head_dim must be ``head_dim``."""
    if rope is None or rope is False:
        return None
    if rope is True:
        if head_dim % 2:
            raise ValueError(f"rope: expected an even head dim (d_model // num_heads) to rotate pairs, got {head_dim}")
        return RotaryEmbedding(head_dim)
    if not isinstance(rope, RotaryEmbedding):
        raise TypeError(f"rope: expected a bool or an attnzero RotaryEmbedding, got {type(rope).__name__}")
    if rope.head_dim != head_dim:
        raise ValueError(f"rope: head_dim {rope.head_dim} does not match the module's head dim {head_dim}")
    return rope
