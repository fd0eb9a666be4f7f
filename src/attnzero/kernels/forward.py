"""Triton forward kernel (FlashAttention-2): one program per (query block, batch·query head).

The program keeps its block of Q in registers and streams the key/value blocks that its queries can
see, with the online softmax of docs/MATH.md in base 2 (``qk_scale = scale · log2 e``; the stored lse
is converted back to natural log). With a bias or a score_mod the scores stay in natural log and a
difference ``s − m`` is taken to base 2 only inside ``exp2`` (``base2``): an additive mask's
``finfo.min`` times ``log2 e`` would overflow to −inf and block a key the row keeps.

Which key blocks are visited, for query rows ``[m0, m0 + BLOCK_M)`` at positions ``p = i + Lk - Lq``
with the (causal-folded) window ``p - left <= j <= p + right``::

      start        f_lo                f_hi        end
        |  LEADING  |     INTERIOR:     | TRAILING  |      blocks outside [start, end) are skipped;
        |  (left    |   no range checks |  (diagonal |      LEADING / TRAILING blocks check the window
        |   edge)   |                   |   and Lk)  |      and j < Lk element by element

``key_blocks`` computes these bounds and ``attend_keys`` walks them: one loop per part, unrolled at
compile time from a constexpr part number, so that every kernel calls its block loop once and only
the edge parts carry the range checks. A dense mask, a bias and dropout are applied in every visited
block (they are data, not ranges).

Softcap (``HAS_SOFTCAP``): the raw score ``x = scale·q·k`` becomes ``softcap·tanh(x / softcap)``
(``cap_scores``) *before* the bias and before any blocked pair is set to -inf (tanh(-inf) = -1
would un-block it). Segment ids (``HAS_SEGMENTS``, a document-style mask that is never densified):
pair (i, j) is kept iff ``q_id[i] == k_id[j]``, compared in the block, and the blocks outside the
key range ``[seg_lo, seg_hi)`` of the program's rows (computed on the host) are not visited.
The record (``attnzero.trace``, drawn by the ladder's rung 7): ``fwd_kernel`` has a ``TRACE``
constexpr, set only while a recording is open; then each program writes the key blocks it visits
into a Trace tensor (``trace_start``). With TRACE off nothing of the record is compiled.

Letters: B batch, Hq / Hkv query / key-value heads, G = Hq // Hkv, Lq / Lk lengths, D / Dv head dims
(padded to the powers of two BLOCK_D / BLOCK_DV with masked loads).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..constants import LN2, LOG2E  # plain floats for the host side (triton_backend reads LOG2E here)

# ---------------------------------------------------------------------------------------------
# Constants of the kernels (a @triton.jit function reads only module globals that are constexpr)

TO_BASE2: tl.constexpr = tl.constexpr(LOG2E)  # natural-log quantity → base 2 (bias, lse)
TO_NATURAL: tl.constexpr = tl.constexpr(LN2)  # base-2 lse → natural log
NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))  # a blocked score; the max / lse of a row that saw no key
POS_INF: tl.constexpr = tl.constexpr(float("inf"))

# lowbias32 (dropout.py's ``_mix32``): xor-shift, multiply, xor-shift, multiply, xor-shift
MIX_SHIFT_1: tl.constexpr = tl.constexpr(16)
MIX_MUL_1: tl.constexpr = tl.constexpr(0x7FEB352D)
MIX_SHIFT_2: tl.constexpr = tl.constexpr(15)
MIX_MUL_2: tl.constexpr = tl.constexpr(0x846CA68B)
MIX_SHIFT_3: tl.constexpr = tl.constexpr(16)
WORD_BITS: tl.constexpr = tl.constexpr(32)  # a 64-bit dropout counter is hashed as two 32-bit words
WORD_MASK: tl.constexpr = tl.constexpr(0xFFFFFFFF)

# The parts of a band of blocks (see the module docstring), visited in this order by every block loop
LEADING: tl.constexpr = tl.constexpr(0)  # before the interior: range checks
INTERIOR: tl.constexpr = tl.constexpr(1)  # every pair kept by position: no range checks
TRAILING: tl.constexpr = tl.constexpr(2)  # after the interior (causal diagonal, ragged last block): range checks
NUM_PARTS: tl.constexpr = tl.constexpr(3)

# tanh for the softcap: an odd polynomial (Taylor to x^11, relative error < 1e-7) below TANH_SMALL,
# where 1 - 2/(e^(2|x|) + 1) would lose digits to cancellation; that form above it (exact limit 1
# when e^(2|x|) overflows)
TANH_SMALL: tl.constexpr = tl.constexpr(0.4)
TANH_C3: tl.constexpr = tl.constexpr(-1.0 / 3.0)
TANH_C5: tl.constexpr = tl.constexpr(2.0 / 15.0)
TANH_C7: tl.constexpr = tl.constexpr(-17.0 / 315.0)
TANH_C9: tl.constexpr = tl.constexpr(62.0 / 2835.0)
TANH_C11: tl.constexpr = tl.constexpr(-1382.0 / 155925.0)
TWO_LOG2E: tl.constexpr = tl.constexpr(2.0 * LOG2E)  # e^(2a) = 2^(2a · log2 e)

# Segment ids outside the tensors (masked loads): never equal to each other or to a real id (>= 0)
NO_QUERY_ID: tl.constexpr = tl.constexpr(-2)
NO_KEY_ID: tl.constexpr = tl.constexpr(-1)

MIN_DOT_DIM = 16  # tl.dot needs every block dim >= 16 (host side: tile sizes)
MAX_HEAD_DIM = 256  # the largest D / Dv the tiles (TILES in triton_backend.py) are made for


@triton.jit
def mm(a, b, PRECISION: tl.constexpr):
    """a @ b with float32 accumulation. PRECISION: "ieee" or "tf32" for float32 operands (ignored
    for 16-bit ones); "upcast" multiplies in float32 — for Triton's CPU interpreter, which would
    multiply bfloat16 blocks as raw bits (bf16 products are exact in float32, so nothing changes)."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def base2(x, NATURAL: tl.constexpr):
    """A difference of scores (``s − m``, ``s − lse``) in base 2, for ``exp2``: natural-log scores
    (NATURAL: with a bias or a score_mod) are multiplied by log2 e here, after the subtraction that
    keeps ``finfo.min``-sized ones finite; base-2 scores already are."""
    if NATURAL:
        x = x * TO_BASE2
    return x


@triton.jit
def score_unit(x, NATURAL: tl.constexpr):
    """A natural-log quantity (the saved lse) in the scores' unit: as it is when NATURAL, else base 2."""
    if not NATURAL:
        x = x * TO_BASE2
    return x


@triton.jit
def natural_log(x, NATURAL: tl.constexpr):
    """A quantity in the scores' unit (a row max) in natural log: as it is when NATURAL, else · ln 2."""
    if not NATURAL:
        x = x * TO_NATURAL
    return x


@triton.jit
def mix32(x):
    """lowbias32 (dropout.py's ``_mix32``) on uint32 values: products wrap at 32 bits."""
    x = x ^ (x >> MIX_SHIFT_1)
    x = x * MIX_MUL_1
    x = x ^ (x >> MIX_SHIFT_2)
    x = x * MIX_MUL_2
    return x ^ (x >> MIX_SHIFT_3)


@triton.jit
def dropout_keep(row_counter, cols, Lk, seed_lo, seed_hi, threshold):
    """dropout.keep_mask bit for bit: keep entry (b, h, i, j) iff hash(seed, counter) >= threshold,
    counter = ((b·Hq + h)·Lq + i)·Lk + j in 64 bits (``row_counter`` = (b·Hq + h)·Lq + i, int64)."""
    c = row_counter * Lk + cols  # int64, broadcast to the block
    lo = (c & WORD_MASK).to(tl.uint32)
    hi = (c >> WORD_BITS).to(tl.uint32)
    x = mix32(lo ^ seed_lo.to(tl.uint32))
    x = mix32(x ^ hi ^ seed_hi.to(tl.uint32))
    return x.to(tl.int64) >= threshold


@triton.jit
def tanh(x):
    """tanh in float32 from exp2 (Triton has no tanh in both its interpreter and CUDA), accurate to
    a few ulp: the odd Taylor polynomial for |x| < TANH_SMALL, ``1 - 2/(e^(2|x|) + 1)`` above."""
    a = tl.abs(x)
    a_s = tl.minimum(a, TANH_SMALL)  # the polynomial's argument (only read below TANH_SMALL: no overflow)
    a2 = a_s * a_s
    small = a_s + a_s * a2 * (TANH_C3 + a2 * (TANH_C5 + a2 * (TANH_C7 + a2 * (TANH_C9 + a2 * TANH_C11))))
    big = 1.0 - 2.0 / (tl.exp2(a * TWO_LOG2E) + 1.0)
    t = tl.where(a < TANH_SMALL, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def cap_scores(qk, qk_scale, cap_in, cap_out, HAS_SOFTCAP: tl.constexpr):
    """Raw products ``q·k`` of a block → base-2 scores ``s`` and the tanh ``t`` the backward needs.
    Without softcap ``s = q·k · scale · log2 e`` (``t`` is not used); with it
    ``t = tanh(q·k · scale / softcap)`` (``cap_in`` = scale / softcap) and ``s = t · softcap · log2 e``
    (``cap_out``)."""
    if HAS_SOFTCAP:
        t = tanh(qk * cap_in)
        s = t * cap_out
    else:
        t = qk
        s = qk * qk_scale
    return s, t


@triton.jit
def no_score_mod(score, b, h, q_idx, kv_idx, CAP):
    """The kernels' SCORE_MOD without a score_mod (never called: HAS_MOD is False)."""
    return score


@triton.jit
def no_score_mod_bwd(score, b, h, q_idx, kv_idx, dy, CAP, CAP_GRAD, ACCUMULATE: tl.constexpr):
    """The kernels' SCORE_MOD_BWD without a score_mod (never called)."""
    return dy


@triton.jit
def no_mask_mod(b, h, q_idx, kv_idx, CAP):
    """The kernels' MASK_MOD without a generated mask_mod (never called: HAS_MASK_MOD is False)."""
    return q_idx == q_idx


@triton.jit
def mod_scores(
    qk, qk_scale, cap_in, cap_out, b, h, q_idx, kv_idx, CAP, MCAP,
    SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, HAS_MOD: tl.constexpr, HAS_MASK_MOD: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """Raw products ``q·k`` of a block → ``(s, t, x)``: scores ``s`` (natural log with a score_mod,
    else in ``qk_scale``'s and ``cap_out``'s unit: base 2, or natural with a bias), the tanh ``t`` of the
    softcap (the backward's ``1 - t²``) and ``x = scale·q·k``, the score_mod's argument (its
    backward's). Without a score_mod: ``cap_scores`` (x not used). With one (``HAS_MOD``; the
    host then passes ``qk_scale = scale``, ``cap_in = 1 / softcap``): ``x = scale·q·k``,
    ``y = SCORE_MOD(x, b, h, q_idx, kv_idx, CAP)`` (code generated from the user's function,
    codegen.py), then the cap of ``y``. ``HAS_MASK_MOD``: pairs a generated predicate
    ``MASK_MOD(b, h, q_idx, kv_idx, MCAP)`` refuses get -inf (after the cap: tanh(-inf) = -1
    would un-block them; ``triton_backend.generate_mask`` passes one for a Mask made from a
    mask_mod). ``b``, ``h`` (the query head), ``q_idx``, ``kv_idx`` (0-based, no bottom-right
    shift) are int32 and broadcast to the block."""
    if HAS_MOD:
        x = qk * qk_scale
        y = SCORE_MOD(x, b, h, q_idx, kv_idx, CAP)
        if HAS_SOFTCAP:
            t = tanh(y * cap_in)
            s = t * cap_out
        else:
            t = y
            s = y
    else:
        s, t = cap_scores(qk, qk_scale, cap_in, cap_out, HAS_SOFTCAP)
        x = t
    if HAS_MASK_MOD:
        s = tl.where(MASK_MOD(b, h, q_idx, kv_idx, MCAP), s, NEG_INF)
    return s, t, x


@triton.jit
def range_keep(pos, cols, rows_ok, Lk, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Kept by position: a real row, a real key, and ``p - left <= j <= p + right``.
    ``pos`` / ``rows_ok`` and ``cols`` are broadcastable to the block (either orientation)."""
    keep = rows_ok & (cols < Lk)
    if HAS_LEFT:
        keep = keep & (cols >= pos - left)
    if HAS_RIGHT:
        keep = keep & (cols <= pos + right)
    return keep


@triton.jit
def scores_mod(
    s, pos, rows_ok, cols, Lk, left, right,
    mask_rows, smn, bias_rows, sbn, load_ok, q_ids, k_ids,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
):
    """(Already capped) scores of one block → add the bias (the scores are then natural-log:
    ``base2``), set blocked pairs to -inf. ``mask_rows`` / ``bias_rows`` are pointers to each row's
    start, ``q_ids`` / ``k_ids`` the segment ids of the block's queries and keys (all broadcastable to the block)."""
    if HAS_BIAS:
        b = tl.load(bias_rows + cols * sbn, mask=load_ok, other=0.0).to(tl.float32)
        s = s + b
    if HAS_SEGMENTS:
        s = tl.where(q_ids == k_ids, s, NEG_INF)
    if HAS_MASK:
        keep = tl.load(mask_rows + cols * smn, mask=load_ok, other=0) != 0
        if MASKED:
            keep = keep & range_keep(pos, cols, rows_ok, Lk, left, right, HAS_LEFT, HAS_RIGHT)
        s = tl.where(keep, s, NEG_INF)
    elif MASKED:
        keep = range_keep(pos, cols, rows_ok, Lk, left, right, HAS_LEFT, HAS_RIGHT)
        s = tl.where(keep, s, NEG_INF)
    return s


@triton.jit
def part_range(PART: tl.constexpr, start, f_lo, f_hi, end):
    """The blocks ``[lo, hi)`` of one part of a band ``start <= f_lo <= f_hi <= end``."""
    if PART == LEADING:
        lo, hi = start, f_lo
    elif PART == INTERIOR:
        lo, hi = f_lo, f_hi
    else:
        lo, hi = f_hi, end
    return lo, hi


@triton.jit
def key_blocks(
    m0, Lq, k_lo, k_hi, off, left, right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    """Key blocks ``[start, end)`` that query rows ``[m0, m0 + BLOCK_M)`` (at positions ``+ off``)
    can see among the keys ``[k_lo, k_hi)`` (``k_lo`` a multiple of BLOCK_N), and within them
    ``[f_lo, f_hi)``, the blocks that need no range checks."""
    p_min = m0 + off
    p_max = tl.minimum(m0 + BLOCK_M, Lq) - 1 + off
    lo = k_lo
    hi = k_hi
    if HAS_LEFT:
        lo = tl.maximum(p_min - left, lo)
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(p_max + right + 1, 0), hi)
    start = lo // BLOCK_N
    end = tl.maximum((hi + BLOCK_N - 1) // BLOCK_N, start)
    f_lo = start
    if HAS_LEFT:
        f_lo = tl.maximum(start, (tl.maximum(p_max - left, 0) + BLOCK_N - 1) // BLOCK_N)
    f_hi = tl.minimum(end, k_hi // BLOCK_N)
    if HAS_RIGHT:
        f_hi = tl.minimum(f_hi, tl.maximum(p_min + right + 1, 0) // BLOCK_N)
    f_lo = tl.minimum(f_lo, end)
    f_hi = tl.maximum(f_hi, f_lo)
    return start, f_lo, f_hi, end


@triton.jit
def clip_blocks(start, f_lo, f_hi, end, lo, hi, BLOCK: tl.constexpr):
    """Blocks ``start <= f_lo <= f_hi <= end`` narrowed to those that meet ``[lo, hi)`` (a segment
    range: everything outside it is blocked for every row of the program; empty when lo >= hi). The
    interior only shrinks, so its blocks still need no range checks."""
    s_lo = lo // BLOCK
    s_hi = tl.where(hi > lo, (hi + BLOCK - 1) // BLOCK, s_lo)
    start = tl.maximum(start, s_lo)
    end = tl.maximum(tl.minimum(end, s_hi), start)
    f_lo = tl.minimum(tl.maximum(f_lo, start), end)
    f_hi = tl.maximum(tl.minimum(f_hi, end), f_lo)
    return start, f_lo, f_hi, end


@triton.jit
def attend_keys(
    q, k_rows, v_rows, skn, svn, m0, Lq, Lk, k_lo, k_hi, offs_d, offs_dv, d_ok, dv_ok, pos, rows_ok, left, right,
    mask_rows, smn, bias_rows, sbn, drop_rows, seed_lo, seed_hi, threshold, qk_scale, cap_in, cap_out,
    q_ids, kid_rows, seg_lo, seg_hi, trace_row, b_idx, h_idx, q_pos, CAP, MCAP,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr, TRACE: tl.constexpr,
    SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, HAS_MOD: tl.constexpr, HAS_MASK_MOD: tl.constexpr,
):
    """The online softmax of query rows ``[m0, m0 + BLOCK_M)`` over every key block of ``[k_lo, k_hi)``
    they can see; returns (acc, m, l), m in the scores' unit (``base2``). ``k_rows`` / ``v_rows``
    point at key/value row 0 of this head (d strides are 1); ``Lk`` is the full key length (dropout
    counters); ``pos`` / ``rows_ok`` are the rows' key positions and validity (BLOCK_M,). With
    segments: ``q_ids`` (BLOCK_M,) the rows' ids, ``kid_rows`` the keys' ids of this batch. Only the
    blocks meeting ``[seg_lo, seg_hi)`` are visited (``segment_rows``: a segment's or a block table's
    range, or every key). With TRACE (instrumentation, compiled out
    otherwise): ``trace_row[nb]`` = the part (LEADING / INTERIOR / TRAILING) in which key block
    ``nb`` was visited; blocks not visited are left as they were. The mods (``mod_scores``) see
    batch ``b_idx``, query head ``h_idx`` (one, or one per row as (BLOCK_M, 1)) and query positions
    ``q_pos`` (BLOCK_M,)."""
    start, f_lo, f_hi, end = key_blocks(m0, Lq, k_lo, k_hi, Lk - Lq, left, right, BLOCK_M, BLOCK_N, HAS_LEFT,
                                        HAS_RIGHT)
    start, f_lo, f_hi, end = clip_blocks(start, f_lo, f_hi, end, seg_lo, seg_hi, BLOCK_N)  # (no ranges: all keys)
    m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for part in tl.static_range(NUM_PARTS):  # unrolled: each part is its own loop
        lo, hi = part_range(part, start, f_lo, f_hi, end)
        for nb in range(lo, hi):
            if TRACE:  # the record of what ran: this block, visited in this part (edge parts: masked)
                tl.store(trace_row + nb, tl.full([], part, tl.int32))
            offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < k_hi
            # K block, transposed: (BLOCK_D, BLOCK_N)
            kT = tl.load(k_rows + offs_n[None, :] * skn + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None],
                         other=0.0)
            # s = q kᵀ · scale (· log2 e without bias or mod; capped: softcap · tanh(q kᵀ · scale / softcap))
            s, _, _ = mod_scores(
                mm(q, kT, PRECISION), qk_scale, cap_in, cap_out, b_idx, h_idx, q_pos[:, None], offs_n[None, :], CAP,
                MCAP, SCORE_MOD, MASK_MOD, HAS_MOD, HAS_MASK_MOD, HAS_SOFTCAP,
            )  # (BLOCK_M, BLOCK_N)
            if HAS_SEGMENTS:
                k_ids = tl.load(kid_rows + offs_n, mask=n_ok, other=NO_KEY_ID)  # (BLOCK_N,)
            else:
                k_ids = tl.zeros([BLOCK_N], tl.int32)  # not read
            s = scores_mod(
                s, pos[:, None], rows_ok[:, None], offs_n[None, :], k_hi, left, right,
                mask_rows[:, None], smn, bias_rows[:, None], sbn, rows_ok[:, None] & n_ok[None, :],
                q_ids[:, None], k_ids[None, :], part != INTERIOR, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS,
                HAS_SEGMENTS,
            )
            # m_new = max(m, rowmax s); the -inf of an all-blocked row becomes 0 only inside exp2
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
            alpha = tl.exp2(base2(m_i - m_safe, HAS_BIAS or HAS_MOD))  # rescales what was accumulated so far
            p = tl.exp2(base2(s - m_safe[:, None], HAS_BIAS or HAS_MOD))
            l_i = l_i * alpha + tl.sum(p, 1)
            if HAS_DROPOUT:
                # the softmax sum l counts every probability; only the kept ones reach P·V (÷ (1 - p) at the end)
                keep = dropout_keep(drop_rows[:, None], offs_n[None, :], Lk, seed_lo, seed_hi, threshold)
                p = tl.where(keep, p, 0.0)
            v = tl.load(v_rows + offs_n[:, None] * svn + offs_dv[None, :], mask=n_ok[:, None] & dv_ok[None, :],
                        other=0.0)
            # acc = alpha · acc + p v                                          (BLOCK_M, BLOCK_DV)
            acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, PRECISION)
            m_i = m_new
    return acc, m_i, l_i


@triton.jit
def finish_rows(acc, m_i, l_i, keep_scale, NATURAL: tl.constexpr):
    """O = acc / l (· 1/(1 - p) under dropout), natural-log lse = (m + log2 l) · ln 2 (NATURAL: m is
    natural already, lse = m + log2 l · ln 2); rows that saw no key: O = 0, lse = -inf."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc * (keep_scale / l_safe)[:, None]
    if NATURAL:
        lse = tl.where(l_i == 0.0, NEG_INF, m_i + tl.log2(l_safe) * TO_NATURAL)
    else:
        lse = tl.where(l_i == 0.0, NEG_INF, (m_i + tl.log2(l_safe)) * TO_NATURAL)
    return out, lse


@triton.jit
def segment_rows(ids_row0, rows, rows_ok, range_ptr, limit, HAS_SEGMENTS: tl.constexpr, HAS_RANGES: tl.constexpr,
                 N: tl.constexpr):
    """The segment ids of a program's ``N`` rows (HAS_SEGMENTS: ``ids_row0`` points at this batch's
    ids, (L,) int32; rows past the end get an id no key has; else zeros, not read) and its range
    ``[lo, hi)`` of columns to visit (HAS_RANGES: two int32 at ``range_ptr``, from the segments or a
    mask's block table; else every column, ``[0, limit)``)."""
    if HAS_SEGMENTS:
        ids = tl.load(ids_row0 + rows, mask=rows_ok, other=NO_QUERY_ID)
    else:
        ids = tl.zeros([N], tl.int32)
    if HAS_RANGES:
        lo = tl.load(range_ptr)
        hi = tl.load(range_ptr + 1)
    else:
        lo = 0
        hi = limit
    return ids, lo, hi


@triton.jit
def trace_start(Trace, pid, first, second, Lk, BLOCK_N: tl.constexpr, TRACE: tl.constexpr):
    """The ladder's record (TRACE): program ``pid``'s row of Trace (programs, 2 + cdiv(Lk, BLOCK_N))
    int32 — writes its two ids there and returns where its key blocks go (``attend_keys``).
    Without TRACE: Trace itself, never read."""
    row = Trace
    if TRACE:
        row = Trace + pid * (2 + tl.cdiv(Lk, BLOCK_N))
        tl.store(row, first.to(tl.int32))
        tl.store(row + 1, second.to(tl.int32))
        row += 2
    return row


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "threshold", "left", "right", "Lq", "Lk"])
def fwd_kernel(
    Q, K, V, Out, Lse, Out32, Mask, Bias, QIds, KIds, Ranges,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
    smb, smh, smm, smn, sbb, sbh, sbm, sbn,
    Hq, G, Lq, Lk, D, Dv, qk_scale, cap_in, cap_out, left, right, seed_lo, seed_hi, threshold, keep_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr, HAS_RANGES: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr, STORE_F32: tl.constexpr,
    Trace, TRACE: tl.constexpr,
    CAP, MCAP, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, HAS_MOD: tl.constexpr, HAS_MASK_MOD: tl.constexpr,
):
    """The forward. Grid (cdiv(Lq, BLOCK_M)·B·Hq,). Writes Out (B, Hq, Lq, Dv) and Lse (B, Hq, Lq) float32, and
    with STORE_F32 the unrounded output to Out32 (B, Hq, Lq, Dv) float32, contiguous — for the
    backward's Δ = rowsum(dO·O), which a 16-bit O would perturb by one rounding.
    Head dims have stride 1; the strides of broadcast mask/bias dims are 0. With HAS_SEGMENTS:
    QIds (B, Lq) and KIds (B, Lk) int32 segment ids, contiguous, and Ranges (B, cdiv(Lq, BLOCK_M), 2)
    int32, the key range [lo, hi) of each query block.
    With TRACE (the ladder's instrumentation, only while a recording is open): Trace (grid, 2 +
    cdiv(Lk, BLOCK_N)) int32, filled with -1 by the launcher; program ``pid`` writes its query block
    and its batch·head to ``Trace[pid, 0:2]`` (``trace_start``) and, for each key block ``nb`` it
    visits, the part it was visited in to ``Trace[pid, 2 + nb]`` (``attend_keys``). Without TRACE
    Trace is never read and nothing of it is compiled. With HAS_MOD / HAS_MASK_MOD: the generated
    SCORE_MOD / MASK_MOD (``mod_scores``) reading the tensors of the tuples CAP / MCAP."""
    # One flat grid axis (no 65535 limit on B·Hq); query blocks of a head are neighbours (they share
    # K/V in L2), the last (under causal: longest) first.
    num_m = tl.cdiv(Lq, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = num_m - 1 - pid % num_m
    pid_bh = (pid // num_m).to(tl.int64)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // G  # the key/value head this query head reads (GQA / MQA)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows_ok = offs_m < Lq
    d_ok = offs_d < D
    dv_ok = offs_dv < Dv
    pos = offs_m + Lk - Lq  # bottom-right alignment: query i sits at key position i + Lk - Lq

    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=rows_ok[:, None] & d_ok[None, :],
                other=0.0)  # (BLOCK_M, BLOCK_D)
    q_ids, seg_lo, seg_hi = segment_rows(QIds + b * Lq, offs_m, rows_ok, Ranges + (b * num_m + pid_m) * 2, Lk,
                                         HAS_SEGMENTS, HAS_RANGES, BLOCK_M)
    trace_row = trace_start(Trace, pid, pid_m, pid_bh, Lk, BLOCK_N, TRACE)
    acc, m_i, l_i = attend_keys(
        q, K + b * skb + hk * skh, V + b * svb + hk * svh, skn, svn, m0, Lq, Lk, 0, Lk,
        offs_d, offs_dv, d_ok, dv_ok, pos, rows_ok, left, right,
        Mask + b * smb + h * smh + offs_m * smm, smn, Bias + b * sbb + h * sbh + offs_m * sbm, sbn,
        pid_bh * Lq + offs_m, seed_lo, seed_hi, threshold, qk_scale,  # dropout counters / Lk: (BLOCK_M,) int64
        cap_in, cap_out, q_ids, KIds + b * Lk, seg_lo, seg_hi, trace_row, b.to(tl.int32), h.to(tl.int32), offs_m,
        CAP, MCAP,
        BLOCK_M, BLOCK_N, BLOCK_DV, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEGMENTS, HAS_SOFTCAP, HAS_DROPOUT,
        PRECISION, TRACE, SCORE_MOD, MASK_MOD, HAS_MOD, HAS_MASK_MOD,
    )
    out, lse = finish_rows(acc, m_i, l_i, keep_scale, HAS_BIAS or HAS_MOD)
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * som + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=rows_ok[:, None] & dv_ok[None, :])
    tl.store(Lse + pid_bh * Lq + offs_m, lse, mask=rows_ok)
    if STORE_F32:
        tl.store(Out32 + (pid_bh * Lq + offs_m)[:, None] * Dv + offs_dv[None, :], out,
                 mask=rows_ok[:, None] & dv_ok[None, :])


def next_pow2(n: int, floor: int = MIN_DOT_DIM) -> int:
    """Smallest power of two >= max(n, floor) (tl.dot needs every block dim >= 16)."""
    return max(floor, triton.next_power_of_2(n))
