"""Rung 1: masks — one convention (``True`` = may attend), drawn as grids.

The seeds block with ``masked_fill(mask == 0, -inf)``: a non-zero entry keeps the pair. attnzero
reads every mask that way. ``az.masks`` builds the usual ones — causal in both alignments, a
sliding window, key padding, packed documents — as small predicates that print themselves and
turn into the same dense keep tensor the seeds' code takes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from .. import masks
from ..masks import Mask
from .common import Printer, Result, attend, figure, max_error, median_time
from .r0_seeds import seeds_attention

TITLE = "masks: one convention, causal in both alignments, window, padding, documents"


def example_masks(Lq: int, Lk: int) -> dict[str, Mask]:
    """The masks this rung draws and checks, for Lq queries and Lk keys (Lq < Lk: a decoding step
    over a cache, where the two causal alignments differ)."""
    docs = [0] * (Lk // 3) + [1] * (Lk // 2) + [2] * (Lk - Lk // 3 - Lk // 2)  # three packed documents
    return {
        "causal (bottom-right)": masks.causal(Lq, Lk),  # attnzero's causal=True: last query at last key
        "causal (top-left)": masks.causal(Lq, Lk, align="top_left"),  # torch's is_causal=True
        "causal, Lq > Lk": masks.causal(Lk, Lq),  # bottom-right: the first Lk - Lq rows see nothing
        "window (left=2)": masks.window(Lk, Lk, left=2),  # the key itself and the 2 before it
        f"padding (lengths 3, {Lk})": masks.padding([3, Lk], Lk),  # per sequence: real keys only
        "document": masks.document(docs),  # packed sequences see only their own document
        "causal and document": masks.causal(Lk) & masks.document(docs),  # packed causal training
    }


def seeds_keep(mask: Mask) -> Tensor:
    """The dense keep tensor that the seeds' ``masked_fill(mask == 0, -inf)`` takes: the same
    convention, so no inversion — just the predicate evaluated everywhere. (B|1, H|1, Lq, Lk) bool."""
    return mask.to_tensor()


def attend_with_mask(q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> Tensor:
    """attnzero with the Mask itself (the caller builds no tensor; the reference formula evaluates it).
    q (B, H, Lq, D), k and v (B, H, Lk, D) → (B, H, Lq, D)."""
    return attend(q, k, v, mask=mask, backend="reference")


def run(out: Path | None, *, small: bool = False, say: Printer) -> Result:
    Lq, Lk = 4, 6
    named = example_masks(Lq, Lk)

    # 1. one convention: the seeds' causal mask is the top-left / bottom-right triangle when Lq = Lk
    tril = torch.tril(torch.ones(Lk, Lk))  # the seeds' causal mask, 1 = may attend
    same = bool(torch.equal(tril.bool(), masks.causal(Lk).to_tensor()[0, 0]))
    say(f"torch.tril(torch.ones({Lk}, {Lk})) == az.masks.causal({Lk}).to_tensor(): {same}")

    # 2. the grids, as print(mask) draws them (■ = may attend, · = blocked)
    for mask in named.values():
        say()
        say(str(mask))

    # 3. check: each Mask through attnzero vs the seeds' function given the same dense keep tensor
    g = torch.Generator().manual_seed(1)
    error = 0.0 if same else float("inf")  # the convention claimed in step 1 is part of the check
    H, D = 2, 8
    say()
    for name, mask in named.items():
        B, _, mq, mk = mask.shape
        mq = mq if mq > 1 else Lq  # padding is (B, 1, 1, Lk): the same for every query row
        q = torch.randn(B, H, mq, D, generator=g, dtype=torch.float64)
        k, v = (torch.randn(B, H, mk, D, generator=g, dtype=torch.float64) for _ in range(2))
        keep = seeds_keep(mask).expand(B, H, mq, mk)
        ours = attend_with_mask(q, k, v, mask)
        theirs, _ = seeds_attention(q, k, v, keep)
        has_key = keep.any(dim=-1)  # (B, H, Lq): rows the seeds' code gets right
        error = max(error, max_error(ours[has_key], theirs[has_key]))
        empty = int((~has_key[0, 0]).sum())
        if empty:  # where the seeds give NaN, attnzero gives 0 (it counts in the check)
            error = max(error, float(ours[~has_key].abs().max()))
        say(f"{name:>24}: max |attnzero − seeds'| on rows with a key {max_error(ours[has_key], theirs[has_key]):.1e}"
            + (f"; {empty} rows with no key → 0" if empty else ""))  # fmt: skip

    # 4. time at a fixed shape: the causal Mask vs the seeds' code with its dense tril
    B, Ht, L, Dt = (1, 2, 64, 32) if small else (2, 8, 512, 64)
    qt, kt, vt = (torch.randn(B, Ht, L, Dt, generator=g) for _ in range(3))
    causal = masks.causal(L)
    t_mask = median_time(lambda: attend_with_mask(qt, kt, vt, causal))
    t_dense = median_time(lambda: seeds_attention(qt, kt, vt, torch.tril(torch.ones(L, L))))
    say(f"\ntime at (B, H, L, D) = {(B, Ht, L, Dt)} float32: reference with masks.causal {t_mask * 1e3:.2f} ms, "
        f"seeds' code with a dense tril {t_dense * 1e3:.2f} ms")  # fmt: skip

    pictures = []
    if out is not None:
        path = out / "r1-masks.png"
        _draw(path, named)
        pictures.append(path)
    return Result(
        rung=1, title=TITLE, check="az.masks through attnzero vs rung 0's seeds' code, same keep tensor (float64)",
        error=error, tol=1e-12, pictures=pictures,
        numbers={"time_mask_s": t_mask, "time_dense_s": t_dense, "shape": (B, Ht, L, Dt)},
    )  # fmt: skip


def _draw(path: Path, named: dict[str, Mask]) -> None:
    """Each mask's dense keep tensor (batch 0, head 0), as ``Mask.to_tensor()`` gives it."""
    ncols = 4
    nrows = -(-len(named) // ncols)
    with figure(path, size=(3.0 * ncols, 2.8 * nrows), ncols=ncols, nrows=nrows) as (_, axes):
        for ax in axes.flat:
            ax.axis("off")
        for ax, (name, mask) in zip(axes.flat, named.items()):
            B, _, Lq, Lk = mask.shape
            dense = mask.to_tensor()  # (B|1, 1, Lq, Lk)
            per_batch = Lq == 1 and B > 1  # padding: one row per sequence, the same for every query
            keep = dense[:, 0, 0] if per_batch else dense[0, 0]  # (B, Lk) or (Lq, Lk)
            ax.axis("on")
            ax.imshow(keep.numpy(), cmap="Greens", vmin=0, vmax=1.3)
            ax.set_title(name, fontsize=9)
            ax.set_xticks(range(Lk))
            ax.set_yticks(range(keep.shape[0]))
            ax.set_xlabel("key j", fontsize=8)
            ax.set_ylabel("sequence b (every query)" if per_batch else "query i", fontsize=8)
