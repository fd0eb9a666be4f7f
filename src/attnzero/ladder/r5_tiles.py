"""Rung 5 — the tiled forward: the flash backend itself, run with small tiles and recorded.

Rung 4 walked ONE query row through the keys block by block, keeping a running max ``m``, a running
sum ``l`` and an unnormalised output ``acc``. The flash backend (``attnzero/flash.py``) does the same
for a whole block of query rows at once: a tile is (a block of query rows) × (a block of key
columns), and ``_forward_block`` runs rung 4's recurrence on every row of its block, one key block
at a time. Nothing here is a copy of that code: this rung calls ``az.attention(...,
backend="flash")`` with small block sizes (``flash.block_sizes``) and reads back the tiles the
backend noted while it ran (``attnzero.trace``, events "flash.tile"). The check runs rung 4's
``online_softmax_row`` on every row, one after the other, and compares.

Which tiles run depends on the mask: causal / window skip the tiles above the diagonal or outside
the band, a document mask skips the tiles between two documents, and only the tiles that a mask cuts
through pay for evaluating it. The picture is drawn from the recorded tiles, not from the mask.

Letters: B batch, H heads, L length (Lq = Lk), D head dim; ``r`` / ``c`` rows / columns of a tile.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import attnzero as az
from attnzero import flash, trace
from attnzero.functional import BackendName
from attnzero.masks import keep_block
from attnzero.trace import Event, Record

from .common import Printer, Result, figure, max_error, median_time
from .r4_online import online_softmax_row

TITLE = "Tiled forward: the flash backend's tiles, visited and skipped"

# the backends rung 6 compares: the formula, materialised, and the tiled one (in float32 on a CPU,
# "flash" is the compiled kernel: the same tiles in C++)
BACKENDS: tuple[BackendName, ...] = ("reference", "flash")

# What a tile of the picture shows (codes of ``tile_map``)
SKIPPED, VISITED, MASKED = 0, 1, 2


def mask_cases(L: int) -> dict[str, dict[str, Any]]:
    """The masks this rung runs, as keyword arguments of ``az.attention``: none, causal, a sliding
    window of L/4 keys behind each query, and three packed documents of lengths 5/16, 7/16 and 4/16
    of L (the first border falls inside a tile, the second on a tile border)."""
    a, b = 5 * L // 16, 12 * L // 16
    ids = [0] * a + [1] * (b - a) + [2] * (L - b)  # (L,) document id of every token
    return {
        "full": {},
        "causal": {"causal": True},
        "window": {"window": (L // 4, 0)},
        "document": {"mask": az.masks.document(ids)},
    }


def tiled_forward(
    q: Tensor, k: Tensor, v: Tensor, rows: int, cols: int, **mask_args: Any
) -> tuple[Tensor, Tensor, Record]:
    """The flash backend's forward with tiles of ``rows`` query rows × ``cols`` key columns, and
    the record of what it did: the online softmax with its running max (``flash._forward_block``),
    rung 4's recurrence."""
    with flash.block_sizes(rows=rows, cols=cols), trace.recording() as rec:
        out, lse = az.attention(q, k, v, backend="flash", return_lse=True, **mask_args)  # (B, H, L, D), (B, H, L)
    return out, lse, rec


def rung4_on_every_row(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, block: int) -> tuple[Tensor, Tensor]:
    """Rung 4's one-row online softmax on every query row, one row after the other: q, k (B, H, L, D),
    v (B, H, L, Dv), keep (L, L) or None → out (B, H, L, Dv), lse (B, H, L)."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Lq, Lk)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    B, H, Lq, _ = s.shape
    out = torch.empty(B, H, Lq, v.shape[-1], dtype=v.dtype)  # (B, H, Lq, Dv)
    lse = torch.empty(B, H, Lq, dtype=s.dtype)  # (B, H, Lq)
    for b, h, i in itertools.product(range(B), range(H), range(Lq)):
        out[b, h, i], lse[b, h, i], _ = online_softmax_row(s[b, h, i], v[b, h], block)
    return out, lse


def first_pair(tiles: Sequence[Event]) -> list[Event]:
    """The tiles of the chunk that holds batch 0 and key/value head 0 (one chunk stacks a few
    (batch, head) pairs; every pair sees the same tiles when the mask is the same for all)."""
    return [e for e in tiles if e["chunk"][0] == 0 and e["chunk"][2] == 0]


def tile_map(tiles: Sequence[Event], Lq: int, Lk: int) -> Tensor:
    """(Lq, Lk) codes from recorded tiles: SKIPPED where no tile covered the pair, VISITED where a
    tile ran with no mask to evaluate, MASKED where the tile's mask was evaluated or causal /
    window cut through it."""
    grid = torch.full((Lq, Lk), SKIPPED, dtype=torch.int8)  # (Lq, Lk)
    for e in tiles:
        (r0, r1), (c0, c1) = e["rows"], e["cols"]
        code = MASKED if e["masked"] or e["edge"] else VISITED
        grid[r0:r1, c0:c1] = torch.clamp(grid[r0:r1, c0:c1], min=code)
    return grid


# Colours of SKIPPED, VISITED and MASKED, and their legend
COLOURS = ["#f4f4f4", "#9ecae1", "#fdae6b"]
LABELS = ["skipped (never computed)", "visited, every pair kept", "visited, mask evaluated"]


def legend(fig: Any, ncol: int = 4) -> None:
    """The colours of ``draw_tiles``, once for the whole figure, in ``ncol`` columns."""
    from matplotlib.patches import Patch

    handles = [Patch(fc=c, ec="#333333", label=t) for c, t in zip(COLOURS, LABELS, strict=True)]
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8, frameon=False)


def draw_tiles(ax: Any, tiles: Sequence[Event], L: int, keep: Tensor | None, title: str) -> None:
    """One panel: the recorded tiles over the L × L scores, coloured by ``tile_map``, each outlined;
    the border of the kept pairs as a thin line."""
    import matplotlib.colors as mcolors
    from matplotlib.patches import Rectangle

    ax.imshow(tile_map(tiles, L, L).numpy(), cmap=mcolors.ListedColormap(COLOURS), vmin=0, vmax=2,
              interpolation="nearest")  # fmt: skip
    if keep is not None and not bool(keep.all()):  # where the mask keeps pairs (context; the colours are the record)
        ax.contour(keep.float().numpy(), levels=[0.5], colors="#7f2704", linewidths=0.7)
    for e in tiles:
        (r0, r1), (c0, c1) = e["rows"], e["cols"]
        ax.add_patch(Rectangle((c0 - 0.5, r0 - 0.5), c1 - c0, r1 - r0, fill=False, lw=0.6, ec="#333333"))
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("key j", fontsize=8)
    ax.set_ylabel("query i", fontsize=8)
    ax.tick_params(labelsize=7)


def run(out: Path | None, *, small: bool = False, say: Printer) -> Result:
    gen = torch.Generator().manual_seed(0)  # the rung's own generator: torch's global one is left alone
    B, H, L, D = (1, 2, 64, 16) if small else (1, 2, 128, 32)
    r = c = 16  # tile: 16 query rows × 16 key columns
    q, k, v = (torch.randn(B, H, L, D, generator=gen, dtype=torch.float64) for _ in range(3))  # (B, H, L, D) each
    grid = -(-L // r) * -(-L // c)  # tiles per (batch, head) pair if none were skipped
    say(f"q, k, v: (B, H, L, D) = {(B, H, L, D)}, float64; tiles of {r} rows × {c} keys: a {L // r} × {L // c} grid")

    error = 0.0
    numbers: dict[str, Any] = {}
    panels = []
    for name, args in mask_cases(L).items():
        before = flash.COUNTS["forward"]
        o, lse, rec = tiled_forward(q, k, v, r, c, **args)
        counted = flash.COUNTS["forward"] - before
        tiles = rec.of("flash.tile")
        keep = keep_block(args.get("mask"), args.get("causal", False), args.get("window"), L, L, (0, L), (0, L),
                          q.device)  # fmt: skip
        keep = None if keep is None else keep.reshape(L, L)  # (L, L): the pairs the mask keeps
        # the check: the tiles give what rung 4's one-row loop gives on every row, in float64
        o4, lse4 = rung4_on_every_row(q, k, v, keep, c)
        error = max(error, max_error(o, o4), max_error(lse, lse4))
        if len(tiles) != counted:  # the record must be the blocks the backend counted, or the picture lies
            error = math.inf
        mine = first_pair(tiles)
        masked = sum(1 for e in mine if e["masked"] or e["edge"])
        covered = float((tile_map(mine, L, L) != SKIPPED).double().mean())  # share of the L × L scores computed
        say(f"{name:9s}: {len(mine):3d} tiles visited ({masked:2d} masked), {covered:4.0%} of the scores "
            f"computed  [flash.COUNTS['forward'] +{counted}, tiles recorded {len(tiles)}]")  # fmt: skip
        numbers[f"tiles_{name}"] = len(mine)
        numbers[f"counted_{name}"], numbers[f"recorded_{name}"] = counted, len(tiles)
        panels.append((name, mine, keep))
    numbers["tiles_grid"] = grid

    # time at a fixed shape: flash.py's tiles (its own block sizes; not the compiled CPU kernel that
    # az.attention's "flash" takes in float32) against the reference
    Bt, Ht, Lt, Dt = (1, 4, 256, 64) if small else (1, 8, 1024, 64)
    qt, kt, vt = (torch.randn(Bt, Ht, Lt, Dt, generator=gen) for _ in range(3))  # float32
    say(f"time, causal forward, (B, H, L, D) = {(Bt, Ht, Lt, Dt)}, float32:")
    calls: dict[str, Callable[[], Any]] = {
        "reference": partial(az.attention, qt, kt, vt, causal=True, backend="reference"),
        "flash.py": partial(flash.attention, qt, kt, vt, causal=True, scale=1 / math.sqrt(Dt)),
    }
    for name, call in calls.items():
        with torch.no_grad():
            secs = median_time(call, repeats=3 if small else 5)
        numbers[f"time_{name}_s"] = secs
        say(f"  {name:9s} {secs * 1e3:8.2f} ms")

    pictures = []
    if out is not None:
        path = out / "r5-tiles.png"
        with figure(path, size=(13.0, 4.0), ncols=4) as (fig, axes):
            for ax, (name, mine, keep) in zip(axes[0], panels, strict=True):
                draw_tiles(ax, mine, L, keep, f"{name}: {len(mine)} tiles (a full grid: {grid})")
            legend(fig)
            fig.subplots_adjust(bottom=0.2)
        pictures.append(path)
        say(f"picture: {path}")
    return Result(
        rung=5, title=TITLE, check="flash tiles vs rung 4's online softmax on every row (out, lse, float64)",
        error=error, tol=1e-12, numbers=numbers, pictures=pictures,
    )  # fmt: skip
