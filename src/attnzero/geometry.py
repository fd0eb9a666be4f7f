"""Where causal and window let a query see keys: the one geometry every backend uses.

DESIGN.md's rule, bottom-right aligned: query ``i`` sits at key position ``p = i + (Lk - Lq)``
(``offset``); ``causal`` keeps key ``j`` iff ``j <= p``; ``window=(left, right)`` keeps it iff
``p - left <= j <= p + right``, a side of None being unbounded. Both together are one band of
``j - p`` (``band``: causal is the window's right side capped at 0).

Everything here is a pure function of ints, so the flash backend's block loop, the keep-masks of
``masks.py``, the Triton launch and the ring's per-step structure (``distributed.py``) all read the
same arithmetic. ``kept`` is the one predicate; it takes Python ints or (broadcasting) integer
tensors alike. For a block of query rows ``[r0, r1)``:

* ``key_range`` — the key columns ``[lo, hi)`` that some row of the block may see (empty: lo == hi);
* ``classify`` — a block of rows × key columns ``[c0, c1)`` is ``SKIP`` (no pair kept), ``FULL``
  (every pair kept: no masking needed) or ``PARTIAL``.

Only position matters here: a dense mask, a bias or dropout are data, and a backend applies them
inside whatever ``classify`` does not skip.
"""

from __future__ import annotations

import enum
from typing import Any

Window = tuple[int | None, int | None] | None
Band = tuple[int | None, int | None]  # (left, right) of j - p >= -left and j - p <= right; None = unbounded
Range = tuple[int, int]  # [start, stop)


class Kind(enum.Enum):
    """What causal / window leave of a block of (query rows × key columns)."""

    SKIP = "skip"  # no pair is kept: the block is not computed at all
    FULL = "full"  # every pair is kept: computed without masking
    PARTIAL = "partial"  # some pairs are kept: computed and masked by position


SKIP, FULL, PARTIAL = Kind.SKIP, Kind.FULL, Kind.PARTIAL


def offset(q_len: int, kv_len: int) -> int:
    """Bottom-right alignment: query ``i`` sits at key position ``i + offset`` (the last query at the
    last key)."""
    return kv_len - q_len


def band(causal: bool, window: Window) -> Band:
    """Causal and window as one ``(left, right)``: ``p - left <= j <= p + right``, None = unbounded.
    Causal is a right side of 0 (or the window's right side if that is smaller)."""
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def kept(i: Any, j: Any, q_len: Any, kv_len: Any, causal: bool, window: Window) -> Any:
    """Whether query ``i`` may see key ``j`` by position (ints → bool; integer tensors that
    broadcast against each other → a bool tensor). Lengths only place the query (``offset``): ints,
    or tensors that broadcast with ``i`` (a varlen row's per-sequence lengths)."""
    left, right = band(causal, window)
    p = i + offset(q_len, kv_len)
    ok: Any = True
    if left is not None:
        ok = (j >= p - left) & ok
    if right is not None:
        ok = (j <= p + right) & ok
    return ok


def key_range(rows: Range, q_len: int, kv_len: int, causal: bool, window: Window) -> Range:
    """The key columns ``[lo, hi)`` that some query row in ``rows = [r0, r1)`` may see, within
    ``[0, kv_len)``; ``lo == hi`` when none. The band moves one key per row, so the keys seen by a
    run of rows are one interval: from the first row's left edge to the last row's right edge."""
    r0, r1 = rows
    if r1 <= r0:
        return 0, 0
    left, right = band(causal, window)
    off = offset(q_len, kv_len)
    lo = 0 if left is None else max(0, r0 + off - left)
    hi = kv_len if right is None else min(kv_len, r1 - 1 + off + right + 1)
    if left is not None and right is not None and right < -left:  # an empty band sees nothing
        return 0, 0
    return (lo, hi) if lo < hi else (0, 0)


def classify(rows: Range, cols: Range, q_len: int, kv_len: int, causal: bool, window: Window) -> Kind:
    """``SKIP``, ``FULL`` or ``PARTIAL`` for query rows ``[r0, r1)`` × key columns ``[c0, c1)``.

    ``d = j - p`` takes every integer from ``c0 - p_last`` to ``c1 - 1 - p_first`` on the block,
    so the block is FULL when that interval lies inside the band, SKIP when it misses it (or the
    block is empty), else PARTIAL. Columns are taken as given (not clipped to ``kv_len``)."""
    (r0, r1), (c0, c1) = rows, cols
    if r1 <= r0 or c1 <= c0:
        return SKIP
    left, right = band(causal, window)
    off = offset(q_len, kv_len)
    d_min, d_max = c0 - (r1 - 1 + off), (c1 - 1) - (r0 + off)
    lo = None if left is None else -left
    if (lo is not None and d_max < lo) or (right is not None and d_min > right) or (
        lo is not None and right is not None and right < lo
    ):
        return SKIP
    if (lo is None or d_min >= lo) and (right is None or d_max <= right):
        return FULL
    return PARTIAL


__all__ = [
    "FULL", "PARTIAL", "SKIP", "Band", "Kind", "Range", "Window", "band", "classify", "kept", "key_range", "offset",
]  # fmt: skip
