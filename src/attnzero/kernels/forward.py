"""Triton forward kernel (FlashAttention-2): one program per (query block, batch·query head).

The program keeps its block of Q in registers and streams the key/value blocks that its queries can
see, with the online softmax of docs/MATH.md in base 2 (``qk_scale = scale · log2 e``; a bias is
multiplied by ``log2 e`` too; the stored lse is converted back to natural log).

Which key blocks are visited, for query rows ``[m0, m0 + BLOCK_M)`` at positions ``p = i + Lk - Lq``
with the (causal-folded) window ``p - left <= j <= p + right``::

      start        f_lo                f_hi        end
        |  masked   |   interior, no    |  masked   |      blocks outside [start, end) are skipped;
        |  (left    |   range checks    |  (diagonal |      masked blocks check the window and
        |   edge)   |                   |   and Lk)  |      j < Lk element by element

A dense mask, a bias and dropout are applied in every visited block (they are data, not ranges).
Letters: B batch, Hq / Hkv query / key-value heads, G = Hq // Hkv, Lq / Lk lengths, D / Dv head dims
(padded to the powers of two BLOCK_D / BLOCK_DV with masked loads).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x · log2 e)
LN2 = 0.6931471805599453  # ln(2): natural lse = base-2 lse · ln 2


@triton.jit
def mm(a, b, PRECISION: tl.constexpr):
    """a @ b with float32 accumulation. PRECISION: "ieee" or "tf32" for float32 operands (ignored
    for 16-bit ones); "upcast" multiplies in float32 — for Triton's CPU interpreter, which would
    multiply bfloat16 blocks as raw bits (bf16 products are exact in float32, so nothing changes)."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def mix32(x):
    """lowbias32 (dropout.py's ``_mix32``) on uint32 values: products wrap at 32 bits."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def dropout_keep(row_counter, cols, Lk, seed_lo, seed_hi, threshold):
    """dropout.keep_mask bit for bit: keep entry (b, h, i, j) iff hash(seed, counter) >= threshold,
    counter = ((b·Hq + h)·Lq + i)·Lk + j in 64 bits (``row_counter`` = (b·Hq + h)·Lq + i, int64)."""
    c = row_counter * Lk + cols  # int64, broadcast to the block
    lo = (c & 0xFFFFFFFF).to(tl.uint32)
    hi = (c >> 32).to(tl.uint32)
    x = mix32(lo ^ seed_lo.to(tl.uint32))
    x = mix32(x ^ hi ^ seed_hi.to(tl.uint32))
    return x.to(tl.int64) >= threshold


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
    mask_rows, smn, bias_rows, sbn, load_ok,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Base-2 scores of one block → add the bias (· log2 e), set blocked pairs to -inf.
    ``mask_rows`` / ``bias_rows`` are pointers to each row's start (broadcastable to the block)."""
    if HAS_BIAS:
        b = tl.load(bias_rows + cols * sbn, mask=load_ok, other=0.0).to(tl.float32)
        s = s + b * 1.4426950408889634
    if HAS_MASK:
        keep = tl.load(mask_rows + cols * smn, mask=load_ok, other=0) != 0
        if MASKED:
            keep = keep & range_keep(pos, cols, rows_ok, Lk, left, right, HAS_LEFT, HAS_RIGHT)
        s = tl.where(keep, s, float("-inf"))
    elif MASKED:
        keep = range_keep(pos, cols, rows_ok, Lk, left, right, HAS_LEFT, HAS_RIGHT)
        s = tl.where(keep, s, float("-inf"))
    return s


@triton.jit
def attend_block(
    acc, m_i, l_i, q, k_rows, v_rows, skn, svn, n0, n_end, Lk,
    offs_d, offs_dv, d_ok, dv_ok, pos, rows_ok, left, right,
    mask_rows, smn, bias_rows, sbn, drop_rows, seed_lo, seed_hi, threshold, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
):
    """One step of the online softmax over keys ``[n0, n0 + BLOCK_N)`` ∩ ``[0, n_end)``; returns
    (acc, m, l). ``k_rows`` / ``v_rows`` point at key/value row 0 of this head (d strides are 1);
    ``Lk`` is the full key length (dropout counters)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_end
    # K block, transposed: (BLOCK_D, BLOCK_N)
    kT = tl.load(k_rows + offs_n[None, :] * skn + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    # s = q kᵀ · scale · log2 e                                               (BLOCK_M, BLOCK_N)
    s = mm(q, kT, PRECISION) * qk_scale
    load_ok = rows_ok[:, None] & n_ok[None, :]
    s = scores_mod(
        s, pos[:, None], rows_ok[:, None], offs_n[None, :], n_end, left, right,
        mask_rows[:, None], smn, bias_rows[:, None], sbn, load_ok,
        MASKED, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS,
    )
    # m_new = max(m, rowmax s); the -inf of an all-blocked row becomes 0 only inside exp2
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)  # rescales what was accumulated so far
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if HAS_DROPOUT:
        # the softmax sum l counts every probability; only the kept ones reach P·V (÷ (1 - p) at the end)
        p = tl.where(dropout_keep(drop_rows[:, None], offs_n[None, :], Lk, seed_lo, seed_hi, threshold), p, 0.0)
    v = tl.load(v_rows + offs_n[:, None] * svn + offs_dv[None, :], mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
    # acc = alpha · acc + p v                                                  (BLOCK_M, BLOCK_DV)
    acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, PRECISION)
    return acc, m_new, l_i


@triton.jit
def finish_rows(acc, m_i, l_i, keep_scale):
    """O = acc / l (· 1/(1 - p) under dropout), natural-log lse = (m + log2 l) · ln 2;
    rows that saw no key: O = 0, lse = -inf."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc * (keep_scale / l_safe)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    return out, lse


@triton.jit
def key_blocks(
    m0, Lq, Lk, off, left, right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    """Key blocks ``[start, end)`` that query rows ``[m0, m0 + BLOCK_M)`` (at positions ``+ off``)
    can see, and within them ``[f_lo, f_hi)``, the blocks that need no range checks."""
    p_min = m0 + off
    p_max = tl.minimum(m0 + BLOCK_M, Lq) - 1 + off
    lo = 0
    hi = Lk
    if HAS_LEFT:
        lo = tl.maximum(p_min - left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(p_max + right + 1, 0), Lk)
    start = lo // BLOCK_N
    end = tl.maximum((hi + BLOCK_N - 1) // BLOCK_N, start)
    f_lo = start
    if HAS_LEFT:
        f_lo = tl.maximum(start, (tl.maximum(p_max - left, 0) + BLOCK_N - 1) // BLOCK_N)
    f_hi = tl.minimum(end, Lk // BLOCK_N)
    if HAS_RIGHT:
        f_hi = tl.minimum(f_hi, tl.maximum(p_min + right + 1, 0) // BLOCK_N)
    f_lo = tl.minimum(f_lo, end)
    f_hi = tl.maximum(f_hi, f_lo)
    return start, f_lo, f_hi, end


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "threshold", "left", "right", "Lq", "Lk"])
def fwd_kernel(
    Q, K, V, Out, Lse, Out32, Mask, Bias,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
    smb, smh, smm, smn, sbb, sbh, sbm, sbn,
    Hq, G, Lq, Lk, D, Dv, qk_scale, left, right, seed_lo, seed_hi, threshold, keep_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr, STORE_F32: tl.constexpr,
):
    """Grid (cdiv(Lq, BLOCK_M)·B·Hq,). Writes Out (B, Hq, Lq, Dv) and Lse (B, Hq, Lq) float32, and
    with STORE_F32 the unrounded output to Out32 (B, Hq, Lq, Dv) float32, contiguous — for the
    backward's Δ = rowsum(dO·O), which a 16-bit O would perturb by one rounding.
    Head dims have stride 1; the strides of broadcast mask/bias dims are 0."""
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
    off = Lk - Lq  # bottom-right alignment: query i sits at key position i + off
    pos = offs_m + off

    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=rows_ok[:, None] & d_ok[None, :],
                other=0.0)  # (BLOCK_M, BLOCK_D)
    k_rows = K + b * skb + hk * skh
    v_rows = V + b * svb + hk * svh
    mask_rows = Mask + b * smb + h * smh + offs_m * smm  # (BLOCK_M,) pointers
    bias_rows = Bias + b * sbb + h * sbh + offs_m * sbm
    drop_rows = pid_bh * Lq + offs_m  # (BLOCK_M,) int64 dropout counters / Lk

    # The key range this block can see, and the part of it that needs no range checks.
    start, f_lo, f_hi, end = key_blocks(m0, Lq, Lk, off, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for nb in range(start, f_lo):  # left edge of the window
        acc, m_i, l_i = attend_block(
            acc, m_i, l_i, q, k_rows, v_rows, skn, svn, nb * BLOCK_N, Lk, Lk, offs_d, offs_dv, d_ok, dv_ok,
            pos, rows_ok, left, right, mask_rows, smn, bias_rows, sbn, drop_rows, seed_lo, seed_hi, threshold,
            qk_scale, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_DROPOUT, PRECISION,
        )
    for nb in range(f_lo, f_hi):  # interior: every pair kept by position
        acc, m_i, l_i = attend_block(
            acc, m_i, l_i, q, k_rows, v_rows, skn, svn, nb * BLOCK_N, Lk, Lk, offs_d, offs_dv, d_ok, dv_ok,
            pos, rows_ok, left, right, mask_rows, smn, bias_rows, sbn, drop_rows, seed_lo, seed_hi, threshold,
            qk_scale, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_DROPOUT, PRECISION,
        )
    for nb in range(f_hi, end):  # causal diagonal / right edge, and the ragged last key block
        acc, m_i, l_i = attend_block(
            acc, m_i, l_i, q, k_rows, v_rows, skn, svn, nb * BLOCK_N, Lk, Lk, offs_d, offs_dv, d_ok, dv_ok,
            pos, rows_ok, left, right, mask_rows, smn, bias_rows, sbn, drop_rows, seed_lo, seed_hi, threshold,
            qk_scale, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_DROPOUT, PRECISION,
        )

    out, lse = finish_rows(acc, m_i, l_i, keep_scale)
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * som + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=rows_ok[:, None] & dv_ok[None, :])
    tl.store(Lse + pid_bh * Lq + offs_m, lse, mask=rows_ok)
    if STORE_F32:
        tl.store(Out32 + (pid_bh * Lq + offs_m)[:, None] * Dv + offs_dv[None, :], out,
                 mask=rows_ok[:, None] & dv_ok[None, :])


def next_pow2(n: int, floor: int = 16) -> int:
    """Smallest power of two >= max(n, floor) (tl.dot needs every block dim >= 16)."""
    return max(floor, triton.next_power_of_2(n))
