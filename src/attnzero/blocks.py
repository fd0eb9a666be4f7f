"""A block table: what a mask keeps of each (query block, key block), per batch and head.

``kinds`` (B|1, H|1, nQ, nK) holds ``SKIP`` (no pair kept), ``PARTIAL`` (some) or ``FULL`` (all) for
blocks of ``bq`` query rows × ``bk`` key columns (the last block of each axis may be shorter). A dim
of size 1 broadcasts. It is what ``masks.from_mod`` computes from a ``mask_mod`` (once per block,
chunked: never a dense (B, H, Lq, Lk) tensor) and what ``attnzero.flex`` reads from torch's own
``BlockMask``; a ``Mask`` that carries one answers the backends' block questions from it:

* ``classify(batches, rows, cols)`` for *any* rows × cols, also not aligned to the table's blocks
  (a backend with other block sizes): the table blocks they touch are all SKIP → SKIP, all FULL →
  FULL, else PARTIAL — each table block's kind holds for every part of it;
* ``key_range(batches, rows)`` — from the first to the last key block that any of those rows keeps;
* ``keep(mask_mod, b, h, q_idx, kv_idx)`` — the Mask's predicate made exact by the table: False on
  SKIP blocks, True on FULL ones, the mask_mod on PARTIAL ones only, which is all it is evaluated
  on (a BlockMask's unlisted blocks are blocked even where its mask_mod would keep a pair).

Every answer is over the batches asked for and every head, as the backends ask today (their chunks
hold several heads); ``heads=`` narrows it to some query heads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from . import geometry, mods

Range = tuple[int, int]  # [start, stop)
SKIP, PARTIAL, FULL = 0, 1, 2  # the int8 codes in ``kinds``
_KIND = {SKIP: geometry.SKIP, PARTIAL: geometry.PARTIAL, FULL: geometry.FULL}
_CHUNK = 1 << 22  # mask_mod evaluations per chunk of ``evaluate`` (4 Mi pairs: a few MB)


class BlockTable:
    """Skip / partial / full per (batch, head, query block, key block); see the module docstring."""

    def __init__(self, kinds: Tensor, block: tuple[int, int], lengths: tuple[int, int]) -> None:
        if kinds.ndim != 4:
            raise ValueError(f"kinds: expected (B, H, nQ, nK), got {tuple(kinds.shape)}")
        self.kinds = kinds.to("cpu", torch.int8)  # (B|1, H|1, nQ, nK)
        self.bq, self.bk = block
        self.Lq, self.Lk = lengths
        nq, nk = -(-self.Lq // self.bq), -(-self.Lk // self.bk)
        if tuple(kinds.shape[2:]) != (nq, nk):
            raise ValueError(f"kinds: expected {nq} × {nk} blocks for lengths {lengths} and blocks {block}, "
                             f"got {tuple(kinds.shape[2:])}")  # fmt: skip
        # over every head: the smallest and largest kind of a block (all SKIP ⇔ max SKIP, ...)
        self._min = self.kinds.amin(dim=1)  # (B|1, nQ, nK)
        self._max = self.kinds.amax(dim=1)  # (B|1, nQ, nK)
        seen = self._max > SKIP  # (B|1, nQ, nK): some head keeps a pair of the block
        idx = torch.arange(nk).view(1, 1, nk)
        self._first = torch.where(seen, idx, nk).amin(dim=-1)  # (B|1, nQ): first key block kept, nk if none
        self._last = torch.where(seen, idx + 1, 0).amax(dim=-1)  # (B|1, nQ): one past the last, 0 if none
        self._cache: dict[tuple[object, ...], object] = {}

    @property
    def shape(self) -> tuple[int, int, int, int]:
        B, H = self.kinds.shape[:2]
        return int(B), int(H), self.Lq, self.Lk

    def _b(self, batches: Range) -> slice:
        return slice(0, 1) if self.kinds.shape[0] == 1 else slice(*batches)

    def _blocks(self, span: Range, size: int, length: int) -> slice:
        a, z = max(0, span[0]), min(length, span[1])
        return slice(a // size, -(-z // size)) if a < z else slice(0, 0)

    def classify(self, batches: Range, rows: Range, cols: Range, heads: Range | None = None) -> geometry.Kind:
        """SKIP / FULL / PARTIAL for query rows ``[r0, r1)`` × key columns ``[c0, c1)`` of every batch
        in ``batches`` and every head (or the query heads ``heads``)."""
        key = ("c", batches, rows, cols, heads)
        got = self._cache.get(key)
        if got is None:
            qs, ks = self._blocks(rows, self.bq, self.Lq), self._blocks(cols, self.bk, self.Lk)
            if heads is None:
                lo_t, hi_t = self._min[self._b(batches), qs, ks], self._max[self._b(batches), qs, ks]
            else:
                hs = slice(0, 1) if self.kinds.shape[1] == 1 else slice(*heads)
                lo_t = hi_t = self.kinds[self._b(batches), hs, qs, ks]
            if lo_t.numel() == 0:
                got = geometry.SKIP
            else:
                lo, hi = int(lo_t.min()), int(hi_t.max())
                got = geometry.SKIP if hi == SKIP else geometry.FULL if lo == FULL else geometry.PARTIAL
            if len(self._cache) < 65536:
                self._cache[key] = got
        assert isinstance(got, geometry.Kind)
        return got

    def key_range(self, batches: Range, rows: Range) -> Range:
        """Keys ``[lo, hi)`` outside which no row of ``rows`` (any batch of ``batches``, any head)
        keeps a pair; ``(0, 0)`` when none does."""
        key = ("k", batches, rows)
        got = self._cache.get(key)
        if got is None:
            qs, b = self._blocks(rows, self.bq, self.Lq), self._b(batches)
            first, last = self._first[b, qs], self._last[b, qs]
            if first.numel() == 0:
                got = (0, 0)
            else:
                lo, hi = int(first.min()) * self.bk, min(self.Lk, int(last.max()) * self.bk)
                got = (lo, hi) if lo < hi else (0, 0)
            if len(self._cache) < 65536:
                self._cache[key] = got
        assert isinstance(got, tuple)
        return got

    def kind_at(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """The int8 kind of the block of each pair (indices broadcast against each other). On
        ``Mask.block``'s grid (each index varying along its own dim of 4), by one index_select per
        dim, (B'|1, H'|1, r, c) — the table's dims of 1 stay 1; else by advanced indexing."""
        kinds = self.kinds.to(kv_idx.device)
        B, H = kinds.shape[:2]
        idx = (b, h, q_idx, kv_idx)
        if _is_grid(idx):
            k = kinds if B == 1 else kinds.index_select(0, b.reshape(-1).long())
            k = k if H == 1 else k.index_select(1, h.reshape(-1).long())
            k = k.index_select(2, q_idx.reshape(-1).long() // self.bq)
            return k.index_select(3, kv_idx.reshape(-1).long() // self.bk)  # (B'|1, H'|1, r, c)
        bi = b.long() if B > 1 else torch.zeros_like(b, dtype=torch.long)
        hi = h.long() if H > 1 else torch.zeros_like(h, dtype=torch.long)
        return kinds[bi, hi, q_idx.long() // self.bq, kv_idx.long() // self.bk]

    def keep(self, mask_mod: mods.MaskMod | None, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """The predicate of a Mask with this table, at index tensors that broadcast (``Mask.block``'s
        grid): False on SKIP blocks, True on FULL ones, ``mask_mod`` on PARTIAL ones (None: True) —
        the mod evaluated on each partial table block of the region only (for the region's batches
        and heads), never on a skipped or full one. Other index tensors than a grid of aranges: the
        mod on every pair asked for, gated by the table (also when compiling: no read-backs)."""
        kind = self.kind_at(b, h, q_idx, kv_idx)  # (broadcast shape) int8
        full, partial = kind == FULL, kind == PARTIAL
        if mask_mod is None:
            return full | partial
        if torch.compiler.is_compiling():  # tensor ops only (no read-back): the mod on every pair, gated
            return full | (partial & call_indices(mask_mod, b, h, q_idx, kv_idx))
        if not bool(partial.any()):
            return full
        idx = (b, h, q_idx, kv_idx)
        shape = torch.broadcast_shapes(*(t.shape for t in idx), partial.shape)
        grid = _is_grid(idx)
        qv, kvv = q_idx.reshape(-1), kv_idx.reshape(-1)
        r0, r1, c0, c1 = int(qv[0]), int(qv[-1]) + 1, int(kvv[0]), int(kvv[-1]) + 1
        if not grid or (r1 - r0, c1 - c0) != (len(qv), len(kvv)):
            return full | (partial & call_indices(mask_mod, b, h, q_idx, kv_idx))
        bv, hv = (t.reshape(-1).to(mods.INDEX_DTYPE) for t in (b, h))
        out = full.expand(shape).clone()  # (nb, nh, r, c)
        qb0, kb0 = r0 // self.bq, c0 // self.bk
        region = self.kinds[:, :, qb0 : -(-r1 // self.bq), kb0 : -(-c1 // self.bk)]  # (B|1, H|1, nq, nk)
        for qb, kb in (region == PARTIAL).any(dim=(0, 1)).nonzero().tolist():
            rs, re = max(r0, (qb0 + qb) * self.bq), min(r1, (qb0 + qb + 1) * self.bq)  # the block's rows here
            cs, ce = max(c0, (kb0 + kb) * self.bk), min(c1, (kb0 + kb + 1) * self.bk)
            rows, cols = slice(rs - r0, re - r0), slice(cs - c0, ce - c0)
            vals = mods.mask_on(mask_mod, bv, hv, qv[rows].to(mods.INDEX_DTYPE), kvv[cols].to(mods.INDEX_DTYPE))
            out[:, :, rows, cols] |= partial[:, :, rows, cols] & vals  # (nb, nh, r', c')
        return out

    def combine(self, other: BlockTable, word: str) -> BlockTable | None:
        """The table of ``self and other`` / ``self or other`` when both have the same blocks and
        lengths (else None: the parts answer one by one)."""
        if (self.bq, self.bk, self.Lq, self.Lk) != (other.bq, other.bk, other.Lq, other.Lk):
            return None
        a, z = torch.broadcast_tensors(self.kinds, other.kinds)
        if word == "and":  # SKIP if either skips, FULL if both are full
            kinds = torch.where((a == SKIP) | (z == SKIP), SKIP, torch.where((a == FULL) & (z == FULL), FULL, PARTIAL))
        else:  # FULL if either is full, SKIP if both skip
            kinds = torch.where((a == FULL) | (z == FULL), FULL, torch.where((a == SKIP) & (z == SKIP), SKIP, PARTIAL))
        return BlockTable(kinds.to(torch.int8), (self.bq, self.bk), (self.Lq, self.Lk))

    def counts(self) -> dict[str, int]:
        """How many (batch, head, query block, key block) are skipped, partial, full."""
        return {name: int((self.kinds == code).sum()) for name, code in (("skip", SKIP), ("partial", PARTIAL),
                                                                         ("full", FULL))}  # fmt: skip


def _is_grid(idx: tuple[Tensor, ...]) -> bool:
    """Whether four index tensors are a grid: 4-D each, varying only along its own dim."""
    return all(t.ndim == 4 and all(n == 1 for d, n in enumerate(t.shape) if d != axis) for axis, t in enumerate(idx))


def evaluate(
    mask_mod: mods.MaskMod,
    shape: tuple[int, int, int, int],
    block: tuple[int, int],
    device: torch.device,
    chunk: int = _CHUNK,
) -> BlockTable:
    """The table of ``mask_mod`` over ``shape`` = (B, H, Lq, Lk): evaluated tile by tile, each tile
    at most ``chunk`` pairs (at least one block), so memory is the table plus one tile."""
    B, H, Lq, Lk = shape
    bq, bk = block
    nq, nk = -(-Lq // bq), -(-Lk // bk)
    kinds = torch.empty(B, H, nq, nk, dtype=torch.int8)
    n = max(1, chunk // (bq * bk))  # blocks per tile
    tk = min(nk, n)
    tq = min(nq, max(1, n // tk))
    th = min(H, max(1, n // (tk * tq)))
    tb = min(B, max(1, n // (tk * tq * th)))
    for b0 in range(0, B, tb):
        for h0 in range(0, H, th):
            for i0 in range(0, nq, tq):
                for j0 in range(0, nk, tk):
                    b1, h1, i1, j1 = min(B, b0 + tb), min(H, h0 + th), min(nq, i0 + tq), min(nk, j0 + tk)
                    rows, cols = (i0 * bq, min(Lq, i1 * bq)), (j0 * bk, min(Lk, j1 * bk))
                    keep = mods.mask_block(mask_mod, batches=(b0, b1), heads=(h0, h1), rows=rows, cols=cols,
                                           device=device)  # (nb, nh, r, c)  # fmt: skip
                    kinds[b0:b1, h0:h1, i0:i1, j0:j1] = _kinds(keep, bq, bk, i1 - i0, j1 - j0).cpu()
    return BlockTable(kinds, block, (Lq, Lk))


def _kinds(keep: Tensor, bq: int, bk: int, nq: int, nk: int) -> Tensor:
    """(nb, nh, r, c) bool → (nb, nh, nq, nk) int8 kinds of its bq × bk blocks (the last ones may be
    short: counted against their true areas)."""
    nb, nh, r, c = keep.shape
    padded = torch.zeros(nb, nh, nq * bq, nk * bk, dtype=torch.int32, device=keep.device)
    padded[..., :r, :c] = keep
    kept = padded.view(nb, nh, nq, bq, nk, bk).sum(dim=(3, 5))  # (nb, nh, nq, nk)
    rows = torch.clamp(r - torch.arange(nq, device=keep.device) * bq, max=bq).view(nq, 1)
    cols = torch.clamp(c - torch.arange(nk, device=keep.device) * bk, max=bk).view(1, nk)
    area = rows * cols  # (nq, nk)
    return torch.where(kept == 0, SKIP, torch.where(kept == area, FULL, PARTIAL)).to(torch.int8)


def call_indices(mask_mod: mods.MaskMod, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``mask_mod`` (written for one pair) at index tensors that broadcast against each other, as
    ``Mask`` calls its predicate: vmapped over the four index vectors when they are the grid's
    (each varying along its own dim of 4 only, as ``Mask.block`` makes them), else over the pairs
    of the broadcast shape, flattened. Bool of the broadcast shape."""
    idx = (b, h, q_idx, kv_idx)
    shape = torch.broadcast_shapes(*(i.shape for i in idx))
    if _is_grid(idx):
        vecs = [i.reshape(-1).to(mods.INDEX_DTYPE) for i in idx]  # (B|1,), (H|1,), (r,), (c,)
        return _broadcast_call(mask_mod, vecs).expand(shape)
    flat = [i.expand(shape).reshape(-1).to(mods.INDEX_DTYPE) for i in idx]  # (N,) each
    if flat[0].numel() == 0:
        return torch.zeros(shape, dtype=torch.bool, device=kv_idx.device)
    with mods.ModOps():
        out = torch.vmap(mask_mod)(*flat)  # (N,)
    out = out if out.dtype == torch.bool else out != 0
    return out.view(shape)


def _broadcast_call(mask_mod: Callable[..., Tensor], vecs: list[Tensor]) -> Tensor:
    """``mask_mod`` on the grid of four index vectors: (nb, nh, r, c) bool."""
    if any(v.numel() == 0 for v in vecs):
        return torch.zeros([v.numel() for v in vecs], dtype=torch.bool, device=vecs[3].device)
    return mods.mask_on(mask_mod, *vecs)
