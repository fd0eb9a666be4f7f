"""Which attention probabilities dropout removes, as a pure function of a seed and the position.

Every backend must drop exactly the same entries in its forward and its backward, and a tiled
backend must be able to regenerate the entries of any block without storing an L×L mask. So the
keep/drop decision of entry (b, h, i, j) is a counter-based hash: ``hash(seed, counter)`` with
``counter = ((b·H + h)·Lq + i)·Lk + j``. The seed itself is drawn from torch's RNG once per call,
so ``torch.manual_seed`` makes dropout reproducible, and all backends drop the same entries. These
are not the entries torch's own scaled_dot_product_attention would drop (it has a random stream of
its own); the keep rate and the expected output are the same.

The hash is Chris Wellons' "lowbias32" integer mixer applied twice (low then high 32 bits of the
counter); it is written with 32-bit wrap-around so that a GPU kernel can compute the same bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
_I32_MIN = -(2**31)


def _int32(x: int) -> int:
    """The int32 with the bits of the uint32 ``x``."""
    return x - 2**32 if x >= 2**31 else x


def seed_tensor(device: torch.device) -> Tensor:
    """A seed from torch's RNG for ``device`` (so torch.manual_seed governs dropout), as a 0-d int64
    tensor: what a compiled graph draws, with no read-back in the traced code (``ops.py`` reads it)."""
    return torch.randint(0, 2**62, (), device=device)


def draw_seed(device: torch.device) -> int:
    """The seed of ``seed_tensor`` as an int: the same number from the same RNG state."""
    return int(seed_tensor(device).item())


def _mix32_(x: Tensor, tmp: Tensor) -> Tensor:
    """lowbias32 in place on an int32 tensor holding uint32 bits: int32 products wrap at 32 bits
    like uint32 ones, and each right shift is made logical by masking off the copied sign bits.
    ``tmp``: scratch of x's shape (the blocks are large: fresh temporaries would cost page faults)."""
    for shift, mult in ((16, 0x7FEB352D), (15, _int32(0x846CA68B)), (16, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        x ^= tmp.bitwise_and_((1 << (32 - shift)) - 1)  # x ^= x >>> shift
        if mult is not None:
            x *= mult
    return x


def _low32(x: Tensor) -> Tensor:
    """The low 32 bits of a non-negative int64 tensor, as int32."""
    lo = x & _M32
    return torch.where(lo >= 2**31, lo - 2**32, lo).to(torch.int32)


def keep_mask(
    seed: int | Tensor,
    p: float,
    shape: tuple[int, int, int, int],
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
    device: torch.device | None = None,
    batches: tuple[int, int] | None = None,
    heads: tuple[int, int] | None = None,
) -> Tensor:
    """Bool keep-mask (True = kept) for batches ``[b0, b1)`` × heads ``[h0, h1)`` × rows
    ``[r0, r1)`` × cols ``[c0, c1)`` of the full (B, H, Lq, Lk) probability tensor (default: all of
    each); each entry is kept with probability ``1 - p``. Shape (b1 - b0, h1 - h0, r1 - r0, c1 - c0).

    The counter of a row's columns is ``start + j``: its low 32 bits are computed in int32 (adding
    j wraps as uint32 does) and its high 32 bits are the row's own, unless the row crosses a
    multiple of 2^32 — then the high bits vary along it and the counters are formed in int64. A
    ``seed`` given as a 0-d int64 tensor (``seed_tensor``, drawn inside a compiled graph) is read
    by tensor ops only, and the counters are then always formed in int64 (no data-dependent test)."""
    B, H, Lq, Lk = shape
    b0, b1 = batches if batches is not None else (0, B)
    h0, h1 = heads if heads is not None else (0, H)
    r0, r1 = rows if rows is not None else (0, Lq)
    c0, c1 = cols if cols is not None else (0, Lk)
    bh = torch.arange(b0, b1, device=device).view(-1, 1) * H + torch.arange(h0, h1, device=device)  # (nb, nh)
    i = torch.arange(r0, r1, device=device).view(1, 1, -1, 1)
    start = (bh.view(b1 - b0, h1 - h0, 1, 1) * Lq + i) * Lk + c0  # counter of each row's first column: (nb, nh, r, 1)
    hi = start >> 32
    if c1 > c0 and (isinstance(seed, Tensor) or not torch.equal(hi, (start + (c1 - c0 - 1)) >> 32)):  # crosses 2^32
        counter = start + torch.arange(c1 - c0, device=device)  # (nb, nh, r, c) int64
        x, hi = _low32(counter), counter >> 32
    else:
        x = _low32(start) + torch.arange(c1 - c0, dtype=torch.int32, device=device)  # (nb, nh, r, c), wraps
    x ^= _low32(seed) if isinstance(seed, Tensor) else _int32(seed & _M32)
    tmp = torch.empty_like(x)
    _mix32_(x, tmp)
    x ^= _low32(hi ^ ((seed >> 32) & _M32))
    _mix32_(x, tmp)
    # keep iff x >= threshold as uint32: flipping the sign bit maps uint32 order onto int32 order
    threshold = min(round(p * 2.0**32), 2**32)
    if threshold == 2**32:  # p within 2^-33 of 1: nothing kept (2^31 as an int32 wraps to -2^31: all kept)
        return torch.zeros_like(x, dtype=torch.bool)
    x ^= _I32_MIN
    return x >= threshold + _I32_MIN
