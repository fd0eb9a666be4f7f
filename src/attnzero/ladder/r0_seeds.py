"""Rung 0: the seeds' formula as written — scores, scale, ``masked_fill(-inf)``, softmax, weights × V.

It is right on every row that keeps at least one key. On a row whose keys are all blocked (a
left-padded sequence under a causal mask, say) it gives NaN: the softmax of a row of ``-inf`` is
``0 / 0``. attnzero's reference gives 0 there and agrees with the seeds everywhere else.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

from .. import attention_weights
from .common import Printer, Result, attend, figure, max_error, median_time

TITLE = "the seeds' formula as written, and the NaN row"


def seeds_attention(Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """softmax(Q Kᵀ / √d_k) V, the way the seeds write it. Q (..., Lq, d_k), K (..., Lk, d_k),
    V (..., Lk, d_v); ``mask`` broadcastable to (..., Lq, Lk), non-zero = may attend.
    Returns (output (..., Lq, d_v), weights (..., Lq, Lk))."""
    d_k = Q.size(-1)
    # 1. similarity of every query with every key
    scores = Q @ K.transpose(-2, -1)  # (..., Lq, Lk)
    # 2. scale, so that the scores' variance does not grow with d_k
    scores = scores / math.sqrt(d_k)
    # 3. blocked pairs get -inf, so that softmax gives them weight exp(-inf) = 0
    if mask is not None:
        scores = scores.masked_fill(mask == 0, float("-inf"))
    # 4. each row → probabilities (sums to 1 — unless every entry of the row is -inf: then NaN)
    weights = torch.softmax(scores, dim=-1)  # (..., Lq, Lk)
    # 5. weighted sum of the values
    return weights @ V, weights  # (..., Lq, d_v), (..., Lq, Lk)


def softmax_of_blocked_row(n: int = 4) -> dict[str, Tensor]:
    """The softmax of a row whose ``n`` entries are all -inf, one step at a time: where NaN comes from."""
    row = torch.full((n,), float("-inf"), dtype=torch.float64)
    m = row.max()  # -inf: the largest of nothing kept
    shifted = row - m  # -inf - (-inf) = NaN  (softmax subtracts the max first)
    unshifted = torch.exp(row)  # without the shift: exp(-inf) = 0 everywhere ...
    total = unshifted.sum()  # ... and the sum is 0, so each weight is 0 / 0 = NaN
    return {"row": row, "max": m, "row - max": shifted, "exp(row)": unshifted, "sum": total,
            "exp(row) / sum": unshifted / total, "torch.softmax": torch.softmax(row, dim=-1)}  # fmt: skip


def left_padded_causal(lengths: list[int], L: int) -> Tensor:
    """Keep-mask (B, 1, L, L) of a batch of left-padded sequences under a causal mask: the seeds'
    ``torch.tril(torch.ones(L, L))`` and a padding mask (key ``j`` of sequence ``b`` is real iff
    ``j >= L - lengths[b]``). The first rows of a padded sequence see only padding: no key at all."""
    causal = torch.tril(torch.ones(L, L))  # (L, L), 1 = may attend
    real = torch.stack([torch.arange(L) >= L - n for n in lengths]).double()  # (B, L): 1 = a real token
    return (causal * real[:, None, :]).unsqueeze(1)  # (B, 1, L, L)


def _draw(path: Path, w_seeds: Tensor, w_ref: Tensor, blocked: Tensor) -> None:
    """Weights of one sequence from both codes, the rows that came out NaN marked."""
    import matplotlib
    import numpy as np

    cmap = matplotlib.colormaps["Blues"].with_extremes(bad="tab:red")  # NaN entries are drawn in red
    with figure(path, size=(8.0, 3.8), ncols=2) as (_, axes):
        for ax, w, name in ((axes[0, 0], w_seeds, "seeds' code"), (axes[0, 1], w_ref, "attnzero reference")):
            ax.imshow(np.ma.masked_invalid(w.numpy()), cmap=cmap, vmin=0.0, vmax=1.0)
            for i in torch.nonzero(blocked).flatten().tolist():
                label = "NaN" if bool(torch.isnan(w[i]).any()) else "0"
                ax.text(w.shape[1] - 0.6, i, f"← {label}", va="center", ha="left", fontsize=9, clip_on=False)
            ax.set_title(f"{name}: weights")
            ax.set_xlabel("key j")
            ax.set_ylabel("query i")


def run(out: Path | None, *, small: bool = False, say: Printer) -> Result:
    # 1. where NaN comes from
    say("softmax of a row that is all -inf, step by step:")
    for name, value in softmax_of_blocked_row().items():
        say(f"  {name:>15}: {value.tolist()}")

    # 2. a batch where it happens: two sequences of length L, the second left-padded, causal mask
    L, D = 6, 8
    lengths = [L, L - 2]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1, L, D, generator=g, dtype=torch.float64) for _ in range(3))  # (B, H, L, D)
    keep = left_padded_causal(lengths, L)  # (B, 1, L, L)
    out_seeds, w_seeds = seeds_attention(q, k, v, keep)
    out_ref = attend(q, k, v, mask=keep != 0, backend="reference")
    w_ref = attention_weights(q, k, mask=keep != 0)
    blocked = ~(keep != 0).any(dim=-1)  # (B, 1, L): rows with no key at all
    empty_rows = blocked[1, 0].nonzero().flatten().tolist()
    say(f"\ncausal mask, sequence 1 left-padded by {L - lengths[1]}: rows with no key {empty_rows}")
    say(f"  seeds' output, sequence 1, rows 0..2, first 3 values:\n{_rows(out_seeds[1, 0, :3, :3])}")
    say(f"  attnzero reference, same entries:\n{_rows(out_ref[1, 0, :3, :3])}")

    # one NaN row spreads in training: dV = Pᵀ dO reads the NaN weights of that row for every value
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    seeds_attention(leaves[0], leaves[1], leaves[2], keep)[0].sum().backward()
    grads = {n: t.grad for n, t in zip("QKV", leaves) if t.grad is not None}
    nans = ", ".join(f"d{n} {int(grad.isnan().sum())}/{grad.numel()}" for n, grad in grads.items())
    say(f"  loss = seeds' output.sum(): NaN entries in {nans}")

    # 3. check: the same numbers on every row that keeps a key; 0 (not NaN) on the others
    ok = ~blocked
    error = max_error(out_seeds[ok], out_ref[ok])
    say(f"  reference on rows with no key: max |out| = {float(out_ref[blocked].abs().max()):.1f}")

    # 4. time at a fixed shape (float32, causal)
    B, H, Lt, Dt = (1, 2, 64, 32) if small else (2, 8, 512, 64)
    qt, kt, vt = (torch.randn(B, H, Lt, Dt, generator=g) for _ in range(3))
    tril = torch.tril(torch.ones(Lt, Lt, dtype=torch.bool))
    t_seeds = median_time(lambda: seeds_attention(qt, kt, vt, tril))
    t_ref = median_time(lambda: attend(qt, kt, vt, mask=tril, backend="reference"))
    say(f"\ntime at (B, H, L, D) = {(B, H, Lt, Dt)} float32, causal: seeds' code {t_seeds * 1e3:.2f} ms, "
        f"reference {t_ref * 1e3:.2f} ms")  # fmt: skip

    pictures = []
    if out is not None:
        path = out / "r0-nan-row.png"
        _draw(path, w_seeds[1, 0], w_ref[1, 0], blocked[1, 0])
        pictures.append(path)
    return Result(
        rung=0, title=TITLE, check="seeds' code vs attnzero reference (rows with a key, float64)",
        error=error, tol=1e-12, pictures=pictures,
        numbers={"nan_rows_seeds": int(out_seeds.isnan().any(-1).sum()), "time_seeds_s": t_seeds,
                 "time_reference_s": t_ref, "shape": (B, H, Lt, Dt)},
    )  # fmt: skip


def _rows(t: Tensor) -> str:
    return "\n".join("    " + "  ".join(f"{x:+.4f}" if x == x else "   nan " for x in row) for row in t.tolist())
