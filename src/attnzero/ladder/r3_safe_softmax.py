"""Rung 3: the safe softmax — subtract the row maximum, keep the statistics in float32.

``softmax(s) = exp(s − m) / Σ exp(s − m)`` for any ``m``; with ``m = max(s)`` every exponent is
≤ 0, so ``exp`` cannot overflow. The formula as read, ``exp(s) / Σ exp(s)``, overflows as soon as a
score passes ln(max of the dtype): 11.09 in float16, 88.72 in bfloat16 and float32 — then
``inf / inf = NaN``. For 16-bit inputs the scores, the max and the sum are kept in float32.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

from .common import Printer, Result, figure, max_error, median_time
from .r0_seeds import left_padded_causal
from .r2_heads import group_keep, grouped_attention

TITLE = "safe softmax: subtract the max, float32 statistics"


def naive_softmax(s: Tensor) -> Tensor:
    """softmax as the formula reads, in the scores' own dtype."""
    e = torch.exp(s)  # inf once s > ln(max of the dtype): 11.09 in float16, 88.72 in bfloat16
    return e / e.sum(dim=-1, keepdim=True)  # inf / inf = NaN


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores, row max and row sum: float32 for 16- and 32-bit inputs, float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def safe_softmax(s: Tensor) -> Tensor:
    """softmax over the last dim with the row max subtracted, in float32 (float64 for float64);
    a row whose entries are all -inf (no key kept) gives 0, not NaN."""
    s = s.to(stats_dtype(s.dtype))  # 16-bit scores → float32 before anything is summed
    m = s.amax(dim=-1, keepdim=True)  # (..., 1) row max; -inf when the row has no kept key
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # such a row: shift by 0, never −inf − (−inf)
    e = torch.exp(s - m)  # every exponent ≤ 0: each entry in [0, 1], no overflow
    l = e.sum(dim=-1, keepdim=True)  # (..., 1) row sum: ≥ 1 with a kept key (the max gives exp(0)), else 0
    return e / l.clamp_min(1.0)  # rows with no key: 0 / 1 = 0


def safe_attention(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None = None) -> Tensor:
    """Rung 2's grouped attention with the safe softmax and the precision policy: scores and
    statistics in float32 for 16-bit inputs, P rounded to v's dtype for P·V.
    q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), keep (B|1, Hq|1, Lq, Lk) → (B, Hq, Lq, Dv)."""
    B, Hq, Lq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    G = Hq // Hkv
    acc = stats_dtype(q.dtype)
    q_g = q.reshape(B, Hkv, G * Lq, D)  # (B, Hkv, G·Lq, D)
    s = (q_g.to(acc) @ k.to(acc).transpose(-2, -1)) / math.sqrt(D)  # (B, Hkv, G·Lq, Lk) in float32
    keep_g = group_keep(keep, Hkv, G)  # (B|1, Hkv|1, G·Lq, Lk)
    if keep_g is not None:
        s = s.masked_fill(keep_g == 0, float("-inf"))
    p = safe_softmax(s)  # (B, Hkv, G·Lq, Lk) in float32
    return (p.to(v.dtype) @ v).view(B, Hq, Lq, Dv)  # (B, Hq, Lq, Dv)


def running_sum(values: Tensor, dtype: torch.dtype) -> float:
    """Σ values added one at a time into an accumulator of ``dtype``, as a loop over keys would."""
    total = torch.zeros((), dtype=dtype)
    for x in values.to(dtype):
        total = total + x  # rounded to dtype after every addition
    return float(total)


def run(out: Path | None, *, small: bool = False, say: Printer) -> Result:
    g = torch.Generator().manual_seed(3)

    # 1. overflow: large scores (sharp attention; a scale of 4 on q, as activations grow in training)
    B, Hq, Hkv, L, D = 1, 2, 1, 32, 16
    q = 4.0 * torch.randn(B, Hq, L, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, L, D, generator=g, dtype=torch.float64)
    for dtype, boost in ((torch.float16, 1.0), (torch.bfloat16, 8.0)):  # bfloat16 needs scores > 88.7
        qd, kd = (q * boost).to(dtype), k.to(dtype)
        s = (qd.reshape(B, Hkv, -1, D) @ kd.transpose(-2, -1)) / math.sqrt(D)  # 16-bit scores, the seeds' way
        e = torch.exp(s)
        naive = naive_softmax(s)
        safe = safe_softmax(s)
        gold = safe_softmax(s.double())  # the same 16-bit scores, float64 softmax
        say(f"{str(dtype)[6:]:>8}: max score {float(s.max()):.1f} > ln(max) {math.log(torch.finfo(dtype).max):.2f}: "
            f"exp → inf in {int(e.isinf().sum())} entries, naive softmax NaN rows "
            f"{int(naive.isnan().any(-1).sum())}/{naive[..., 0].numel()}; safe softmax: no NaN, "
            f"max error {max_error(safe, gold):.1e}")  # fmt: skip
        if dtype == torch.float16:  # the picture: the float16 row with the most overflows
            i = int(e.isinf().flatten(0, -2).sum(-1).argmax())
            picture_row = tuple(t.flatten(0, -2)[i].double() for t in (s, naive, safe))

    # 2. why float32 statistics: a row sum accumulated key by key in 16 bits stalls
    n = 1024 if small else 8192
    terms = torch.rand(n, generator=g, dtype=torch.float64)  # exp(s − m) is in [0, 1]
    exact = float(terms.sum())
    say(f"\nsum of {n} terms in [0, 1], one at a time (exact {exact:.1f}): " + ", ".join(
        f"{str(dt)[6:]} {running_sum(terms, dt):.1f}" for dt in (torch.bfloat16, torch.float16, torch.float32)
    ))  # fmt: skip

    # 3. check: safe_attention vs rung 2's grouped attention in float64, on left-padded causal rows
    #    (two rows have no key: rung 2 gives NaN there, the safe softmax 0)
    Lc = 12
    qc = torch.randn(2, 4, Lc, D, generator=g, dtype=torch.float64)
    kc, vc = (torch.randn(2, 2, Lc, D, generator=g, dtype=torch.float64) for _ in range(2))
    keep = left_padded_causal([Lc, Lc - 2], Lc)  # (B, 1, L, L)
    ours, theirs = safe_attention(qc, kc, vc, keep), grouped_attention(qc, kc, vc, keep)
    has_key = (keep != 0).any(-1).expand(2, 4, Lc)  # (B, Hq, L)
    error = max(max_error(ours[has_key], theirs[has_key]), float(ours[~has_key].abs().max()))
    say(f"\nrows with no key: rung 2 gives NaN in {int(theirs.isnan().any(-1).sum())} rows, safe_attention "
        f"max |out| {float(ours[~has_key].abs().max()):.1f}")  # fmt: skip

    # 4. time at a fixed shape: float32 and bfloat16 inputs
    Bt, Hqt, Hkvt, Lt, Dt = (1, 4, 1, 64, 32) if small else (2, 16, 2, 512, 64)
    qt = torch.randn(Bt, Hqt, Lt, Dt, generator=g)
    kt, vt = (torch.randn(Bt, Hkvt, Lt, Dt, generator=g) for _ in range(2))
    tril = torch.tril(torch.ones(1, 1, Lt, Lt, dtype=torch.bool))
    times = {
        "rung 2 (torch.softmax) float32": median_time(lambda: grouped_attention(qt, kt, vt, tril)),
        "safe float32": median_time(lambda: safe_attention(qt, kt, vt, tril)),
        "safe bfloat16": median_time(lambda: safe_attention(qt.bfloat16(), kt.bfloat16(), vt.bfloat16(), tril)),
    }
    say(f"\ntime at (B, Hq, Hkv, L, D) = {(Bt, Hqt, Hkvt, Lt, Dt)}, causal: "
        + ", ".join(f"{n_} {t * 1e3:.2f} ms" for n_, t in times.items()))  # fmt: skip

    pictures = []
    if out is not None:
        path = out / "r3-overflow.png"
        _draw(path, *picture_row)
        pictures.append(path)
    return Result(
        rung=3, title=TITLE, check="safe_attention vs rung 2's grouped attention (float64; rows with no key → 0)",
        error=error, tol=1e-12, pictures=pictures,
        numbers={**{f"time {n_} s": t for n_, t in times.items()}, "shape": (Bt, Hqt, Hkvt, Lt, Dt)},
    )  # fmt: skip


def _draw(path: Path, scores_t: Tensor, naive_t: Tensor, safe_t: Tensor) -> None:
    """One float16 row: its scores against the overflow line, and the two softmaxes of it."""
    import numpy as np

    limit = math.log(torch.finfo(torch.float16).max)
    j = np.arange(len(scores_t))
    scores, naive, safe = (t.numpy() for t in (scores_t, naive_t, safe_t))
    over = scores > limit
    with figure(path, size=(8.0, 5.0), nrows=2) as (_, axes):
        ax = axes[0, 0]
        ax.bar(j[~over], scores[~over], color="tab:blue", label="score")
        ax.bar(j[over], scores[over], color="tab:red", label="exp(score) = inf in float16")
        ax.axhline(limit, color="tab:red", ls="--", lw=1)
        ax.text(len(scores) - 0.5, limit, " ln 65504 = 11.09", color="tab:red", va="bottom", ha="right", fontsize=8)
        ax.set_ylabel("score s_j (float16)")
        ax.legend(fontsize=8, loc="lower center", ncol=2, bbox_to_anchor=(0.5, 1.0))
        ax = axes[1, 0]
        ax.bar(j, safe, color="tab:green", label="safe softmax: exp(s − max) / sum")
        bad = np.isnan(naive)  # exp(s) / inf: 0 where exp(s) is finite, inf / inf = NaN where it is not
        ax.scatter(j[~bad], naive[~bad], marker=".", color="tab:red", label="naive softmax: exp(s) / inf = 0")
        ax.scatter(j[bad], np.full(int(bad.sum()), 0.5), marker="x", s=60, color="tab:red",
                   label="naive softmax: inf / inf = NaN")  # fmt: skip
        ax.set_xlabel("key j")
        ax.set_ylabel("probability")
        ax.legend(fontsize=8, loc="upper left")
