"""Ring attention over ``torch.distributed``: a sequence too long for one device, split across W ranks.

Each rank holds a slice of the sequence — its queries and the keys/values of the same positions.
The key/value blocks travel around a ring of ranks (rank r sends to r+1 and receives from r-1), so
after W steps every rank has seen every block, and no rank ever holds more than two blocks::

    step 0:  rank 0 holds K/V 0   rank 1 holds K/V 1   rank 2 holds K/V 2
    step 1:  rank 0 holds K/V 2   rank 1 holds K/V 0   rank 2 holds K/V 1
    step 2:  rank 0 holds K/V 1   rank 1 holds K/V 2   rank 2 holds K/V 0

At each step a rank attends its queries to the block it holds with the backend that
``functional.choose`` picks for this rank's inputs, as ``az.attention(backend="auto")`` would (the
Triton kernels on CUDA, the flash or reference backend on the CPU, flash for float64), whose plain
forward returns the block's output and log-sum-exp; the partial results merge by log-sum-exp
(docs/MATH.md, "Merging partial results"), in float32 (float64 for float64 inputs). The
send/receive of the next block is posted before the current block is computed, so communication
overlaps computation.

The backward walks the same ring. Each rank recomputes, block by block, its contribution to dQ (kept
at home) and to the dK/dV of the block it holds — the backend's backward, given the GLOBAL output and
log-sum-exp, gives exactly the block's share; those dK/dV partial sums travel with the block and
one last hop brings each block's finished dK/dV back to its owner.

Layouts (the sequence is cut into equal chunks; W = world size)::

    "contiguous"  W chunks,  rank r holds chunk r:             r0 r0 | r1 r1 | r2 r2
    "zigzag"      2W chunks, rank r holds chunks r, 2W-1-r:     r0 | r1 | r2 | r2 | r1 | r0

With ``causal=True`` a block is either full, diagonal (causal inside) or skipped entirely, decided
from the global chunk positions by ``geometry.classify``. Contiguous is simple but unbalanced (rank
W-1 does W times the work of rank 0); zigzag gives every rank the same work: against a block from
an earlier rank all of its queries see only that rank's early chunk, against a block from a later
rank only its own late chunk of queries sees anything (and it sees both chunks).

Soft-capping (``softcap``) changes the scores of kept pairs only, so every step's backend applies it,
forward and backward. Attention sinks (``sinks``) are one more, virtual, key per query row: they are
added ONCE, after the merge of every step (``sinks.fold`` on the merged out and lse), never per step
(which would count the sink W times). The backward hands every step's backend the sink-folded global
out and lse — the sink is a key of value 0, so P = exp(s − lse) and Δ = rowsum(dO ∘ O) are then
exactly right — and computes this rank's dsinks from its own rows (``sinks.grad``), with no
communication.

A ``score_mod`` / ``mask_mod`` sees GLOBAL positions: a piece's local query ``i`` and key ``j`` are
handed to the user's function as ``pos_q[i]`` / ``pos_k[j]``, the positions in the whole sequence of
this rank's rows and of the held block's keys (``_positions``: both layouts, zigzag's two chunks
included). The score_mod runs on flash.py's tiles forward and backward; the backward's per-piece
gradients of the tensors it captures are summed into this rank's share (its query rows against every
key) and, as for dsinks, not reduced across ranks: the sum over the ranks is the whole gradient. A
mask_mod becomes, per piece, an ``az.masks.from_mod`` Mask, so the backend skips what it blocks.

Letters: B batch, Hq / Hkv query / key-value heads, L this rank's slice length, D head dim of q and
k, Dv head dim of v. Set the timeout of every wait with ``torch.distributed.init_process_group(...,
timeout=...)``: a rank that raises or dies makes the others fail with a clear error within it.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from . import checks, functional, geometry, masks, mods, ops, trace
from . import sinks as sinks_
from .reference import accum_dtype

__all__ = ["gather", "ring_attention", "shard"]

Layout = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")

# Tags of the point-to-point messages (gloo matches sends and receives by tag; NCCL ignores them).
_TAG_KV = 0  # k, v
_TAG_DKV = 2  # dk, dv

# dtypes that the shape agreement can name (anything else is reported as "other").
_DTYPES = (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
)  # fmt: skip
_MAX_DIMS = 8


# ---------------------------------------------------------------------------------------------
# The ring: who sends to whom, and transfers that can be waited on with a clear error


@dataclass(frozen=True)
class _Ring:
    group: Any  # a ProcessGroup, or None for the default group
    rank: int  # this rank's index in the group
    world: int  # number of ranks in the group
    to_next: int  # global rank of (rank + 1) % world
    from_prev: int  # global rank of (rank - 1) % world

    @staticmethod
    def of(group: Any) -> _Ring:
        """The ring of ``group`` (None = the default group), checked."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "group: expected an initialised torch.distributed process group "
                "(call torch.distributed.init_process_group first), got none"
            )
        outside = getattr(dist.GroupMember, "NON_GROUP_MEMBER", object())  # what new_group gives a rank outside it
        if group is not None and not isinstance(group, dist.ProcessGroup) and group != outside:
            raise TypeError(f"group: expected None or a torch.distributed ProcessGroup, got {type(group).__name__}")
        rank, world = (-1, 0) if group == outside else (dist.get_rank(group), dist.get_world_size(group))
        if rank < 0:
            raise ValueError("group: expected a process group that this rank belongs to, got one without it")

        def global_rank(r: int) -> int:
            return r if group is None else dist.get_global_rank(group, r)

        return _Ring(group, rank, world, global_rank((rank + 1) % world), global_rank((rank - 1) % world))

    def start(self, tensors: list[Tensor], tag: int, what: str) -> _Transfer:
        """Send ``tensors`` to the next rank and receive same-shaped ones from the previous rank."""
        if self.world == 1:  # a ring of one: the "next rank" is this one
            return _Transfer(self, [], tensors, what)
        sends = [t.contiguous() for t in tensors]
        recvs = [torch.empty_like(t) for t in sends]
        ops = [dist.P2POp(dist.isend, t, self.to_next, self.group, tag + i) for i, t in enumerate(sends)]
        ops += [dist.P2POp(dist.irecv, t, self.from_prev, self.group, tag + i) for i, t in enumerate(recvs)]
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise self.lost(what, e) from e
        return _Transfer(self, works, recvs, what)

    def lost(self, what: str, e: BaseException) -> RuntimeError:
        return RuntimeError(
            f"ring_attention: rank {self.rank} of {self.world} could not exchange {what} with its ring "
            f"neighbours (ranks {(self.rank - 1) % self.world} and {(self.rank + 1) % self.world}): another rank "
            "raised, died, or did not reach this step within the process group's timeout "
            f"(init_process_group(timeout=...)). Cause: {e}"
        )


@dataclass
class _Transfer:
    ring: _Ring
    works: list[Any]
    received: list[Tensor]
    what: str

    def wait(self) -> list[Tensor]:
        """Block until the exchange is done; the tensors received from the previous rank."""
        try:
            for w in self.works:
                w.wait()
        except RuntimeError as e:
            raise self.ring.lost(self.what, e) from e
        return self.received


def _agree(ring: _Ring, device: torch.device, what: str, fields: dict[str, int]) -> None:
    """Every rank passes the same ``fields`` (shapes, dtype, flags), or every rank raises
    ``ValueError`` naming the field and each rank's value. One tiny all_gather of integers."""
    mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=device)  # (F,)
    everyone = [torch.empty_like(mine) for _ in range(ring.world)]
    try:
        dist.all_gather(everyone, mine, group=ring.group)
    except RuntimeError as e:
        raise ring.lost(f"the {what} arguments' shapes", e) from e
    table = torch.stack(everyone).tolist()  # (W, F)
    for i, name in enumerate(fields):
        column = [row[i] for row in table]
        if len(set(column)) > 1:
            given = ", ".join(f"rank {r}: {_decode(name, x)}" for r, x in enumerate(column))
            raise ValueError(f"{what}: expected the same {name} on every rank of the group, got {given}")


def _decode(name: str, x: int) -> str:
    if name == "dtype":
        return str(_DTYPES[x]) if 0 <= x < len(_DTYPES) else "another dtype"
    if name == "scale":
        return repr(struct.unpack("<d", struct.pack("<q", x))[0])
    if name == "softcap":
        return "None" if x == 0 else repr(struct.unpack("<d", struct.pack("<q", x))[0])
    if name == "sinks":
        return ("None", "per head (Hq,)", "per query (B, Hq, L)")[x] if 0 <= x < 3 else str(x)
    if name in ("causal", "requires_grad", "score_mod", "mask_mod"):
        return str(bool(x))
    if name == "layout":
        return repr(LAYOUTS[x])
    return str(x)


def _shape_fields(prefix: str, x: Tensor) -> dict[str, int]:
    """ndim, dtype and the size of every dim (0 past the last one, up to ``_MAX_DIMS``)."""
    fields = {f"{prefix} ndim": x.ndim, "dtype": _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1}
    for d in range(_MAX_DIMS):
        fields[f"{prefix} size of dim {d}"] = x.shape[d] if d < x.ndim else 0
    return fields


def _comm_device(ring: _Ring, x: Tensor) -> torch.device:
    """Where the small agreement tensor lives: the inputs' device for NCCL, the CPU otherwise."""
    return x.device if dist.get_backend(ring.group) == "nccl" else torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# Which part of the block from rank `src` do this rank's queries see?

_Block = tuple[slice, slice, bool]  # (query rows, key columns, causal inside the block)


def _chunks_of(rank: int, L: int, world: int, layout: str) -> list[tuple[slice, int]]:
    """Rank ``rank``'s chunks of the sequence, in local order: (local slice, global start)."""
    if layout == "contiguous":
        return [(slice(0, L), rank * L)]
    half = L // 2  # zigzag: chunks rank and 2W-1-rank of 2W
    return [(slice(0, half), rank * half), (slice(half, L), (2 * world - 1 - rank) * half)]


def _span(parts: list[slice]) -> slice | None:
    """The slices as one, when they follow one another (None when they leave a gap)."""
    for a, b in itertools.pairwise(parts):
        if a.stop != b.start:
            return None
    return slice(parts[0].start, parts[-1].stop)


def _blocks(rank: int, src: int, L: int, causal: bool, layout: str, world: int) -> list[_Block]:
    """The pieces of (this rank's queries) × (rank ``src``'s keys) that may attend; L = slice length.

    Each (query chunk, key chunk) pair is classified on the global positions of the whole sequence
    (``geometry.classify``: SKIP, FULL or PARTIAL). Pieces:

    * the rank's own block: one call, causal inside whenever some pair is not FULL. Its queries and
      keys sit at the same positions in the same increasing order, so the block's own causal
      (Lq == Lk) is the global one — in both layouts;
    * another rank's block: chunks of equal length on one grid never straddle the diagonal (no
      PARTIAL), so it is the FULL pairs, as one call when they form a rectangle of neighbouring
      chunks (always, for both layouts), else one call per pair."""
    total = world * L
    mine, theirs = _chunks_of(rank, L, world, layout), _chunks_of(src, L, world, layout)
    kind = {
        (a, b): geometry.classify(
            (qa, qa + rows.stop - rows.start), (kb, kb + cols.stop - cols.start), total, total, causal, None
        )
        for a, (rows, qa) in enumerate(mine)
        for b, (cols, kb) in enumerate(theirs)
    }
    if all(k is geometry.SKIP for k in kind.values()):
        return []
    every = slice(0, L)
    if src == rank:
        return [(every, every, any(k is not geometry.FULL for k in kind.values()))]
    assert geometry.PARTIAL not in kind.values(), "a block of another rank straddles the diagonal"
    full = [(a, b) for (a, b), k in kind.items() if k is geometry.FULL]
    rows_in = sorted({a for a, _ in full})
    cols_in = sorted({b for _, b in full})
    row_span = _span([mine[a][0] for a in rows_in])
    col_span = _span([theirs[b][0] for b in cols_in])
    if len(full) == len(rows_in) * len(cols_in) and row_span is not None and col_span is not None:
        return [(row_span, col_span, False)]  # the FULL pairs form one rectangle
    return [(mine[a][0], theirs[b][0], False) for a, b in full]


def _note_step(pass_: str, ring: _Ring, step: int, src: int, L: int, layout: str, blocks: list[_Block]) -> None:
    """Instrumentation (``attnzero.trace``, drawn by the ladder's rung 9): one "ring.step" event —
    which block this rank holds at this step and the pieces of it that it computes. ``blocks`` in
    local indices (rows of this rank's slice, columns of the held block) and kind "full" or
    "diagonal" (causal inside); empty when the whole block is skipped. ``q_at`` / ``kv_at``: the
    global starts of the chunks (of ``chunk`` positions) that the local indices run through. Free
    when nothing records."""
    if not trace.active():
        return
    chunks = _chunks_of(ring.rank, L, ring.world, layout)
    trace.note(
        "ring.step", pass_=pass_, rank=ring.rank, world=ring.world, step=step, src=src, layout=layout,
        chunk=chunks[0][0].stop - chunks[0][0].start, q_at=[g for _, g in chunks],
        kv_at=[g for _, g in _chunks_of(src, L, ring.world, layout)],
        blocks=[(r.start, r.stop, c.start, c.stop, "diagonal" if d else "full") for r, c, d in blocks],
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# score_mod / mask_mod at global positions


def _positions(rank: int, L: int, world: int, layout: str, device: torch.device) -> Tensor:
    """The global positions (L,) int32 of rank ``rank``'s slice, in its local order."""
    chunks = _chunks_of(rank, L, world, layout)  # (local slice, global start) of each chunk
    return torch.cat([torch.arange(g, g + sl.stop - sl.start, dtype=mods.INDEX_DTYPE) for sl, g in chunks]).to(device)


@dataclass(frozen=True)
class _Mods:
    """The user's ``score_mod`` / ``mask_mod`` (either may be None) and the tensors the score_mod
    captures (``mods.captured_tensors``: they get gradients from the ring's backward)."""

    score_mod: mods.ScoreMod | None = None
    mask_mod: mods.MaskMod | None = None
    captured: tuple[Tensor, ...] = ()

    def on_piece(self, qpos: Tensor, kpos: Tensor, B: int, Hq: int) -> dict[str, Any]:
        """A backend's ``mask`` (and ``score_mod``) arguments for one piece whose local query ``i`` sits at
        global position ``qpos[i]`` and local key ``j`` at ``kpos[j]`` (int32 vectors): the mods
        called with global positions (an index into the vectors, which vmap batches)."""
        kw: dict[str, Any] = {"mask": None}
        user_score, user_mask = self.score_mod, self.mask_mod
        if user_score is not None:

            def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return user_score(score, b, h, qpos[q_idx], kpos[kv_idx])

            kw["score_mod"] = score_mod
        if user_mask is not None:

            def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return user_mask(b, h, qpos[q_idx], kpos[kv_idx])

            # The piece's blocks classified once (skip / partial / full): backends skip what it blocks.
            kw["mask"] = masks.from_mod(mask_mod, B, Hq, len(qpos), len(kpos), device=qpos.device)
        return kw


# ---------------------------------------------------------------------------------------------
# Forward and backward around the ring


def _part(t: Tensor, sl: slice, dtype: torch.dtype | None = None) -> Tensor:
    """``t[:, :, sl]`` (in ``dtype``, when given: a 16-bit piece computed in float32, its results
    not rounded before they are summed); a copy when it is a strict part (flash runs ~20% faster on
    dense inputs)."""
    part = t if sl.start == 0 and sl.stop == t.shape[2] else t[:, :, sl].contiguous()
    return part if dtype is None else part.to(dtype)


def _merge(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """In place: (out, lse) ← merge of (out, lse) and a block's (out_b, lse_b), the rule of docs/MATH.md.
    out (B, Hq, l, Dv) and lse (B, Hq, l) in the accumulator dtype."""
    new = torch.logaddexp(lse, lse_b)  # (B, Hq, l); -inf only when both parts are -inf
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))  # never exp(-inf - (-inf))
    out.mul_(torch.exp(lse - safe).unsqueeze(-1))
    out.add_(torch.exp(lse_b - safe).unsqueeze(-1) * out_b.to(out.dtype))
    lse.copy_(new)


def _ring_forward(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, causal: bool, scale: float, softcap: float | None,
    ring: _Ring, layout: str, backend: ops.Backend, mo: _Mods,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """This rank's (out (B, Hq, L, Dv), lse (B, Hq, L)), both in the accumulator dtype (float32 for
    16-bit inputs: each piece is computed, merged and kept for the backward unrounded — a piece's
    output rounded to 16 bits before the merge rounds it twice), the sink folded in once the steps
    are merged."""
    B, Hq, L, _ = q.shape
    pos_q = _positions(ring.rank, L, ring.world, layout, q.device)  # (L,) global positions of our queries
    acc = accum_dtype(q.dtype)
    out = torch.zeros(B, Hq, L, v.shape[-1], dtype=acc, device=q.device)  # (B, Hq, L, Dv)
    lse = torch.full((B, Hq, L), float("-inf"), dtype=acc, device=q.device)  # (B, Hq, L)
    kv = [k, v]
    for step in range(ring.world):
        # Post the exchange of the block for step + 1 first, then compute with the one we hold.
        nxt = ring.start(kv, _TAG_KV, "key/value blocks") if step + 1 < ring.world else None
        src = (ring.rank - step) % ring.world  # whose keys/values we hold now
        blocks = _blocks(ring.rank, src, L, causal, layout, ring.world)
        _note_step("forward", ring, step, src, L, layout, blocks)  # a no-op unless recording
        pos_k = _positions(src, L, ring.world, layout, q.device)  # (L,) global positions of the held keys
        for rows, cols, blk_causal in blocks:
            out_b, lse_b = backend.forward(
                _part(q, rows, acc), _part(kv[0], cols, acc), _part(kv[1], cols, acc),
                bias=None, causal=blk_causal, window=None, scale=scale, softcap=softcap,
                dropout_p=0.0, dropout_seed=0, **mo.on_piece(pos_q[rows], pos_k[cols], B, Hq),
            )  # fmt: skip
            _merge(out[:, :, rows], lse[:, :, rows], out_b, lse_b)
        if nxt is not None:
            kv = nxt.wait()
    if sinks is not None:  # once, on the merge of every step: one virtual key per row
        out, lse = sinks_.fold(out, lse, sinks.detach())  # (B, Hq, L, Dv), (B, Hq, L)
    return out, lse


def _ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    causal: bool, scale: float, softcap: float | None, ring: _Ring, layout: str, backend: ops.Backend, mo: _Mods,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor | None]]:  # fmt: skip
    """(dq, dk, dv) of this rank's slices, and this rank's share of the gradient of each tensor the
    score_mod captures (``mo.captured``; None where no piece used it): the terms of this rank's
    query rows, against every key. Blocks travel as in the forward; each block's dK/dV partial sum
    travels one hop behind it and reaches its owner after W hops. ``out`` and ``lse`` are the global
    ones, the sink folded in when there is one."""
    B, Hq, L, _ = q.shape
    if mo.score_mod is not None:  # the pin's check (each piece wraps it anew): it reaches the forward's tensors
        mods.captured_tensors(mo.score_mod)
    pos_q = _positions(ring.rank, L, ring.world, layout, q.device)  # (L,)
    dcaptured: dict[int, Tensor] = {}  # id(captured tensor) -> its gradient, summed over the pieces
    acc = accum_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, Hq, L, D)
    kv = [k, v]
    dkv: _Transfer | None = None  # the dK/dV partial sums in flight
    for step in range(ring.world):
        nxt = ring.start(kv, _TAG_KV, "key/value blocks") if step + 1 < ring.world else None
        src = (ring.rank - step) % ring.world
        dk_b = torch.zeros(k.shape, dtype=acc, device=k.device)  # (B, Hkv, L, D) of src's block
        dv_b = torch.zeros(v.shape, dtype=acc, device=v.device)  # (B, Hkv, L, Dv)
        blocks = _blocks(ring.rank, src, L, causal, layout, ring.world)
        _note_step("backward", ring, step, src, L, layout, blocks)  # a no-op unless recording
        pos_k = _positions(src, L, ring.world, layout, q.device)  # (L,)
        for rows, cols, blk_causal in blocks:
            # The backward recomputes P = exp(s - lse) with the GLOBAL out and lse, which gives
            # exactly this block's share of dq, dk, dv (and of the captured tensors' gradients).
            piece = mo.on_piece(pos_q[rows], pos_k[cols], B, Hq)
            grads: list[Tensor | None] = []
            if mo.score_mod is not None:
                piece["captured_grads"] = grads  # filled by flash.backward, in captured_tensors' order
            dq_p, dk_p, dv_p, _ = backend.backward(
                _part(dout, rows, acc), _part(q, rows, acc), _part(kv[0], cols, acc), _part(kv[1], cols, acc),
                _part(out, rows), _part(lse, rows),
                bias=None, causal=blk_causal, window=None, scale=scale, softcap=softcap,
                dropout_p=0.0, dropout_seed=0, **piece,
            )  # fmt: skip
            if grads:  # the piece's mod captures the user's tensors (and its own position vectors)
                for t, g in zip(mods.captured_tensors(piece["score_mod"]), grads):
                    if g is not None:
                        dcaptured[id(t)] = g if id(t) not in dcaptured else dcaptured[id(t)] + g
            dq[:, :, rows] += dq_p
            dk_b[:, :, cols] += dk_p
            dv_b[:, :, cols] += dv_p
        if dkv is not None:  # the sums of the ranks that held src's block before us
            dk_in, dv_in = dkv.wait()
            dk_b += dk_in
            dv_b += dv_in
        dkv = ring.start([dk_b, dv_b], _TAG_DKV, "dK/dV partial sums")
        if nxt is not None:
            kv = nxt.wait()
    assert dkv is not None
    dk, dv = dkv.wait()  # after W hops: this rank's own block, summed over every rank's queries
    dcap = [dcaptured.get(id(t)) for t in mo.captured]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dcap


class _NoSecondDerivative(torch.autograd.Function):
    """A gradient of the ring, as a function of the ring's inputs whose own derivative raises."""

    @staticmethod
    def forward(ctx: Any, grad: Tensor, *inputs: Tensor) -> Tensor:  # type: ignore[override]
        return grad

    @staticmethod
    def backward(ctx: Any, *_: Tensor) -> None:  # type: ignore[override]
        raise RuntimeError(
            "ring_attention: no second derivative through it (a gradient taken with create_graph=True); "
            "az.attention on one process has one"
        )


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, causal: bool, scale: float,
        softcap: float | None, ring: _Ring, layout: str, backend: ops.Backend, mo: _Mods, *captured: Tensor,
    ) -> Tensor:  # fmt: skip
        out, lse = _ring_forward(q, k, v, sinks, causal, scale, softcap, ring, layout, backend, mo)
        # the captured tensors: inputs so that they get gradients, saved so that one changed in place
        # before the backward is refused by autograd (the score_mod reads them itself)
        ctx.save_for_backward(q, k, v, sinks, out, lse, *captured)
        ctx.args = (causal, scale, softcap, ring, layout, backend, mo)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        saved = ctx.saved_tensors  # (read once: a non-reentrant checkpoint refuses a second unpacking)
        with torch.no_grad():
            grads = _RingAttention._grads(ctx, saved, dout)
        if not torch.is_grad_enabled():
            return grads
        # A graph of the gradients asked for (create_graph=True): a second derivative would need the
        # ring inside autograd, so each gradient comes back as a function of the ring's inputs whose
        # derivative raises (once_differentiable refused only when the incoming gradient needed one:
        # after loss = out.sum() a gradient penalty through the ring silently added nothing). A second
        # derivative that does not pass through the ring (a later layer's gradient) still runs. dout
        # counts among the inputs: a later layer's weight reaches the ring's gradients through it.
        q, k, v, sinks, _, _, *captured = saved
        inputs = [t for t in (q, k, v, sinks, dout, *captured) if t is not None and t.requires_grad]
        return tuple(None if g is None else _NoSecondDerivative.apply(g, *inputs) for g in grads)

    @staticmethod
    def _grads(ctx: Any, saved: tuple[Tensor, ...], dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, sinks, out, lse, *_ = saved  # (unpacked: autograd's check of the captured)
        dout = dout.contiguous()
        dq = dk = dv = dsinks = None
        mo: _Mods = ctx.args[-1]
        dcap: list[Tensor | None] = [None] * len(mo.captured)
        # The ring runs when q, k, v or a tensor the score_mod captures want a gradient — the same
        # on every rank (ring_attention agreed on it); dsinks alone needs no other rank.
        if any(ctx.needs_input_grad[:3]) or any(ctx.needs_input_grad[11:]):
            dq, dk, dv, dcap = _ring_backward(dout, q, k, v, out, lse, *ctx.args)
            dq, dk, dv = (g if need else None for g, need in zip((dq, dk, dv), ctx.needs_input_grad[:3]))
        if sinks is not None and ctx.needs_input_grad[3]:
            # This rank's rows only: for per-head sinks (Hq,) the sum over rows of this rank's
            # queries. Summed over the ranks (DDP, or all_reduce) it is the whole sequence's.
            dsinks = sinks_.grad(dout, out, lse, sinks.detach())  # sinks' shape and dtype
        # A captured tensor's gradient is this rank's share, like dsinks (summed over the ranks).
        dcap = [None if g is None else g.to(t.dtype) for g, t in zip(dcap, mo.captured)]
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None, *dcap


# ---------------------------------------------------------------------------------------------
# Public functions


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    group: Any = None,
    layout: Layout = "contiguous",
    score_mod: mods.ScoreMod | None = None,
    mask_mod: mods.MaskMod | None = None,
) -> Tensor:
    """Attention over a sequence split across the ranks of ``group``; every rank calls it at once.

    Args:
        q: (B, Hq, L, D), this rank's slice of the queries (dim 2; see ``layout``).
        k: (B, Hkv, L, D), the keys of the same positions. v: (B, Hkv, L, Dv). Query head ``h`` reads
            key/value head ``h // (Hq // Hkv)`` (GQA / MQA). Every rank passes the same shapes.
        causal: position i sees position j iff j <= i, positions counted over the whole sequence.
        scale: defaults to ``1 / sqrt(D)``.
        softcap: None, or a float > 0: each score ``s`` becomes ``softcap · tanh(s / softcap)``
            (Gemma 2), as in ``az.attention``.
        sinks: None, or attention-sink logits (gpt-oss): ``(Hq,)``, one per head — the same
            parameter on every rank (a replica, as every other weight of a data/sequence-parallel
            model) — or ``(B, Hq, L)``, one per query of this rank's slice (in the layout's order,
            as ``shard`` cuts it). A virtual key of value 0 in each row's softmax, as in
            ``az.attention``. Its gradient is this rank's share: the terms of this rank's query
            rows (for ``(Hq,)``, summed over them). The ring does not all-reduce it; like the
            gradients of every replicated parameter, the sum over the ranks — what DDP's reduction
            does (averaging, as for the other weights), or ``all_reduce`` — is the gradient over
            the whole sequence. ``(B, Hq, L)`` sinks get exactly their rows' gradient.
        group: a ``torch.distributed`` process group (None = the default one).
        layout: how the sequence of length W·L was cut (``shard`` does it): ``"contiguous"`` — rank r
            holds chunk r of W; ``"zigzag"`` — rank r holds chunks r and 2W-1-r of 2W (L even), which
            balances the causal work.
        score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score``, as in
            ``az.attention`` (applied to ``scale · q · k`` before ``softcap``; −inf blocks the pair),
            called with GLOBAL positions: ``q_idx`` / ``kv_idx`` count over the whole sequence of
            W·L positions, in either layout (what the mod would see in ``az.attention`` on the whole
            sequence). The same function on every rank. It runs on flash.py's tiles (as "auto" runs
            it in ``az.attention``). Tensors it captures get gradients; like ``sinks``, each rank's
            is its share — the terms of its query rows — and the sum over the ranks (DDP's
            reduction, or ``all_reduce``) is the whole sequence's gradient.
        mask_mod: FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend), with
            global positions as ``score_mod``; and-ed with ``causal``. Each piece of each step is
            classified by ``az.masks.from_mod`` (in its default blocks), so the backends skip the
            blocks it blocks; evaluated again by the backward. The same function on every rank.

    Returns:
        this rank's slice (B, Hq, L, Dv) of the attention output over the whole sequence, in q's
        dtype; differentiable w.r.t. q, k, v, ``sinks`` and the tensors ``score_mod`` captures (the
        backward is a second trip around the ring, so every rank must run it). Equal to
        ``az.attention`` on the whole sequence (with ``mask=az.masks.from_mod(mask_mod, ...)``).

    Raises ``ValueError`` / ``TypeError`` for bad arguments and, on every rank, for shapes, dtypes
    or flags that differ between ranks; ``RuntimeError`` when another rank raised, died or timed out.
    """
    B, Hq, Hkv, L, Lk = checks.qkv(q, k, v, empty_ok=True)  # (zero sizes: valid, DESIGN.md)
    if Lk != L:
        raise ValueError(f"k: expected this rank's slice of the same sequence as q (length {L}), got length {Lk}")
    is_causal = checks.flag("causal", causal)
    sc = checks.scale(scale, q.shape[-1])
    cap = checks.softcap(softcap)
    sink = checks.sinks(sinks, B, Hq, L, q.device)  # (Hq,) or (B, Hq, L): this rank's queries
    sink_kind = 0 if sink is None else (1 if sink.ndim == 1 else 2)  # none, per head, per query
    lay = checks.choice("layout", layout, LAYOUTS)
    if lay == "zigzag" and L % 2:
        raise ValueError(f"q: the zigzag layout holds two equal chunks per rank, so expected an even length, got {L}")
    fn = mods.check_callable("score_mod", score_mod)
    fn = None if fn is None else mods.pin(fn)  # the backward reads what this forward read (mods.pin)
    mm = mods.check_callable("mask_mod", mask_mod)
    mm = None if mm is None else mods.own_closure(mm)  # each piece's mask, forward and backward, as now
    mo = _Mods(fn, mm, tuple(mods.captured_tensors(fn)) if fn is not None else ())
    ring = _Ring.of(group)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *mo.captured))
    _agree(ring, _comm_device(ring, q), "ring_attention", {
        "B": B, "Hq": Hq, "Hkv": Hkv, "L": L, "D": q.shape[3], "Dv": v.shape[3],
        "dtype": _DTYPES.index(q.dtype), "causal": int(is_causal), "layout": LAYOUTS.index(lay),
        "scale": struct.unpack("<q", struct.pack("<d", sc))[0], "requires_grad": int(grad),
        "softcap": 0 if cap is None else struct.unpack("<q", struct.pack("<d", cap))[0], "sinks": sink_kind,
        "score_mod": int(fn is not None), "mask_mod": int(mm is not None),
    })  # fmt: skip
    if 0 in (B, Hq, L, v.shape[3]):  # an empty output (every rank agreed on the shapes): nothing to exchange
        inputs = [t for t in (q, k, v, sink, *mo.captured) if t is not None]
        none = sum((t.sum() * 0).to(q.dtype) for t in inputs)  # zero gradients, of the inputs' shapes
        return q.new_zeros(B, Hq, L, v.shape[3]) + none
    if q.shape[3] == 0:  # D = 0: every score is 0, as one column of zeros in q and k gives (as ops.py does)
        q, k = (torch.cat([x, x.new_zeros(*x.shape[:-1], 1)], dim=-1) for x in (q, k))
    # The backend, chosen as az.attention(backend="auto") chooses it (once, in functional.choose);
    # a score_mod runs on flash.py's tiles, as az.attention's "auto" runs it. Only the gradients of
    # q, k, v and the captured tensors need its backward (and the ring); the sinks' is computed here.
    name = "flash" if fn is not None else functional.choose("auto", q, k, needs_grad=grad, v=v)
    backend = ops.backend(name)
    out = _RingAttention.apply(q, k, v, sink, is_causal, sc, cap, ring, lay, backend, mo, *mo.captured)
    assert isinstance(out, Tensor)
    return out


def _chunks(name: str, x: Any, layout: str, ring: _Ring, length_of: str) -> int:
    """Checks ``x`` and returns the chunk length along dim 2."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 3 or x.ndim > _MAX_DIMS:
        raise ValueError(f"{name}: expected 3 to {_MAX_DIMS} dims (B, H, L, ...), got shape {tuple(x.shape)}")
    parts = ring.world if layout == "contiguous" else 2 * ring.world
    L = x.shape[2]
    if length_of == "whole":
        if L % parts:
            raise ValueError(
                f"{name}: expected a length (dim 2) divisible by {parts} ({layout} layout over {ring.world} "
                f"ranks), got {L}"
            )
        return L // parts
    if layout == "zigzag" and L % 2:
        raise ValueError(
            f"{name}: the zigzag layout holds two equal chunks per rank, so expected an even length, got {L}"
        )
    return L if layout == "contiguous" else L // 2


def shard(x: Tensor, layout: Layout = "contiguous", group: Any = None) -> Tensor:
    """This rank's part, along dim 2, of a whole-sequence tensor ``x`` (B, H, L, ...) that every rank
    holds: chunk r of W (``"contiguous"``) or chunks r and 2W-1-r of 2W (``"zigzag"``), L divisible
    by W (2W). A view (contiguous) or a copy (zigzag); differentiable."""
    lay = checks.choice("layout", layout, LAYOUTS)
    ring = _Ring.of(group)
    c = _chunks("x", x, lay, ring, "whole")
    first = x.narrow(2, ring.rank * c, c)  # (B, H, c, ...)
    if lay == "contiguous":
        return first
    last = x.narrow(2, (2 * ring.world - 1 - ring.rank) * c, c)  # (B, H, c, ...)
    return torch.cat([first, last], dim=2)  # (B, H, 2c, ...)


def gather(x: Tensor, layout: Layout = "contiguous", group: Any = None) -> Tensor:
    """The whole sequence from every rank's part ``x`` along dim 2 — the inverse of :func:`shard`.
    Every rank calls it and gets the whole (B, H, W·L, ...). A convenience for checks and outputs
    (it uses all_gather and is not differentiable); ring_attention never calls it."""
    lay = checks.choice("layout", layout, LAYOUTS)
    ring = _Ring.of(group)
    c = _chunks("x", x, lay, ring, "part")
    _agree(ring, _comm_device(ring, x), "gather", _shape_fields("x", x))
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(ring.world)]
    try:
        dist.all_gather(parts, x.detach().contiguous(), group=ring.group)  # W × (B, H, L, ...)
    except RuntimeError as e:
        raise ring.lost("the gathered parts", e) from e
    if lay == "contiguous":
        return torch.cat(parts, dim=2)  # (B, H, W·L, ...)
    early = [p.narrow(2, 0, c) for p in parts]  # chunks 0 .. W-1
    late = [p.narrow(2, c, c) for p in reversed(parts)]  # chunks W .. 2W-1
    return torch.cat(early + late, dim=2)  # (B, H, 2W·c, ...)
