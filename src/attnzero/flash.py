"""The same function as ``reference.py``, tiled: an online softmax over key/value blocks
(FlashAttention-2), in plain PyTorch, with its own backward. Extra memory is O(L), not O(L²).

Read ``docs/MATH.md`` next to this file. In one sentence: walk the keys in blocks, keep for every query
row a running max ``m``, a running sum ``l`` and an unnormalised output ``acc``, rescale what was
accumulated whenever the max grows, and divide by ``l`` at the end. The backward never stores P: it
recomputes each block of it from the saved output and log-sum-exp.

Letters: B batch, Hq / Hkv query / key-value heads, G = Hq // Hkv, Lq / Lk query / key length,
D head dim of q and k, Dv of v; ``r`` / ``c`` the rows / columns of one block. Inside, a *chunk* is a
few (batch, key/value head) pairs processed together by batched matmuls, and the G query heads that
share a key/value head are stacked along the row axis (as ``reference.py`` does), so one matmul per
block serves the whole group and K/V are never repeated: a block of scores is ``(N, G·r, c)`` with
N the number of (batch, kv head) pairs in the chunk.

Precision: scores, softmax statistics and accumulators are float32 for 16/32-bit inputs and
float64 for float64 (``reference.accum_dtype``). Exponentials are base 2 inside: ``log2 e`` is
folded into the scale and the bias once, so ``exp(x) = exp2(x·log2 e)`` (torch's ``exp2`` is about
three times faster than ``exp`` on CPU); the log-sum-exp is converted back to natural log outside.

Skipping: for each block of query rows only the key columns that causal / window can reach are
visited, so causal does about half the work; a block is masked only where some pair in it is
blocked, and the causal / window edge enters the score matmul as an additive 0 / −inf tile (no
pass of its own). An ``az.masks.Mask`` says the same of itself (``Mask.key_range``,
``Mask.classify``): only its key range is visited, blocks it blocks whole are not computed, blocks it
keeps whole are not masked — a document mask costs what its documents cost. ``COUNTS`` counts the
blocks visited (for tests and curious readers); while ``attnzero.trace`` records, each visited block
is also noted as a "flash.tile" event (the ladder draws its pictures from them).

Soft-capping (``softcap``): the matmul gives ``x = q·k·scale/softcap``, the score is
``softcap·tanh(x)``; the edge tile and any shift go in after the tanh, and the backward multiplies
the score's gradient by ``1 − tanh²`` (docs/MATH.md, section 2). On CPU in float32 the whole line
(tanh, scale, edge tile, shift) is one pass of a small C kernel where it builds (``softcap_cpu.py``);
elsewhere it is torch's ops, and where torch's tanh is slow (MKL's, on a CPU not Intel's) the matmul
gives 2x instead and ``tanh(x) = e / (e + 2)``, ``e = expm1(2x)``.

Cores: on CPU, every problem of two or more tasks runs on Python worker threads, one per core,
each taking whole (chunk, row block) tasks with single-threaded ops (the runtime is ``parallel.py``).

One key block: when a row's keys fit one block and no row can be fully blocked, the online softmax
takes a single step, which is torch's fused softmax between two matmuls (``_forward_softmax``):
the tiny calls, sentence embeddings, BERT's L = 512, a decode step.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import dropout, geometry, reference, softcap_cpu, trace
from .constants import LN2, LOG2E
from .masks import Mask, block_of, keep_block
from .parallel import Arena, arena, run_tasks
from .reference import accum_dtype

NEG_INF = float("-inf")

# Block sizes, chosen by measuring on a 2-core AVX-512 CPU (docs/benchmarks.md). ``rows``: query rows
# per head in a block; ``cols``: key columns (0 = as many as make a score block of about ``elems``
# floats); ``kv``: floats of the per-chunk copy of K and V (bounds the extra memory).
# ``threads``: worker threads on CPU (0 = torch.get_num_threads(); see ``_threads``).
# ``unshifted``: 1 = try the forward's no-max variant first, 0 = the online softmax only.
# ``softmax``: 1 = problems whose keys fit one block take the single-step ``_forward_softmax``.
# ``tanh``: how softcap takes its tanh (``_tanh_route``): 0 = the fastest that applies here, else one
# of ``TANH_ROUTES`` forced by its index + 1 (where it applies).
_SIZES: dict[str, int] = {
    "rows": 256, "cols": 0, "elems": 1 << 19, "kv": 1 << 21, "threads": 0, "unshifted": 1, "softmax": 1,
    "tanh": 0,
}  # fmt: skip

# The forward's single-step case (``_forward_softmax``) serves problems with at most this many
# scores per (batch, kv head) pair (a 2 MiB block: BERT's L = 512, a decode step over 100k keys);
# causal ones only up to this many keys (it computes every score, where the online softmax skips
# the blocked blocks: a causal L = 256 is as fast online).
_SOFTMAX_MAX_SCORES = 1 << 19
_SOFTMAX_MAX_CAUSAL = 128

# Counters read by tests: blocks visited by the forward and the backward, row blocks whose
# unshifted forward was not exact and went to the online softmax ("fallback"), and calls that took
# the single-step softmax ("softmax"). The worker threads
# count theirs in ``parallel.COUNTS``.
COUNTS: dict[str, int] = {"forward": 0, "backward": 0, "fallback": 0, "softmax": 0}

# The forward's unshifted variant is exact when every row sum lies below this and above a floor
# (see ``_forward_rows_unshifted``).
_UNSHIFTED_MAX = 2.0**64


_LOCK = threading.Lock()


def _count(key: str) -> None:
    with _LOCK:  # worker threads count too
        COUNTS[key] += 1


def _note_tile(
    pb: _Problem, c: _Chunk, rows: tuple[int, int], cols: tuple[int, int], masked: bool, pass_: str, variant: str
) -> None:
    """Record one visited block in ``attnzero.trace`` (called only while a recording is open): which
    pass and variant ran it, the chunk ``(b0, b1, n0, n1)``, its rows and key columns, whether the
    mask was evaluated on it (``masked``), whether causal / window cut through it (``edge``), and
    the thread that computed it."""
    trace.note(
        "flash.tile", pass_=pass_, variant=variant, chunk=(c.b0, c.b1, c.n0, c.n1), rows=rows, cols=cols,
        masked=masked and pb.mask is not None, edge=pb.kind(rows, cols) is not geometry.FULL,
        thread=threading.get_ident(),
    )  # fmt: skip


@contextmanager
def block_sizes(
    rows: int | None = None,
    cols: int | None = None,
    elems: int | None = None,
    kv: int | None = None,
    threads: int | None = None,
    unshifted: bool | None = None,
    softmax: bool | None = None,
    tanh: str | None = None,
) -> Iterator[None]:
    """Temporarily force the block sizes, the worker threads, whether the forward tries its
    unshifted variant or its single-step softmax (tests use tiny blocks to hit every boundary), and
    how softcap's tanh is taken (``tanh``: one of ``TANH_ROUTES``, or "auto")."""
    old = dict(_SIZES)
    given = {
        "rows": rows, "cols": cols, "elems": elems, "kv": kv, "threads": threads, "unshifted": unshifted,
        "softmax": softmax, "tanh": None if tanh is None else _tanh_code(tanh),
    }  # fmt: skip
    for key, value in given.items():
        if value is not None:
            _SIZES[key] = int(value)
    try:
        yield
    finally:
        _SIZES.update(old)


@dataclass(frozen=True)
class _Chunk:
    """Batches ``[b0, b1)`` × key/value heads ``[n0, n1)``; either one batch or every head, so that
    the (batch, head) pairs flatten into one axis of N = (b1 - b0)·(n1 - n0) without copying."""

    b0: int
    b1: int
    n0: int
    n1: int
    G: int

    @property
    def n(self) -> int:
        return (self.b1 - self.b0) * (self.n1 - self.n0)

    def kv(self, t: Tensor, cols: tuple[int, int] | None = None) -> Tensor:
        """Key columns ``cols`` (default all) of k or v (B, Hkv, Lk, E) → (N, c, E)."""
        x = t[self.b0 : self.b1, self.n0 : self.n1]  # (nb, nh, Lk, E)
        if cols is not None:
            x = x[:, :, cols[0] : cols[1]]  # (nb, nh, c, E)
        return x.reshape(self.n, x.shape[2], x.shape[3])  # (N, c, E)

    def heads(self, t: Tensor) -> Tensor:
        """The chunk's batches and query heads of a tensor broadcastable to (B, Hq, ...):
        dims of size 1 stay size 1."""
        if t.ndim < 4:
            return t
        bs = slice(self.b0, self.b1) if t.shape[0] > 1 else slice(None)
        hs = slice(self.n0 * self.G, self.n1 * self.G) if t.shape[1] > 1 else slice(None)
        return t[bs, hs]

    def rows(self, t: Tensor, rows: tuple[int, int]) -> Tensor:
        """Query rows of a (B, Hq, Lq, E) tensor → (N, G·r, E), the group's heads stacked."""
        x = t[self.b0 : self.b1, self.n0 * self.G : self.n1 * self.G, rows[0] : rows[1]]  # (nb, nh·G, r, E)
        return x.reshape(self.n, -1, x.shape[-1])  # (N, G·r, E)

    def block(self, dst: Tensor, rows: tuple[int, int]) -> Tensor:
        """The chunk's rows ``rows`` of dst (B, Hq, Lq, ...), a view (nb, nh·G, r, ...): an
        (N, G·r, ...) block viewed to this shape lines up with it."""
        return dst[self.b0 : self.b1, self.n0 * self.G : self.n1 * self.G, rows[0] : rows[1]]

    def put(self, dst: Tensor, rows: tuple[int, int], src: Tensor) -> None:
        """Write (N, G·r, ...) back into rows ``rows`` of dst (B, Hq, Lq, ...)."""
        view = self.block(dst, rows)  # (nb, nh·G, r, ...)
        view.copy_(src.reshape(view.shape))


def _chunks(B: int, Hkv: int, G: int, per_pair: int, at_least: int = 1) -> list[_Chunk]:
    """Split the B·Hkv (batch, kv head) pairs into balanced chunks whose K/V copies (``per_pair``
    floats each) fit in ``_SIZES["kv"]``, and into ``at_least`` chunks if there are enough pairs."""
    n = max(1, min(B * Hkv, _SIZES["kv"] // max(1, per_pair), -(-B * Hkv // at_least)))
    if n >= Hkv:
        nb = max(1, n // Hkv)
        nb = -(-B // -(-B // nb))  # balance: the same number of batches in every chunk
        return [_Chunk(b, min(B, b + nb), 0, Hkv, G) for b in range(0, B, nb)]
    n = -(-Hkv // -(-Hkv // n))
    return [_Chunk(b, b + 1, h, min(Hkv, h + n), G) for b in range(B) for h in range(0, Hkv, n)]


def _edges_safe(q: Tensor, k: Tensor, factor: float, acc: torch.dtype) -> bool:
    """Whether every product ``q·k·factor`` of the score matmul (``factor``: what q is scaled by)
    is finite, so that adding a −inf edge tile never meets +inf or NaN: q and k finite with
    |q|·|k|·D·factor far below the accumulator's largest float. One read-back per call (q and k
    are O(L), the scores O(L²))."""
    return _product_bound(q, k, factor) < torch.finfo(acc).max / 16


def _product_bound(q: Tensor, k: Tensor, factor: float) -> float:
    """A bound on every |q·k·factor| of the score matmul and on its partial sums: |q|·|k|·D·factor
    (inf when q or k is not finite). One read-back."""
    v = torch.stack([x.to(torch.float64) for x in (*torch.aminmax(q), *torch.aminmax(k))]).tolist()
    if not all(math.isfinite(x) for x in v):  # a NaN anywhere in q or k makes its min and max NaN
        return math.inf
    return max(-v[0], v[1]) * max(-v[2], v[3]) * q.shape[-1] * abs(factor)


# A row whose bias lies farther than this from 0 everywhere (natural units) is computed with its
# bias's row max taken out (``bias_row_shift``).
_ROW_SHIFT_MIN = 32.0


def bias_row_shift(bias: Tensor | None, acc: torch.dtype) -> Tensor | None:
    """None, or a per-row constant ``c`` (the bias's finite row max, (B|1, H|1, Lq|1)) for
    ``_Problem.scores`` to take out before converting to base 2 — when some row's bias is far from 0
    everywhere (``|c| > _ROW_SHIFT_MIN``: an additive mask's fully masked row, −1e9 or ``finfo.min``)
    or some entry would overflow in base 2. Such a row's scores, and the −lse that the backward folds
    into the score matmul, would otherwise be numbers near ``c`` whose rounding (128 at c = −1e9 in
    float32) swamps q·k. With it, the scores are the reference's, ``scale·q·k + bias`` rounded in
    natural units, shifted per row: the softmax does not change, each row's largest entry is near 0,
    and the lse is ``c`` larger. One read-back per call with a bias."""
    if bias is None:
        return None
    limit = torch.finfo(acc).max / LOG2E / 2
    c = bias.amax(dim=-1).to(acc)  # (B|1, H|1, Lq|1)
    c = torch.where(torch.isfinite(c), c, 0.0)
    lo, hi = torch.aminmax(bias)
    worst, low, high = torch.stack([c.abs().amax().double(), lo.double(), hi.double()]).tolist()
    if worst <= _ROW_SHIFT_MIN and -limit <= low and high <= limit:  # (False for NaN: harmless, NaN either way)
        return None
    return c


def _five(t: Tensor, G: int) -> Tensor:
    """A block (nb|1, nh·G|1, r|1, c|1) → (nb|1, nh|1, G|1, r|1, c|1), to broadcast against a
    score block viewed per (batch, kv head, group member); a 2-D (r, c) block broadcasts as is."""
    if t.ndim < 4:
        return t
    if t.shape[1] == 1:
        return t.unsqueeze(2)
    return t.view(t.shape[0], t.shape[1] // G, G, t.shape[2], t.shape[3])


def _threads(device: torch.device) -> int:
    """Worker threads on CPU: as forced by ``block_sizes(threads=...)``, else torch's thread count
    (1 on other devices). Even small problems take the workers when there are two or more tasks:
    each worker's ops then run on one core, and the threads meet once per call — where torch's
    intra-op threads inside a dozen small ops per block meet after every op, which on a machine
    whose cores are busy with other work costs a scheduler time slice each (measured 10–20×
    slower than the workers under load, docs/benchmarks.md)."""
    if device.type != "cpu":
        return 1
    return _SIZES["threads"] or torch.get_num_threads()


class _Problem:
    """The trusted arguments of one call, and how to read one block of scores from them.

    A trick used by the backward: a per-row shift ``t_i`` is folded into the score matmul as the
    ``input`` of ``baddbmm``, broadcast along the row, so that ``q_i · k_j + t_i`` comes out of the
    matmul already shifted — one pass over the score block fewer (and faster than giving q and k
    one more column, which makes the matmul's inner size an awkward 65)."""

    def __init__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | Mask | None,
        bias: Tensor | None,
        causal: bool,
        window: tuple[int | None, int | None] | None,
        scale: float,
        dropout_p: float,
        dropout_seed: int,
        softcap: float | None = None,
    ) -> None:
        self.q, self.k, self.v = q, k, v
        self.B, self.Hq, self.Lq, self.D = q.shape
        self.Hkv, self.Lk, self.Dv = k.shape[1], k.shape[2], v.shape[3]
        self.G = self.Hq // self.Hkv
        self.acc = accum_dtype(q.dtype)
        self.mask, self.causal, self.window = mask, causal, window
        self.bias = bias
        # a bias too large for base 2: scores in natural units first, less this per-row constant
        # (given back in the lse; see bias_row_shift and scores)
        self.row_shift = bias_row_shift(bias, self.acc)
        self.natural = self.row_shift is not None
        # softcap: the matmul gives tanh's argument x = q·k·scale/softcap, and the score is
        # s₂ = cap_factor · tanh(x) (+ bias · log2 e): see ``scores``
        self.softcap = softcap
        to2 = 1.0 if self.natural else LOG2E  # scores in base 2, or in natural units (natural mode)
        self.cap_factor = 0.0 if softcap is None else softcap * to2
        # how tanh is taken (``_tanh_route``): by the C kernel, by torch's tanh, or by expm1 (tanh(x) =
        # e / (e + 2) with e = expm1(2x), so the matmul gives 2x; ``clamp``: 2x clamped first)
        self.tanh, self.clamp = ("torch", False) if softcap is None else _tanh_route(q, k, scale, softcap, self.acc)
        expm1 = self.tanh == "expm1"
        self.zero = torch.zeros((), dtype=self.acc, device=q.device) if expm1 else None  # addcdiv's input
        x_factor = 2.0 if expm1 else 1.0  # the matmul gives tanh's argument x, or 2x
        self.q_factor = scale * to2 if softcap is None else x_factor * scale / softcap  # what scaled_q multiplies q by
        # dK is accumulated against the scaled q: this takes it back to ``scale · q`` (softcap:
        # scale / q_factor = softcap / x_factor; base 2: ln 2; natural: 1)
        self.dk_factor = (1.0 if self.natural else LN2) if softcap is None else softcap / x_factor
        self.scale = scale
        self.dropout_p, self.dropout_seed = dropout_p, dropout_seed
        self.keep_scale = 1.0 / (1.0 - dropout_p)  # what dropout multiplies a kept probability by
        self._edges: dict[tuple[int, int, int, bool], Tensor] = {}  # see ``edge``
        # A Mask that knows its block structure: key ranges and SKIP / FULL / PARTIAL blocks
        # (``key_range``, ``col_blocks``); a dense mask is only read, block by block
        self.block_mask = mask if isinstance(mask, Mask) else None
        self._ranges: dict[tuple[int, int, int, int], tuple[int, int]] = {}  # see ``key_range``
        self.unshifted = _SIZES["unshifted"] != 0  # try the forward's no-max variant first
        self._v_tiny: bool | None = None  # see ``v_tiny``
        # Causal / window enter the score matmul as an additive −inf tile (``edge``) only where no
        # score can be +inf or NaN: −inf + (+inf or NaN) is NaN, and the reference blocks such a
        # pair like any other. Otherwise, and with a bias (checking a dense one would cost a pass
        # over all its L² entries), they are masked after the scores.
        # With softcap the tile is added after the tanh (tanh(−inf) = −1 would keep a blocked pair).
        self.use_edges = (causal or window is not None) and bias is None and _edges_safe(q, k, self.q_factor, self.acc)
        # Query rows per block: ``_SIZES["rows"]``, but under causal at least two row blocks (half
        # the rows, 64 at least): one block of all rows would see every key, the blocked half too.
        self.rows = _SIZES["rows"]
        if causal and self.Lq < 2 * self.rows:
            self.rows = max(64, -(-self.Lq // 64) * 32)

    def v_tiny(self) -> bool:
        """Whether some column of v (one (batch, head, d)) is nonzero but has no entry of size
        2^-60 or more (one read-back, on first use)."""
        if self._v_tiny is None:
            top = torch.maximum(self.v.amax(dim=2), -self.v.amin(dim=2))  # max_j |v_jd|: (B, Hkv, Dv)
            self._v_tiny = bool(((top < 2.0**-60) & (top != 0)).any())
        return self._v_tiny

    def threads(self, mutex: bool) -> int:
        """Worker threads for the tasks: 1 when blocks add into shared memory (``mutex``: a
        broadcast bias gradient), else ``_threads``."""
        return 1 if mutex else _threads(self.q.device)

    def chunks(self, per_pair: int) -> list[_Chunk]:
        """Chunks whose copies of K/V (``per_pair`` floats per position and pair) fit in
        ``_SIZES["kv"]`` and whose score blocks can still be 512 keys wide."""
        wide = _SIZES["elems"] // (self.G * min(self.rows, self.Lq) * min(512, self.Lk))
        # and at least two tasks per worker thread, when there are that many pairs
        row_blocks = -(-self.Lq // self.rows)
        at_least = -(-2 * _threads(self.q.device) // row_blocks)
        return _chunks(self.B, self.Hkv, self.G, max(per_pair * self.Lk, _SIZES["kv"] // max(1, wide)), at_least)

    def col_step(self, c: _Chunk) -> int:
        """Key columns per block: forced, or enough for a score block of about ``elems`` floats."""
        return _SIZES["cols"] or max(128, _SIZES["elems"] // (c.n * self.G * min(self.rows, self.Lq)) // 64 * 64)

    def key_range(self, c: _Chunk, rows: tuple[int, int]) -> tuple[int, int]:
        """The key columns ``[lo, hi)`` that the chunk's batches may see from query rows ``rows``:
        causal / window's (``geometry.key_range``) within the Mask's (``Mask.key_range``, when
        the mask is one); ``lo == hi`` when none. Kept per (batches, rows): ``tasks`` and the
        block loop ask for the same ones."""
        key = (c.b0, c.b1, rows[0], rows[1])
        got = self._ranges.get(key)
        if got is None:
            lo, hi = geometry.key_range(rows, self.Lq, self.Lk, self.causal, self.window)
            if self.block_mask is not None and lo < hi:
                m_lo, m_hi = self.block_mask.key_range((c.b0, c.b1), rows)
                lo, hi = max(lo, m_lo), min(hi, m_hi)
            got = self._ranges[key] = (lo, hi) if lo < hi else (0, 0)
        return got

    def col_blocks(self, c: _Chunk, rows: tuple[int, int]) -> list[tuple[tuple[int, int], bool]]:
        """The key blocks that query rows ``rows`` of the chunk visit, each as ``(cols, masked)``:
        within ``key_range``, without the blocks the Mask blocks whole (``Mask.classify`` SKIP);
        ``masked`` is False where no mask needs evaluating (no mask, or the Mask keeps the whole
        block: FULL). Causal / window are not part of ``masked`` (``scores`` asks ``kind``)."""
        lo, hi = self.key_range(c, rows)
        step = self.col_step(c)
        blocks = []
        for j0 in range(lo, hi, step):
            cols = (j0, min(hi, j0 + step))
            if self.block_mask is None:
                blocks.append((cols, self.mask is not None))
                continue
            kind = self.block_mask.classify((c.b0, c.b1), rows, cols)
            if kind is not geometry.SKIP:
                blocks.append((cols, kind is not geometry.FULL))
        return blocks

    def kind(self, rows: tuple[int, int], cols: tuple[int, int]) -> geometry.Kind:
        """What causal / window leave of one block (``geometry.classify``)."""
        return geometry.classify(rows, cols, self.Lq, self.Lk, self.causal, self.window)

    def arena(self) -> Arena:
        """A worker's scratch memory (see ``parallel.arena``)."""
        return arena(self.acc, self.q.device)

    def tasks(self, chunks: list[_Chunk]) -> list[tuple[int, tuple[int, int]]]:
        """Every (chunk, block of query rows), the costliest first (under causal the last rows see
        the most keys), so that the worker threads finish together."""
        step = self.rows
        blocks = [(i0, min(self.Lq, i0 + step)) for i0 in range(0, self.Lq, step)]
        todo = []
        for ci, c in enumerate(chunks):
            for b in blocks:
                lo, hi = self.key_range(c, b)  # the keys the block loop visits (within a Mask's too)
                todo.append(((hi - lo) * c.n, ci, b))
        return [(ci, b) for _, ci, b in sorted(todo, key=lambda t: -t[0])]

    @staticmethod
    def split(task: tuple[int, tuple[int, int]]) -> tuple[Any, Any] | None:
        """A task's rows in two halves (the first a multiple of 32 rows), or None when it has under
        256 (a smaller piece would cost more in per-task work than it saves at the end)."""
        ci, (r0, r1) = task
        if r1 - r0 < 256:
            return None
        mid = r0 + (r1 - r0) // 64 * 32
        return (ci, (r0, mid)), (ci, (mid, r1))

    def scaled_q(self, c: _Chunk, rows: tuple[int, int], ar: Arena) -> Tensor:
        """``q · scale · log2 e`` (``q · scale`` in natural mode) for the block's rows, (N, G·r, D),
        accumulator dtype."""
        x = _in(ar, "q", c.rows(self.q, rows), self.acc)  # converted first: the product is in float32
        return torch.mul(x, self.q_factor, out=ar.get("q", *x.shape))  # (N, G·r, D)

    def edge(self, rows: tuple[int, int], cols: tuple[int, int], transposed: bool) -> Tensor | None:
        """Causal / window of one block as an additive 0 / −inf tile, (G·r, c) (transposed: (c, G·r)),
        the G query heads of a group stacked as in the score block; None when they keep the whole
        block. It enters the score matmul as ``baddbmm``'s input, so masking costs no pass of its
        own. Whether pair (i, j) is kept depends only on ``j - i`` and the block's offset
        ``delta = c0 - (r0 + Lk - Lq)``, so blocks with the same (r, c, delta) share one tile."""
        if self.kind(rows, cols) is geometry.FULL:
            return None
        r, nc = rows[1] - rows[0], cols[1] - cols[0]
        delta = cols[0] - rows[0] - geometry.offset(self.Lq, self.Lk)
        key = (r, nc, delta, transposed)
        tile = self._edges.get(key)
        if tile is None:
            keep = keep_block(None, self.causal, self.window, self.Lq, self.Lk, rows, cols, self.q.device)
            assert keep is not None  # not all kept
            tile = torch.zeros((r, nc), dtype=self.acc, device=self.q.device).masked_fill_(~keep, NEG_INF)
            tile = tile.repeat(self.G, 1)  # (G·r, c): one copy per query head of the group
            tile = tile.t().contiguous() if transposed else tile  # (c, G·r)
            if len(self._edges) < 16:  # a handful of offsets recur; hold at most 16 tiles
                self._edges[key] = tile
        return tile

    def fuses_exp2(self, rows: tuple[int, int], cols: tuple[int, int], masked: bool, shifted: bool) -> bool:
        """Whether ``scores(..., exp2=True)`` takes the exp2 in the C kernel's pass: softcap by the
        kernel, and no step after the cap (a bias, a mask evaluated on this block (``masked``), a
        causal / window cut that is not an edge tile, a natural-mode shift)."""
        if self.tanh != "kernel":
            return False
        after = self.bias is not None or (masked and self.mask is not None) or self.late(rows, cols)
        return not (after or (self.natural and shifted))

    def late(self, rows: tuple[int, int], cols: tuple[int, int]) -> bool:
        """Whether causal / window cut this block and are still to mask after the scores: they could
        not enter as an edge tile (``use_edges``)."""
        return not self.use_edges and self.kind(rows, cols) is not geometry.FULL

    def scores(
        self,
        c: _Chunk,
        qa: Tensor,
        ka: Tensor,
        rows: tuple[int, int],
        cols: tuple[int, int],
        ar: Arena,
        name: str = "s",
        transposed: bool = False,
        shift: Tensor | None = None,
        masked: bool = True,
        t_name: str | None = None,
        exp2: bool = False,
    ) -> Tensor:
        """``s₂ = (scale · q kᵀ + bias) · log2 e`` for one block, blocked pairs −inf: (N, G·r, c),
        from the scaled queries ``qa`` (N, G·r, D) and the chunk's keys ``ka`` (N, Lk, D), written
        into the arena's buffer ``name``. ``shift`` (N, G·r, 1), if given, is added to every score of
        its row (see the class docstring). ``transposed``: return sᵀ (N, c, G·r), computed as K Qᵀ.
        ``masked``: whether the mask is evaluated on this block (False: it keeps the whole block).

        softcap: ``s₂ = softcap · log2 e · tanh(x) + bias · log2 e`` with ``x = q kᵀ · scale /
        softcap`` the matmul's result (``qa`` is scaled so; ``expm1``: 2x, and ``tanh(x) = e / (e + 2)``
        with ``e = expm1(2x)``); the edge tile and the shift are added only after the tanh (the C
        kernel: all of it in one pass).
        ``t_name``: keep ``t = tanh(x)`` (laid out as the block) in that arena buffer, for the
        backward's ``1 − t²``. ``exp2``: return ``p = exp2(s₂)`` instead, in the C kernel's pass
        where nothing comes after the softcap (``fuses_exp2``); then the kept buffer holds
        ``p · (1 − t²)``, the factor the backward's dS takes, instead of t."""
        r, nc = rows[1] - rows[0], cols[1] - cols[0]
        N, GR = qa.shape[0], qa.shape[1]
        kb = ka[:, cols[0] : cols[1]]  # (N, c, D)
        edge = self.edge(rows, cols, transposed) if self.use_edges else None  # (G·r, c) or (c, G·r)
        # shift (N, G·r, 1), or shiftᵀ (N, 1, G·r): broadcast along each row (down each column);
        # in natural mode it is added once the scores are in base 2, at the end
        add = None if shift is None or self.natural else shift.transpose(1, 2) if transposed else shift
        buf = ar.get(name, N, nc, GR) if transposed else ar.get(name, N, GR, nc)  # (N, c, G·r) or (N, G·r, c)
        x, y = (kb, qa.transpose(1, 2)) if transposed else (qa, kb.transpose(1, 2))
        late = self.late(rows, cols)
        masked = masked and self.mask is not None
        fused = exp2 and self.fuses_exp2(rows, cols, masked, shift is not None)
        if self.softcap is not None:
            torch.bmm(x, y, out=buf)  # x = q·k·scale / softcap (expm1: 2x)
            if self.tanh == "kernel":  # one pass: t = tanh(x), kept if asked; s₂ = cap_factor · t + shift + edge
                t_out = None if t_name is None else ar.get(t_name, *buf.shape)
                softcap_cpu.softcap_(buf, self.cap_factor, t_out=t_out, a=add, b=edge, exp2=fused, dtanh=fused)
            else:
                self._cap_in_torch(buf, add, edge, ar, t_name)
        elif add is not None and edge is not None:
            torch.add(add, edge, out=buf).baddbmm_(x, y)
        elif (extra := add if add is not None else edge) is not None:
            torch.baddbmm(extra, x, y, out=buf)
        else:
            torch.bmm(x, y, out=buf)
        s = buf.transpose(1, 2) if transposed else buf  # (N, G·r, c)
        if self.bias is not None or masked or late:
            s5 = s.view(c.b1 - c.b0, c.n1 - c.n0, self.G, r, nc)  # (nb, nh, G, r, c): one query head per (nh, G)
            if self.bias is not None:
                b5 = _five(c.heads(block_of(self.bias, rows, cols)), self.G)
                if self.natural:  # s = scale·q·k + bias as the reference rounds it, then to base 2
                    assert self.row_shift is not None
                    shift5 = _five(c.heads(block_of(self.row_shift.unsqueeze(-1), rows, (0, 1))), self.G)
                    s5.add_(b5).sub_(shift5).mul_(LOG2E)  # (s − c) · log2 e
                else:
                    s5.add_(b5, alpha=LOG2E)
            win = self.window if late else None
            mask = self.mask if masked else None
            keep = keep_block(mask, self.causal and late, win, self.Lq, self.Lk, rows, cols, s.device)
            if keep is not None:
                s5.masked_fill_(_five(c.heads(keep), self.G).logical_not(), NEG_INF)
        if self.natural and shift is not None:
            s.add_(shift)
        if exp2 and not fused:
            s.exp2_()
        return s.transpose(1, 2) if transposed else s

    def _cap_in_torch(
        self, buf: Tensor, add: Tensor | None, edge: Tensor | None, ar: Arena, t_name: str | None
    ) -> None:
        """``scores``' softcap by torch's ops, in place on the matmul's ``buf``: s₂ = cap_factor · t,
        then the shift ``add`` and the edge tile (one pass when only one is there); ``t = tanh(x)``
        by torch's tanh or by expm1 (``buf`` holds 2x then), kept in ``t_name`` if given."""
        extra = add if add is not None else edge
        if self.zero is not None and t_name is None:  # expm1, t not kept: s₂ = softcap · log2 e · e / (e + 2)
            e = _expm1_(buf, self.clamp)
            d = torch.add(e, 2.0, out=ar.get("d", *buf.shape))  # e + 2
            torch.addcdiv(self.zero if extra is None else extra, e, d, value=self.cap_factor, out=buf)
        else:
            if self.zero is not None:  # expm1: tanh(x) = e / (e + 2), e = expm1(2x), into the kept buffer
                assert t_name is not None
                e = _expm1_(buf, self.clamp)
                d = torch.add(e, 2.0, out=ar.get(t_name, *buf.shape))  # e + 2
                t = torch.div(e, d, out=d)
            else:
                t = buf.tanh_() if t_name is None else torch.tanh(buf, out=ar.get(t_name, *buf.shape))
            if extra is not None:
                torch.add(extra, t, alpha=self.cap_factor, out=buf)
            else:
                torch.mul(t, self.cap_factor, out=buf)
        if add is not None and edge is not None:
            buf.add_(edge)

    def dropout_keep(self, c: _Chunk, rows: tuple[int, int], cols: tuple[int, int]) -> Tensor:
        """Z for one block, (N, G·r, c) bool: the entries ``dropout.keep_mask`` keeps for the full
        (B, Hq, Lq, Lk) problem, for the chunk's batches and query heads. The factor 1 / (1 - p) of
        the kept entries is applied to a row block's sums, not to each entry (``keep_scale``)."""
        keep = dropout.keep_mask(
            self.dropout_seed, self.dropout_p, (self.B, self.Hq, self.Lq, self.Lk), rows, cols, self.q.device,
            batches=(c.b0, c.b1), heads=(c.n0 * self.G, c.n1 * self.G),
        )  # (nb, nh·G, r, c)  # fmt: skip
        return keep.view(c.n, -1, cols[1] - cols[0])  # (N, G·r, c)


@torch.no_grad()
def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | Mask | None,
    bias: Tensor | None,
    causal: bool,
    window: tuple[int | None, int | None] | None,
    scale: float,
    dropout_p: float,
    dropout_seed: int,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out (B, Hq, Lq, Dv) in q's dtype, lse (B, Hq, Lq))`` by an online softmax over key blocks.
    A plain function (no autograd). Fully blocked rows: out 0, lse −inf."""
    out, lse, _ = _forward_parts(q, k, v, mask, bias, causal, window, scale, dropout_p, dropout_seed, softcap)
    return out, lse


def _forward_parts(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | Mask | None, bias: Tensor | None, causal: bool,
    window: tuple[int | None, int | None] | None, scale: float, dropout_p: float, dropout_seed: int,
    softcap: float | None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``forward``'s (out, lse), and the lse before the bias's row shift was added back (None
    without one: see ``bias_row_shift``), which the backward needs and cannot get back from the lse."""
    if _softmax_applies(q, k, mask, bias, causal, window, dropout_p):
        out1, lse1 = _forward_softmax(q, k, v, causal, scale, with_lse=True, softcap=softcap)
        assert lse1 is not None
        return out1, lse1, None
    pb = _Problem(q, k, v, mask, bias, causal, window, scale, dropout_p, dropout_seed, softcap)
    out, lse = _forward_problem(pb)
    if pb.row_shift is None:
        return out, lse, None
    return out, lse + pb.row_shift, lse  # the constant taken out of the bias, given back (see bias_row_shift)


def _forward_problem(pb: _Problem) -> tuple[Tensor, Tensor]:
    """``forward`` on the problem: out, and the lse of its scores as ``_Problem.scores`` computes
    them (in natural mode, less the per-row ``row_shift``)."""
    q, k, v = pb.q, pb.k, pb.v
    out = torch.empty(pb.B, pb.Hq, pb.Lq, pb.Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(pb.B, pb.Hq, pb.Lq, dtype=pb.acc, device=q.device)
    chunks = pb.chunks(0 if k.dtype == pb.acc else pb.D + pb.Dv)
    # K and V of each chunk: views unless they need converting or were not contiguous, (N, Lk, D|Dv)
    kv = [(c.kv(k).to(pb.acc), c.kv(v).to(pb.acc)) for c in chunks]

    def rows_of(task: tuple[int, tuple[int, int]], ar: Arena, own: bool) -> None:
        ci, rows = task
        c, (kc, vc) = chunks[ci], kv[ci]
        _forward_rows(pb, c, rows, kc, vc, ar, out, lse)  # each task writes only its own rows

    # every task is a group of its own: the workers take them in order, costliest first
    run_tasks(list(enumerate(pb.tasks(chunks))), rows_of, pb.arena, pb.threads(mutex=False), pb.split)
    return out, lse


def _softmax_applies(
    q: Tensor,
    k: Tensor,
    mask: Tensor | Mask | None,
    bias: Tensor | None,
    causal: bool,
    window: tuple[int | None, int | None] | None,
    dropout_p: float,
) -> bool:
    """Whether ``_forward_softmax`` computes this problem: every row's keys fit one block and
    every row keeps at least one key (no mask, bias or window; causal only with Lq <= Lk, and only
    for one query or short keys: it computes every score, where the online softmax skips the
    blocked blocks)."""
    Hq, Lq, Hkv, Lk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    plain = mask is None and bias is None and window is None and dropout_p == 0.0 and _SIZES["softmax"] != 0
    # one (batch, kv head) pair's scores fit a block (forced narrower blocks: tiles, for tests)
    one_block = Hq // Hkv * Lq * Lk <= _SOFTMAX_MAX_SCORES and Lk <= (_SIZES["cols"] or Lk)
    keys = Lk > 0 and (not causal or Lq == 1 or Lq <= Lk <= _SOFTMAX_MAX_CAUSAL)  # every row has a key
    return plain and one_block and keys


def _forward_softmax(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, with_lse: bool, softcap: float | None = None
) -> tuple[Tensor, Tensor | None]:
    """The online softmax when the keys of every row fit in one block: it takes a single step,
    ``m`` = the row max, ``p = exp(s − m)``, ``l = Σ p``, ``O = p V / l`` — which is torch's fused
    softmax followed by P·V. No row is fully blocked here (``_softmax_applies``), so the softmax
    never sees a row of −inf. The (batch, kv head) pairs run in tasks whose score blocks, about
    2 MiB, stay in the core's cache, at least one per worker thread. ``with_lse``: also the lse,
    from the row max of the scores and of P (two more passes; else None) — the output is the same
    either way. ``softcap``: the scores are ``softcap · tanh(scale · Q Kᵀ / softcap)`` before the
    causal −inf (tanh(−inf) = −1 would keep a blocked pair)."""
    _count("softmax")
    if trace.active():  # one step over all keys: no tiles to record
        trace.note("flash.softmax", shape=(q.shape[0], q.shape[1], q.shape[2], k.shape[2]), causal=causal)
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G, N = Hq // Hkv, B * Hkv
    acc = accum_dtype(q.dtype)
    qg = _as(q.reshape(N, G * Lq, D), acc)  # (N, G·Lq, D): the G query heads of a kv head stacked
    kt = _as(k.reshape(N, Lk, D), acc).transpose(1, 2)  # Kᵀ: (N, D, Lk)
    vg = _as(v.reshape(N, Lk, Dv), acc)  # (N, Lk, Dv)
    blocked = None
    if causal and Lq > 1:  # query i sees keys j <= i + Lk − Lq: the rest is −inf before the softmax
        keep = keep_block(None, True, None, Lq, Lk, (0, Lq), (0, Lk), q.device)  # (Lq, Lk)
        blocked = None if keep is None else keep.logical_not().repeat(G, 1)  # (G·Lq, Lk)
    lse = torch.empty(N, G * Lq, dtype=acc, device=q.device) if with_lse else None  # (N, G·Lq)
    # softcap's tanh the way ``_Problem`` would take it
    how, clamp = ("torch", False) if softcap is None else _tanh_route(q, k, scale, softcap, acc)
    zero = torch.zeros((), dtype=acc, device=q.device) if how == "expm1" else None  # addcdiv's input

    def block(n0: int, n1: int, out: Tensor | None = None) -> Tensor:
        """O = softmax(scale · Q Kᵀ) V for pairs [n0, n1): (n, G·Lq, Dv) in the accumulator dtype
        (into ``out`` if given); their lse into ``lse``."""
        whole = n1 - n0 == N  # one task: no slicing (a tiny call is a few µs per op)
        qa, ka, va = (qg, kt, vg) if whole else (qg[n0:n1], kt[n0:n1], vg[n0:n1])
        # On the calling thread with torch's intra-op threads (a single task), torch's softmax and
        # exp reach for the OpenMP / MKL threads even on a 16 × 16 block, and on a busy machine
        # each such call can wait a scheduler time slice (7 ms, benchmarks/shapes.py --busy):
        # there exp(s − m) is exp2((s − m) · log2 e), and exp2, max and sum stay on this thread.
        s = qa.new_empty(n1 - n0, G * Lq, Lk)  # (beta=0: its contents are ignored, NaN included)
        if softcap is None:
            s.baddbmm_(qa, ka, beta=0.0, alpha=scale)  # scale · Q Kᵀ: (n, G·Lq, Lk)
        elif how == "kernel":  # the same, the tanh and the scale in one pass of the C kernel
            softcap_cpu.softcap_(s.baddbmm_(qa, ka, beta=0.0, alpha=scale / softcap), softcap)
        elif zero is None:  # softcap · tanh(scale · Q Kᵀ / softcap)
            s.baddbmm_(qa, ka, beta=0.0, alpha=scale / softcap).tanh_().mul_(softcap)
        else:  # the same with tanh(x) = e / (e + 2), e = expm1(2x): see _Problem.scores
            s.baddbmm_(qa, ka, beta=0.0, alpha=2.0 * scale / softcap)  # 2x: (n, G·Lq, Lk)
            e = _expm1_(s, clamp)  # in place
            torch.addcdiv(zero, e, e + 2.0, value=softcap, out=s)  # softcap · e / (e + 2)
        if blocked is not None:
            s.masked_fill_(blocked, NEG_INF)
        if torch.get_num_threads() > 1:
            m_row = s.amax(dim=-1, keepdim=True)  # the row max m: (n, G·Lq, 1)
            e = s.sub_(m_row).mul_(LOG2E).exp2_()  # exp(s − m), in place (s − m <= 0: no overflow)
            l = e.sum(dim=-1, keepdim=True)  # (n, G·Lq, 1), >= 1
            if lse is not None:
                torch.add(m_row, l.log2().mul_(LN2), out=lse[n0:n1].unsqueeze(-1))  # lse = m + log l
            return torch.bmm(e, va, out=out).div_(l)  # O = exp(s − m) V / l
        m = s.amax(dim=-1) if lse is not None else None  # the row max: (n, G·Lq)
        p = torch.softmax(s, dim=-1)  # P = exp(s − m) / l
        if m is not None and lse is not None:
            # the row's largest p is exp(0) / l: lse = m + log l = m − log(max_j p_ij)
            torch.sub(m, p.amax(dim=-1).log_(), out=lse[n0:n1])
        return torch.bmm(p, va, out=out)  # O = P V

    # pairs per task: a block of about ``elems`` scores, and a share for every worker thread (a
    # single task would run its ops on torch's intra-op threads, which stall on a busy machine)
    per = max(1, min(_SIZES["elems"] // (G * Lq * Lk), -(-N // _threads(q.device))))
    lse4 = None if lse is None else lse.view(B, Hq, Lq)
    if per >= N:
        return _as(block(0, N), q.dtype).view(B, Hq, Lq, Dv), lse4
    out = torch.empty(B, Hq, Lq, Dv, dtype=q.dtype, device=q.device)
    og = out.view(N, G * Lq, Dv)  # (N, G·Lq, Dv)

    def task(n0: int, scratch: None, own: bool) -> None:
        n1 = min(N, n0 + per)
        if og.dtype == acc:
            block(n0, n1, og[n0:n1])
        else:
            og[n0:n1] = block(n0, n1)

    run_tasks(list(enumerate(range(0, N, per))), task, lambda: None, _threads(q.device), lambda item: None)
    return out, lse4


def _forward_rows(
    pb: _Problem, c: _Chunk, rows: tuple[int, int], kc: Tensor, vc: Tensor, ar: Arena, out: Tensor, lse: Tensor
) -> None:
    """One block of query rows against every key block it can see, by the online softmax of docs/MATH.md;
    writes its rows of out and lse. Base 2 throughout (``s₂ = s · log2 e``, see ``_Problem``).

    Per row: the running max ``m`` (−inf until the row meets a kept key), the running sum
    ``l = Σ_j exp2(s_ij − m)`` and the unnormalised output ``acc = Σ_j exp2(s_ij − m) v_j``.
    Every ``p`` is at most 1 and every rescale ``alpha = exp2(m − m_new)`` at most 1, so nothing
    overflows, and the largest term of a row is exactly 1, so nothing that matters underflows,
    whatever the size of the scores.

    The unshifted variant is tried first (``_forward_rows_unshifted``: no max at all, exact when
    its check passes, which it does for scores of ordinary size); this is the path otherwise."""
    blocks = pb.col_blocks(c, rows)  # [(cols, masked)]
    if not blocks:  # no key to see (a Mask or causal / window block them all): O = 0, lse = −inf
        if trace.active():
            trace.note("flash.rows_empty", pass_="forward", chunk=(c.b0, c.b1, c.n0, c.n1), rows=rows)
        c.block(out, rows).zero_()
        c.block(lse, rows).fill_(NEG_INF)
        return
    qs = pb.scaled_q(c, rows, ar)  # q · scale · log2 e (softcap: q · scale / softcap): (N, G·r, D)
    if pb.unshifted and _forward_rows_unshifted(pb, c, rows, qs, kc, vc, ar, out, lse, blocks):
        return
    shape = (c.n, qs.shape[1], 1)
    m = torch.full(shape, NEG_INF, dtype=pb.acc, device=qs.device)  # running max (base 2): (N, G·r, 1)
    l = torch.zeros(shape, dtype=pb.acc, device=qs.device)  # running sum: (N, G·r, 1)
    acc = ar.get("acc", c.n, qs.shape[1], pb.Dv).zero_()  # unnormalised output: (N, G·r, Dv)
    for cols, masked in blocks:
        _count("forward")
        if trace.active():
            _note_tile(pb, c, rows, cols, masked, "forward", "online")
        s = pb.scores(c, qs, kc, rows, cols, ar, masked=masked)  # s₂, blocked pairs −inf: (N, G·r, c)
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # m_new = max(m, max_j s_ij)
        # A row that has met no kept key yet keeps m = −inf; inside exp2 it is 0 instead, so that
        # exp2(−inf − (−inf)) is never evaluated (its p and alpha are then exp2(−inf) = 0).
        m_use = torch.where(m_new == NEG_INF, 0.0, m_new)
        p = s.sub_(m_use).exp2_()  # p_ij = exp2(s_ij − m_new), in place
        alpha = torch.exp2(m - m_use)  # alpha = exp2(m − m_new): rescales what was accumulated
        l.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))  # l = alpha·l + Σ_j p_ij
        if pb.dropout_p > 0.0:
            p.mul_(pb.dropout_keep(c, rows, cols))  # dropped entries leave acc, not the normaliser l
        acc.mul_(alpha).baddbmm_(p, vc[:, cols[0] : cols[1]])  # acc = alpha·acc + Σ_j p_ij v_j
        m = m_new
    if pb.dropout_p > 0.0:
        acc.mul_(pb.keep_scale)  # the kept entries' 1 / (1 - p), once per row
    # O = acc / l and lse = (m + log2 l) · ln 2; a row with l = 0 saw no kept key: O = 0, lse = −inf.
    _finish_rows(c, rows, acc, l, m, out, lse)


def _forward_rows_unshifted(
    pb: _Problem,
    c: _Chunk,
    rows: tuple[int, int],
    qs: Tensor,
    kc: Tensor,
    vc: Tensor,
    ar: Arena,
    out: Tensor,
    lse: Tensor,
    blocks: list[tuple[tuple[int, int], bool]],
) -> bool:
    """The rows of ``_forward_rows`` with no running max: ``p = exp2(s₂)`` as it is. Returns False,
    having written nothing, when that was not exact; then the online softmax runs.

    ``acc / l`` is the same whatever common factor the terms of a row carry, so the max matters
    only for range: without it each block is a matmul, one exp2 in place, a row sum and a matmul
    (no max pass, no subtraction; measured in docs/benchmarks.md). It is exact when, for every row,
    ``1 <= l < 2^64`` and ``acc`` is finite: nothing overflowed, and each term ``p_ij`` is ``l``
    times the probability the reference multiplies ``v_j`` by, so no product in ``acc``
    underflows where the reference's does not. ``l`` down to 2^-64 is as good when no column of v
    is tiny (``_Problem.v_tiny``): a product then shrinks by at most 2^64 and stays far above the
    smallest normal float. A row that sees no key (``l = 0``) fails the check too."""
    l = ar.get("l", c.n, qs.shape[1], 1).zero_()  # Σ_j exp2(s_ij): (N, G·r, 1)
    acc = ar.get("acc", c.n, qs.shape[1], pb.Dv).zero_()  # Σ_j exp2(s_ij) v_j: (N, G·r, Dv)
    for cols, masked in blocks:
        _count("forward")
        if trace.active():
            _note_tile(pb, c, rows, cols, masked, "forward", "unshifted")
        p = pb.scores(c, qs, kc, rows, cols, ar, masked=masked, exp2=True)  # p_ij = exp2(s_ij), in place: (N, G·r, c)
        l.add_(p.sum(dim=-1, keepdim=True))
        if pb.dropout_p > 0.0:
            p.mul_(pb.dropout_keep(c, rows, cols))  # dropped entries leave acc, not the normaliser l
        acc.baddbmm_(p, vc[:, cols[0] : cols[1]])  # acc += p · v
    if pb.dropout_p > 0.0:
        acc.mul_(pb.keep_scale)  # the kept entries' 1 / (1 - p), once per row
    # One small read-back: the smallest and largest row sum (NaN if any is) and the sum of acc
    # (not finite if any entry is; an overflow of the sum alone just takes the online softmax).
    lo, hi, total = torch.stack((*torch.aminmax(l), acc.sum())).tolist()
    ok = hi < _UNSHIFTED_MAX and math.isfinite(total) and (lo >= 1.0 or (lo >= 2.0**-64 and not pb.v_tiny()))
    if not ok:  # (False for NaN too)
        _count("fallback")
        if trace.active():  # its blocks are visited again by the online softmax
            trace.note("flash.fallback", chunk=(c.b0, c.b1, c.n0, c.n1), rows=rows)
        return False
    _finish_rows(c, rows, acc, l, torch.zeros((), dtype=l.dtype, device=l.device), out, lse)
    return True


def _finish_rows(c: _Chunk, rows: tuple[int, int], acc: Tensor, l: Tensor, m: Tensor, out: Tensor, lse: Tensor) -> None:
    """``O = acc / l`` and ``lse = (m + log2 l) · ln 2`` into the chunk's rows of out and lse; a row
    with ``l = 0`` saw no kept key: ``O = 0``, ``lse = −inf``."""
    seen = l > 0
    o = c.block(out, rows)  # (nb, nh·G, r, Dv), a view
    torch.div(acc.view(o.shape), torch.where(seen, l, 1.0).view(*o.shape[:-1], 1), out=o)
    c.put(lse, rows, torch.where(seen, (m + torch.log2(l)) * LN2, NEG_INF).squeeze(-1))  # (N, G·r)


@torch.no_grad()
def backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    mask: Tensor | Mask | None,
    bias: Tensor | None,
    causal: bool,
    window: tuple[int | None, int | None] | None,
    scale: float,
    dropout_p: float,
    dropout_seed: int,
    bias_grad: bool = True,
    softcap: float | None = None,
    shifted_lse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dv, dbias)`` from the saved ``out`` and ``lse``, recomputing P block by block.
    dk / dv are summed over each GQA group; dbias has bias's (broadcast) shape, None without bias
    (or when ``bias_grad`` is False). ``shifted_lse``: the forward's lse before a bias's row shift
    was added back, when the caller kept it (else it is recovered from ``lse``, ``_shifted_lse``)."""
    pb = _Problem(q, k, v, mask, bias, causal, window, scale, dropout_p, dropout_seed, softcap)
    if pb.row_shift is not None:
        lse = shifted_lse if shifted_lse is not None else _shifted_lse(pb, q, k, v, lse)
    dq = torch.empty_like(q)
    # dK / dV, zeroed chunk by chunk by the worker that owns the chunk, on its first task there
    # (so both threads zero, and touch fresh pages, in parallel)
    dk = torch.empty(k.shape, dtype=pb.acc, device=q.device)  # (B, Hkv, Lk, D)
    dv = torch.empty(v.shape, dtype=pb.acc, device=q.device)  # (B, Hkv, Lk, Dv)
    zeroed: set[int] = set()
    dbias = torch.zeros(bias.shape, dtype=pb.acc, device=q.device) if bias is not None and bias_grad else None
    chunks = pb.chunks(0 if k.dtype == pb.acc else pb.D + pb.Dv)
    # K and V of each chunk: views unless they need converting or were not contiguous, (N, Lk, D|Dv)
    kv = [(c.kv(k).to(pb.acc), c.kv(v).to(pb.acc)) for c in chunks]

    def scratch() -> tuple[Arena, dict[int, tuple[Tensor, Tensor]]]:
        return pb.arena(), {}  # and the worker's own dK / dV of chunks it helps with (see parallel.Queue)

    def rows_of(
        task: tuple[int, tuple[int, int]], st: tuple[Arena, dict[int, tuple[Tensor, Tensor]]], own: bool
    ) -> None:
        ci, rows = task
        c, (kc, vc), (ar, helped) = chunks[ci], kv[ci], st
        if own:  # this worker owns the chunk: it adds into dk / dv themselves
            dk_c, dv_c = c.kv(dk), c.kv(dv)  # (N, Lk, D), (N, Lk, Dv): views
            if ci not in zeroed:  # only the owner gets here for this chunk
                zeroed.add(ci)
                dk_c.zero_()
                dv_c.zero_()
        else:
            if ci not in helped:
                helped[ci] = (torch.zeros_like(c.kv(dk)), torch.zeros_like(c.kv(dv)))
            dk_c, dv_c = helped[ci]
        _backward_rows(pb, c, rows, kc, vc, ar, dk_c, dv_c, dout, out, lse, dq, dbias)

    # a group per chunk: the tasks of one chunk add into the same rows of dk / dv
    tasks = [(ci, (ci, rows)) for ci, rows in pb.tasks(chunks)]
    for _, helped in run_tasks(tasks, rows_of, scratch, pb.threads(mutex=dbias is not None), pb.split):
        for ci, (dk_h, dv_h) in helped.items():
            chunks[ci].kv(dk).add_(dk_h)
            chunks[ci].kv(dv).add_(dv_h)
    dk.mul_(pb.dk_factor)  # dk was accumulated against the scaled q (q · scale · log2 e, or see dk_factor)
    db = dbias.to(bias.dtype) if dbias is not None and bias is not None else None
    return dq, dk.to(k.dtype), dv.to(v.dtype), db


def _shifted_lse(pb: _Problem, q: Tensor, k: Tensor, v: Tensor, lse: Tensor) -> Tensor:
    """The lse of the scores as ``bias_row_shift`` shifted them, for the backward, from the ``lse`` given.

    ``lse − row_shift`` would do, except where the shift is so large that ``lse = lse_s + row_shift``
    kept none of ``lse_s``'s bits (a row whose every bias is ``finfo.min``, as additive padding masks
    write a fully padded row: its scores all round to the same number, P is uniform, and lse_s is
    log Lk). So the forward's own ``lse_s`` is computed again (no dropout: the lse does not depend on
    it), and what the given lse adds to this forward's — a sink, a ring's other keys — is added back:
    nothing, bitwise, when the lse is this forward's own."""
    assert pb.row_shift is not None
    if float(pb.row_shift.abs().max()) <= _ROW_SHIFT_MIN:  # small shifts (an overflow guard): nothing lost
        return lse - pb.row_shift
    own = _forward_problem(_Problem(q, k, v, pb.mask, pb.bias, pb.causal, pb.window, pb.scale, 0.0, 0, pb.softcap))[1]
    given_extra = lse - (own + pb.row_shift)  # 0 for this forward's lse; a row with no key: NaN, not used
    return torch.where(own == NEG_INF, lse - pb.row_shift, own + given_extra)


def _backward_rows(
    pb: _Problem,
    c: _Chunk,
    rows: tuple[int, int],
    kc: Tensor,
    vc: Tensor,
    ar: Arena,
    dk: Tensor,
    dv: Tensor,
    dout: Tensor,
    out: Tensor,
    lse: Tensor,
    dq: Tensor,
    dbias: Tensor | None,
) -> None:
    """Gradients from one block of query rows: writes its rows of dq; adds into the chunk's dK and
    dV (N, Lk, ·) and into dbias.
    Both shifts come out of the matmuls (see ``_Problem``): ``s₂ − lse₂`` and ``dp − D`` (with
    softcap the first is added after the tanh, see ``_Problem.scores``)."""
    blocks = pb.col_blocks(c, rows)  # [(cols, masked)]
    if not blocks and trace.active():  # no key to see: dQ = 0 for these rows, nothing added to dK / dV
        trace.note("flash.rows_empty", pass_="backward", chunk=(c.b0, c.b1, c.n0, c.n1), rows=rows)
    qs = pb.scaled_q(c, rows, ar)  # q · scale · log2 e (softcap: q · scale / softcap): (N, G·r, D)
    N, GR = qs.shape[0], qs.shape[1]
    lse2 = c.rows(lse.unsqueeze(-1), rows) * LOG2E  # (N, G·r, 1), base 2
    neg_lse2 = torch.where(lse2 == NEG_INF, 0.0, -lse2)  # a blocked row's scores are all −inf anyway
    do = _in(ar, "do", c.rows(dout, rows), pb.acc)  # (N, G·r, Dv)
    o = _in(ar, "o", c.rows(out, rows), pb.acc)  # (N, G·r, Dv)
    d_i = torch.mul(do, o, out=ar.get("do_o", N, GR, pb.Dv)).sum(dim=-1, keepdim=True)  # D_i = Σ_d dO_id O_id
    neg_d_t = d_i.transpose(1, 2).neg()  # −Dᵀ: (N, 1, G·r)
    # dropout: dO / (1 - p), the factor of every kept entry, applied once per row block
    do_kept = torch.mul(do, pb.keep_scale, out=ar.get("do_kept", N, GR, pb.Dv)) if pb.dropout_p > 0.0 else None
    dq_acc = ar.get("dq", N, GR, pb.D).zero_()
    # The blocks are computed transposed, (N, c, G·r): then three of the four matmuls that read them
    # (dV, dp, dK) take them as they are laid out, and only dQ reads a transposed operand.
    t_name = None if pb.softcap is None else "t"  # softcap: tanh(x)ᵀ kept for 1 − t²: (N, c, G·r)
    for cols, masked in blocks:
        _count("backward")
        if trace.active():
            _note_tile(pb, c, rows, cols, masked, "backward", "recompute")
        j0, j1 = cols
        # pᵀ: exp(s − lse), in place: (N, c, G·r); softcap by the fused kernel: the t buffer holds
        # (p · (1 − t²))ᵀ then, else tᵀ
        p_t = pb.scores(c, qs, kc, rows, cols, ar, "p", transposed=True, shift=neg_lse2, masked=masked, t_name=t_name,
                        exp2=True)  # fmt: skip
        fused = t_name is not None and pb.fuses_exp2(rows, cols, masked, True)
        dp_t = ar.get("dp", *p_t.shape)  # (N, c, G·r)
        if do_kept is not None:  # dropout: p̃ = Z∘p/(1-p), and dp reads v through the same Z/(1-p)
            z_t = pb.dropout_keep(c, rows, cols).transpose(1, 2)  # Zᵀ: (N, c, G·r) bool
            torch.bmm(vc[:, j0:j1], do_kept.transpose(1, 2), out=dp_t)  # (v_j · dO_i)ᵀ / (1-p)
            pz_t = torch.mul(p_t, z_t, out=ar.get("pz", *p_t.shape))  # (Z∘p)ᵀ
            _add_bmm(dv[:, j0:j1], pz_t, do_kept, ar)  # dV_j += Σ_i p̃_ij dO_i
            dp_t.mul_(z_t).add_(neg_d_t)  # Z∘dp/(1-p) - D_i
        else:
            torch.baddbmm(neg_d_t, vc[:, j0:j1], do.transpose(1, 2), out=dp_t)  # (dp_ij - D_i)ᵀ
            _add_bmm(dv[:, j0:j1], p_t, do, ar)  # dV_j += Σ_i p_ij dO_i
        if fused:  # softcap's ds · (1 − t²) at once: p (dp − D) (1 − t²); no bias (it would need ds itself)
            assert t_name is not None and dbias is None
            ds_t = dp_t.mul_(ar.get(t_name, *dp_t.shape))
        else:
            ds_t = dp_t.mul_(p_t)  # ds_ij = p_ij (dp_ij - D_i): gradient of the natural-log score
        if dbias is not None:
            _add_dbias(dbias, c, rows, cols, ds_t.transpose(1, 2))
        if t_name is not None and not fused:  # softcap: times d(softcap·tanh(x))/d(scale·q·k) = 1 − t²
            t_t = ar.get(t_name, *ds_t.shape)  # tᵀ, as ``scores`` left it: (N, c, G·r)
            _TANH_BACKWARD(ds_t, t_t, grad_input=ds_t)  # ds · (1 − t²), one pass
        dq_acc.baddbmm_(ds_t.transpose(1, 2), kc[:, j0:j1])  # dQ_i += Σ_j ds_ij k_j   (· scale at the end)
        _add_bmm(dk[:, j0:j1], ds_t, qs, ar)  # dK_j += Σ_i ds_ij q_i · scale · log2 e   (or see dk_factor)
    g = c.block(dq, rows)  # (nb, nh·G, r, D), a view
    torch.mul(dq_acc.view(g.shape), pb.scale, out=g)  # dQ_i = scale · Σ_j ds_ij k_j


# Softcap by expm1: 2x clamped to ±this when it could overflow (see ``_Problem.__init__``)
_EXPM1_CLAMP = 40.0
_EXPM1_FASTER: dict[str, bool] = {}  # per device type, decided once (``_expm1_faster``)


# softcap's ways to take tanh (``_tanh_route``): the fused C kernel (``softcap_cpu``), e / (e + 2)
# with e = expm1(2x), torch's tanh
TANH_ROUTES = ("kernel", "expm1", "torch")


def _tanh_code(name: str) -> int:
    """``_SIZES["tanh"]`` for a route's name ("auto": 0)."""
    if name == "auto":
        return 0
    if name not in TANH_ROUTES:
        raise ValueError(f"tanh: expected 'auto' or one of {TANH_ROUTES}, got {name!r}")
    return TANH_ROUTES.index(name) + 1


def _tanh_route(q: Tensor, k: Tensor, scale: float, softcap: float, acc: torch.dtype) -> tuple[str, bool]:
    """How softcap takes its tanh, and whether 2x is clamped to ±``_EXPM1_CLAMP`` first (expm1
    only, where some 2x could overflow expm1; tanh(20) is ±1 exactly, in float32 and float64).
    The C kernel where it applies (float32 on CPU) and is available; else ``e / (e + 2)``,
    ``e = expm1(2x)``, where that is faster than torch's tanh (``_expm1_faster``, asked first: the
    bound costs a read-back) and every 2x is finite; else torch's tanh. A route forced by
    ``block_sizes(tanh=...)`` is taken where it applies; forcing the kernel where it does not build
    is an error."""
    forced = _SIZES["tanh"]
    want = TANH_ROUTES[forced - 1] if forced else None
    kernel_applies = acc == torch.float32 and q.device.type == "cpu"
    if want == "kernel" and kernel_applies and not softcap_cpu.available():
        raise RuntimeError(f"flash: the softcap kernel was forced but is not available: {softcap_cpu.why()}")
    if want in (None, "kernel") and kernel_applies and softcap_cpu.available():
        return "kernel", False
    if want in ("torch", "kernel") or (want is None and not _expm1_faster(q.device)):
        return "torch", False
    bound = _product_bound(q, k, 2.0 * scale / softcap)
    if bound >= torch.finfo(acc).max / 16:
        return "torch", False
    return "expm1", bound > _EXPM1_CLAMP


def _expm1_(x: Tensor, clamp: bool) -> Tensor:
    """``e = expm1(x)`` in place, x clamped to ±``_EXPM1_CLAMP`` first when ``clamp``."""
    return (x.clamp_(-_EXPM1_CLAMP, _EXPM1_CLAMP) if clamp else x).expm1_()


def _expm1_faster(device: torch.device) -> bool:
    """Whether ``e = expm1(y)``, ``e + 2`` and a division (three passes) beat one ``torch.tanh``
    here. torch's CPU tanh is MKL's where torch has MKL: as fast as exp2 on the Intel VMs of
    docs/benchmarks.md, but 9× exp2 on the AMD EPYC one (MKL takes a slow path on other vendors'
    CPUs), where the three passes take 0.57 of it (0.76 against 1.33 ms on 512k floats, one
    thread). So: yes on a CPU that is not Intel's when torch has MKL; no without MKL (tanh is then
    Sleef's, as expm1 is) and on other devices (tanh is one cheap kernel there). A timing at run
    time was tried and dropped: on a busy 2-core VM it picked either way."""
    if device.type != "cpu":
        return False
    got = _EXPM1_FASTER.get(device.type)
    if got is None:
        mkl = torch.backends.mkl.is_available()
        got = _EXPM1_FASTER[device.type] = mkl and softcap_cpu.cpuinfo("vendor_id") not in ("", "GenuineIntel")
    return got


# ds · (1 − t²) in one pass (ATen's derivative of tanh, given its output t), written into ds
_TANH_BACKWARD = torch.ops.aten.tanh_backward.grad_input


def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype`` (itself when it is already: no dispatch at all)."""
    return x if x.dtype == dtype else x.to(dtype)


def _in(ar: Arena, name: str, x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype``: itself, or converted into the arena's buffer ``name``."""
    return x if x.dtype == dtype else ar.get(name, *x.shape).copy_(x)


def _add_bmm(dst: Tensor, a: Tensor, b: Tensor, ar: Arena) -> None:
    """``dst += a @ b`` (batched). ``dst`` is a block of rows of a longer (N, Lk, E) buffer, not
    contiguous when N > 1, where ``baddbmm_`` would fall back to one matmul per batch entry: one
    batched matmul into the arena and one add are faster."""
    if dst.is_contiguous():
        dst.baddbmm_(a, b)
        return
    dst.add_(torch.bmm(a, b, out=ar.get("tmp", *dst.shape)))


def _add_dbias(dbias: Tensor, c: _Chunk, rows: tuple[int, int], cols: tuple[int, int], ds: Tensor) -> None:
    """dbias += ds, summed over the dims where bias broadcasts (size 1)."""
    ds4 = ds.reshape(c.b1 - c.b0, -1, rows[1] - rows[0], cols[1] - cols[0])  # (nb, nh·G, r, c)
    dims = [d for d in range(4) if dbias.shape[d] == 1 and ds4.shape[d] > 1]
    part = ds4.sum(dim=dims, keepdim=True) if dims else ds4
    target = c.heads(block_of(dbias, rows, cols))  # a view into dbias
    target.add_(part)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None,
        options: dict[str, Any],
    ) -> tuple[Tensor, Tensor]:
        out, lse, shifted = _forward_parts(
            q, k, v, options["mask"], bias, options["causal"], options["window"], options["scale"],
            options["dropout_p"], options["dropout_seed"], options["softcap"],
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, bias, out, lse, shifted)
        ctx.options = options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        del dlse  # lse is returned as non-differentiable
        q, k, v, bias, out, lse, shifted = ctx.saved_tensors
        if reference.needs_graph(dout):  # create_graph=True, or a batched dout: autograd through the formula
            needs = tuple(ctx.needs_input_grad[:4])
            return (*reference.backward_with_graph(dout, q, k, v, bias, needs, **ctx.options), None)
        dq, dk, dv, dbias = backward(
            dout, q, k, v, out, lse, bias=bias, bias_grad=ctx.needs_input_grad[3], shifted_lse=shifted, **ctx.options
        )
        return dq, dk, dv, dbias, None


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | Mask | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    scale: float,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    need_lse: bool = True,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The backend entry used by ``functional.py``: ``(out (B, Hq, Lq, Dv), lse (B, Hq, Lq))``,
    differentiable in q, k, v and bias (lse is not). ``need_lse=False``: lse may be None (a call
    that fits one key block then skips computing it; ``forward`` takes that path too, with the lse,
    so the output is the same either way)."""
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias))
    if not needs_grad and not need_lse and _softmax_applies(q, k, mask, bias, causal, window, dropout_p):
        return _forward_softmax(q, k, v, causal, scale, with_lse=False, softcap=softcap)
    options: dict[str, Any] = {
        "mask": mask,
        "causal": causal,
        "window": window,
        "scale": scale,
        "dropout_p": dropout_p,
        "dropout_seed": dropout_seed,
        "softcap": softcap,
    }
    if not needs_grad:
        return forward(q, k, v, bias=bias, **options)
    out, lse = _FlashAttention.apply(q, k, v, bias, options)
    return out, lse


__all__ = ["COUNTS", "attention", "backward", "block_sizes", "forward"]
