"""Triton backward kernels (FlashAttention-2), recomputing P block by block from (O, lse).

1. ``delta_kernel``: ``Δ_i = Σ_d dO_id · O_id`` (one pass before the main loops).
2. ``dkdv_kernel``: one program per (key block, batch·key/value head). It holds K_j, V_j and the
   accumulators dK_j, dV_j, and walks the query blocks of every query head of its GQA group that can
   see the key block (``dkdv_queries``, one call per head: whole blocks outside the causal/window
   band are skipped; range checks only on the band's edges, the parts of forward.py).
   With ``ATOMIC_DQ`` it also adds each block's ``dS K`` into a float32 dQ
   with atomics (one pass, fast, but the summation order — hence the last bits — varies run to run).
3. ``dq_kernel``: the deterministic alternative for dQ, one program per (query block, batch·query
   head) walking the key blocks like the forward (``dq_keys``).

Everything is computed "transposed" in dkdv (rows = keys, columns = queries), so that
``dV += Pᵀ dO`` and ``dK += dSᵀ Q`` are plain products. In base 2: ``P = exp2(s₂ - lse₂)`` with
``s₂ = scale·q·k·log2 e``, ``lse₂ = lse·log2 e``; with a bias or a score_mod the scores stay natural
and ``P = exp2((s - lse)·log2 e)`` (forward.py's ``base2``); ``dS = P ∘ (dP - Δ)`` is the gradient
with respect to the natural-scale score, so ``dQ = scale · dS K``, ``dK = scale · dSᵀ Q`` and a
bias receives ``dS``. Dropout (mask Z, keep 1-p): ``dV`` uses ``P∘Z/(1-p)``, ``dS = P(Z∘dP/(1-p) - Δ)``.
Softcap: the score is ``softcap·t`` with ``t = tanh(scale·q·k / softcap)`` (recomputed in each
kernel, before bias and masking); the bias still receives ``dS``, while q and k receive
``dS_raw = dS ∘ (1 - t²)`` (``uncap``). Segment ids: as in the forward, compared in the block, and
each program visits only the blocks that meet its range (the dK/dV kernel: the query range of its
key block).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .forward import (
    INTERIOR,
    NEG_INF,
    NO_KEY_ID,
    NO_QUERY_ID,
    NUM_PARTS,
    POS_INF,
    base2,
    clip_blocks,
    dropout_keep,
    key_blocks,
    mm,
    mod_scores,
    part_range,
    score_unit,
    scores_mod,
    segment_rows,
)


@triton.jit
def delta_kernel(O, dO, Delta, soh, som, sdh, sdm, Lq, Dv, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Grid (cdiv(Lq, BLOCK_M)·B·Hq,). O, dO: (B·Hq, Lq, Dv) views; Delta (B·Hq, Lq) float32."""
    num_m = tl.cdiv(Lq, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % num_m
    pid_bh = (pid // num_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    ok = (offs_m[:, None] < Lq) & (offs_dv[None, :] < Dv)
    o = tl.load(O + pid_bh * soh + offs_m[:, None] * som + offs_dv[None, :], mask=ok, other=0.0).to(tl.float32)
    do = tl.load(dO + pid_bh * sdh + offs_m[:, None] * sdm + offs_dv[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(Delta + pid_bh * Lq + offs_m, tl.sum(o * do, 1), mask=offs_m < Lq)


@triton.jit
def probs_and_dscores(
    s, lse_s, delta, dp, pos, rows_ok, cols, Lk, left, right,
    mask_rows, smn, bias_rows, sbn, load_ok, drop_rows, seed_lo, seed_hi, threshold, keep_scale, q_ids, k_ids,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SEGMENTS: tl.constexpr, HAS_DROPOUT: tl.constexpr, NATURAL: tl.constexpr,
):
    """From (capped) scores ``s`` and ``dP = dO·Vᵀ`` of one block (either orientation: the query
    quantities ``lse_s`` — the lse in the scores' unit, ``score_unit`` —, ``delta``, ``pos``,
    ``rows_ok``, ``*_rows``, ``q_ids`` and the key indices ``cols`` and ``k_ids`` are already
    broadcastable to it), return ``(P as it multiplied V, dS)``, dS with respect to the (capped)
    score. NATURAL: the scores are natural-log (``base2``)."""
    s = scores_mod(
        s, pos, rows_ok, cols, Lk, left, right, mask_rows, smn, bias_rows, sbn, load_ok, q_ids, k_ids,
        MASKED, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEGMENTS,
    )
    # p = exp2(s₂ - lse₂); a fully blocked row (lse = -inf) gets +inf here so that p = 0
    p = tl.exp2(base2(s - tl.where(lse_s == NEG_INF, POS_INF, lse_s), NATURAL))
    if HAS_DROPOUT:
        z = dropout_keep(drop_rows, cols, Lk, seed_lo, seed_hi, threshold)
        p_used = tl.where(z, p, 0.0) * keep_scale
        ds = p * (tl.where(z, dp, 0.0) * keep_scale - delta)
    else:
        p_used = p
        ds = p * (dp - delta)
    return p_used, ds


@triton.jit
def uncap(ds, t, HAS_SOFTCAP: tl.constexpr):
    """dS with respect to the raw score ``scale·q·k``: ``dS ∘ (1 - t²)`` under softcap (d/dx of
    softcap·tanh(x / softcap)), else dS."""
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    return ds


@triton.jit
def query_blocks(
    n0, Lq, Lk, left, right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    """forward.key_blocks seen from a key block: the query blocks ``[start, end)`` with some row that
    can see a key of ``[n0, n0 + BLOCK_N)`` (``p + right >= n0`` and ``p - left <= n0 + BLOCK_N - 1``
    at ``p = i + Lk - Lq``), and within them ``[f_lo, f_hi)``, those whose pairs are all kept by
    position (none in the ragged last key block, which needs the j < Lk check everywhere)."""
    off = Lk - Lq
    n_last = tl.minimum(n0 + BLOCK_N, Lk) - 1
    lo = 0
    hi = Lq
    if HAS_RIGHT:
        lo = tl.maximum(n0 - right - off, 0)
    if HAS_LEFT:
        hi = tl.minimum(tl.maximum(n_last + left - off + 1, 0), Lq)
    start = lo // BLOCK_M
    end = tl.maximum((hi + BLOCK_M - 1) // BLOCK_M, start)
    f_lo = start
    if HAS_RIGHT:
        f_lo = tl.maximum(start, (tl.maximum(n_last - right - off, 0) + BLOCK_M - 1) // BLOCK_M)
    f_hi = tl.minimum(end, Lq // BLOCK_M)
    if HAS_LEFT:
        f_hi = tl.minimum(f_hi, tl.maximum(n0 + left - off + 1, 0) // BLOCK_M)
    if n0 + BLOCK_N > Lk:  # the ragged last key block
        f_hi = start
    f_lo = tl.minimum(f_lo, end)
    f_hi = tl.maximum(f_hi, f_lo)
    return start, f_lo, f_hi, end


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "threshold", "left", "right", "Lq", "Lk"])
def dkdv_kernel(
    Q, K, V, dO, Lse, Delta, dQacc, dK, dV, dBias, Mask, Bias, QIds, KIds, Ranges,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom,
    sdqb, sdqh, sdqm, sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
    smb, smh, smm, smn, sbb, sbh, sbm, sbn,
    Hq, G, Lq, Lk, D, Dv, qk_scale, scale, cap_in, cap_out, left, right, seed_lo, seed_hi, threshold, keep_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr, HAS_RANGES: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BIAS_GRAD: tl.constexpr, HAS_DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr, PRECISION: tl.constexpr,
    CAP, CAP_GRAD, MCAP, SCORE_MOD: tl.constexpr, SCORE_MOD_BWD: tl.constexpr, MASK_MOD: tl.constexpr,
    HAS_MOD: tl.constexpr, HAS_MASK_MOD: tl.constexpr,
):
    """Grid (cdiv(Lk, BLOCK_N)·B·Hkv,). dK, dV get their final values; dQacc (float32, B, Hq, Lq,
    D) receives atomic adds when ATOMIC_DQ; dBias (float32, B, Hq, Lq, Lk) receives dS when
    BIAS_GRAD (the caller sums it over the bias's broadcast dims). With HAS_SEGMENTS: QIds (B, Lq),
    KIds (B, Lk) int32 segment ids and Ranges (B, cdiv(Lk, BLOCK_N), 2) int32, the query range
    [lo, hi) of each key block. With HAS_MOD: dS is taken through the generated SCORE_MOD_BWD,
    which also adds the captured tensors' gradients into the float32 buffers of CAP_GRAD."""
    num_n = tl.cdiv(Lk, BLOCK_N)
    pid = tl.program_id(0)
    pid_n = pid % num_n  # under causal the first key blocks have the most work
    pid_bk = (pid // num_n).to(tl.int64)
    Hkv = Hq // G
    b = pid_bk // Hkv
    hk = pid_bk % Hkv
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_ok = offs_n < Lk
    d_ok = offs_d < D
    dv_ok = offs_dv < Dv
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                other=0.0)  # (BLOCK_N, BLOCK_D)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_dv[None, :],
                mask=n_ok[:, None] & dv_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    # the key block's segment ids (keys past Lk: an id no query has) and its query range
    k_ids, seg_lo, seg_hi = segment_rows(KIds + b * Lk, offs_n, n_ok, Ranges + (b * num_n + pid_n) * 2, Lq,
                                         HAS_SEGMENTS, HAS_RANGES, BLOCK_N)
    for g in range(0, G):
        h = hk * G + g  # query head g of this key/value head's group
        bh = b * Hq + h
        dk, dv = dkdv_queries(
            dk, dv, k, v, Q + b * sqb + h * sqh, dO + b * sdob + h * sdoh, dQacc + b * sdqb + h * sdqh,
            Lse + bh * Lq, Delta + bh * Lq, dBias + bh * Lq * Lk, Mask + b * smb + h * smh, Bias + b * sbb + h * sbh,
            sqm, sdom, sdqm, smm, smn, sbm, sbn, bh * Lq, n0, offs_d, offs_dv, d_ok, dv_ok, Lq, Lk,
            qk_scale, scale, cap_in, cap_out, left, right, seed_lo, seed_hi, threshold, keep_scale,
            QIds + b * Lq, k_ids, seg_lo, seg_hi, b.to(tl.int32), h.to(tl.int32), CAP, CAP_GRAD, MCAP,
            BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEGMENTS, HAS_SOFTCAP, BIAS_GRAD,
            HAS_DROPOUT, ATOMIC_DQ, PRECISION, SCORE_MOD, SCORE_MOD_BWD, MASK_MOD, HAS_MOD, HAS_MASK_MOD, True,
        )

    # dK = scale · Σ dSᵀ Q; dV = Σ Pᵀ dO. Both (BLOCK_N, ·), written once (no atomics).
    dk_ptrs = dK + b * sdkb + hk * sdkh + offs_n[:, None] * sdkn + offs_d[None, :]
    tl.store(dk_ptrs, (dk * scale).to(dK.dtype.element_ty), mask=n_ok[:, None] & d_ok[None, :])
    dv_ptrs = dV + b * sdvb + hk * sdvh + offs_n[:, None] * sdvn + offs_dv[None, :]
    tl.store(dv_ptrs, dv.to(dV.dtype.element_ty), mask=n_ok[:, None] & dv_ok[None, :])


@triton.jit
def dkdv_queries(
    dk, dv, k, v, q_head, do_head, dq_head, lse_head, delta_head, dbias_head, mask_head, bias_head,
    sqm, sdom, sdqm, smm, smn, sbm, sbn, drop_head, n0, offs_d, offs_dv, d_ok, dv_ok, Lq, Lk,
    qk_scale, scale, cap_in, cap_out, left, right, seed_lo, seed_hi, threshold, keep_scale,
    qid_row0, k_ids, seg_lo, seg_hi, b_idx, h_idx, CAP, CAP_GRAD, MCAP,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEGMENTS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BIAS_GRAD: tl.constexpr, HAS_DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr, PRECISION: tl.constexpr,
    SCORE_MOD: tl.constexpr, SCORE_MOD_BWD: tl.constexpr, MASK_MOD: tl.constexpr, HAS_MOD: tl.constexpr,
    HAS_MASK_MOD: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """dkdv_kernel's walk over the query blocks of one query head that can see the key block
    ``[n0, n0 + BLOCK_N)``, in the transposed orientation; returns (dk, dv) with this head added.
    ``*_head`` point at the head's row 0 (``drop_head`` = (b·Hq + h)·Lq, its first dropout row).
    Segments: ``qid_row0`` points at the batch's query ids, ``k_ids`` (BLOCK_N,) are the key block's.
    Only query blocks meeting ``[seg_lo, seg_hi)`` are visited (the segments' or a block table's range,
    or every query)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < Lk
    start, f_lo, f_hi, end = query_blocks(n0, Lq, Lk, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    start, f_lo, f_hi, end = clip_blocks(start, f_lo, f_hi, end, seg_lo, seg_hi, BLOCK_M)  # (no ranges: all)
    for part in tl.static_range(NUM_PARTS):  # unrolled: each part is its own loop
        lo, hi = part_range(part, start, f_lo, f_hi, end)
        for mb in range(lo, hi):
            offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
            m_ok = offs_m < Lq
            q = tl.load(q_head + offs_m[:, None] * sqm + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :],
                        other=0.0)
            do = tl.load(do_head + offs_m[:, None] * sdom + offs_dv[None, :], mask=m_ok[:, None] & dv_ok[None, :],
                         other=0.0)
            lse_s = score_unit(tl.load(lse_head + offs_m, mask=m_ok, other=0.0), HAS_BIAS or HAS_MOD)  # (BLOCK_M,)
            delta = tl.load(delta_head + offs_m, mask=m_ok, other=0.0)
            # sᵀ = k qᵀ · scale · log2 e (capped: tT the tanh) and dPᵀ = v dOᵀ  (BLOCK_N, BLOCK_M)
            sT, tT, xT = mod_scores(
                mm(k, tl.trans(q), PRECISION), qk_scale, cap_in, cap_out, b_idx, h_idx, offs_m[None, :],
                offs_n[:, None], CAP, MCAP, SCORE_MOD, MASK_MOD, HAS_MOD, HAS_MASK_MOD, HAS_SOFTCAP,
            )
            dpT = mm(v, tl.trans(do), PRECISION)
            load_ok = n_ok[:, None] & m_ok[None, :]
            if HAS_SEGMENTS:
                q_ids = tl.load(qid_row0 + offs_m, mask=m_ok, other=NO_QUERY_ID)  # (BLOCK_M,)
            else:
                q_ids = tl.zeros([BLOCK_M], tl.int32)  # not read
            pT, dsT = probs_and_dscores(
                sT, lse_s[None, :], delta[None, :], dpT, (offs_m + Lk - Lq)[None, :], m_ok[None, :], offs_n[:, None],
                Lk, left, right, (mask_head + offs_m * smm)[None, :], smn, (bias_head + offs_m * sbm)[None, :], sbn,
                load_ok, (drop_head + offs_m)[None, :], seed_lo, seed_hi, threshold, keep_scale,
                q_ids[None, :], k_ids[:, None],
                part != INTERIOR, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEGMENTS, HAS_DROPOUT,
                HAS_BIAS or HAS_MOD,
            )
            if BIAS_GRAD:  # the bias is added after the cap: it receives dS itself
                tl.store(dbias_head + offs_m.to(tl.int64)[None, :] * Lk + offs_n[:, None], dsT, mask=load_ok)
            dsT = uncap(dsT, tT, HAS_SOFTCAP)  # with respect to the raw score (the mod's output), for dK and dQ
            if HAS_MOD:  # through the mod: to x = scale·q·k, and the captured tensors' shares (ACCUMULATE)
                dsT = SCORE_MOD_BWD(xT, b_idx, h_idx, offs_m[None, :], offs_n[:, None], dsT, CAP, CAP_GRAD, ACCUMULATE)
            dv += mm(pT.to(do.dtype), do, PRECISION)  # dV += Pᵀ dO
            dk += mm(dsT.to(q.dtype), q, PRECISION)  # dK += dSᵀ Q (· scale at the end)
            if ATOMIC_DQ:
                # dQ += scale · dS K                                           (BLOCK_M, BLOCK_D)
                dq = mm(tl.trans(dsT.to(k.dtype)), k, PRECISION) * scale
                tl.atomic_add(dq_head + offs_m[:, None] * sdqm + offs_d[None, :], dq,
                              mask=m_ok[:, None] & d_ok[None, :])
    return dk, dv


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "threshold", "left", "right", "Lq", "Lk"])
def dq_kernel(
    Q, K, V, dO, Lse, Delta, dQ, Mask, Bias, QIds, KIds, Ranges,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdom, sdqb, sdqh, sdqm,
    smb, smh, smm, smn, sbb, sbh, sbm, sbn,
    Hq, G, Lq, Lk, D, Dv, qk_scale, scale, cap_in, cap_out, left, right, seed_lo, seed_hi, threshold, keep_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr, HAS_RANGES: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr,
    CAP, CAP_GRAD, MCAP, SCORE_MOD: tl.constexpr, SCORE_MOD_BWD: tl.constexpr, MASK_MOD: tl.constexpr,
    HAS_MOD: tl.constexpr, HAS_MASK_MOD: tl.constexpr,
):
    """Grid (cdiv(Lq, BLOCK_M)·B·Hq,): dQ = scale · Σ_j dS K, deterministic (no atomics). Segments as
    in the forward kernel (Ranges per query block of this kernel's BLOCK_M). A score_mod's captured
    tensors get their gradients in dkdv_kernel only (ACCUMULATE False here)."""
    num_m = tl.cdiv(Lq, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = num_m - 1 - pid % num_m  # the longest (causal) first
    pid_bh = (pid // num_m).to(tl.int64)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // G
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < Lq
    d_ok = offs_d < D
    dv_ok = offs_dv < Dv
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :],
                other=0.0)
    do = tl.load(dO + b * sdob + h * sdoh + offs_m[:, None] * sdom + offs_dv[None, :],
                 mask=m_ok[:, None] & dv_ok[None, :], other=0.0)
    lse_s = score_unit(tl.load(Lse + pid_bh * Lq + offs_m, mask=m_ok, other=0.0), HAS_BIAS or HAS_MOD)
    delta = tl.load(Delta + pid_bh * Lq + offs_m, mask=m_ok, other=0.0)
    q_ids, seg_lo, seg_hi = segment_rows(QIds + b * Lq, offs_m, m_ok, Ranges + (b * num_m + pid_m) * 2, Lk,
                                         HAS_SEGMENTS, HAS_RANGES, BLOCK_M)
    dq = dq_keys(
        q, do, lse_s, delta, K + b * skb + hk * skh, V + b * svb + hk * svh, skn, svn, m0, Lq, Lk,
        offs_d, offs_dv, d_ok, dv_ok, left, right, Mask + b * smb + h * smh + offs_m * smm, smn,
        Bias + b * sbb + h * sbh + offs_m * sbm, sbn, pid_bh * Lq + offs_m, seed_lo, seed_hi, threshold, keep_scale,
        qk_scale, cap_in, cap_out, q_ids, KIds + b * Lk, seg_lo, seg_hi, b.to(tl.int32), h.to(tl.int32), CAP, CAP_GRAD,
        MCAP,
        BLOCK_M, BLOCK_N, BLOCK_D, HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEGMENTS, HAS_SOFTCAP, HAS_DROPOUT,
        PRECISION, SCORE_MOD, SCORE_MOD_BWD, MASK_MOD, HAS_MOD, HAS_MASK_MOD,
    )
    tl.store(dQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqm + offs_d[None, :], (dq * scale).to(dQ.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def dq_keys(
    q, do, lse_s, delta, k_rows, v_rows, skn, svn, m0, Lq, Lk, offs_d, offs_dv, d_ok, dv_ok,
    left, right, mask_rows, smn, bias_rows, sbn, drop_rows, seed_lo, seed_hi, threshold, keep_scale, qk_scale,
    cap_in, cap_out, q_ids, kid_rows, seg_lo, seg_hi, b_idx, h_idx, CAP, CAP_GRAD, MCAP,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    SCORE_MOD: tl.constexpr, SCORE_MOD_BWD: tl.constexpr, MASK_MOD: tl.constexpr, HAS_MOD: tl.constexpr,
    HAS_MASK_MOD: tl.constexpr,
):
    """dq_kernel's walk over the key blocks that query rows ``[m0, m0 + BLOCK_M)`` can see (the
    forward's ranges, segments included); returns Σ_j dS K, not yet multiplied by ``scale``."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < Lq
    pos = offs_m + Lk - Lq
    start, f_lo, f_hi, end = key_blocks(m0, Lq, 0, Lk, Lk - Lq, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    start, f_lo, f_hi, end = clip_blocks(start, f_lo, f_hi, end, seg_lo, seg_hi, BLOCK_N)  # (no ranges: all keys)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for part in tl.static_range(NUM_PARTS):  # unrolled: each part is its own loop
        lo, hi = part_range(part, start, f_lo, f_hi, end)
        for nb in range(lo, hi):
            offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < Lk
            kT = tl.load(k_rows + offs_n[None, :] * skn + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None],
                         other=0.0)
            vT = tl.load(v_rows + offs_n[None, :] * svn + offs_dv[:, None], mask=n_ok[None, :] & dv_ok[:, None],
                         other=0.0)
            s, t, x = mod_scores(
                mm(q, kT, PRECISION), qk_scale, cap_in, cap_out, b_idx, h_idx, offs_m[:, None], offs_n[None, :], CAP,
                MCAP, SCORE_MOD, MASK_MOD, HAS_MOD, HAS_MASK_MOD, HAS_SOFTCAP,
            )  # (BLOCK_M, BLOCK_N)
            dp = mm(do, vT, PRECISION)  # dP = dO Vᵀ
            if HAS_SEGMENTS:
                k_ids = tl.load(kid_rows + offs_n, mask=n_ok, other=NO_KEY_ID)  # (BLOCK_N,)
            else:
                k_ids = tl.zeros([BLOCK_N], tl.int32)  # not read
            _, ds = probs_and_dscores(
                s, lse_s[:, None], delta[:, None], dp, pos[:, None], m_ok[:, None], offs_n[None, :], Lk, left, right,
                mask_rows[:, None], smn, bias_rows[:, None], sbn, m_ok[:, None] & n_ok[None, :], drop_rows[:, None],
                seed_lo, seed_hi, threshold, keep_scale, q_ids[:, None], k_ids[None, :], part != INTERIOR, HAS_LEFT,
                HAS_RIGHT, HAS_MASK, HAS_BIAS, HAS_SEGMENTS, HAS_DROPOUT, HAS_BIAS or HAS_MOD,
            )
            ds = uncap(ds, t, HAS_SOFTCAP)  # with respect to the raw score (the mod's output)
            if HAS_MOD:  # through the mod (its captured tensors' gradients come from dkdv_kernel)
                ds = SCORE_MOD_BWD(x, b_idx, h_idx, offs_m[:, None], offs_n[None, :], ds, CAP, CAP_GRAD, False)
            # dQ += dS K (· scale at the end): (BLOCK_M, BLOCK_N) @ (BLOCK_N, BLOCK_D)
            dq += mm(ds.to(kT.dtype), tl.trans(kT), PRECISION)
    return dq
