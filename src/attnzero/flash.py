"""The same function as ``reference.py``, tiled: an online softmax over key/value blocks
(FlashAttention-2) in plain PyTorch, with its own backward. Extra memory is O(L), not O(L²).

Read it beside ``docs/MATH.md``: section 3 is ``_forward_block``, section 4 is ``_backward_block``,
section 5 their dropout, section 7 which blocks are visited (``_Problem.key_blocks``). In one
sentence: walk the keys in blocks, keep for every query row a running max ``m``, a running sum
``l`` and an unnormalised output ``acc``, rescale what was accumulated whenever the max grows, and
divide by ``l`` at the end. The backward never stores P: it recomputes each block of it from the
saved output and log-sum-exp.

Letters: B batch, Hq / Hkv query / key-value heads, G = Hq // Hkv, Lq / Lk query / key length,
D head dim of q and k, Dv of v; ``r`` / ``c`` the query rows (per head) / key columns of one block.
A *chunk* is a run of batches ``[b0, b1)`` with every head, N = (b1 − b0)·Hkv (batch, kv head)
pairs; the G query heads that share a key/value head are stacked along the row axis (as
``reference.py`` does), so one batched matmul per block serves the whole group and K/V are never
repeated: a block of scores is ``(N, G·r, c)``, which is also ``(b1 − b0, Hq, r, c)`` viewed.

Precision: scores, ``m``, ``l``, ``acc`` and the gradients are float32 for 16/32-bit inputs and
float64 for float64 (``reference.accum_dtype``). Exponentials are natural (``exp``), as in MATH.md.

Variants. Every block of scores comes from one step, ``_Problem.score``: ``s = scale · q kᵀ``, then
the cap (``softcap · tanh(s / softcap)``), the bias, and −inf where the mask, causal or window
block a pair — evaluated only on the blocks where something is blocked. The forward and the
backward block functions take whatever ``score`` gives; a new variant (a score_mod) is a change of
``score`` and of the factor the backward multiplies ``ds`` by (``1 − t²`` for the cap).

Blocks: ``BLOCK`` query rows × key columns unless a call passes ``block=``; ``block_sizes(rows,
cols)`` sets it for the calls made inside a ``with`` in this thread (context) only — the ladder
and the tests draw small tiles through ``az.attention``. ``COUNTS`` counts the visited blocks;
while ``attnzero.trace`` records, each is also noted as a "flash.tile" event.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor

from . import dropout, geometry, mods, reference, sinks, trace
from .geometry import Range
from .masks import Mask, block_of, keep_block, unchanged, version_of
from .reference import accum_dtype

NEG_INF = float("-inf")

# Query rows (per head) × key columns of one block: measured once on a 2-core CPU
# (docs/benchmarks.md, "flash.py without the kernel"); any sizes give the same result.
BLOCK = (128, 128)
_BLOCK: ContextVar[tuple[int, int]] = ContextVar("attnzero_flash_block", default=BLOCK)

# Blocks visited by the forward and the backward (read by tests and the ladder).
COUNTS: dict[str, int] = {"forward": 0, "backward": 0}

# An lse beyond ± this (float32 ulp 2⁻¹³ or coarser) is taken out of its row's scores in the backward
# (``row_shift``): an additive mask's −1e4 … finfo.min on every key kept; natural scores stay below.
ROW_SHIFT_MIN = 1024.0


@contextmanager
def block_sizes(rows: int | None = None, cols: int | None = None) -> Iterator[None]:
    """Blocks of ``rows`` query rows × ``cols`` key columns for the flash calls made inside the
    ``with`` in this context (a side not given keeps its current size)."""
    old = _BLOCK.get()
    token = _BLOCK.set((rows or old[0], cols or old[1]))
    try:
        yield
    finally:
        _BLOCK.reset(token)


class _Problem:
    """The trusted arguments of one call, and how to read one block of scores from them."""

    def __init__(
        self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | Mask | None, bias: Tensor | None, causal: bool,
        window: tuple[int | None, int | None] | None, scale: float, softcap: float | None, dropout_p: float,
        dropout_seed: int, block: tuple[int, int] | None, score_mod: mods.ScoreMod | None = None,
        shift: Tensor | None = None,
    ) -> None:  # fmt: skip
        self.q, self.k, self.v = q, k, v
        self.B, self.Hq, self.Lq, self.D = q.shape
        self.Hkv, self.Lk, self.Dv = k.shape[1], k.shape[2], v.shape[3]
        self.G = self.Hq // self.Hkv
        self.acc = accum_dtype(q.dtype)
        self.mask, self.bias, self.causal, self.window = mask, bias, causal, window
        self.scale, self.softcap, self.score_mod = scale, softcap, score_mod
        # The captured tensors' gradients, summed over blocks by the backward (score_mod only).
        self.captured: list[Tensor] = mods.captured_tensors(score_mod) if score_mod is not None else []
        self.dcaptured: list[Tensor | None] = [None] * len(self.captured)
        self.dropout_p, self.dropout_seed = dropout_p, dropout_seed
        self.rows, self.cols = block or _BLOCK.get()
        # The backward's row shift c (``row_shift``): scores s − c, (B, Hq, Lq, 1), or None.
        self.shift = shift

    def chunks(self) -> list[Range]:
        """Runs of batches computed together: all of them, or one each where a Mask's documents or
        padding differ per batch (each batch then skips its own blocks)."""
        per_batch = isinstance(self.mask, Mask) and self.mask.segments is not None and self.mask.shape[0] > 1
        return [(b, b + 1) for b in range(self.B)] if per_batch else [(0, self.B)]

    def key_blocks(self, batches: Range, rows: Range) -> list[tuple[Range, bool]]:
        """The key blocks ``(cols, masked)`` that query rows ``rows`` visit (docs/MATH.md section 7):
        within the keys causal / window and a Mask leave, without the blocks that either blocks
        whole; ``masked``: the mask is evaluated on the block (a dense mask always, a Mask where it
        is PARTIAL). Causal / window are applied by ``score`` where they cut the block."""
        lo, hi = geometry.key_range(rows, self.Lq, self.Lk, self.causal, self.window)
        structured = self.mask if isinstance(self.mask, Mask) else None
        if structured is not None and lo < hi:
            m_lo, m_hi = structured.key_range(batches, rows)
            lo, hi = max(lo, m_lo), min(hi, m_hi)
        blocks = []
        for j0 in range(lo, hi, self.cols):
            cols = (j0, min(hi, j0 + self.cols))
            by_position = geometry.classify(rows, cols, self.Lq, self.Lk, self.causal, self.window)
            by_mask = geometry.PARTIAL if self.mask is not None else geometry.FULL  # a dense mask: evaluated
            if structured is not None:
                by_mask = structured.classify(batches, rows, cols)
            if geometry.SKIP not in (by_position, by_mask):
                blocks.append((cols, by_mask is geometry.PARTIAL))
        return blocks

    def q_rows(self, t: Tensor, batches: Range, rows: Range) -> Tensor:
        """Rows ``rows`` of a (B, Hq, Lq, E) tensor, group heads stacked: (N, G·r, E), accumulator dtype."""
        x = t[batches[0] : batches[1], :, rows[0] : rows[1]]  # (nb, Hq, r, E) = (nb, Hkv, G, r, E)
        return x.reshape(-1, self.G * (rows[1] - rows[0]), x.shape[-1]).to(self.acc)  # (N, G·r, E)

    def kv(self, t: Tensor, batches: Range) -> Tensor:
        """k or v (B, Hkv, Lk, E) of a chunk: (N, Lk, E), accumulator dtype (a view when it is already)."""
        x = t[batches[0] : batches[1]]  # (nb, Hkv, Lk, E)
        return x.reshape(-1, x.shape[2], x.shape[3]).to(self.acc)  # (N, Lk, E)

    def score(
        self, s: Tensor, batches: Range, rows: Range, cols: Range, masked: bool
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """One block of scores from ``s = q kᵀ`` (N, G·r, c): ``scale · s``, the user's ``score_mod``,
        capped, plus the bias (less the row shift), −inf where causal / window cut the block and, if
        ``masked``, where the mask blocks (docs/MATH.md sections 1 and 2). Returns the scores,
        ``t = tanh(y / softcap)`` (None without softcap; y the score the cap takes), whose ``1 − t²``
        the backward needs, and ``x = scale · q·k`` before the mod (None without one), which its
        backward needs. Forward and backward both take their scores from here: a variant is a step
        here."""
        s4 = s.view(batches[1] - batches[0], self.Hq, rows[1] - rows[0], cols[1] - cols[0])  # (nb, Hq, r, c)
        s4.mul_(self.scale)  # s = scale · q·k
        x = None
        if self.score_mod is not None:  # s = score_mod(s, b, h, q_idx, kv_idx): a new block
            x = s4
            s4 = mods.score_block(self.score_mod, x, batches=batches, heads=(0, self.Hq), rows=rows, cols=cols)
            s = s4.view(s.shape)
        t = None
        if self.softcap is not None:
            t = torch.tanh(s4 / self.softcap)  # t = tanh(s / softcap)
            torch.mul(t, self.softcap, out=s4)  # s = softcap · t
        if self.bias is not None:
            s4.add_(block_of(self.bias, rows, cols, batches))  # s = s + b
        if self.shift is not None:
            s4.sub_(block_of(self.shift, rows, (0, 1), batches))  # s = s − c (the row's shift)
        mask = self.mask if masked else None
        keep = keep_block(mask, self.causal, self.window, self.Lq, self.Lk, rows, cols, s.device)  # None: all kept
        if keep is not None:  # (B|1, Hq|1, r, c) or (r, c): this chunk's batches
            s4.masked_fill_(block_of(keep, (0, s4.shape[2]), (0, s4.shape[3]), batches).logical_not(), NEG_INF)
        return s, None if t is None else t.view(s.shape), x

    def dropout_keep(self, batches: Range, rows: Range, cols: Range) -> Tensor | None:
        """Z for one block, (N, G·r, c) bool: the entries ``dropout.keep_mask`` keeps for the whole
        (B, Hq, Lq, Lk) problem; None without dropout."""
        if self.dropout_p == 0.0:
            return None
        z = dropout.keep_mask(
            self.dropout_seed, self.dropout_p, (self.B, self.Hq, self.Lq, self.Lk), rows, cols, self.q.device,
            batches=batches,
        )  # (nb, Hq, r, c)  # fmt: skip
        return z.view(-1, self.G * (rows[1] - rows[0]), cols[1] - cols[0])  # (N, G·r, c)

    def visit(self, pass_: str, batches: Range, rows: Range) -> Iterator[tuple[Range, bool]]:
        """``key_blocks``, each block counted in ``COUNTS[pass_]`` and, while ``attnzero.trace``
        records, noted as a "flash.tile" event (rows that visit none: "flash.rows_empty")."""
        blocks, chunk = self.key_blocks(batches, rows), (*batches, 0, self.Hkv)
        if not blocks and trace.active():
            trace.note("flash.rows_empty", pass_=pass_, chunk=chunk, rows=rows)
        for cols, masked in blocks:
            COUNTS[pass_] += 1
            if trace.active():
                edge = geometry.classify(rows, cols, self.Lq, self.Lk, self.causal, self.window) is not geometry.FULL
                trace.note("flash.tile", pass_=pass_, chunk=chunk, rows=rows, cols=cols, masked=masked, edge=edge)
            yield cols, masked


class _Softmax:
    """The running statistics of a block of query rows (docs/MATH.md section 3): the max ``m`` and
    the sum ``l`` (N, G·r, 1), the unnormalised output ``acc`` (N, G·r, Dv)."""

    def __init__(self, n: int, rows: int, dv: int, dtype: torch.dtype, device: torch.device) -> None:
        self.m = torch.full((n, rows, 1), NEG_INF, dtype=dtype, device=device)  # −inf: no kept key yet
        self.l = torch.zeros((n, rows, 1), dtype=dtype, device=device)
        self.acc = torch.zeros((n, rows, dv), dtype=dtype, device=device)


def _forward_block(st: _Softmax, s: Tensor, v: Tensor, z: Tensor | None) -> None:
    """One step of the online softmax: scores ``s`` (N, G·r, c) of one key block against its
    values ``v`` (N, c, Dv); ``z``: dropout's keep-mask (N, G·r, c) or None."""
    m_new = torch.maximum(st.m, s.amax(dim=-1, keepdim=True))  # m_new = max(m, max_j s_ij)
    # A row that has met no kept key keeps m = −inf; 0 stands in for it inside exp, so that
    # exp(−inf − (−inf)) never occurs (its p and alpha are then exp(−inf) = 0).
    m_use = torch.where(m_new == NEG_INF, 0.0, m_new)
    alpha = torch.exp(st.m - m_use)  # alpha = exp(m − m_new): rescales what was accumulated
    p = s.sub_(m_use).exp_()  # p_ij = exp(s_ij − m_new), in place
    st.l.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))  # l = alpha·l + Σ_j p_ij
    if z is not None:
        p.mul_(z)  # dropout: Z∘p in acc (the 1 / (1 − p_drop) at the end), all of p in l
    st.acc.mul_(alpha).baddbmm_(p, v)  # acc = alpha·acc + Σ_j p_ij v_j
    st.m = m_new


def _forward(pb: _Problem, out_f32: bool = False) -> tuple[Tensor, Tensor]:
    """``(out (B, Hq, Lq, Dv) in q's dtype, lse (B, Hq, Lq))``, the lse of the scores as ``score``
    gives them (less the row shift, if any). ``out_f32``: a 16-bit call's out in float32, before its
    rounding (what a backward takes for D: MATH.md, section 4)."""
    wide = out_f32 and pb.q.dtype in (torch.float16, torch.bfloat16)
    out = torch.empty(pb.B, pb.Hq, pb.Lq, pb.Dv, dtype=torch.float32 if wide else pb.q.dtype, device=pb.q.device)
    lse = torch.empty(pb.B, pb.Hq, pb.Lq, dtype=pb.acc, device=pb.q.device)
    for batches in pb.chunks():
        k, v = pb.kv(pb.k, batches), pb.kv(pb.v, batches)  # (N, Lk, D), (N, Lk, Dv)
        for i0 in range(0, pb.Lq, pb.rows):
            rows = (i0, min(pb.Lq, i0 + pb.rows))
            q = pb.q_rows(pb.q, batches, rows)  # (N, G·r, D)
            st = _Softmax(q.shape[0], q.shape[1], pb.Dv, pb.acc, q.device)
            for cols, masked in pb.visit("forward", batches, rows):
                s, _, _ = pb.score(torch.bmm(q, k[:, cols[0] : cols[1]].transpose(1, 2)), batches, rows, cols, masked)
                _forward_block(st, s, v[:, cols[0] : cols[1]], pb.dropout_keep(batches, rows, cols))
            if pb.dropout_p > 0.0:
                st.acc.mul_(1.0 / (1.0 - pb.dropout_p))  # the kept entries' 1 / (1 − p_drop), once per row
            # O = acc / l, lse = m + log l; l = 0 (no kept key): O = 0, lse = −inf; l NaN (a NaN score): NaN
            seen = st.l != 0
            o = out[batches[0] : batches[1], :, rows[0] : rows[1]]  # (nb, Hq, r, Dv), a view
            o.copy_((st.acc / torch.where(seen, st.l, 1.0)).view(o.shape))
            row_lse = torch.where(seen, st.m + torch.log(st.l), NEG_INF)  # (N, G·r, 1)
            lse[batches[0] : batches[1], :, rows[0] : rows[1]] = row_lse.view(o.shape[:-1])
    return out, lse


@torch.no_grad()
def forward(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | Mask | None, bias: Tensor | None, causal: bool,
    window: tuple[int | None, int | None] | None, scale: float, dropout_p: float, dropout_seed: int,
    softcap: float | None = None, block: tuple[int, int] | None = None, score_mod: mods.ScoreMod | None = None,
    out_f32: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out (B, Hq, Lq, Dv) in q's dtype — a 16-bit call's in float32 with ``out_f32`` —, lse
    (B, Hq, Lq))`` by an online softmax over key blocks. A plain function (no autograd). Fully
    blocked rows: out 0, lse −inf."""
    pb = _Problem(q, k, v, mask=mask, bias=bias, causal=causal, window=window, scale=scale, softcap=softcap,
                  dropout_p=dropout_p, dropout_seed=dropout_seed, block=block, score_mod=score_mod)  # fmt: skip
    return _forward(pb, out_f32)


def row_shift(lse: Tensor, bias: Tensor | None, score_mod: mods.ScoreMod | None) -> Tensor | None:
    """The backward's row shift ``c`` (B, Hq, Lq, 1), or None: the lse in rows whose finite lse lies
    beyond ±``ROW_SHIFT_MIN``, with a mod or a bias that has such finite entries (an additive mask's
    −1e9 on every key a row keeps: its float32 lse keeps none of log n's bits — MATH.md section 2)."""
    if bias is None and score_mod is None:
        return None
    far = torch.isfinite(lse) & (lse.abs() > ROW_SHIFT_MIN)  # (B, Hq, Lq)
    if not bool(far.any()):
        return None
    if score_mod is None and bias is not None:  # a bias near 0 everywhere: q·k alone made the lse large
        if float(torch.where(torch.isfinite(bias), bias, 0.0).abs().amax()) <= ROW_SHIFT_MIN:
            return None
    return torch.where(far, lse, 0.0).unsqueeze(-1)  # (B, Hq, Lq, 1)


def _backward_block(
    pb: _Problem, s: Tensor, t: Tensor | None, lse: Tensor, d: Tensor, do: Tensor, q: Tensor, k: Tensor, v: Tensor,
    z: Tensor | None, through_mod: Any = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """One block of the backward (docs/MATH.md sections 4 and 5), from the scores ``s`` (N, G·r, c)
    and the cap's ``t``, the rows' ``lse`` and ``D`` (N, G·r, 1), their ``dO`` (N, G·r, Dv) and
    ``q`` (N, G·r, D), and the block's ``k`` (N, c, D) and ``v`` (N, c, Dv). Returns the block's
    shares ``(dQ (N, G·r, D), dK (N, c, D), dV (N, c, Dv), ds (N, G·r, c))``, ds the gradient of
    the score (the bias's)."""
    p = s.sub_(lse).exp_()  # p_ij = exp(s_ij − lse_i): 0 for blocked pairs (s = −inf)
    if z is None:
        dv = torch.bmm(p.transpose(1, 2), do)  # dV_j = Σ_i p_ij dO_i
        dp = torch.bmm(do, v.transpose(1, 2))  # dp_ij = dO_i · v_j
    else:  # dropout: p̃ = Z∘p / (1 − p_drop) in dV, and dp through the same Z / (1 − p_drop)
        keep_scale = 1.0 / (1.0 - pb.dropout_p)
        dv = torch.bmm((p * z).transpose(1, 2), do).mul_(keep_scale)  # dV_j = Σ_i p̃_ij dO_i
        dp = torch.bmm(do, v.transpose(1, 2)).mul_(z).mul_(keep_scale)  # Z_ij dp_ij / (1 − p_drop)
    ds = dp.sub_(d).mul_(p)  # ds_ij = p_ij (dp_ij − D_i): the gradient of the score s_ij
    dsx = ds if t is None else ds * (1.0 - t * t)  # softcap: through d(softcap·tanh(x/softcap))/dx = 1 − t²
    if through_mod is not None:
        dsx = through_mod(dsx)  # score_mod: dx = (∂ score_mod / ∂x) · dy (its captured tensors' share noted)
    dq = torch.bmm(dsx, k).mul_(pb.scale)  # dQ_i = scale · Σ_j ds_ij k_j
    dk = torch.bmm(dsx.transpose(1, 2), q).mul_(pb.scale)  # dK_j = scale · Σ_i ds_ij q_i (the G heads summed)
    return dq, dk, dv, ds


def _shifted_lse(pb: _Problem, lse: Tensor) -> Tensor:
    """The lse of the scores less the row shift, from the ``lse`` given. ``lse − c`` would keep none of
    the shifted lse's bits in a row whose bias is huge everywhere (``finfo.min``: the lse rounds to
    c), so this forward's own shifted lse is computed again (no dropout: it does not change the lse)
    and what the given lse adds to it — a sink, a ring's other keys — is added back: nothing, bitwise,
    when the lse is this forward's own."""
    assert pb.shift is not None
    undropped = copy.copy(pb)
    undropped.dropout_p = 0.0
    own = _forward(undropped)[1]  # (B, Hq, Lq)
    c = pb.shift.squeeze(-1)  # (B|1, Hq|1, Lq|1)
    return own + torch.where(own == NEG_INF, 0.0, lse - (own + c))


@torch.no_grad()
def backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, mask: Tensor | Mask | None,
    bias: Tensor | None, causal: bool, window: tuple[int | None, int | None] | None, scale: float, dropout_p: float,
    dropout_seed: int, bias_grad: bool = True, softcap: float | None = None, block: tuple[int, int] | None = None,
    score_mod: mods.ScoreMod | None = None, captured_grads: list[Tensor | None] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
    """``(dq, dk, dv, dbias)`` from the saved ``out`` and ``lse``, recomputing P block by block.
    dk / dv are summed over each GQA group; dbias has bias's (broadcast) shape, None without bias
    (or when ``bias_grad`` is False). With a ``score_mod``, the gradients of the tensors it captures
    (``mods.captured_tensors``) are written into ``captured_grads`` (None where it does not use one)."""
    shift = row_shift(lse, bias, score_mod)
    pb = _Problem(q, k, v, mask=mask, bias=bias, causal=causal, window=window, scale=scale, softcap=softcap,
                  dropout_p=dropout_p, dropout_seed=dropout_seed, block=block, score_mod=score_mod,
                  shift=None if shift is None else shift.to(accum_dtype(q.dtype)))  # fmt: skip
    if pb.shift is not None:
        lse = _shifted_lse(pb, lse)
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=pb.acc, device=q.device)  # (B, Hkv, Lk, D)
    dv = torch.zeros(v.shape, dtype=pb.acc, device=q.device)  # (B, Hkv, Lk, Dv)
    dbias = torch.zeros(bias.shape, dtype=pb.acc, device=q.device) if bias is not None and bias_grad else None
    for batches in pb.chunks():
        kc, vc = pb.kv(k, batches), pb.kv(v, batches)  # (N, Lk, D), (N, Lk, Dv)
        dk_c, dv_c = pb.kv(dk, batches), pb.kv(dv, batches)  # views into dk, dv: (N, Lk, D), (N, Lk, Dv)
        for i0 in range(0, pb.Lq, pb.rows):
            rows = (i0, min(pb.Lq, i0 + pb.rows))
            qr, do = pb.q_rows(q, batches, rows), pb.q_rows(dout, batches, rows)  # (N, G·r, D), (N, G·r, Dv)
            d = (do * pb.q_rows(out, batches, rows)).sum(dim=-1, keepdim=True)  # D_i = Σ_d dO_id O_id: (N, G·r, 1)
            lse_r = pb.q_rows(lse.unsqueeze(-1), batches, rows)  # (N, G·r, 1)
            lse_r = torch.where(lse_r == NEG_INF, 0.0, lse_r)  # a row with no key: its scores are all −inf
            dq_r = torch.zeros_like(qr)  # (N, G·r, D)
            for cols, masked in pb.visit("backward", batches, rows):
                kb, vb = kc[:, cols[0] : cols[1]], vc[:, cols[0] : cols[1]]  # (N, c, D), (N, c, Dv)
                s, t, x = pb.score(torch.bmm(qr, kb.transpose(1, 2)), batches, rows, cols, masked)
                through = None if x is None else _through_mod(pb, x, batches, rows, cols)
                dq_b, dk_b, dv_b, ds = _backward_block(pb, s, t, lse_r, d, do, qr, kb, vb,
                                                       pb.dropout_keep(batches, rows, cols), through)  # fmt: skip
                dq_r += dq_b
                dk_c[:, cols[0] : cols[1]] += dk_b
                dv_c[:, cols[0] : cols[1]] += dv_b
                if dbias is not None:  # db_ij = ds_ij, summed over the dims where the bias broadcasts
                    ds4 = ds.view(batches[1] - batches[0], pb.Hq, rows[1] - rows[0], cols[1] - cols[0])
                    target = block_of(dbias, rows, cols, batches)  # a view into dbias
                    dims = [i for i in range(4) if target.shape[i] == 1 and ds4.shape[i] > 1]
                    target += ds4.sum(dim=dims, keepdim=True) if dims else ds4
            g = dq[batches[0] : batches[1], :, rows[0] : rows[1]]  # (nb, Hq, r, D), a view
            g.copy_(dq_r.view(g.shape))
    db = dbias.to(bias.dtype) if dbias is not None and bias is not None else None
    if captured_grads is not None:
        captured_grads[:] = pb.dcaptured
    return dq, dk.to(k.dtype), dv.to(v.dtype), db


def _through_mod(pb: _Problem, x: Tensor, batches: Range, rows: Range, cols: Range) -> Any:
    """The score_mod's step of the backward on one block: from the gradient of the modified score
    (N, G·r, c), the gradient of ``x = scale · q·k`` (the mod's derivative, by autograd on the block)
    — and the block's share of each captured tensor's gradient, added to ``pb.dcaptured``."""
    fn = pb.score_mod
    assert fn is not None

    def step(dy: Tensor) -> Tensor:
        dx, grads = mods.score_block_backward(
            fn, x, dy.view(x.shape), pb.captured, batches=batches, heads=(0, pb.Hq), rows=rows, cols=cols
        )  # (nb, Hq, r, c)
        pb.dcaptured = [a if g is None else g if a is None else a + g for a, g in zip(pb.dcaptured, grads)]
        return dx.view(dy.shape)  # (N, G·r, c)

    return step


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, sink: Tensor | None, options: dict[str, Any],
        *captured: Tensor,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        out, lse = forward(q, k, v, bias=bias, **options, out_f32=True)
        if sink is not None:  # the sink joins each row's softmax (sinks.py); the backward takes (O₂, lse₂)
            out, lse = sinks.fold(out, lse, sink)
        # the captured tensors: inputs so that they get gradients, saved so that one changed in place
        # before the backward is refused by autograd (the score_mod reads them itself)
        ctx.save_for_backward(q, k, v, bias, sink, out, lse, *captured)
        ctx.options, ctx.mask_seen = options, version_of(options["mask"])
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        del dlse  # lse is returned as non-differentiable
        q, k, v, bias, sink, out, lse, *_ = ctx.saved_tensors  # (unpacked: autograd's check of the captured)
        unchanged(ctx.mask_seen)  # (the same check for the mask, which is no input of the graph)
        needs = ctx.needs_input_grad  # (q, k, v, bias, sink, options, *captured)
        if reference.needs_graph(dout):  # create_graph=True, or a batched dout: autograd through the formula
            options = {key: value for key, value in ctx.options.items() if key != "block"}
            fn = options.get("score_mod")
            inputs = mods.captured_tensors(fn) if fn is not None else []  # the score_mod's captured tensors
            return reference.function_backward_with_graph(dout, q, k, v, bias, sink, needs, options, inputs)
        captured: list[Tensor | None] = []
        dq, dk, dv, dbias = backward(dout, q, k, v, out, lse, bias=bias, bias_grad=needs[3],
                                     captured_grads=captured, **ctx.options)  # fmt: skip
        dsink = sinks.grad(dout, out, lse, sink) if sink is not None and needs[4] else None
        return dq, dk, dv, dbias, dsink, None, *captured


def attention(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | Mask | None = None, bias: Tensor | None = None,
    causal: bool = False, window: tuple[int | None, int | None] | None = None, scale: float, dropout_p: float = 0.0,
    dropout_seed: int = 0, need_lse: bool = True, softcap: float | None = None, block: tuple[int, int] | None = None,
    score_mod: mods.ScoreMod | None = None, sink: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The backend entry used by ``functional.py``: ``(out (B, Hq, Lq, Dv), lse (B, Hq, Lq))``,
    differentiable in q, k, v, bias, ``sink`` and the tensors a ``score_mod`` captures (lse is not).
    ``sink``: attention sinks (``sinks.py``; (Hq,) or (B, Hq, Lq)) folded into the result, here so that
    a score_mod's call keeps its captured tensors' gradients with them. The lse is always computed
    (``need_lse`` is the backends' common signature)."""
    del need_lse
    options: dict[str, Any] = {
        "mask": mask, "causal": causal, "window": window, "scale": scale, "dropout_p": dropout_p,
        "dropout_seed": dropout_seed, "softcap": softcap, "block": block or _BLOCK.get(),
    }  # fmt: skip
    captured: list[Tensor] = []
    if score_mod is not None:
        options["score_mod"] = score_mod
        captured = mods.captured_tensors(score_mod)
    inputs = (q, k, v, bias, sink, *captured)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)):
        if sink is None:
            return forward(q, k, v, bias=bias, **options)
        out, lse = sinks.fold(*forward(q, k, v, bias=bias, **options, out_f32=True), sink)
        return out.to(q.dtype), lse  # (rounded once, after the fold: as with a gradient)
    out, lse = _FlashAttention.apply(q, k, v, bias, sink, options, *captured)
    return out, lse


__all__ = ["BLOCK", "COUNTS", "attention", "backward", "block_sizes", "forward"]
