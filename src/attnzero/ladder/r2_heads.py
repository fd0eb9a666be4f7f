"""Rung 2: heads — multi-head attention as reshapes, and GQA/MQA as one more reshape.

Letters: B batch, L sequence, d_model = H·D model width, Hq query heads, Hkv key/value heads
(Hkv = Hq: multi-head; 1 < Hkv < Hq: grouped-query; Hkv = 1: multi-query), G = Hq // Hkv query
heads per key/value head, D head dim. Query head ``h`` reads key/value head ``h // G``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from .. import masks
from .common import Printer, Result, attend, figure, max_error, median_time
from .r0_seeds import seeds_attention

TITLE = "heads: multi-head, GQA and MQA as reshapes"


def split_heads(x: Tensor, H: int) -> Tensor:
    """(B, L, H·D) → (B, H, L, D): cut the width into H heads, then put heads before positions."""
    B, L, width = x.shape  # (B, L, H·D)
    x = x.view(B, L, H, width // H)  # (B, L, H, D): no copy, the same memory read in 4 dims
    return x.transpose(1, 2)  # (B, H, L, D): a strided view, still no copy


def merge_heads(o: Tensor) -> Tensor:
    """(B, H, L, D) → (B, L, H·D): the inverse of ``split_heads`` (one copy, for the transpose)."""
    B, H, L, D = o.shape
    return o.transpose(1, 2).reshape(B, L, H * D)  # (B, L, H, D) → (B, L, H·D)


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None = None) -> Tensor:
    """Attention with Hkv ≤ Hq key/value heads, K and V never copied: the G query heads that share
    a key/value head are stacked along the query axis, so that one (G·Lq × Lk) score matrix per
    key/value head serves the whole group. q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv),
    keep (B|1, Hq|1, Lq, Lk) → (B, Hq, Lq, Dv)."""
    B, Hq, Lq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    G = Hq // Hkv
    # query head h = n·G + g lands in group n at rows g·Lq … g·Lq + Lq − 1
    q_g = q.reshape(B, Hkv, G * Lq, D)  # (B, Hkv, G·Lq, D): a view when q is contiguous
    keep_g = group_keep(keep, Hkv, G)  # (B|1, Hkv|1, G·Lq, Lk)
    out_g, _ = seeds_attention(q_g, k, v, keep_g)  # (B, Hkv, G·Lq, Dv): rung 0, K and V as they are
    return out_g.view(B, Hq, Lq, Dv)  # (B, Hq, Lq, Dv)


def group_keep(keep: Tensor | None, Hkv: int, G: int) -> Tensor | None:
    """A keep-mask (B|1, Hq|1, Lq, Lk) stacked as the grouped queries are: (B|1, Hkv|1, G·Lq, Lk)."""
    if keep is None:
        return None
    _, H, Lq, Lk = keep.shape
    if H == 1:  # the same for every head: G copies along the query axis
        return keep.repeat(1, 1, G, 1)  # (B|1, 1, G·Lq, Lk)
    return keep.reshape(-1, Hkv, G * Lq, Lk)  # (B|1, Hkv, G·Lq, Lk): each query head its own


def repeated_attention(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None = None) -> Tensor:
    """The same result the obvious way: copy each key/value head G times, then plain multi-head."""
    G = q.shape[1] // k.shape[1]
    k_r = k.repeat_interleave(G, dim=1)  # (B, Hq, Lk, D): heads n, n, …, n (G times), n + 1, …
    v_r = v.repeat_interleave(G, dim=1)  # (B, Hq, Lk, Dv)
    return seeds_attention(q, k_r, v_r, keep)[0]  # (B, Hq, Lq, Dv)


def per_head_loop(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None = None) -> Tensor:
    """One head at a time with rung 0's function on (B, L, D), as the seeds call it, and the rung 1
    mask of that head: query head h reads key/value head h // G."""
    Hq, Hkv = q.shape[1], k.shape[1]
    G = Hq // Hkv
    outs = []
    for h in range(Hq):
        keep_h = None if keep is None else keep[:, h if keep.shape[1] > 1 else 0]  # (B|1, Lq, Lk)
        out_h, _ = seeds_attention(q[:, h], k[:, h // G], v[:, h // G], keep_h)  # (B, Lq, Dv)
        outs.append(out_h)
    return torch.stack(outs, dim=1)  # (B, Hq, Lq, Dv)


def multi_head_attention(
    x: Tensor, w_q: Tensor, w_k: Tensor, w_v: Tensor, w_o: Tensor, Hq: int, Hkv: int, keep: Tensor | None = None
) -> Tensor:
    """The seeds' ``MultiHeadAttention.forward`` (self-attention, no biases) with Hkv key/value heads.
    x (B, L, d_model); w_q (Hq·D, d_model), w_k and w_v (Hkv·D, d_model), w_o (d_model, Hq·D)."""
    q = split_heads(x @ w_q.T, Hq)  # (B, L, Hq·D) → (B, Hq, L, D)
    k = split_heads(x @ w_k.T, Hkv)  # (B, L, Hkv·D) → (B, Hkv, L, D): G times fewer heads to keep
    v = split_heads(x @ w_v.T, Hkv)  # (B, L, Hkv·D) → (B, Hkv, L, D)
    o = grouped_attention(q, k, v, keep)  # (B, Hq, L, D)
    return merge_heads(o) @ w_o.T  # (B, L, Hq·D) → (B, L, d_model)


def kv_head_read(Hq: int, Hkv: int) -> list[int]:
    """Which key/value head each query head read, found by running ``grouped_attention``: zero
    queries and keys (uniform weights) and values that hold their own head's index, so the output of
    query head h is the index of the head it read."""
    q = torch.zeros(1, Hq, 1, 1, dtype=torch.float64)
    k = torch.zeros(1, Hkv, 1, 1, dtype=torch.float64)
    v = torch.arange(Hkv, dtype=torch.float64).view(1, Hkv, 1, 1)  # value of head n = n
    return [int(x) for x in grouped_attention(q, k, v).flatten().tolist()]


def run(out: Path | None, *, small: bool = False, say: Printer) -> Result:
    g = torch.Generator().manual_seed(2)
    B, L, Hq, D = 2, 5, 8, 4
    d_model = Hq * D
    x = torch.randn(B, L, d_model, generator=g, dtype=torch.float64)
    keep = masks.causal(L).to_tensor()  # (1, 1, L, L): rung 1's causal mask

    # 1. the shapes, as multi_head_attention sees them (GQA with Hkv = 2 here)
    Hkv = 2
    w_q = torch.randn(Hq * D, d_model, generator=g, dtype=torch.float64) / d_model**0.5
    q = split_heads(x @ w_q.T, Hq)
    projected = x @ w_q.T
    viewed = projected.view(B, L, Hq, D)
    say(f"x {tuple(x.shape)} (B, L, d_model) → x W_qᵀ {tuple(projected.shape)} → view {tuple(viewed.shape)} "
        f"(B, L, Hq, D) → transpose {tuple(q.shape)} (B, Hq, L, D)")  # fmt: skip
    q = q.contiguous()
    q_g = q.reshape(B, Hkv, (Hq // Hkv) * L, D)
    say(f"GQA, Hkv = {Hkv}, G = {Hq // Hkv}: q {tuple(q.shape)} → q_g {tuple(q_g.shape)} (B, Hkv, G·L, D), "
        f"same memory: {q_g.data_ptr() == q.data_ptr()}")  # fmt: skip

    # 2. check: grouped (a reshape) vs a loop over heads of the seeds' function vs repeat_interleave
    #    vs az.attention with GQA, for multi-head, grouped-query and multi-query attention
    error = 0.0
    for Hkv in (Hq, 2, 1):
        q = torch.randn(B, Hq, L, D, generator=g, dtype=torch.float64)
        k, v = (torch.randn(B, Hkv, L, D, generator=g, dtype=torch.float64) for _ in range(2))
        grouped = grouped_attention(q, k, v, keep)
        errors = {
            "per-head loop": max_error(grouped, per_head_loop(q, k, v, keep)),
            "repeat_interleave": max_error(grouped, repeated_attention(q, k, v, keep)),
            "az.attention": max_error(grouped, attend(q, k, v, mask=keep, backend="reference")),
        }
        error = max(error, *errors.values())
        kind = "MHA" if Hkv == Hq else ("MQA" if Hkv == 1 else "GQA")
        say(f"{kind} Hq={Hq} Hkv={Hkv}: grouped vs " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
        say(f"    query head → kv head read: {kv_head_read(Hq, Hkv)}")

    # and the whole layer, (B, L, d_model) in and out
    Hkv = 2
    w_k, w_v = (torch.randn(Hkv * D, d_model, generator=g, dtype=torch.float64) for _ in range(2))
    w_o = torch.randn(d_model, Hq * D, generator=g, dtype=torch.float64)
    y = multi_head_attention(x, w_q, w_k, w_v, w_o, Hq, Hkv, keep)
    say(f"multi_head_attention: x {tuple(x.shape)} → {tuple(y.shape)}")

    # 3. time and memory at a fixed shape: grouped (no copy) vs repeat_interleave vs the head loop
    Bt, Hqt, Hkvt, Lt, Dt = (1, 4, 1, 64, 32) if small else (2, 16, 2, 512, 64)
    qt = torch.randn(Bt, Hqt, Lt, Dt, generator=g)
    kt, vt = (torch.randn(Bt, Hkvt, Lt, Dt, generator=g) for _ in range(2))
    kt_keep = masks.causal(Lt).to_tensor()
    times = {
        "grouped": median_time(lambda: grouped_attention(qt, kt, vt, kt_keep)),
        "repeat_interleave": median_time(lambda: repeated_attention(qt, kt, vt, kt_keep)),
        "per-head loop": median_time(lambda: per_head_loop(qt, kt, vt, kt_keep)),
    }
    copy_mb = 2 * kt.numel() * kt.element_size() * (Hqt // Hkvt) / 2**20
    say(f"\ntime at (B, Hq, Hkv, L, D) = {(Bt, Hqt, Hkvt, Lt, Dt)} float32, causal: "
        + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in times.items()))  # fmt: skip
    say(f"K and V copied by repeat_interleave: {copy_mb:.1f} MB (grouped: 0 MB, K and V read as they are)")

    pictures = []
    if out is not None:
        path = out / "r2-heads.png"
        _draw(path, Hq, {f"MHA (Hkv={Hq})": Hq, "GQA (Hkv=2)": 2, "MQA (Hkv=1)": 1})
        pictures.append(path)
    return Result(
        rung=2, title=TITLE,
        check="grouped reshape vs a per-head loop of rung 0's seeds' code, repeat_interleave, az.attention (float64)",
        error=error, tol=1e-12, pictures=pictures,
        numbers={**{f"time_{n}_s": t for n, t in times.items()}, "repeat_copy_mb": copy_mb,
                 "shape": (Bt, Hqt, Hkvt, Lt, Dt)},
    )  # fmt: skip


def _draw(path: Path, Hq: int, cases: dict[str, int]) -> None:
    """Query heads (top) joined to the key/value head each one read (bottom), as ``kv_head_read``
    found by running ``grouped_attention``."""
    with figure(path, size=(3.6 * len(cases), 2.6), ncols=len(cases)) as (_, axes):
        for ax, (name, Hkv) in zip(axes[0], cases.items()):
            read = kv_head_read(Hq, Hkv)
            spread = (Hq - 1) / max(Hkv - 1, 1)  # kv heads spread under the query heads
            xs_kv = [n * spread if Hkv > 1 else (Hq - 1) / 2 for n in range(Hkv)]
            for h, n in enumerate(read):
                ax.plot([h, xs_kv[n]], [1, 0], color=f"C{n % 10}", lw=1.5)
            ax.scatter(range(Hq), [1] * Hq, s=120, c=[f"C{n % 10}" for n in read], zorder=3)
            ax.scatter(xs_kv, [0] * Hkv, s=220, marker="s", c=[f"C{n % 10}" for n in range(Hkv)], zorder=3)
            for h in range(Hq):
                ax.text(h, 1.12, f"q{h}", ha="center", fontsize=8)
            for n, xn in enumerate(xs_kv):
                ax.text(xn, -0.22, f"kv{n}", ha="center", fontsize=8)
            ax.set_title(name, fontsize=10)
            ax.set_ylim(-0.4, 1.3)
            ax.axis("off")
