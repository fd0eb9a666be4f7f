"""Keep-masks: ``True`` means *the query may attend to the key*.

One convention everywhere in attnzero (the seeds' ``masked_fill(mask == 0, -inf)`` reads the same
way): a non-zero / True entry keeps the pair, a zero / False entry blocks it.

Every builder here returns a :class:`Mask`: a small predicate ``keep(b, h, q_idx, kv_idx)`` plus the
shape ``(B, H, Lq, Lk)`` it describes (1 = the same for every batch / head). A Mask costs nothing
until it is evaluated, backends evaluate only the blocks they need, and ``print(mask)`` draws it::

    >>> print(causal(4, 6))                       # bottom-right: the last query sits at the last key
    causal (bottom-right) 4×6
    ■ ■ ■ · · ·
    ■ ■ ■ ■ · ·
    ■ ■ ■ ■ ■ ·
    ■ ■ ■ ■ ■ ■
    >>> print(causal(4, 6, align="top_left"))     # torch's is_causal: query i sees keys 0..i
    causal (top-left) 4×6
    ■ · · · · ·
    ■ ■ · · · ·
    ■ ■ ■ · · ·
    ■ ■ ■ ■ · ·

``mask.to_tensor()`` gives the dense bool tensor; ``and_`` / ``or_`` (or ``&`` / ``|``) combine
masks and plain tensors. ``alibi`` is the one float *bias* builder (pass it as ``bias=``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

from . import geometry

__all__ = [
    "Mask",
    "alibi",
    "and_",
    "causal",
    "document",
    "from_tensor",
    "or_",
    "padding",
    "to_string",
    "window",
]

# keep(b, h, q_idx, kv_idx) -> bool; the four index tensors broadcast against each other.
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
Shape4 = tuple[int, int, int, int]


class Mask:
    """A keep-mask described by a predicate over indices, of broadcastable shape (B, H, Lq, Lk)."""

    def __init__(self, keep: MaskMod, shape: Sequence[int], name: str = "mask") -> None:
        if len(shape) != 4:
            raise ValueError(f"shape: expected 4 sizes (B, H, Lq, Lk), got {tuple(shape)}")
        self.keep = keep
        self.shape: Shape4 = (int(shape[0]), int(shape[1]), int(shape[2]), int(shape[3]))
        self.name = name

    def block(
        self,
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """Evaluate query rows ``[r0, r1)`` × key columns ``[c0, c1)``: bool, broadcastable to
        (B, H, r1 - r0, c1 - c0). A dim of size 1 in ``self.shape`` broadcasts: it is evaluated at
        index 0 only, whatever the range asked for."""
        B, H, Lq, Lk = self.shape
        r0, r1 = rows if rows is not None and Lq > 1 else (0, Lq)
        c0, c1 = cols if cols is not None and Lk > 1 else (0, Lk)
        b = torch.arange(B, device=device).view(B, 1, 1, 1)
        h = torch.arange(H, device=device).view(1, H, 1, 1)
        q_idx = torch.arange(r0, r1, device=device).view(1, 1, -1, 1)  # (1, 1, r, 1)
        kv_idx = torch.arange(c0, c1, device=device).view(1, 1, 1, -1)  # (1, 1, 1, c)
        return self(b, h, q_idx, kv_idx)

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """The predicate at these indices (which broadcast against each other), as bool: whatever
        ``keep`` returns, non-zero = may attend. A dim of size 1 in ``self.shape`` broadcasts: it is
        read at index 0, whatever index is asked for (so masks of batch 1 and batch B combine)."""
        idx = [i if n > 1 else torch.zeros_like(i) for i, n in zip((b, h, q_idx, kv_idx), self.shape)]
        out = self.keep(idx[0], idx[1], idx[2], idx[3])
        out = out if isinstance(out, Tensor) else torch.as_tensor(out, device=kv_idx.device)
        return out if out.dtype == torch.bool else out != 0

    def to_tensor(self, device: torch.device | str | None = None) -> Tensor:
        """The dense bool keep-mask, shape exactly ``self.shape``."""
        return self.block(device=device).expand(self.shape).contiguous()

    def __and__(self, other: Mask | Tensor) -> Mask:
        return and_(self, other)

    def __or__(self, other: Mask | Tensor) -> Mask:
        return or_(self, other)

    def __invert__(self) -> Mask:
        return Mask(lambda b, h, q, kv: self(b, h, q, kv).logical_not(), self.shape, f"not {self.name}")

    def __repr__(self) -> str:
        return f"Mask({self.name}, shape={self.shape})"

    def __str__(self) -> str:
        return to_string(self)


# Lengths, windows and ids stay below this: index arithmetic on them (q + Lk - Lq, p - left) must
# not overflow torch's int64.
MAX_INT = 2**62


def _check_len(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if value > MAX_INT:
        raise ValueError(f"{name}: expected at most 2**62, got {value}")
    return value


def _ints(name: str, values: Tensor | Sequence[int], expected: str) -> Tensor:
    """``values`` as an integer tensor with entries within ±2**62, or a ValueError naming ``name``
    and what was ``expected``."""
    try:
        t = torch.as_tensor(values)
    except (OverflowError, RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"{name}: expected {expected} within ±2**62, got {values!r}") from e
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name}: expected {expected}, got {tuple(t.shape)} {t.dtype}")
    if t.numel() and bool((t.abs() > MAX_INT).any()):
        raise ValueError(f"{name}: expected {expected} within ±2**62, got {t.tolist()}")
    return t


def causal(
    q_len: int, kv_len: int | None = None, *, align: Literal["bottom_right", "top_left"] = "bottom_right"
) -> Mask:
    """Causal mask. ``bottom_right`` (attnzero's ``causal=True``): query ``i`` sits at position
    ``i + Lk - Lq`` and sees keys up to it — what a KV cache needs. ``top_left`` (torch's
    ``is_causal=True``): query ``i`` sees keys ``0..i``. Both are the usual lower triangle when
    ``Lq == Lk``."""
    Lq = _check_len("q_len", q_len)
    Lk = Lq if kv_len is None else _check_len("kv_len", kv_len)
    if align not in ("bottom_right", "top_left"):
        raise ValueError(f"align: expected 'bottom_right' or 'top_left', got {align!r}")
    placed = Lq if align == "bottom_right" else Lk  # top-left: placed as if Lq were Lk (offset 0)

    def keep(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return geometry.kept(q, kv, placed, Lk, True, None)

    return Mask(keep, (1, 1, Lq, Lk), f"causal ({align.replace('_', '-')})")


def window(q_len: int, kv_len: int | None = None, left: int | None = None, right: int | None = 0) -> Mask:
    """Sliding window, bottom-right aligned: query ``i`` at ``p = i + Lk - Lq`` sees key ``j`` iff
    ``p - left <= j <= p + right`` (``None`` = unbounded on that side). ``window(L, L, 2)``::

        ■ · · · ·
        ■ ■ · · ·
        ■ ■ ■ · ·
        · ■ ■ ■ ·
        · · ■ ■ ■
    """
    Lq = _check_len("q_len", q_len)
    Lk = Lq if kv_len is None else _check_len("kv_len", kv_len)
    for name, side in (("left", left), ("right", right)):
        if side is not None and (isinstance(side, bool) or not isinstance(side, int) or side < 0):
            raise ValueError(f"{name}: expected None or an int >= 0, got {side!r}")
        if side is not None and side > MAX_INT:
            raise ValueError(f"{name}: expected at most 2**62 (None = unbounded), got {side}")

    def keep(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        kept = geometry.kept(q, kv, Lq, Lk, False, (left, right))
        return kept if isinstance(kept, Tensor) else torch.ones((), dtype=torch.bool, device=kv.device)

    return Mask(keep, (1, 1, Lq, Lk), f"window (left={left}, right={right})")


def padding(lengths: Tensor | Sequence[int], kv_len: int | None = None) -> Mask:
    """Key padding from the true lengths of each sequence: key ``j`` of batch ``b`` is kept iff
    ``j < lengths[b]``. Shape (B, 1, 1, kv_len), kv_len defaulting to ``max(lengths)``."""
    lens = _ints("lengths", lengths, "a 1-D sequence of ints")
    if lens.ndim != 1:
        raise ValueError(f"lengths: expected a 1-D sequence of ints, got {tuple(lens.shape)} {lens.dtype}")
    if len(lens) == 0 or bool((lens < 0).any()):
        raise ValueError(f"lengths: expected non-negative lengths for at least one sequence, got {lens.tolist()}")
    if kv_len is None and int(lens.max()) == 0:
        raise ValueError(f"lengths: expected a length > 0 somewhere (or kv_len given), got {lens.tolist()}")
    Lk = int(lens.max()) if kv_len is None else _check_len("kv_len", kv_len)
    if int(lens.max()) > Lk:
        raise ValueError(f"lengths: expected every length <= kv_len {Lk}, got {lens.tolist()}")

    def keep(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return kv < lens.to(kv.device)[b]

    return Mask(keep, (len(lens), 1, 1, Lk), "padding")


def document(ids: Tensor | Sequence[int], kv_ids: Tensor | Sequence[int] | None = None) -> Mask:
    """Packed sequences: query ``i`` sees key ``j`` iff both belong to the same document.
    ``ids`` is (L,) or (B, L) of document ids per token; ``kv_ids`` (default ``ids``) the keys'.
    Combine with ``causal`` for packed causal training. ``document([0, 0, 1, 1, 1])``::

        ■ ■ · · ·
        ■ ■ · · ·
        · · ■ ■ ■
        · · ■ ■ ■
        · · ■ ■ ■
    """
    q_ids = _ints("ids", ids, "(L,) or (B, L) integer ids")
    k_ids = q_ids if kv_ids is None else _ints("kv_ids", kv_ids, "(L,) or (B, L) integer ids")
    for name, t in (("ids", q_ids), ("kv_ids", k_ids)):
        if t.ndim not in (1, 2) or t.numel() == 0:
            raise ValueError(f"{name}: expected (L,) or (B, L) integer ids, got {tuple(t.shape)} {t.dtype}")
    q2, k2 = q_ids.reshape(-1, q_ids.shape[-1]), k_ids.reshape(-1, k_ids.shape[-1])  # (B, L)
    if q2.shape[0] != k2.shape[0] and 1 not in (q2.shape[0], k2.shape[0]):
        raise ValueError(f"kv_ids: batch {k2.shape[0]} does not match ids' {q2.shape[0]}")
    B = max(q2.shape[0], k2.shape[0])

    def keep(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        qi, ki = q2.to(q.device), k2.to(kv.device)
        bq = b if qi.shape[0] > 1 else torch.zeros_like(b)
        bk = b if ki.shape[0] > 1 else torch.zeros_like(b)
        return qi[bq, q] == ki[bk, kv]

    return Mask(keep, (B, 1, q2.shape[1], k2.shape[1]), "document")


def from_tensor(mask: Tensor, name: str = "tensor") -> Mask:
    """Wrap a dense keep-mask (any dtype, non-zero = keep) of up to 4 dims as a Mask."""
    if mask.ndim > 4:
        raise ValueError(f"mask: expected at most 4 dims (B, H, Lq, Lk), got {mask.ndim}")
    t = (mask if mask.dtype == torch.bool else mask != 0).reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))

    def keep(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        idx = [i if n > 1 else torch.zeros_like(i) for i, n in zip((b, h, q, kv), t.shape)]
        return t.to(kv.device)[idx[0], idx[1], idx[2], idx[3]]

    return Mask(keep, t.shape, name)


def _as_mask(m: Mask | Tensor) -> Mask:
    if isinstance(m, Mask):
        return m
    if isinstance(m, Tensor):
        return from_tensor(m)
    raise TypeError(f"mask: expected an attnzero Mask or a torch.Tensor, got {type(m).__name__}")


def _combine(masks: Sequence[Mask | Tensor], op: Callable[[Tensor, Tensor], Tensor], word: str) -> Mask:
    if not masks:
        raise ValueError(f"{word}_: expected at least one mask, got none")
    ms = [_as_mask(m) for m in masks]
    try:
        shape = torch.broadcast_shapes(*(m.shape for m in ms))
    except RuntimeError as e:
        shapes = ", ".join(str(m.shape) for m in ms)
        raise ValueError(f"{word}_: mask shapes {shapes} do not broadcast together") from e

    def keep(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        out = ms[0](b, h, q, kv)  # each mask reads its own broadcast dims at index 0
        for m in ms[1:]:
            out = op(out, m(b, h, q, kv))
        return out

    return Mask(keep, tuple(shape), f" {word} ".join(m.name for m in ms))


def and_(*masks: Mask | Tensor) -> Mask:
    """Keep a pair only where every mask keeps it."""
    return _combine(masks, torch.logical_and, "and")


def or_(*masks: Mask | Tensor) -> Mask:
    """Keep a pair where any mask keeps it."""
    return _combine(masks, torch.logical_or, "or")


def to_string(mask: Mask | Tensor, *, max_size: int = 64) -> str:
    """Draw a keep-mask as a grid: ``■`` = may attend, ``·`` = blocked (one grid per batch/head)."""
    m = _as_mask(mask)
    dense = m.to_tensor()
    B, H, Lq, Lk = dense.shape
    lines = [f"{m.name} {Lq}×{Lk}" + (f" (B={B}, H={H})" if B * H > 1 else "")]
    for b in range(B):
        for h in range(H):
            if B * H > 1:
                lines.append(f"[b={b}, h={h}]")
            for row in dense[b, h, :max_size, :max_size].tolist():
                lines.append(" ".join("■" if x else "·" for x in row) + (" …" if Lk > max_size else ""))
            if Lq > max_size:
                lines.append("⋮")
    return "\n".join(lines)


def alibi_slopes(num_heads: int) -> Tensor:
    """The ALiBi paper's head slopes: a geometric sequence starting at 2^(-8/n) for the nearest
    power of two n, with the odd-indexed slopes of 2n appended when num_heads is not a power of 2."""
    n = 2 ** math.floor(math.log2(num_heads))
    base = [2 ** (-8 * (i + 1) / n) for i in range(n)]
    extra = [2 ** (-8 * (i + 1) / (2 * n)) for i in range(0, 2 * n, 2)][: num_heads - n]
    return torch.tensor(base + extra, dtype=torch.float32)


def alibi(num_heads: int, q_len: int, kv_len: int | None = None) -> Tensor:
    """ALiBi float *bias* (pass as ``bias=``): ``-slope_h · |p - j|`` with ``p = i + Lk - Lq`` the
    bottom-right query position. Shape (1, num_heads, Lq, Lk), float32."""
    H = _check_len("num_heads", num_heads)
    Lq = _check_len("q_len", q_len)
    Lk = Lq if kv_len is None else _check_len("kv_len", kv_len)
    pos = torch.arange(Lq).view(-1, 1) + (Lk - Lq)  # (Lq, 1)
    dist = (pos - torch.arange(Lk).view(1, -1)).abs().to(torch.float32)  # (Lq, Lk)
    return (-alibi_slopes(H).view(1, H, 1, 1) * dist).contiguous()  # (1, H, Lq, Lk)


# ---------------------------------------------------------------------------------------------
# What backends use: the keep-mask of one block, from the normalised arguments of attention().


def block_of(t: Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> Tensor:
    """Rows ``[r0, r1)`` and columns ``[c0, c1)`` of a tensor broadcastable to (B, H, Lq, Lk);
    dims of size 1 stay size 1 (they broadcast)."""
    r = slice(*rows) if t.shape[-2] > 1 else slice(None)
    c = slice(*cols) if t.shape[-1] > 1 else slice(None)
    return t[..., r, c]


def keep_block(
    mask: Tensor | Mask | None,
    causal: bool,
    win: tuple[int | None, int | None] | None,
    q_len: int,
    kv_len: int,
    rows: tuple[int, int],
    cols: tuple[int, int],
    device: torch.device,
) -> Tensor | None:
    """The combined keep-mask (mask ∧ causal ∧ window) of one block, broadcastable to
    (B, H, r1 - r0, c1 - c0); ``None`` when nothing is blocked. Causal and window are bottom-right
    aligned (``geometry``): query ``i`` sits at position ``i + Lk - Lq``; a block that they keep
    whole (``geometry.FULL``) costs no position mask."""
    keep: Tensor | None = None
    by_position = geometry.band(causal, win) != (None, None)
    if by_position and geometry.classify(rows, cols, q_len, kv_len, causal, win) is not geometry.FULL:
        i = torch.arange(rows[0], rows[1], device=device).view(-1, 1)  # (r, 1)
        j = torch.arange(cols[0], cols[1], device=device).view(1, -1)  # (1, c)
        keep = geometry.kept(i, j, q_len, kv_len, causal, win)  # (r, c)
    if mask is not None:
        m = mask.block(rows, cols, device) if isinstance(mask, Mask) else block_of(mask, rows, cols)
        keep = m if keep is None else keep & m
    return keep
