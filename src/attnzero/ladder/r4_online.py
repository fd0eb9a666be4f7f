"""Rung 4: the online softmax — one query row, the keys read block by block.

Rung 3 needs the whole row of scores before it can subtract its maximum. Here the row is read one
key block at a time, keeping three things: the running max ``m``, the running sum ``l`` of
``exp(s − m)`` and the running, not yet normalised output ``acc``. When a block brings a larger
max, what was summed so far is rescaled by ``alpha = exp(m_old − m_new)`` (docs/MATH.md). At the end
``out = acc / l`` and ``lse = m + log l``. This is the loop inside every flash kernel.

Base e here, for reading. The kernels work in base 2: ``exp(x) = exp2(x · log2 e)``, with
``log2 e`` folded into the scale once, and ``lse`` converted back with ``· ln 2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .common import Printer, Result, figure, max_error, median_time
from .r3_safe_softmax import safe_softmax

TITLE = "online softmax: one row, key block by key block (m, l, acc, alpha)"


@dataclass(frozen=True)
class BlockStep:
    """What ``online_softmax_row`` did at one key block ``[start, stop)``: the block's own max,
    then the running max ``m`` and sum ``l`` after it, and ``alpha``, the factor that rescaled
    ``l`` and ``acc`` (1: the max did not move; 0: nothing had been kept before)."""

    start: int
    stop: int
    block_max: float
    m: float
    l: float
    alpha: float


def online_softmax_row(s: Tensor, v: Tensor, block: int) -> tuple[Tensor, Tensor, list[BlockStep]]:
    """softmax(s) @ v for one query row, reading ``block`` keys at a time. s (Lk,) scores, -inf where
    blocked; v (Lk, Dv). Returns (out (Dv,), lse (), the record: one BlockStep per key block).
    A row with no kept key gives out 0 and lse -inf, and its m stays -inf."""
    m = torch.tensor(float("-inf"), dtype=s.dtype)  # running max of the scores read so far
    l = torch.zeros((), dtype=s.dtype)  # running Σ_j exp(s_j − m)
    acc = torch.zeros(v.shape[-1], dtype=s.dtype)  # running Σ_j exp(s_j − m) v_j   (Dv,)
    record = []
    for start in range(0, len(s), block):
        s_b, v_b = s[start : start + block], v[start : start + block]  # (b,), (b, Dv)
        # m_new = max(m, max_j s_ij)
        m_new = torch.maximum(m, s_b.max())
        # while every score so far is blocked m_new = -inf: shift by 0 (never exp(-inf - (-inf))),
        # but keep m = -inf in the state, so a later block of very negative scores still counts
        shift = m_new if torch.isfinite(m_new) else torch.zeros_like(m_new)
        # alpha = exp(m - m_new) ≤ 1: rescales what was summed under the old max
        alpha = torch.exp(m - shift)
        # p_ij = exp(s_ij - m_new), each in [0, 1]
        p = torch.exp(s_b - shift)  # (b,)
        # l = alpha·l + Σ_j p_ij ;  acc = alpha·acc + Σ_j p_ij v_j
        l = alpha * l + p.sum()
        acc = alpha * acc + p @ v_b  # (Dv,)
        m = m_new
        record.append(BlockStep(start, start + len(s_b), float(s_b.max()), float(m), float(l), float(alpha)))
    # O = acc / l (l ≥ 1 once a key was kept: the max contributes exp(0); a row with none: 0 / 1 = 0)
    out = acc / l.clamp_min(1.0)
    lse = m + torch.log(l)  # -inf + log 0 = -inf for a row with no key
    return out, lse, record


def _row_problem(Lk: int, Dv: int, blocked_prefix: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """Scores of one query against Lk keys (float64, scale 1/√D) with the first ``blocked_prefix``
    keys blocked (left padding), and the values."""
    D = 64
    q = torch.randn(D, generator=g, dtype=torch.float64)
    k = torch.randn(Lk, D, generator=g, dtype=torch.float64)
    v = torch.randn(Lk, Dv, generator=g, dtype=torch.float64)
    s = (k @ q) / math.sqrt(D)  # (Lk,)
    s[:blocked_prefix] = float("-inf")
    return s, v


def run(out: Path | None, *, small: bool = False, say: Printer) -> Result:
    g = torch.Generator().manual_seed(4)
    Lk, block, Dv = (256, 32, 16) if small else (1024, 64, 64)
    rows = {
        "random row": _row_problem(Lk, Dv, 0, g),
        "left-padded row (2.5 blocks blocked)": _row_problem(Lk, Dv, 2 * block + block // 2, g),
        "row with no key": _row_problem(Lk, Dv, Lk, g),
    }

    # 1. each row, block by block, against rung 3's safe softmax of the whole row (float64)
    error = 0.0
    records = {}
    for name, (s, v) in rows.items():
        o, lse, record = online_softmax_row(s, v, block)
        records[name] = record
        whole = safe_softmax(s) @ v  # rung 3: the whole row at once
        lse_whole = torch.logsumexp(s, dim=0)
        err_out = max_error(o, whole)
        if math.isfinite(float(lse_whole)):
            err_lse = abs(float(lse - lse_whole))
        else:  # no key: lse must be -inf too
            err_lse = 0.0 if float(lse) == -math.inf else math.inf
        error = max(error, err_out, err_lse)
        rescaled = sum(1 for r in record if 0.0 < r.alpha < 1.0)
        say(f"{name}: {len(record)} blocks of {block}, max rose (alpha < 1) at {rescaled} of them; "
            f"out vs rung 3 {err_out:.1e}, lse {float(lse):+.4f} (off torch.logsumexp by {err_lse:.1e})")  # fmt: skip

    # 2. the record of the random row: what the loop kept after each block
    say("\nrandom row, after each block:   block max        m          l       alpha")
    for r in records["random row"]:
        say(f"  keys [{r.start:4d}, {r.stop:4d})          {r.block_max:+8.4f}  {r.m:+8.4f}  {r.l:9.4f}  {r.alpha:8.5f}")
    padded = records["left-padded row (2.5 blocks blocked)"]
    say("left-padded row, first blocks (m, l, alpha): "
        + "  ".join(f"({r.m:+.2f}, {r.l:.2f}, {r.alpha:.2f})" for r in padded[:4]))  # fmt: skip
    empty = records["row with no key"]
    say(f"row with no key: m after every block {sorted({r.m for r in empty})}, l {sorted({r.l for r in empty})}")
    if any(r.m != -math.inf for r in empty):
        error = math.inf  # m must stay -inf: nothing kept, nothing to shift by

    # 3. time at a fixed row: the Python block loop vs rung 3's whole-row softmax
    s, v = rows["random row"]
    t_online = median_time(lambda: online_softmax_row(s, v, block))
    t_whole = median_time(lambda: safe_softmax(s) @ v)
    say(f"\ntime for one row of {Lk} keys, Dv = {Dv}, float64: online (blocks of {block}) {t_online * 1e6:.0f} µs, "
        f"whole row {t_whole * 1e6:.0f} µs; scores held at once: {block} vs {Lk}")  # fmt: skip

    pictures = []
    if out is not None:
        path = out / "r4-online.png"
        _draw(path, records["random row"], records["left-padded row (2.5 blocks blocked)"])
        pictures.append(path)
    return Result(
        rung=4, title=TITLE, check="online softmax row vs rung 3's safe softmax of the row (out and lse, float64)",
        error=error, tol=1e-12, pictures=pictures,
        numbers={"blocks": len(records["random row"]), "time_online_s": t_online, "time_whole_s": t_whole,
                 "shape": (Lk, block, Dv)},
    )  # fmt: skip


def _draw(path: Path, record: list[BlockStep], padded: list[BlockStep]) -> None:
    """From the record: per block, the block's max and the running max m (top) and the rescale
    factor alpha (bottom), for a random row and a row whose first keys are blocked."""
    with figure(path, size=(9.0, 5.0), nrows=2, ncols=2) as (_, axes):
        for col, (name, rec) in enumerate((("random row", record), ("first keys blocked (left padding)", padded))):
            n = list(range(len(rec)))
            top, bottom = axes[0, col], axes[1, col]
            seen = [i for i in n if math.isfinite(rec[i].m)]  # blocks after which some key was kept
            for i in n:
                if i not in seen:  # nothing kept yet: m is still -inf
                    for ax in (top, bottom):
                        ax.axvspan(i - 0.5, i + 0.5, color="tab:gray", alpha=0.15, lw=0)
                    top.text(i, 0.5, "m = −inf", rotation=90, ha="center", va="center", fontsize=8,
                             transform=top.get_xaxis_transform())  # fmt: skip
            top.scatter(seen, [rec[i].block_max for i in seen], color="tab:gray", label="block max", zorder=3)
            top.step(seen, [rec[i].m for i in seen], where="mid", color="tab:blue", label="running max m")
            top.set_title(name, fontsize=10)
            top.set_ylabel("score")
            top.legend(fontsize=8, loc="lower right")
            colors = ["tab:red" if r.alpha < 1.0 else "tab:green" for r in rec]
            bottom.bar(n, [r.alpha for r in rec], color=colors)
            for i in n:
                if rec[i].alpha == 0.0:  # nothing summed before this block: nothing to rescale
                    bottom.text(i, 0.02, "0", ha="center", va="bottom", fontsize=8, color="tab:red")
            bottom.set_ylim(0, 1.1)
            bottom.set_ylabel("alpha = exp(m_old − m_new)", fontsize=9)
            bottom.set_xlabel("key block")
            for ax in (top, bottom):
                ax.set_xlim(-0.5, len(rec) - 0.5)
                ax.set_xticks(n[:: max(1, len(n) // 8)])
