"""Split-KV decoding (flash-decoding): few queries, a long key/value sequence, no gradient.

With Lq ≤ 16 the forward grid has too few programs to fill a GPU, and each query head would read its
key/value head again. Here one program takes *all* query rows of a key/value head's GQA group —
rows ``r = g·Lq + i`` (query head ``hk·G + g``, query ``i``) — and one split of the keys, so K/V
are read once per group; the splits run in parallel and write partial results: ``O_s``, normalised
over the split's own keys, and the split's row max ``m_s`` and sum ``l_s`` (its lse is
``m_s + log l_s``). ``merge_kernel`` then combines them by log-sum-exp (docs/MATH.md): with
``m = max_s m_s`` and ``w_s = l_s · exp(m_s − m)``, ``O = Σ_s w_s·O_s / Σ_s w_s`` and
``lse = m + log Σ_s w_s``; splits that saw no key have ``l_s = 0`` and contribute nothing. (Not the
splits' lse: under an additive mask's −1e9 a float32 lse keeps none of log l_s's bits, and the
merge weighed every split alike.)

As in the forward, ``split_kernel``'s ``TRACE`` constexpr (set only while an ``attnzero.trace``
recording is open) makes each program write down the key blocks it visits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .forward import NEG_INF, attend_keys, finish_rows, natural_log, segment_rows, trace_start

WAVES = 2  # split the keys until about this many programs per multiprocessor run


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "threshold", "left", "right", "Lq", "Lk"])
def split_kernel(
    Q, K, V, Opart, Lpart, Mask, Bias, QIds, KIds, Ranges,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
    smb, smh, smm, smn, sbb, sbh, sbm, sbn,
    Hq, G, Lq, Lk, D, Dv, S, chunk, qk_scale, cap_in, cap_out, left, right, seed_lo, seed_hi, threshold, keep_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr, HAS_RANGES: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr, Trace, TRACE: tl.constexpr,
    CAP, MCAP, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, HAS_MOD: tl.constexpr, HAS_MASK_MOD: tl.constexpr,
):
    """The split-KV pass. Grid (S·B·Hkv,). Opart (B, Hq, S, Lq, Dv) and Lpart (B, Hq, S, Lq, 2) float32: each
    row's output over the split's keys, and its max (natural log) and sum.
    With HAS_SEGMENTS: QIds (B, Lq), KIds (B, Lk) int32 segment ids; with HAS_RANGES (segments, or a
    mask's block table) Ranges (B, 1, 2) int32, the key range [lo, hi) of all Lq queries of a batch.
    With TRACE (the ladder's instrumentation, only while a recording is open): Trace (grid, 2 + cdiv(Lk, BLOCK_N))
    int32, filled with -1 by the launcher; program ``pid`` writes its split and its batch·kv head to
    ``Trace[pid, 0:2]`` and, for each key block ``nb`` it visits, the part it was visited in to
    ``Trace[pid, 2 + nb]``. The mods (HAS_MOD / HAS_MASK_MOD) see each row's own query head and
    position."""
    pid = tl.program_id(0)
    pid_s = pid % S
    pid_bk = (pid // S).to(tl.int64)
    Hkv = Hq // G
    b = pid_bk // Hkv
    hk = pid_bk % Hkv
    offs_r = tl.arange(0, BLOCK_M)
    rows_ok = offs_r < G * Lq
    g = offs_r // Lq
    i = offs_r % Lq
    h = hk * G + g  # (BLOCK_M,) query head of each row
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < D
    dv_ok = offs_dv < Dv
    pos = i + Lk - Lq  # key position of each row's query

    q_rows = Q + b * sqb + h * sqh + i * sqm  # (BLOCK_M,) pointers
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=rows_ok[:, None] & d_ok[None, :], other=0.0)
    # This split's keys [k_lo, k_hi) (whole blocks: chunk is a multiple of BLOCK_N), walked as the
    # forward walks them; every row sits at a query position in [0, Lq) (m0 = 0, BLOCK_M >= Lq).
    k_lo = pid_s * chunk
    q_ids, seg_lo, seg_hi = segment_rows(QIds + b * Lq, i, rows_ok, Ranges + b * 2, Lk, HAS_SEGMENTS, HAS_RANGES,
                                         BLOCK_M)
    trace_row = trace_start(Trace, pid, pid_s, pid_bk, Lk, BLOCK_N, TRACE)
    acc, m_i, l_i = attend_keys(
        q, K + b * skb + hk * skh, V + b * svb + hk * svh, skn, svn, 0, Lq, Lk, k_lo, tl.minimum(k_lo + chunk, Lk),
        offs_d, offs_dv, d_ok, dv_ok, pos, rows_ok, left, right,
        Mask + b * smb + h * smh + i * smm, smn, Bias + b * sbb + h * sbh + i * sbm, sbn,
        (b * Hq + h) * Lq + i, seed_lo, seed_hi, threshold, qk_scale,  # dropout counters / Lk: (BLOCK_M,) int64
        cap_in, cap_out, q_ids, KIds + b * Lk, seg_lo, seg_hi, trace_row, b.to(tl.int32), h.to(tl.int32)[:, None], i,
        CAP, MCAP,
        BLOCK_M, BLOCK_N, BLOCK_DV, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEGMENTS, HAS_SOFTCAP, HAS_DROPOUT,
        PRECISION, TRACE, SCORE_MOD, MASK_MOD, HAS_MOD, HAS_MASK_MOD,
    )
    out, _ = finish_rows(acc, m_i, l_i, keep_scale, HAS_BIAS or HAS_MOD)
    part = ((b * Hq + h) * S + pid_s) * Lq + i  # (BLOCK_M,) row index into (B, Hq, S, Lq)
    tl.store(Opart + part[:, None] * Dv + offs_dv[None, :], out, mask=rows_ok[:, None] & dv_ok[None, :])
    tl.store(Lpart + part * 2, natural_log(m_i, HAS_BIAS or HAS_MOD), mask=rows_ok)  # m_s (-inf: no key)
    tl.store(Lpart + part * 2 + 1, l_i, mask=rows_ok)  # l_s


@triton.jit(do_not_specialize=["Lq"])
def merge_kernel(
    Opart, Lpart, Out, Lse, sob, soh, som, Hq, Lq, Dv, S, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr
):
    """Grid (B·Hq·Lq,): merge the S partial rows of one query (Lpart: their max and sum). Out (B, Hq, Lq, Dv),
    Lse (B, Hq, Lq)."""
    row = tl.program_id(0).to(tl.int64)  # (b·Hq + h)·Lq + i
    bh = row // Lq
    i = row % Lq
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_ok = offs_s < S
    part = (bh * S + offs_s) * Lq + i  # (BLOCK_S,)
    m_s = tl.load(Lpart + part * 2, mask=s_ok, other=NEG_INF)
    l_s = tl.load(Lpart + part * 2 + 1, mask=s_ok, other=0.0)
    o_s = tl.load(Opart + part[:, None] * Dv + offs_dv[None, :], mask=s_ok[:, None] & (offs_dv[None, :] < Dv),
                  other=0.0)  # (BLOCK_S, BLOCK_DV)
    # w_s = l_s · exp(m_s - m): each split's share of the row's sum, m = max m_s (guarded for all -inf)
    m = tl.max(m_s, 0)
    m_safe = tl.where(m == NEG_INF, 0.0, m)
    w = l_s * tl.exp(m_s - m_safe)
    total = tl.sum(w, 0)
    total_safe = tl.where(total == 0.0, 1.0, total)
    out = tl.sum(o_s * (w / total_safe)[:, None], 0)  # (BLOCK_DV,)
    lse = tl.where(total == 0.0, NEG_INF, m_safe + tl.log(total_safe))
    b = bh // Hq
    h = bh % Hq
    tl.store(Out + b * sob + h * soh + i * som + offs_dv, out.to(Out.dtype.element_ty), mask=offs_dv < Dv)
    tl.store(Lse + row, lse)


def splits_for(batch_kv_heads: int, Lk: int, block_n: int, num_sms: int) -> tuple[int, int]:
    """(S, chunk): about ``WAVES`` waves of programs over the multiprocessors, chunks of whole blocks."""
    return split_keys(Lk, block_n, triton.cdiv(WAVES * num_sms, batch_kv_heads))


def split_keys(Lk: int, block_n: int, want: int) -> tuple[int, int]:
    """(S, chunk): the ``Lk`` keys cut into at most ``want`` splits of whole blocks of ``block_n``
    (split ``s`` takes keys ``[s·chunk, min((s + 1)·chunk, Lk))``). S can be less than ``want``:
    never more splits than blocks, and equal chunks of whole blocks may need fewer."""
    blocks = triton.cdiv(Lk, block_n)
    want = max(1, min(blocks, want))
    chunk = triton.cdiv(blocks, want) * block_n
    return triton.cdiv(Lk, chunk), chunk
