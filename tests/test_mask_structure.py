"""Masks carry their block structure (masks.py): every claim a mask makes about a block — SKIP, FULL,
its key range, its segments — is checked against the mask's own dense tensor, for every builder and
their combinations, over random block partitions; and attention with a structured Mask equals
attention with the dense tensor, while the flash backend visits only the blocks the mask keeps."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from conftest import check_against_golden, qkv

import attnzero as az
from attnzero import flash, geometry
from attnzero import masks as M


def _docs(L: int, n: int, B: int = 1, sorted_: bool = True) -> torch.Tensor:
    ids = torch.sort(torch.randint(0, n, (B, L)), dim=-1).values if sorted_ else torch.randint(0, n, (B, L))
    return ids if B > 1 else ids[0]


def _masks(Lq: int, Lk: int) -> dict[str, M.Mask]:
    L = Lq
    out = {
        "causal": M.causal(Lq, Lk),
        "causal_tl": M.causal(Lq, Lk, align="top_left"),
        "window": M.window(Lq, Lk, 3, 2),
        "window_left": M.window(Lq, Lk, 4, None),
        "padding": M.padding([Lk, max(1, Lk // 3), 0], Lk),
    }
    if Lq == Lk:
        out |= {
            "document": M.document(_docs(L, 4)),
            "document_b": M.document(_docs(L, 3, B=3)),
            "document_unsorted": M.document(_docs(L, 3, sorted_=False)),
            "document_cu": M.document(cu_seqlens=[0, L // 3, L // 3, L]),
            "causal&document": M.and_(M.causal(L), M.document(_docs(L, 5))),
            "document&padding": M.and_(M.document(_docs(L, 3, B=3)), M.padding([L, L // 2, 1], L)),
            "window&document&tensor": M.and_(M.window(L, L, 5), M.document(_docs(L, 2)), torch.rand(L, L) < 0.7),
            "causal|window": M.or_(M.causal(L), M.window(L, L, 2, 3)),
            "document|causal": M.or_(M.document(_docs(L, 3)), M.causal(L)),
            "not causal": ~M.causal(L),
        }
    return out


def _partition(n: int, rng: random.Random) -> list[tuple[int, int]]:
    cuts = sorted({0, n, *(rng.randrange(1, n) for _ in range(rng.randrange(0, 4)) if n > 1)})
    return list(itertools.pairwise(cuts))


@pytest.mark.parametrize(("Lq", "Lk"), [(1, 1), (17, 17), (40, 40), (9, 30), (30, 9)])
def test_every_block_claim_holds_on_the_dense_mask(Lq: int, Lk: int) -> None:
    rng = random.Random(Lq * 100 + Lk)
    for name, m in _masks(Lq, Lk).items():
        m = m.at(Lq, Lk)
        dense = m.to_tensor().expand(m.shape[0], 1, Lq, Lk)  # (B, 1, Lq, Lk)
        B = dense.shape[0]
        for _ in range(6):
            for b0, b1 in _partition(B, rng):
                for rows in _partition(Lq, rng):
                    sub = dense[b0:b1, :, rows[0] : rows[1]]  # (nb, 1, r, Lk)
                    lo, hi = m.key_range((b0, b1), rows)
                    outside = torch.ones(Lk, dtype=torch.bool)
                    outside[max(0, lo) : min(hi, Lk)] = False
                    assert not sub[..., outside].any(), f"{name}: keys outside {lo, hi} are kept for rows {rows}"
                    for cols in _partition(Lk, rng):
                        block = sub[..., cols[0] : cols[1]]
                        kind = m.classify((b0, b1), rows, cols)
                        if kind is geometry.SKIP:
                            assert not block.any(), f"{name}: SKIP block {rows, cols} keeps a pair"
                        elif kind is geometry.FULL:
                            assert block.all(), f"{name}: FULL block {rows, cols} blocks a pair"


def test_segments_are_exactly_the_mask_and_ranges_are_its_key_ranges() -> None:
    L = 45
    for m in (M.document(_docs(L, 4, B=2)), M.padding([3, 45], 45), M.document(cu_seqlens=[0, 10, 10, 45])):
        seg = m.segments
        assert seg is not None and seg.sorted
        dense = m.to_tensor()
        b = torch.arange(m.shape[0]).view(-1, 1, 1, 1)
        i = torch.arange(m.shape[2]).view(1, 1, -1, 1)
        j = torch.arange(m.shape[3]).view(1, 1, 1, -1)
        assert torch.equal(seg.keep(b, torch.zeros(1, 1, 1, 1, dtype=torch.long), i, j).expand_as(dense), dense)
        r = seg.ranges(16, 2, L)  # (B, n_row_blocks, 2)
        assert r.dtype == torch.int32 and r.shape == (2, 3, 2)
        full = dense.expand(2, 1, L, L)
        for bb in range(2):
            for blk in range(3):
                lo, hi = r[bb, blk].tolist()
                rows = full[bb, 0, blk * 16 : (blk + 1) * 16]
                kept_cols = rows.any(dim=0).nonzero().flatten()
                if len(kept_cols):
                    assert lo <= int(kept_cols.min()) and int(kept_cols.max()) < hi


def test_structure_of_each_builder() -> None:
    assert M.causal(5, 8).band == (None, 3) and M.causal(5, 8).exact
    assert M.causal(5, 8, align="top_left").band == (None, 0)
    assert M.window(6, 6, 2, 1).band == (-2, 1)
    assert M.window(6, 6, None, None).band is None
    assert M.causal(6).without_band() is None  # a pure band leaves nothing to evaluate
    cd = M.and_(M.causal(6), M.document([0, 0, 0, 1, 1, 1]))
    rest = cd.without_band()
    assert cd.band == (None, 0) and rest is not None and rest.segments is not None and rest.band is None
    mixed = M.and_(M.document([0, 0, 1, 1]), torch.ones(4, 4, dtype=torch.bool))
    assert mixed.segments is None and not mixed.exact  # a dense part: segments only as a bound
    assert M.from_tensor(torch.ones(3, 3)).band is None
    assert M.causal(1, 1).at(4, 4).band is None  # broadcast along the rows: its band means nothing there
    with pytest.raises(ValueError, match="cu_seqlens"):
        M.document(cu_seqlens=[1, 4])
    with pytest.raises(ValueError, match="cu_seqlens"):
        M.document([0, 1], cu_seqlens=[0, 2])


@pytest.mark.parametrize("backend", ["reference", "flash"])
@pytest.mark.parametrize(("Lq", "Lk"), [(17, 17), (40, 40), (9, 30), (30, 9)])
def test_attention_with_a_structured_mask_equals_the_dense_one(backend: str, Lq: int, Lk: int) -> None:
    q, k, v = qkv(3, 2, 1, Lq, Lk, 8)
    with flash.block_sizes(rows=8, cols=8):  # many blocks: skip, full and partial ones
        for name, m in _masks(Lq, Lk).items():
            dense = m.to_tensor()
            check_against_golden(backend, torch.float64, q, k, v, mask=m, grads=True)
            a = az.attention(q, k, v, mask=m, backend=backend, return_lse=True)
            b = az.attention(q, k, v, mask=dense, backend="reference", return_lse=True)
            torch.testing.assert_close(a[0], b[0], msg=lambda s, n=name: f"{n}: {s}")
            torch.testing.assert_close(a[1], b[1], msg=lambda s, n=name: f"{n}: {s}")


def _blocks(**kw: object) -> tuple[int, int]:
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 64, 64, 8))
    flash.COUNTS.update(forward=0, backward=0)
    with flash.block_sizes(rows=8, cols=8):
        out = az.attention(q, k, v, backend="flash", **kw)
        out.sum().backward()  # type: ignore[union-attr]
    return flash.COUNTS["forward"], flash.COUNTS["backward"]


def test_a_causal_mask_costs_what_causal_costs() -> None:
    causal = _blocks(causal=True)
    assert _blocks(mask=M.causal(64)) == causal
    assert _blocks(mask=M.causal(64, align="top_left")) == causal
    full = _blocks()
    assert causal[0] < 0.6 * full[0]


def test_the_drop_in_is_causal_costs_what_causal_costs() -> None:
    q, k, v = qkv(1, 2, 2, 48, 64, 8)
    with flash.block_sizes(rows=8, cols=8):
        flash.COUNTS.update(forward=0)
        az.scaled_dot_product_attention(q, k, v, is_causal=True)  # top-left, Lq != Lk: a Mask
        tl = flash.COUNTS["forward"]
        flash.COUNTS.update(forward=0)
        az.attention(q, k, v, mask=M.causal(48, 64, align="top_left").to_tensor(), backend="flash")
        dense = flash.COUNTS["forward"]
    assert tl < 0.6 * dense
def test_a_document_mask_visits_only_its_documents() -> None:
    ids = torch.arange(8).repeat_interleave(8)  # 8 documents of 8 tokens
    docs = _blocks(mask=M.document(ids))
    full = _blocks()
    assert docs[0] <= full[0] / 8 and docs[1] <= full[1] / 8


def test_narrow_integer_ids_and_cu_seqlens_are_taken() -> None:
    """int32 cu_seqlens (varlen's own dtype) and int16 ids: 2**62 must not wrap in their dtype."""
    a = M.document(cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32)).to_tensor()
    b = M.document([0, 0, 1, 1, 1]).to_tensor()
    assert torch.equal(a, b)
    assert torch.equal(M.document(torch.tensor([0, 0, 1, 1, 1], dtype=torch.int16)).to_tensor(), b)
    assert M.padding(torch.tensor([2, 3], dtype=torch.int32)).shape == (2, 1, 1, 3)


def _broadcast_masks(Lq: int, Lk: int) -> dict[str, M.Mask]:
    """Masks made with one query row (or one key) that broadcast over the call's Lq (or Lk): a
    combination keeps its parts' bands and block tables at the lengths they were made for."""
    odd = M.from_mod(lambda b, h, i, j: j % 2 == 0, 1, 1, 1, Lk)  # a block table, one row
    col = M.from_tensor(torch.rand(Lq, 1) < 0.6)  # one key column
    return {
        "window(1, Lk)": M.window(1, Lk, 4, 0),
        "causal(1, Lk)": M.causal(1, Lk),
        "window(1, Lk) & mod": M.and_(M.window(1, Lk, 4, 0), odd),
        "window(1, Lk) | mod": M.or_(M.window(1, Lk, 4, 0), odd),
        "causal(1, Lk) & padding": M.and_(M.causal(1, Lk), M.padding([Lk, 3], Lk)),
        "causal(Lq, 1) & column": M.and_(M.causal(Lq, 1), col),
        "window(Lq, 1) | column": M.or_(M.window(Lq, 1, 0, 0), col),
        "causal(Lq, 1) & mod": M.and_(M.causal(Lq, 1), M.from_mod(lambda b, h, i, j: i % 3 != 0, 1, 1, Lq, 1)),
    }


@pytest.mark.parametrize(("Lq", "Lk"), [(140, 40), (9, 30), (30, 9)])
def test_block_claims_hold_where_a_combination_broadcasts(Lq: int, Lk: int) -> None:
    """A part made for one query row (one key) answers for every row (key) of the call, as its dense
    tensor broadcasts: its band is read at row 0 (key 0), not at the call's row."""
    rng = random.Random(Lq + Lk)
    for name, m in _broadcast_masks(Lq, Lk).items():
        m = m.at(Lq, Lk)
        dense = m.to_tensor().expand(m.shape[0], 1, Lq, Lk)  # (B, 1, Lq, Lk)
        for _ in range(6):
            for rows in _partition(Lq, rng):
                sub = dense[:, :, rows[0] : rows[1]]  # (B, 1, r, Lk)
                lo, hi = m.key_range((0, dense.shape[0]), rows)
                outside = torch.ones(Lk, dtype=torch.bool)
                outside[max(0, lo) : min(hi, Lk)] = False
                assert not sub[..., outside].any(), f"{name}: keys outside {lo, hi} are kept for rows {rows}"
                for cols in _partition(Lk, rng):
                    block, kind = sub[..., cols[0] : cols[1]], m.classify((0, dense.shape[0]), rows, cols)
                    assert kind is not geometry.SKIP or not block.any(), f"{name}: SKIP {rows, cols} keeps a pair"
                    assert kind is not geometry.FULL or block.all(), f"{name}: FULL {rows, cols} blocks a pair"


@pytest.mark.parametrize("backend", ["flash", "auto"])
def test_attention_with_a_broadcast_combination_equals_the_dense_one(backend: str) -> None:
    for Lq, Lk in [(140, 40), (30, 9)]:
        q, k, v = (t.float() for t in qkv(2, 2, 1, Lq, Lk, 8))
        for name, m in _broadcast_masks(Lq, Lk).items():
            want = az.attention(q, k, v, mask=m.to_tensor(), backend="reference")
            got = az.attention(q, k, v, mask=m, backend=backend)
            torch.testing.assert_close(got, want, msg=lambda s, n=f"{name} at {Lq, Lk}": f"{n}: {s}")


def test_a_predicate_that_answers_with_one_value_on_flash_py() -> None:
    """A keep that is 0-d (window(L, L, None, None) keeps every pair; its negation; a Mask of a
    constant predicate) broadcasts over every block: flash.py read two dims of it."""
    q, k, v = qkv(1, 2, 1, 3, 3, 4)
    for m in (M.window(3, 3, None, None), ~M.window(3, 3, None, None), M.Mask(lambda b, h, i, j: True, (1, 1, 3, 3))):
        want = az.attention(q, k, v, mask=m.to_tensor(), backend="reference")
        torch.testing.assert_close(az.attention(q, k, v, mask=m, backend="flash"), want)


def test_a_block_tables_answers_per_head_are_not_mixed_up() -> None:
    """BlockTable caches its answers: one asked for head 0 must not answer for head 1, nor for all heads."""
    from attnzero.blocks import FULL, SKIP, BlockTable

    kinds = torch.tensor([SKIP, FULL], dtype=torch.int8).view(1, 2, 1, 1)  # (B, H, nQ, nK): head 0 skips, head 1 keeps
    table = BlockTable(kinds, (4, 4), (4, 4))
    assert table.classify((0, 1), (0, 4), (0, 4), heads=(0, 1)) is geometry.SKIP
    assert table.classify((0, 1), (0, 4), (0, 4), heads=(1, 2)) is geometry.FULL
    assert table.classify((0, 1), (0, 4), (0, 4)) is geometry.PARTIAL  # every head: some skip, some keep


@pytest.mark.parametrize("backend", ["reference", "flash", "auto"])
def test_a_banded_mask_with_causal_or_window_arguments_keeps_their_intersection(backend: str) -> None:
    """A window Mask's band and the call's causal / window are joined into one band: the pairs all of
    them keep (the join took the wider right edge once: pairs past causal's diagonal were kept)."""
    Lq, Lk = 20, 26
    q, k, v = qkv(1, 2, 1, Lq, Lk, 8)
    mask = M.window(Lq, Lk, left=6, right=4)
    i, j = torch.arange(Lq).view(-1, 1) + (Lk - Lq), torch.arange(Lk)  # bottom-right positions
    cases = (({"causal": True}, j <= i), ({"window": (None, 2)}, j <= i + 2), ({"window": (3, 9)}, j >= i - 3))
    for kw, extra in cases:
        dense = mask.to_tensor() & extra  # (1, 1, Lq, Lk)
        got = az.attention(q, k, v, mask=mask, backend=backend, **kw)
        want = az.attention(q, k, v, mask=dense, backend="reference")
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
