"""Rung 10 — your own attention: a ``score_mod`` and a ``mask_mod``, run through the tiles.

Every rung so far used attnzero's built-in variants (causal, window, documents). Here the variant is
two small Python functions, written for ONE (query, key) pair as torch's FlexAttention takes them:

* ``score_mod(score, b, h, q_idx, kv_idx) -> score`` rewrites the pair's scaled score ``scale·q·k``
  — here ALiBi, ``score − slopes[h]·|q_idx − kv_idx|``, its slopes a learnable tensor;
* ``mask_mod(b, h, q_idx, kv_idx) -> bool`` says whether the pair is kept — here prefix-LM over a
  padded sequence: the first keys seen by every query, causal after, the padding seen by none.

``az.masks.from_mod`` evaluates the mask_mod once per block of the tile size and keeps each block as
skip / partial / full; the flash backend (rung 5) then skips the skipped tiles, evaluates the mask
only on the partial ones, and runs the score_mod on every tile it visits. The picture is drawn from
the tiles the backend recorded (``attnzero.trace``). The check: out and the gradients of q, k, v and
the slopes against the formula written out below, in float64.

Letters: B batch, H heads, L length (Lq = Lk), D head dim.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import attnzero as az
from attnzero import flash, trace
from attnzero.mods import MaskMod, ScoreMod

from .common import Printer, Result, figure, max_error, median_time
from .r5_tiles import draw_tiles, first_pair, legend

TITLE = "Your own attention: a score_mod and a mask_mod through the tiles"


def alibi(slopes: Tensor) -> ScoreMod:
    """ALiBi as a score_mod: every head's score falls by its slope per position of distance. The
    function reads ``slopes`` (H,) from its closure: the tensor gets a gradient."""

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score - slopes[h] * (q_idx - kv_idx).abs()

    return score_mod


def prefix_lm(prefix: int, length: int) -> MaskMod:
    """Prefix-LM as a mask_mod: keys ``0 .. prefix-1`` are seen by every query, the rest causally;
    positions from ``length`` on are padding — no query sees them, and they see nothing."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        real = (q_idx < length) & (kv_idx < length)
        return real & ((kv_idx < prefix) | (kv_idx <= q_idx))

    return mask_mod


def indices(*sizes: int) -> list[Tensor]:
    """b, h, q_idx, kv_idx for the grid ``sizes`` = (B, H, Lq, Lk): aranges of shapes (B, 1, 1, 1),
    (1, H, 1, 1), (1, 1, Lq, 1), (1, 1, 1, Lk), which broadcast to it."""
    return [torch.arange(n).view([n if d == a else 1 for d in range(4)]) for a, n in enumerate(sizes)]


def by_the_formula(q: Tensor, k: Tensor, v: Tensor, score_mod: ScoreMod, mask_mod: MaskMod) -> Tensor:
    """softmax over ``where(mask_mod, score_mod(scale·q·k), −inf)`` times V, a row with no kept key 0:
    q, k, v (B, H, L, D) → (B, H, L, D). The mods are called once on index tensors that broadcast
    to the (B, H, L, L) grid (enough for these two; attnzero calls them per pair, as Flex does)."""
    B, H, L, D = q.shape
    b, h, i, j = indices(B, H, L, L)
    s = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, L, L): scale·q·k
    keep = mask_mod(b, h, i, j).expand(B, H, L, L)  # (B, H, L, L) bool
    s = torch.where(keep, score_mod(s, b, h, i, j), -math.inf)  # (B, H, L, L)
    m = s.detach().amax(dim=-1, keepdim=True)  # (B, H, L, 1): the row max (−inf: no kept key)
    e = torch.exp(s - torch.where(m == -math.inf, 0.0, m))  # (B, H, L, L), 0 where blocked
    l = e.sum(dim=-1, keepdim=True)  # (B, H, L, 1)
    return (e / torch.where(l > 0, l, 1.0)) @ v  # (B, H, L, D): a row with l = 0 gives 0


def tiled(q: Tensor, k: Tensor, v: Tensor, score_mod: ScoreMod, mask: az.masks.Mask, tile: int,
          dout: Tensor) -> tuple[Tensor, trace.Record]:  # fmt: skip
    """The flash backend with ``tile`` × ``tile`` blocks, forward and backward, recorded: out
    (B, H, L, D) and the record (q, k, v and the captured slopes get their ``.grad``)."""
    with flash.block_sizes(rows=tile, cols=tile), trace.recording() as rec:
        out = az.attention(q, k, v, score_mod=score_mod, mask=mask, backend="flash")  # (B, H, L, D)
        assert isinstance(out, Tensor)
        out.backward(dout)
    return out, rec


def exact_tiles(keep: Tensor, tile: int) -> dict[tuple[tuple[int, int], tuple[int, int]], bool]:
    """The tiles a run must visit, from the kept pairs ``keep`` (L, L): every tile that keeps a pair,
    mapped to True where it also blocks one (the mask must be evaluated there)."""
    L = keep.shape[0]
    want = {}
    for i0 in range(0, L, tile):
        for j0 in range(0, L, tile):
            block = keep[i0 : i0 + tile, j0 : j0 + tile]
            if bool(block.any()):
                rows, cols = (i0, min(L, i0 + tile)), (j0, min(L, j0 + tile))
                want[(rows, cols)] = not bool(block.all())
    return want


def grad(t: Tensor) -> Tensor:
    """``t.grad``; NaN where none came (the check then fails: NaN never passes)."""
    return torch.full_like(t, math.nan) if t.grad is None else t.grad


def run(out: Path | None, *, small: bool = False, say: Printer) -> Result:
    gen = torch.Generator().manual_seed(10)  # the rung's own generator: torch's global one is left alone
    B, H, L, D = (1, 2, 64, 16) if small else (1, 2, 128, 16)
    tile, prefix, length = 16, 5 * L // 16, L - 3 * L // 32  # prefix and padding borders inside tiles
    q, k, v, dout = (torch.randn(B, H, L, D, generator=gen, dtype=torch.float64) for _ in range(4))
    slopes0 = torch.tensor([2.0 ** (-8 * (n + 1) / H) for n in range(H)], dtype=torch.float64)  # (H,): ALiBi's
    say(f"q, k, v: (B, H, L, D) = {(B, H, L, D)}, float64; tiles of {tile} × {tile}: a {L // tile} × {L // tile} grid")
    say(f"score_mod alibi: score − slopes[h]·|q_idx − kv_idx|, slopes {[round(x, 5) for x in slopes0.tolist()]} "
        "(learnable)")  # fmt: skip
    say(f"mask_mod prefix_lm: keys 0-{prefix - 1} seen by all, causal after, positions {length}-{L - 1} padding")

    mask_mod = prefix_lm(prefix, length)
    mask = az.masks.from_mod(mask_mod, 1, 1, L, L, block_size=tile)  # skip / partial / full per tile
    kinds = mask.table.kinds if mask.table is not None else torch.zeros(0)  # (1, 1, L/tile, L/tile)
    table = [int((kinds == kind).sum()) for kind in (0, 1, 2)]  # skip, partial, full
    say(f"from_mod's block table: {table[0]} skip, {table[1]} partial, {table[2]} full")

    # 1. the tiles: flash, forward and backward, recorded
    q1, k1, v1, slopes = (t.clone().requires_grad_() for t in (q, k, v, slopes0))
    o, rec = tiled(q1, k1, v1, alibi(slopes), mask, tile, dout)
    got = [o.detach(), *(grad(t) for t in (q1, k1, v1, slopes))]
    tiles = {p: first_pair([e for e in rec.of("flash.tile") if e["pass_"] == p]) for p in ("forward", "backward")}

    # 2. the formula, on the same functions, autograd for the gradients
    q1, k1, v1, slopes = (t.clone().requires_grad_() for t in (q, k, v, slopes0))
    o64 = by_the_formula(q1, k1, v1, alibi(slopes), mask_mod)
    o64.backward(dout)
    want = [o64.detach(), *(grad(t) for t in (q1, k1, v1, slopes))]

    # 3. what was visited, against the tiles the kept pairs call for
    keep = mask_mod(*indices(1, 1, L, L))[0, 0]  # (L, L): the pairs kept
    must = exact_tiles(keep, tile)
    errors = {name: max_error(a, b) for name, a, b in zip(("out", "dq", "dk", "dv", "dslopes"), got, want)}
    numbers: dict[str, Any] = {"errors": errors, "table": table, "must": (len(must), sum(must.values()))}
    for pass_, events in tiles.items():
        visited = {(e["rows"], e["cols"]): e["masked"] for e in events}
        masked = sum(visited.values())
        numbers[f"visited_{pass_}"] = (len(events), masked)
        say(f"{pass_:8s}: {len(visited):2d} tiles visited ({masked:2d} with the mask evaluated) of "
            f"{(L // tile) ** 2}; the kept pairs call for {len(must)} ({sum(must.values())})")  # fmt: skip
        if visited != must or len(events) != len(visited):  # another tile, or one twice: the picture would lie
            errors[f"tiles {pass_}"] = math.inf
    empty = ~keep.any(dim=-1)  # (L,): the rows with no kept key
    say(f"rows that see no key: {int(empty.sum())}, their output {float(got[0][..., empty, :].abs().max()):g}")
    say("flash vs the formula (float64): " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))

    # 4. time at a fixed shape: flash.py's tiles (the textbook code, not the compiled CPU kernel that
    # az.attention takes for built-ins) with causal=True, and with the two functions
    Bt, Ht, Lt, Dt = (1, 2, 256, 32) if small else (1, 8, 1024, 64)
    qt, kt, vt = (torch.randn(Bt, Ht, Lt, Dt, generator=gen) for _ in range(3))  # float32
    slopes_t = torch.tensor([2.0 ** (-8 * (n + 1) / Ht) for n in range(Ht)])  # (Ht,)
    mask_t = az.masks.from_mod(prefix_lm(Lt // 4, Lt), 1, 1, Lt, Lt)  # prefix-LM over L/4 keys, no padding
    cases: dict[str, dict[str, Any]] = {
        "causal=True": {"causal": True},
        "alibi + prefix_lm": {"score_mod": alibi(slopes_t), "mask": mask_t},
    }
    say(f"time, forward, (B, H, L, D) = {(Bt, Ht, Lt, Dt)}, float32, flash.py's tiles:")
    for label, kw in cases.items():
        with torch.no_grad():
            call = partial(flash.attention, qt, kt, vt, scale=1 / math.sqrt(Dt), **kw)
            secs = median_time(call, repeats=3)
        numbers[f"time_{label}_s"] = secs
        say(f"  {label:18s} {secs * 1e3:8.1f} ms")

    pictures = []
    if out is not None:
        path = out / "r10-mods.png"
        bias = alibi(slopes0)(torch.zeros(1, H, L, L, dtype=torch.float64), *indices(1, H, L, L))[0, 0]  # (L, L)
        with figure(path, size=(12.0, 4.4), ncols=3) as (fig, axes):
            ax = axes[0, 0]
            im = ax.imshow(torch.where(keep, bias, math.nan).numpy(), cmap="viridis", interpolation="nearest")
            fig.colorbar(im, ax=ax, shrink=0.8).ax.tick_params(labelsize=7)
            ax.tick_params(labelsize=7)
            ax.set_title("your functions, pair by pair: head 0's\nscore_mod(0, …) where mask_mod keeps", fontsize=9)
            ax.set_xlabel("key j", fontsize=8)
            ax.set_ylabel("query i", fontsize=8)
            for ax, (pass_, events) in zip(axes[0, 1:], tiles.items(), strict=True):
                draw_tiles(ax, events, L, keep, f"{pass_}: the tiles flash visited ({len(events)})")
            legend(fig, ncol=3)
            fig.subplots_adjust(bottom=0.2)
        pictures.append(path)
        say(f"picture: {path}")
    return Result(
        rung=10, title=TITLE, error=max(errors.values()), tol=1e-12, numbers=numbers, pictures=pictures,
        check="flash with score_mod + mask_mod vs the formula (out, dq, dk, dv, dslopes, float64), tiles vs the mask",
    )  # fmt: skip
