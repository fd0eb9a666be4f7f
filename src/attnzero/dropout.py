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


def seed_tensor(device: torch.device) -> Tensor:
    """A seed from torch's RNG for ``device`` (so torch.manual_seed governs dropout), as a 0-d int64
    tensor: what a compiled graph draws, with no read-back in the traced code (``ops.py`` reads it)."""
    return torch.randint(0, 2**62, (), device=device)


def draw_seed(device: torch.device) -> int:
    """The seed of ``seed_tensor`` as an int: the same number from the same RNG state."""
    return int(seed_tensor(device).item())


def _mix32(x: Tensor) -> Tensor:
    # x holds uint32 values in int64; every product is masked back to 32 bits.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def keep_mask(
    seed: int,
    p: float,
    shape: tuple[int, int, int, int],
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Bool keep-mask (True = kept) for rows ``[r0, r1)`` × cols ``[c0, c1)`` of the full
    (B, H, Lq, Lk) probability tensor; each entry is kept with probability ``1 - p``."""
    B, H, Lq, Lk = shape
    r0, r1 = rows if rows is not None else (0, Lq)
    c0, c1 = cols if cols is not None else (0, Lk)
    bh = torch.arange(B * H, device=device, dtype=torch.int64).view(B, H, 1, 1)
    i = torch.arange(r0, r1, device=device, dtype=torch.int64).view(1, 1, -1, 1)
    j = torch.arange(c0, c1, device=device, dtype=torch.int64).view(1, 1, 1, -1)
    counter = (bh * Lq + i) * Lk + j  # (B, H, r, c)
    x = _mix32((counter & _M32) ^ (seed & _M32))
    x = _mix32(x ^ (counter >> 32) ^ ((seed >> 32) & _M32))
    threshold = min(round(p * 2.0**32), 2**32)
    return x >= threshold
