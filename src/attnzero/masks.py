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

Block structure. A builder also says what it knows of where its mask keeps pairs, so that backends
skip whole blocks and pay no masking on blocks kept whole, without evaluating the predicate there:

* a ``band`` — an interval of ``d = j − i`` outside which nothing is kept (causal in either
  alignment, window). ``attention`` joins it to its ``causal`` / ``window`` arguments, so a causal
  ``Mask`` costs what ``causal=True`` costs;
* ``Segments`` — ids per query and per key: a pair is kept only if the ids are equal (documents,
  padding). With sorted ids a block of rows sees one interval of keys (``key_range``) and a block
  is skipped, kept whole or partial by its first and last ids (``classify``);
* ``exact`` — whether the mask *is* its band and segments (then a block they keep whole needs no
  predicate at all), or only lies inside them (``from_tensor``, ``or_``, a custom predicate);
* a ``BlockTable`` (``blocks.py``) — skip / partial / full per (batch, head, query block, key
  block), what ``from_mod`` computes from a FlexAttention ``mask_mod`` once per block.

The mask_mod itself (``Mask.mod``, a ``ModSource``): ``from_mod`` and ``attnzero.flex``'s BlockMask
keep the function their predicate calls, so that a backend that can run it itself — the Triton
kernels, on code generated from it (``kernels/codegen.py``) — need not materialise the mask. Masks
derived from one (``and_`` / ``or_``, ``~``) have none: their predicate is another function.

``and_`` intersects bands and joins segments (pairs of ids relabelled as one id); ``or_`` keeps the
hull of the bands only. Where a part has a table, the combination keeps its parts and answers from
them: for ``and_`` a block is SKIP if any part skips it and FULL if every part keeps it whole; for
``or_`` FULL if any part keeps it whole and SKIP if every part skips it.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from . import blocks, geometry, mods

__all__ = [
    "Mask",
    "ModSource",
    "alibi",
    "and_",
    "causal",
    "document",
    "from_mod",
    "from_tensor",
    "or_",
    "padding",
    "to_string",
    "window",
]

# keep(b, h, q_idx, kv_idx) -> bool; the four index tensors broadcast against each other.
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
Shape4 = tuple[int, int, int, int]


Band = tuple[int | None, int | None]  # (lo, hi): pairs with lo <= j - i <= hi; None = unbounded
Range = tuple[int, int]  # [start, stop)
# The key range of a mask that does not know its key length (a dim of size 1 broadcasts)
_ALL = 2**62


class Segments:
    """Ids per query and per key: pair (b, i, j) is kept only where ``q_ids[b, i] == k_ids[b, j]``
    (index 0 on a dim of size 1). ``q_ids`` (B|1, Lq|1), ``k_ids`` (B|1, Lk|1), int64 on the CPU,
    with their rows as Python lists for the block questions below (a few list reads per block)."""

    def __init__(self, q_ids: Tensor, k_ids: Tensor, shape: Shape4) -> None:
        self.q_ids = q_ids.to("cpu", torch.int64)  # (B|1, Lq|1)
        self.k_ids = k_ids.to("cpu", torch.int64)  # (B|1, Lk|1)
        self.shape = shape  # of the mask: (B|1, H|1, Lq|1, Lk|1)
        self._q: list[list[int]] = self.q_ids.tolist()
        self._k: list[list[int]] = self.k_ids.tolist()
        # key_range and classify read only the first and last id of a run: they need sorted ids
        self.sorted = all(all(a <= b for a, b in itertools.pairwise(r)) for r in (*self._q, *self._k))

    def _span(self, ids: list[list[int]], b: int, span: Range) -> tuple[int, int]:
        """The smallest and largest id of positions ``[s0, s1)`` of batch ``b`` (sorted ids)."""
        row = ids[b if len(ids) > 1 else 0]
        if len(row) == 1:
            return row[0], row[0]
        return row[span[0]], row[span[1] - 1]

    def key_range(self, batches: Range, rows: Range) -> Range:
        """Keys ``[lo, hi)`` outside which no row of ``rows`` of any batch of ``batches`` sees one."""
        if not self.sorted:
            return 0, _ALL
        lo, hi = _ALL, 0
        for b in range(batches[0], batches[1]):
            qa, qz = self._span(self._q, b, rows)
            krow = self._k[b if len(self._k) > 1 else 0]
            if len(krow) == 1:  # one id for every key
                a, z = (0, _ALL) if qa <= krow[0] <= qz else (0, 0)
            else:
                a, z = bisect.bisect_left(krow, qa), bisect.bisect_right(krow, qz)
            if a < z:
                lo, hi = min(lo, a), max(hi, z)
        return (lo, hi) if lo < hi else (0, 0)

    def classify(self, batches: Range, rows: Range, cols: Range) -> geometry.Kind:
        """SKIP when no pair of the block has equal ids (in any batch of ``batches``), FULL when all
        have, else PARTIAL."""
        if not self.sorted:
            return geometry.PARTIAL
        kinds = set()
        for b in range(batches[0], batches[1]):
            qa, qz = self._span(self._q, b, rows)
            ka, kz = self._span(self._k, b, cols)
            if qz < ka or kz < qa:
                kinds.add(geometry.SKIP)
            elif qa == qz == ka == kz:
                kinds.add(geometry.FULL)
            else:
                return geometry.PARTIAL
        return kinds.pop() if len(kinds) == 1 else geometry.PARTIAL

    def ranges(self, block_m: int, B: int, q_len: int | None = None) -> Tensor:
        """Per batch and block of ``block_m`` query rows, the keys ``[lo, hi)`` they may see:
        int32 (B, n_row_blocks, 2) on the CPU (``hi`` capped at the keys' length when known)."""
        Lq = self.shape[2] if q_len is None else q_len
        Lk = self.shape[3] if self.shape[3] > 1 else _ALL
        n = -(-Lq // block_m)
        out = torch.zeros(B, n, 2, dtype=torch.int64)
        for b in range(B):
            bb = b if len(self._q) > 1 or len(self._k) > 1 else 0
            for i in range(n):
                rows = (i * block_m, min(Lq, (i + 1) * block_m))
                if self.shape[2] == 1:
                    rows = (0, 1)
                lo, hi = self.key_range((bb, bb + 1), rows)
                out[b, i, 0], out[b, i, 1] = lo, min(hi, Lk)
        return out.clamp_(max=2**31 - 1).to(torch.int32)

    def keep(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        """The predicate (a ``MaskMod``)."""
        qi, ki = self.q_ids.to(q.device), self.k_ids.to(kv.device)
        bq = b if qi.shape[0] > 1 else torch.zeros_like(b)
        bk = b if ki.shape[0] > 1 else torch.zeros_like(b)
        iq = q if qi.shape[1] > 1 else torch.zeros_like(q)
        ik = kv if ki.shape[1] > 1 else torch.zeros_like(kv)
        return qi[bq, iq] == ki[bk, ik]


def _band_window(band: Band, q_len: int, kv_len: int) -> tuple[int | None, int | None]:
    """A band of ``d = j − i`` as geometry's window around ``p = i + Lk − Lq`` (sides may be < 0)."""
    lo, hi = band
    off = geometry.offset(q_len, kv_len)
    return (None if lo is None else off - lo), (None if hi is None else hi - off)


@dataclass(frozen=True)
class ModSource:
    """The mask_mod a ``Mask``'s predicate is, for a backend that runs it itself: at indices
    ``(b, h, q_idx, kv_idx)`` — index 0 on the Mask's dims of size 1, as ``Mask.__call__`` reads
    them — the predicate is ``mask_mod(b, h, q_idx, kv_idx)`` alone (``from_mod``: its block table
    was computed from the mod, so it says nothing the mod does not), or with ``gated`` the Mask's
    block table first (torch's BlockMask: SKIP blocks blocked and FULL blocks kept whole whatever
    the mod says there, the mod on PARTIAL blocks only; ``mask_mod`` None: True on them)."""

    mask_mod: mods.MaskMod | None
    gated: bool = False


class Mask:
    """A keep-mask described by a predicate over indices, of broadcastable shape (B, H, Lq, Lk).

    ``band``, ``segments`` and ``exact`` describe its block structure (module docstring); a mask
    made from a bare predicate has none, and backends then evaluate it on every block. ``mod``
    (a ``ModSource``): the mask_mod the predicate is (``from_mod``, a BlockMask), or None."""

    def __init__(
        self,
        keep: MaskMod,
        shape: Sequence[int],
        name: str = "mask",
        *,
        band: Band | None = None,
        segments: Segments | None = None,
        exact: bool = False,
        table: blocks.BlockTable | None = None,
        parts: tuple[str, list[Mask]] | None = None,
        mod: ModSource | None = None,
    ) -> None:
        if len(shape) != 4 or any(isinstance(n, int) and n < 0 for n in shape):
            raise ValueError(f"shape: expected 4 sizes (B, H, Lq, Lk), none negative, got {tuple(shape)}")
        self.keep = keep
        self.shape: Shape4 = tuple(n if isinstance(n, torch.SymInt) else int(n) for n in shape)  # type: ignore[assignment]
        self.name = name
        self.band = band  # pairs kept only where lo <= j - i <= hi
        self._segments = segments  # pairs kept only where the ids are equal
        self.exact = exact and (band is not None or segments is not None)  # kept = band ∧ segments
        self.table = table  # skip / partial / full per block, exact (``blocks.BlockTable``)
        self.parts = parts  # ("and" | "or", masks): a combination that answers from its parts
        if mod is not None and mod.gated and table is None:
            raise ValueError("mod: a gated ModSource needs the block table that gates it")
        self.mod = mod  # the mask_mod the predicate is (see ModSource), or None
        self._recipe: tuple[Any, ...] | None = None  # how a builder made it (_made): what pickle stores
        # the tensors its predicate reads (a ``from_tensor`` mask's, ids, lengths; a combination's
        # parts'): a backward that evaluates it again checks they did not change (``version_of``)
        self.tensors: tuple[Tensor, ...] = ()
        # the mask_mods its predicate calls on partial blocks (a from_mod's; a combination's parts'):
        # what they read is known only by walking them again (``mods.fingerprint``), which a cache of
        # what the Mask derives does at each call
        self.mods: tuple[Callable[..., Any], ...] = ()

    # -- block structure (see the module docstring)

    @property
    def segments(self) -> Segments | None:
        """The segments when the mask is exactly "equal ids" (no band, nothing else), else None:
        what a kernel can evaluate from two id vectors instead of a dense mask."""
        return self._segments if self.exact and self.band is None else None

    def at(self, q_len: int, kv_len: int) -> Mask:
        """This mask as used for Lq × Lk scores: a band is only meaningful at the lengths it was made
        for (a dim of size 1 broadcasts index 0), so it is dropped otherwise."""
        if self.band is None or self.shape[2:] == (q_len, kv_len):
            return self
        return _reading(Mask(
            self.keep, self.shape, self.name, segments=self._segments, table=self.table, parts=self.parts, mod=self.mod
        ), self)  # (the same predicate: the same mod, the same tensors)

    def without_band(self) -> Mask | None:
        """What is left once the band is enforced elsewhere (``attention`` joins it to ``causal`` /
        ``window``): None for a pure band, the segments alone for band ∧ segments, else itself."""
        if self.band is None or not self.exact:
            return self
        seg = self._segments
        if seg is None:
            return None
        return _reading(Mask(seg.keep, self.shape, self.name, segments=seg, exact=True), self)

    def key_range(self, batches: Range, rows: Range) -> Range:
        """Keys ``[lo, hi)`` outside which no pair of query rows ``rows`` (in any batch of
        ``batches``, any head) is kept; ``lo == hi`` when none is. Intersect it with the actual
        key length: a mask broadcast along the keys answers up to 2**62."""
        Lq, Lk = self.shape[2], self.shape[3]
        lo, hi = 0, (Lk if Lk > 1 else _ALL)
        if self.band is not None:  # (a dim of size 1 broadcasts its index 0)
            lo, hi = geometry.key_range(rows if Lq > 1 else (0, 1), Lq, Lk, False, _band_window(self.band, Lq, Lk))
        if self._segments is not None and lo < hi:
            a, z = self._segments.key_range(batches, rows)
            lo, hi = max(lo, a), min(hi, z)
        if self.table is not None and lo < hi:
            a, z = self.table.key_range(batches, rows if Lq > 1 else (0, 1))
            lo, hi = max(lo, a), min(hi, z)
        if self.parts is not None and lo < hi:
            ranges = [m.key_range(batches, rows) for m in self.parts[1]]
            ranges = [(a, z) for a, z in ranges if a < z]
            if self.parts[0] == "and":  # inside every part's range
                a, z = (
                    (max(r[0] for r in ranges), min(r[1] for r in ranges))
                    if len(ranges) == len(self.parts[1])
                    else (0, 0)
                )
            else:  # inside the hull of the parts' ranges
                a, z = (min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else (0, 0)
            lo, hi = max(lo, a), min(hi, z)
        if Lk == 1 and lo < hi:  # key 0 kept: every key is (a dim of size 1 broadcasts)
            return 0, _ALL
        return (lo, hi) if lo < hi else (0, 0)

    def classify(self, batches: Range, rows: Range, cols: Range) -> geometry.Kind:
        """SKIP (no pair of the block is kept, for any of ``batches``, any head), FULL (every pair is:
        no mask to evaluate) or PARTIAL (evaluate ``block``)."""
        Lq, Lk = self.shape[2], self.shape[3]
        if self.table is not None or self.parts is not None:  # exact answers, before the rest
            known = self._classify_parts(batches, rows, cols)
            if known is not geometry.PARTIAL:
                return known
        kinds = []
        if self.band is not None:  # (a dim of size 1 broadcasts its index 0)
            r, c = rows if Lq > 1 else (0, 1), cols if Lk > 1 else (0, 1)
            kinds.append(geometry.classify(r, c, Lq, Lk, False, _band_window(self.band, Lq, Lk)))
        if self._segments is not None:
            kinds.append(self._segments.classify(batches, rows, cols))
        if geometry.SKIP in kinds:
            return geometry.SKIP
        if self.exact and kinds and all(k is geometry.FULL for k in kinds):
            return geometry.FULL
        return geometry.PARTIAL

    def _classify_parts(self, batches: Range, rows: Range, cols: Range) -> geometry.Kind:
        """What the table, or the parts of a combination, say of a block (each answer exact)."""
        if self.table is not None:
            Lq, Lk = self.shape[2], self.shape[3]
            return self.table.classify(batches, rows if Lq > 1 else (0, 1), cols if Lk > 1 else (0, 1))
        assert self.parts is not None
        word, ms = self.parts
        kinds = [m.classify(batches, rows, cols) for m in ms]
        if word == "and":
            if geometry.SKIP in kinds:
                return geometry.SKIP
            return geometry.FULL if all(k is geometry.FULL for k in kinds) else geometry.PARTIAL
        if geometry.FULL in kinds:
            return geometry.FULL
        return geometry.SKIP if all(k is geometry.SKIP for k in kinds) else geometry.PARTIAL

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

    def __rand__(self, other: Tensor) -> Mask:  # tensor & mask (a tensor does not know a Mask)
        return and_(other, self)

    def __ror__(self, other: Tensor) -> Mask:  # tensor | mask
        return or_(other, self)

    def __invert__(self) -> Mask:  # (no structure: the complement of a band is not a band)
        name = f"not {_grouped(self.name, 'not')}"
        out = Mask(lambda b, h, q, kv: self(b, h, q, kv).logical_not(), self.shape, name)
        return _made(_reading(out, self), operator.invert, self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save``, a DataLoader worker's batch) as the builder call that made it —
        its predicate is a local function, which pickle cannot store — and rebuilt by that call. A
        Mask made otherwise (``Mask(keep, ...)`` directly) is pickled as any object (``copy.deepcopy``
        works either way)."""
        if self._recipe is None:
            return super().__reduce_ex__(protocol)
        return self._recipe

    def __repr__(self) -> str:
        return f"Mask({self.name}, shape={self.shape})"

    def __str__(self) -> str:
        return to_string(self)


def _reading(mask: Mask, *sources: Mask) -> Mask:
    """``mask``, reading the tensors of ``sources`` (``Mask.tensors``) and calling their mask_mods
    (``Mask.mods``)."""
    mask.tensors = tuple(t for m in sources for t in m.tensors)
    mask.mods = tuple(f for m in sources for f in m.mods)
    return mask


def version_of(mask: Tensor | Mask | None) -> list[tuple[Tensor, int]]:
    """``(tensor, its version)`` for each tensor a keep-mask reads — a dense one; a Mask's
    ``tensors`` — which a backward evaluates again: ``unchanged`` then refuses one changed in place
    since the forward (its gradients would be another mask's). Inference tensors keep no version."""
    ts = (mask,) if isinstance(mask, Tensor) else () if mask is None else mask.tensors
    return [(t, t._version) for t in ts if not t.is_inference()]


def unchanged(seen: list[tuple[Tensor, int]]) -> None:
    """Raises, as autograd does for a saved tensor, when a tensor of ``version_of`` changed in place."""
    for t, was in seen:
        if t._version != was:
            raise RuntimeError(
                f"mask: changed in place between the forward and the backward (version {t._version}, expected "
                f"{was}): the gradients would be another mask's; change it after the backward, or pass a copy. "
                "(torch: one of the variables needed for gradient computation has been modified by an inplace "
                "operation)"
            )


# Elements of tensors a cache copies to tell later whether they changed (``copies`` and
# ``equal_values``); above it the cached thing is made again each call.
COMPARED_MAX = 1 << 22


def copies(ts: Sequence[Tensor]) -> list[Tensor]:
    """What ``equal_values`` compares with later."""
    return [t.detach().clone() for t in ts]


def equal_values(copied: Sequence[Tensor], now: Sequence[Tensor]) -> bool:
    """Whether ``now`` holds what ``copied`` (``copies``, made earlier) held: a write through
    ``.data`` or numpy changes no version, so caches compare values."""
    return len(copied) == len(now) and all(
        c.shape == t.shape and c.dtype == t.dtype and torch.equal(_bits(c), _bits(t.detach()))
        for c, t in zip(copied, now)
    )


def _bits(t: Tensor) -> Tensor:
    """A float tensor's bits as integers, so that ``torch.equal`` compares bits (−0.0 is then not 0.0,
    and a NaN equals itself); any other tensor as it is."""
    return t.view(_INTS[t.element_size()]) if t.dtype.is_floating_point else t


_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}  # by element size


def _made(mask: Mask, builder: Callable[..., Any], *args: Any, **kwargs: Any) -> Mask:
    """``mask``, noting that ``builder(*args, **kwargs)`` makes it (``Mask.__reduce_ex__``)."""
    mask._recipe = (_rebuild, (builder, args, kwargs))
    return mask


def _rebuild(builder: Callable[..., Mask], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Mask:
    return builder(*args, **kwargs)


# Lengths, windows and ids stay below this: index arithmetic on them (q + Lk - Lq, p - left) must
# not overflow torch's int64.
MAX_INT = 2**62


def _check_len(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | torch.SymInt) or value < 1:  # (SymInt: export's sizes)
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
    if t.numel() and bool((t.to(torch.int64).abs() > MAX_INT).any()):  # int64: 2**62 wraps in narrower ints
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

    band = (None, geometry.offset(placed, Lk))  # j - i <= Lk - Lq (bottom-right) or 0 (top-left)
    made = Mask(keep, (1, 1, Lq, Lk), f"causal ({align.replace('_', '-')})", band=band, exact=True)
    return _made(made, causal, Lq, Lk, align=align)


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

    off = geometry.offset(Lq, Lk)
    band = (None if left is None else off - left, None if right is None else off + right)
    if band == (None, None):  # unbounded both ways: keeps everything, no band to skip by
        return _made(Mask(keep, (1, 1, Lq, Lk), f"window (left={left}, right={right})"), window, Lq, Lk, left, right)
    made = Mask(keep, (1, 1, Lq, Lk), f"window (left={left}, right={right})", band=band, exact=True)
    return _made(made, window, Lq, Lk, left, right)


def padding(lengths: Tensor | Sequence[int], kv_len: int | None = None) -> Mask:
    """Key padding from the true lengths of each sequence: key ``j`` of batch ``b`` is kept iff
    ``j < lengths[b]``. Shape (B, 1, 1, kv_len), kv_len defaulting to ``max(lengths)``.

    The lengths are read (checked, and turned into the blocks a backend skips), so under
    ``torch.compile`` the call runs eagerly: one graph break, and new lengths do not recompile.
    Under ``torch.export`` nothing can be read: the mask is the comparison itself, computed in the
    exported program (``_exported_padding``: dense, no blocks skipped), and a tensor of lengths
    needs ``kv_len``."""
    if torch.compiler.is_exporting():
        return _exported_padding(lengths, kv_len)
    return _padding(lengths, kv_len)


@torch.compiler.disable  # (see padding's docstring)
def _padding(lengths: Tensor | Sequence[int], kv_len: int | None) -> Mask:
    lens = _ints("lengths", lengths, "a 1-D sequence of ints").clone()  # the mask as made (its blocks are)
    if lens.ndim != 1:
        raise ValueError(f"lengths: expected a 1-D sequence of ints, got {tuple(lens.shape)} {lens.dtype}")
    Lk = _key_length(lens.tolist(), kv_len)

    def keep(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return kv < lens.to(kv.device)[b]

    # as segments: every query has id 0, a real key 0 and a padding key 1 (sorted ids)
    k_ids = (torch.arange(Lk).view(1, Lk) >= lens.to("cpu", torch.int64).view(-1, 1)).long()  # (B, Lk)
    shape = (len(lens), 1, 1, Lk)
    segments = Segments(torch.zeros(len(lens), 1, dtype=torch.int64), k_ids, shape)
    made = Mask(keep, shape, "padding", segments=segments, exact=True)
    made.tensors = (lens,)
    return _made(made, padding, lens, Lk)


def _key_length(lengths: list[int], kv_len: int | None) -> int:
    """padding's key length (``kv_len``, else the longest of ``lengths``), the lengths checked."""
    if not lengths or min(lengths) < 0:
        raise ValueError(f"lengths: expected non-negative lengths for at least one sequence, got {lengths}")
    if kv_len is None and max(lengths) == 0:
        raise ValueError(f"lengths: expected a length > 0 somewhere (or kv_len given), got {lengths}")
    Lk = max(lengths) if kv_len is None else _check_len("kv_len", kv_len)
    if max(lengths) > Lk:
        raise ValueError(f"lengths: expected every length <= kv_len {Lk}, got {lengths}")
    return Lk


def _cu_lengths(name: str, cu: list[int]) -> list[int]:
    """The N sequence lengths of cumulative lengths ``cu`` (N + 1,): 0, ..., T, checked."""
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)) or cu[-1] < 1:
        raise ValueError(
            f"{name}: expected (N + 1,) non-decreasing ints starting at 0 and ending at the packed length > 0, got {cu}"
        )
    return [b - a for a, b in itertools.pairwise(cu)]


def _ids_from_cu(name: str, cu: Tensor | Sequence[int]) -> Tensor:
    """(T,) document index of each token from cumulative lengths ``cu`` (N + 1,): 0, ..., T."""
    c = _ints(name, cu, "(N + 1,) cumulative sequence lengths")
    values = c.tolist()  # (a list of lists for 2 dims, refused as it is; a 0-d one is one value)
    lengths = torch.tensor(_cu_lengths(name, values if isinstance(values, list) else [values]), dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # (T,)


def document(
    ids: Tensor | Sequence[int] | None = None,
    kv_ids: Tensor | Sequence[int] | None = None,
    *,
    cu_seqlens: Tensor | Sequence[int] | None = None,
    cu_seqlens_kv: Tensor | Sequence[int] | None = None,
) -> Mask:
    """Packed sequences: query ``i`` sees key ``j`` iff both belong to the same document.
    ``ids`` is (L,) or (B, L) of document ids per token; ``kv_ids`` (default ``ids``) the keys'.
    Or, as FlashAttention's varlen layout writes it, ``cu_seqlens`` (N + 1,) cumulative lengths
    (``[0, L₀, L₀ + L₁, ...]``; ``cu_seqlens_kv`` for the keys, default the same). Combine with
    ``causal`` for packed causal training. ``document([0, 0, 1, 1, 1])``, or
    ``document(cu_seqlens=[0, 2, 5])``::

        ■ ■ · · ·
        ■ ■ · · ·
        · · ■ ■ ■
        · · ■ ■ ■
        · · ■ ■ ■

    Sorted ids (documents back to back) let backends skip every block between two documents.
    Under ``torch.compile`` the call runs eagerly, and under ``torch.export`` it is the comparison of
    ids computed in the program, as :func:`padding` (there ``cu_seqlens`` must be Python ints).
    """
    if cu_seqlens is not None or cu_seqlens_kv is not None:
        if ids is not None or kv_ids is not None:
            raise ValueError("cu_seqlens: expected either ids or cu_seqlens, got both")
        if cu_seqlens is None:
            raise ValueError("cu_seqlens: expected the queries' cumulative lengths too when cu_seqlens_kv is given")
    elif ids is None:
        raise ValueError("ids: expected (L,) or (B, L) integer ids (or cu_seqlens), got None")
    build = _exported_document if torch.compiler.is_exporting() else _document
    return build(ids, kv_ids, cu_seqlens, cu_seqlens_kv)


def _id_rows(q_ids: Tensor, k_ids: Tensor) -> tuple[Tensor, Tensor]:
    """The queries' and keys' ids as (B, L) rows, checked: (L,) or (B, L), not empty, batches equal
    or one of them 1."""
    for name, t in (("ids", q_ids), ("kv_ids", k_ids)):
        if t.ndim not in (1, 2) or t.numel() == 0:
            raise ValueError(f"{name}: expected (L,) or (B, L) integer ids, got {tuple(t.shape)} {t.dtype}")
    q2, k2 = q_ids.reshape(-1, q_ids.shape[-1]), k_ids.reshape(-1, k_ids.shape[-1])  # (B, L)
    if q2.shape[0] != k2.shape[0] and 1 not in (q2.shape[0], k2.shape[0]):
        raise ValueError(f"kv_ids: batch {k2.shape[0]} does not match ids' {q2.shape[0]}")
    return q2, k2


@torch.compiler.disable  # (as padding: the ids are read)
def _document(
    ids: Any, kv_ids: Any, cu_seqlens: Tensor | Sequence[int] | None, cu_seqlens_kv: Tensor | Sequence[int] | None
) -> Mask:
    if cu_seqlens is not None:
        ids = _ids_from_cu("cu_seqlens", cu_seqlens)
        kv_ids = None if cu_seqlens_kv is None else _ids_from_cu("cu_seqlens_kv", cu_seqlens_kv)
    q_ids = _ints("ids", ids, "(L,) or (B, L) integer ids").clone()  # the mask as made: its segments are
    k_ids = q_ids if kv_ids is None else _ints("kv_ids", kv_ids, "(L,) or (B, L) integer ids").clone()
    q2, k2 = _id_rows(q_ids, k_ids)
    B = max(q2.shape[0], k2.shape[0])

    def keep(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        qi, ki = q2.to(q.device), k2.to(kv.device)
        bq = b if qi.shape[0] > 1 else torch.zeros_like(b)
        bk = b if ki.shape[0] > 1 else torch.zeros_like(b)
        return qi[bq, q] == ki[bk, kv]

    shape = (B, 1, q2.shape[1], k2.shape[1])
    made = Mask(keep, shape, "document", segments=Segments(q2, k2, shape), exact=True)
    made.tensors = (q2, k2)
    return _made(made, document, q2, k2)


# Under torch.export: a tensor's values cannot be read while the program is traced (there is no
# data, or reading one would fix it into the program), so padding and document become the dense
# comparison their predicate makes, computed in the program from the lengths or ids given; Python
# ints are still checked as in eager.


def _exported_ints(name: str, values: Tensor | Sequence[Any], dims: tuple[int, ...], expected: str) -> Tensor:
    """``values`` as an integer tensor of one of ``dims`` dims, checked without reading a tensor's data."""
    if isinstance(values, Tensor):
        t = values
    else:
        try:
            t = torch.tensor(values, dtype=torch.int64)  # Python ints: a constant of the program
        except (OverflowError, RuntimeError, TypeError, ValueError) as e:
            raise ValueError(f"{name}: expected {expected}, got {values!r}") from e
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool or t.ndim not in dims:
        raise ValueError(f"{name}: expected {expected}, got {tuple(t.shape)} {t.dtype}")
    return t


def _exported_padding(lengths: Tensor | Sequence[int], kv_len: int | None) -> Mask:
    lens = _exported_ints("lengths", lengths, (1,), "a 1-D sequence of ints")  # (B,)
    if isinstance(lengths, Tensor):
        if kv_len is None:
            raise ValueError(
                "kv_len: expected an int under torch.export (a tensor of lengths is not read while exporting), got None"
            )
        Lk = _check_len("kv_len", kv_len)
    else:
        Lk = _key_length([int(x) for x in lengths], kv_len)
    keep = torch.arange(Lk, device=lens.device).view(1, Lk) < lens.view(-1, 1)  # (B, Lk)
    return from_tensor(keep.view(-1, 1, 1, Lk), "padding")  # (B, 1, 1, Lk)


def _exported_cu_ids(name: str, cu: Tensor | Sequence[int]) -> Tensor:
    """(T,) document index of each token from Python cumulative lengths (a tensor's are refused)."""
    if isinstance(cu, Tensor):
        raise ValueError(
            f"{name}: expected Python ints under torch.export (the packed length a tensor holds is not read "
            "while exporting); give ids (L,) instead"
        )
    lengths = _cu_lengths(name, [int(x) for x in cu])
    return torch.tensor([d for d, n in enumerate(lengths) for _ in range(n)], dtype=torch.int64)


def _exported_document(
    ids: Any, kv_ids: Any, cu_seqlens: Tensor | Sequence[int] | None, cu_seqlens_kv: Tensor | Sequence[int] | None
) -> Mask:
    if cu_seqlens is not None:
        ids = _exported_cu_ids("cu_seqlens", cu_seqlens)
        kv_ids = None if cu_seqlens_kv is None else _exported_cu_ids("cu_seqlens_kv", cu_seqlens_kv)
    q_ids = _exported_ints("ids", ids, (1, 2), "(L,) or (B, L) integer ids")
    k_ids = q_ids if kv_ids is None else _exported_ints("kv_ids", kv_ids, (1, 2), "(L,) or (B, L) integer ids")
    q2, k2 = _id_rows(q_ids, k_ids)
    keep = q2.unsqueeze(2) == k2.to(q2.device).unsqueeze(1)  # (B, Lq, Lk), a batch of 1 broadcast
    return from_tensor(keep.unsqueeze(1), "document")  # (B, 1, Lq, Lk)


def from_tensor(mask: Tensor, name: str = "tensor") -> Mask:
    """Wrap a dense keep-mask (any dtype, non-zero = keep) of up to 4 dims as a Mask."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.ndim > 4:
        raise ValueError(f"mask: expected at most 4 dims (B, H, Lq, Lk), got {mask.ndim}")
    t = (mask if mask.dtype == torch.bool else mask != 0).reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))

    def keep(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        idx = [i if n > 1 else torch.zeros_like(i) for i, n in zip((b, h, q, kv), t.shape)]
        return t.to(kv.device)[idx[0], idx[1], idx[2], idx[3]]

    made = Mask(keep, t.shape, name)
    made.tensors = (t,)
    return _made(made, from_tensor, t, name)


def from_mod(
    mask_mod: mods.MaskMod,
    B: int,
    H: int,
    Lq: int,
    Lk: int,
    *,
    block_size: int | tuple[int, int] | None = None,
    device: torch.device | str | None = None,
) -> Mask:
    """A Mask from FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend),
    written for one pair and called as Flex calls it (``mods.py``). ``B`` or ``H`` of 1 broadcast
    (the mod is evaluated at index 0 only). The mod is evaluated once over every block of
    ``block_size`` query rows × keys (default 128 × 128; an int or a ``(rows, keys)`` pair), tile by
    tile, and each (batch, head, query block, key block) kept as skip / partial / full
    (``blocks.BlockTable``): memory is O(blocks + one tile), never a dense (B, H, Lq, Lk) tensor.
    Backends then skip the blocks it blocks and pay no masking on the blocks it keeps whole, at any
    block size of theirs. ``device``: where the mod runs (the device of the tensors it captures).
    The table is made here, once (as torch's ``create_block_mask``); the mod runs again on partial
    blocks at each call, reading what it reads then — after changing that (document ids of the next
    batch), make the mask again, or blocks the table skips or keeps whole keep their old kind.
    The Mask keeps the mod (``mask.mod``, a ``ModSource``): ``backend="triton"`` runs it in its
    kernels as generated code instead of materialising the mask (``kernels/triton_backend.py``).
    ``from_mod(lambda b, h, q, kv: (kv < 2) | (kv <= q), 1, 1, 4, 4)`` (prefix-LM)::

        ■ ■ · ·
        ■ ■ · ·
        ■ ■ ■ ·
        ■ ■ ■ ■
    """
    if mask_mod is None or not callable(mask_mod):
        raise TypeError(f"mask_mod: expected a function {mods.SIGNATURES['mask_mod']}, got {type(mask_mod).__name__}")
    sizes = tuple(_check_len(n, x) for n, x in (("B", B), ("H", H), ("Lq", Lq), ("Lk", Lk)))
    shape: Shape4 = (sizes[0], sizes[1], sizes[2], sizes[3])
    bs = 128 if block_size is None else block_size
    pair = (bs, bs) if isinstance(bs, int) else tuple(bs)
    if len(pair) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in pair):
        raise ValueError(
            f"block_size: expected None, a positive int or a (rows, keys) pair of them, got {block_size!r}"
        )
    dev = torch.device("cpu") if device is None else torch.device(device)
    user_mod = mask_mod  # (pickled by name: the copy below is not the function its module holds)
    mask_mod = mods.own_closure(mask_mod)  # the mask as made: a loop variable it reads stays as it is now
    table = blocks.evaluate(mask_mod, shape, (int(pair[0]), int(pair[1])), dev)

    def keep(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return table.keep(mask_mod, b, h, q, kv)  # the mod on partial blocks only

    name = f"from_mod({getattr(mask_mod, '__name__', type(mask_mod).__name__)})"
    made = Mask(keep, shape, name, table=table, mod=ModSource(mask_mod))
    made.mods = (mask_mod,)
    return _made(made, from_mod, user_mod, *shape, block_size=block_size, device=device)


def _as_mask(m: Mask | Tensor) -> Mask:
    if isinstance(m, Mask):
        return m
    if isinstance(m, Tensor):
        return from_tensor(m)
    raise TypeError(f"mask: expected an attnzero Mask or a torch.Tensor, got {type(m).__name__}")


def _combine(masks: Sequence[Mask | Tensor], op: Callable[[Tensor, Tensor], Tensor], word: str) -> Mask:
    ms = [_as_mask(m) for m in masks]
    return _reading(_combined(ms, op, word), *ms)


def _combined(ms: list[Mask], op: Callable[[Tensor, Tensor], Tensor], word: str) -> Mask:
    if not ms:
        raise ValueError(f"{word}_: expected at least one mask, got none")
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

    full: Shape4 = (shape[0], shape[1], shape[2], shape[3])
    parts = [m.at(full[2], full[3]) for m in ms]  # a band broadcast along a length says nothing there
    name = f" {word} ".join(_grouped(m.name, word) for m in ms)
    bands = [m.band for m in parts]
    if any(m.table is not None or m.parts is not None for m in parts):
        return _combine_blocks(keep, full, name, parts, word)
    if word == "and":  # kept where every mask keeps: bands intersect, segments join
        band = _intersect([b for b in bands if b is not None])
        segs = [m._segments for m in parts if m._segments is not None]
        exact = all(m.exact for m in parts)
        return Mask(keep, full, name, band=band, segments=_join(segs, full), exact=exact)
    # kept where any mask keeps: inside the hull of the bands, if every mask has one
    hull = None
    if all(b is not None for b in bands):
        los, his = [b[0] for b in bands if b is not None], [b[1] for b in bands if b is not None]
        hull = (None if None in los else min(x for x in los if x is not None),
                None if None in his else max(x for x in his if x is not None))  # fmt: skip
    return Mask(keep, full, name, band=hull if hull != (None, None) else None)


def _combine_blocks(keep: MaskMod, shape: Shape4, name: str, parts: list[Mask], word: str) -> Mask:
    """A combination with a block table in a part: one table when every part is a table of the same
    blocks, else the parts kept, each answering for itself (``Mask._classify_parts``). An ``and``
    keeps the band of its parts (``attention`` joins it to causal / window)."""
    tables = [m.table for m in parts]
    if all(t is not None for t in tables) and all(m.shape == shape for m in parts):
        table = tables[0]
        for t in tables[1:]:
            assert table is not None and t is not None
            table = table.combine(t, word)
            if table is None:
                break
        if table is not None:
            return Mask(keep, shape, name, table=table)
    band = _intersect([m.band for m in parts if m.band is not None]) if word == "and" else None
    return Mask(keep, shape, name, band=band, parts=(word, parts))


def _intersect(bands: list[Band]) -> Band | None:
    """The band of pairs inside every band (None: no band at all)."""
    if not bands:
        return None
    los = [b[0] for b in bands if b[0] is not None]
    his = [b[1] for b in bands if b[1] is not None]
    return (max(los) if los else None), (min(his) if his else None)


def _join(segs: list[Segments], shape: Shape4) -> Segments | None:
    """Segments whose ids are equal exactly where every one of ``segs`` has equal ids: each position's
    tuple of ids relabelled as one id (sorted tuples stay sorted)."""
    if len(segs) <= 1:
        return segs[0] if segs else None
    B, _, Lq, Lk = shape
    n = len(segs)
    q = torch.stack([s.q_ids.expand(B, Lq) for s in segs], -1)  # (B, Lq, n): a position's ids, one per segments
    k = torch.stack([s.k_ids.expand(B, Lk) for s in segs], -1)  # (B, Lk, n)
    _, labels = torch.unique(torch.cat([q.reshape(-1, n), k.reshape(-1, n)]), dim=0, return_inverse=True)
    return Segments(labels[: B * Lq].view(B, Lq), labels[B * Lq :].view(B, Lk), shape)


def _grouped(name: str, word: str) -> str:
    """A part's name inside a combination by ``word`` ("and", "or", "not"), bracketed where the part
    is itself a combination of another kind: ``(causal or window) and padding`` and ``causal or
    (window and padding)`` are different masks, and so are ``not (causal and window)`` and ``not
    causal and window`` ("not" binding first, then "and", then "or")."""
    combined = " and " in name or " or " in name or name.startswith("not ")
    other = {"and": " or ", "or": " and "}.get(word)
    alike = other is not None and other not in name and not name.startswith("not ")  # a ∧ b ∧ c: no brackets
    return f"({name})" if combined and not alike else name


def and_(*masks: Mask | Tensor) -> Mask:
    """Keep a pair only where every mask keeps it."""
    return _made(_combine(masks, torch.logical_and, "and"), and_, *masks)


def or_(*masks: Mask | Tensor) -> Mask:
    """Keep a pair where any mask keeps it."""
    return _made(_combine(masks, torch.logical_or, "or"), or_, *masks)


def to_string(mask: Mask | Tensor, *, max_size: int = 64) -> str:
    """Draw a keep-mask as a grid: ``■`` = may attend, ``·`` = blocked (one grid per batch/head)."""
    _check_len("max_size", max_size)
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
    _check_len("num_heads", num_heads)
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


def block_of(
    t: Tensor, rows: tuple[int, int], cols: tuple[int, int], batches: tuple[int, int] | None = None
) -> Tensor:
    """Rows ``[r0, r1)`` and columns ``[c0, c1)`` — and of a 4-D tensor batches ``[b0, b1)``, if
    given — of a tensor broadcastable to (B, H, Lq, Lk), a view; dims of size 1 stay size 1 (they
    broadcast). A tensor of fewer than 2 dims (a predicate's 0-d answer) broadcasts as it is."""
    if t.ndim < 2:
        return t
    r = slice(*rows) if t.shape[-2] > 1 else slice(None)
    c = slice(*cols) if t.shape[-1] > 1 else slice(None)
    t = t[..., r, c]
    return t[batches[0] : batches[1]] if batches is not None and t.ndim == 4 and t.shape[0] > 1 else t


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
