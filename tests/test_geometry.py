"""geometry.py against brute force: a dense keep-matrix written from DESIGN.md's sentence, pair by
pair, for every alignment (Lq < Lk, Lq == Lk, Lq > Lk), windows with None sides, and blocks of
awkward sizes — including blocks that run past the last key."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnzero import geometry
from attnzero.geometry import FULL, PARTIAL, SKIP

Window = tuple[int | None, int | None] | None


def dense(Lq: int, Lk: int, causal: bool, window: Window, cols: int | None = None) -> list[list[bool]]:
    """DESIGN.md: query i at p = i + (Lk - Lq) sees key j iff (not causal or j <= p) and
    p - left <= j <= p + right (None = unbounded). ``cols`` columns (default Lk; more = past Lk)."""
    left, right = (None, None) if window is None else window
    grid = []
    for i in range(Lq):
        p = i + (Lk - Lq)
        row = []
        for j in range(Lk if cols is None else cols):
            ok = (not causal or j <= p) and (left is None or j >= p - left) and (right is None or j <= p + right)
            row.append(ok)
        grid.append(row)
    return grid


sides = st.one_of(st.none(), st.integers(0, 40))
windows = st.one_of(st.none(), st.tuples(sides, sides))
lengths = st.integers(1, 60)


@settings(max_examples=300, deadline=None)
@given(Lq=lengths, Lk=lengths, causal=st.booleans(), window=windows, data=st.data())
def test_key_range_and_classify_match_brute_force(
    Lq: int, Lk: int, causal: bool, window: Window, data: st.DataObject
) -> None:
    extra = data.draw(st.integers(0, 20), label="columns past Lk")
    keep = dense(Lq, Lk, causal, window, Lk + extra)
    r0 = data.draw(st.integers(0, Lq - 1), label="r0")
    r1 = data.draw(st.integers(r0 + 1, Lq), label="r1")
    # key_range: exactly the columns (< Lk) that some row of the block keeps, as one interval
    seen = [j for j in range(Lk) if any(keep[i][j] for i in range(r0, r1))]
    lo, hi = geometry.key_range((r0, r1), Lq, Lk, causal, window)
    assert 0 <= lo <= hi <= Lk
    assert list(range(lo, hi)) == seen, (lo, hi, seen)
    # classify: any block of columns, inside [0, Lk) or past it
    c0 = data.draw(st.integers(0, Lk + extra - 1), label="c0")
    c1 = data.draw(st.integers(c0 + 1, Lk + extra), label="c1")
    pairs = [keep[i][j] for i in range(r0, r1) for j in range(c0, c1)]
    want = FULL if all(pairs) else SKIP if not any(pairs) else PARTIAL
    assert geometry.classify((r0, r1), (c0, c1), Lq, Lk, causal, window) is want
    # kept: the same predicate on ints and on broadcast tensors
    i = data.draw(st.integers(0, Lq - 1), label="i")
    j = data.draw(st.integers(0, Lk + extra - 1), label="j")
    assert bool(geometry.kept(i, j, Lq, Lk, causal, window)) == keep[i][j]
    t = geometry.kept(torch.arange(Lq).view(-1, 1), torch.arange(Lk + extra).view(1, -1), Lq, Lk, causal, window)
    grid = torch.tensor(keep, dtype=torch.bool)
    assert torch.equal(torch.as_tensor(t).expand(grid.shape), grid)


@pytest.mark.parametrize("Lq,Lk", [(1, 1), (1, 17), (17, 1), (17, 17), (33, 50), (50, 33), (113, 64)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (0, 0), (3, None), (None, 2), (5, 7), (None, None), (0, None)])
@pytest.mark.parametrize("block", [(16, 16), (7, 5), (1, 3), (13, 64)])
def test_every_block_of_a_grid(Lq: int, Lk: int, causal: bool, window: Window, block: tuple[int, int]) -> None:
    """A tiling of the whole matrix (ragged last blocks): every block classified as brute force
    says, and the columns each row block visits are exactly those with a kept pair."""
    keep = torch.tensor(dense(Lq, Lk, causal, window), dtype=torch.bool).view(Lq, Lk)
    bm, bn = block
    for r0 in range(0, Lq, bm):
        r1 = min(Lq, r0 + bm)
        lo, hi = geometry.key_range((r0, r1), Lq, Lk, causal, window)
        cols = keep[r0:r1].any(dim=0).nonzero().flatten().tolist()
        assert list(range(lo, hi)) == cols
        for c0 in range(0, Lk, bn):
            c1 = min(Lk, c0 + bn)
            b = keep[r0:r1, c0:c1]
            want = FULL if bool(b.all()) else SKIP if not bool(b.any()) else PARTIAL
            assert geometry.classify((r0, r1), (c0, c1), Lq, Lk, causal, window) is want, (r0, r1, c0, c1)
            if want is SKIP:  # a skipped block lies outside the row block's key range, or in a gap of none
                assert c1 <= lo or c0 >= hi or lo == hi


def test_band_offset_and_empty_blocks() -> None:
    assert geometry.offset(3, 10) == 7 and geometry.offset(10, 3) == -7
    assert geometry.band(False, None) == (None, None)
    assert geometry.band(True, None) == (None, 0)
    assert geometry.band(True, (4, 9)) == (4, 0)
    assert geometry.band(True, (None, None)) == (None, 0)
    assert geometry.band(False, (2, None)) == (2, None)
    assert geometry.classify((3, 3), (0, 5), 8, 8, False, None) is SKIP  # no rows
    assert geometry.classify((0, 5), (4, 4), 8, 8, False, None) is SKIP  # no columns
    assert geometry.key_range((5, 5), 8, 8, False, None) == (0, 0)
    # Lq > Lk under causal: the first Lq - Lk rows sit before key 0 and see nothing
    assert geometry.key_range((0, 4), 10, 6, True, None) == (0, 0)
    assert geometry.key_range((0, 5), 10, 6, True, None) == (0, 1)
