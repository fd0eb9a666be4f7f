"""az.masks: every builder against a hand-written expectation, combinations, blocks, printing, ALiBi."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import pytest
import torch
from conftest import absent
from hypothesis import given, settings
from hypothesis import strategies as st

import attnzero as az
from attnzero.masks import Mask, alibi_slopes, block_of, keep_block


def grid(rows: str) -> torch.Tensor:
    """A keep-mask written by hand: one string per query row, 'x' = keep, '.' = blocked."""
    return torch.tensor([[c == "x" for c in r.split()] for r in rows.strip().splitlines()])


def dense(m: Mask) -> torch.Tensor:
    """The (Lq, Lk) grid of a mask that is the same for every batch and head."""
    t = m.to_tensor()
    assert t.dtype == torch.bool and t.shape == m.shape
    return t[0, 0]


# ---------------------------------------------------------------------------------------------
# Causal, both alignments


def test_causal_square_is_the_lower_triangle_in_both_alignments() -> None:
    want = grid("""
        x . . .
        x x . .
        x x x .
        x x x x""")
    assert torch.equal(dense(az.masks.causal(4)), want)
    assert torch.equal(dense(az.masks.causal(4, 4, align="bottom_right")), want)
    assert torch.equal(dense(az.masks.causal(4, 4, align="top_left")), want)


def test_causal_bottom_right_more_keys() -> None:
    m = az.masks.causal(4, 6)  # the default alignment: the last query sits at the last key
    assert m.shape == (1, 1, 4, 6)
    want = grid("""
        x x x . . .
        x x x x . .
        x x x x x .
        x x x x x x""")
    assert torch.equal(dense(m), want)
    assert torch.equal(dense(az.masks.causal(4, 6, align="bottom_right")), want)


def test_causal_top_left_more_keys() -> None:
    want = grid("""
        x . . . . .
        x x . . . .
        x x x . . .
        x x x x . .""")
    assert torch.equal(dense(az.masks.causal(4, 6, align="top_left")), want)


def test_causal_more_queries_than_keys() -> None:
    bottom_right = grid("""
        . . .
        . . .
        x . .
        x x .
        x x x""")  # the first Lq - Lk queries see nothing
    top_left = grid("""
        x . .
        x x .
        x x x
        x x x
        x x x""")
    assert torch.equal(dense(az.masks.causal(5, 3)), bottom_right)
    assert torch.equal(dense(az.masks.causal(5, 3, align="top_left")), top_left)


def test_print_causal_grid() -> None:
    assert str(az.masks.causal(4, 6)) == (
        "causal (bottom-right) 4×6\n■ ■ ■ · · ·\n■ ■ ■ ■ · ·\n■ ■ ■ ■ ■ ·\n■ ■ ■ ■ ■ ■"
    )
    assert str(az.masks.causal(4, 6, align="top_left")) == (
        "causal (top-left) 4×6\n■ · · · · ·\n■ ■ · · · ·\n■ ■ ■ · · ·\n■ ■ ■ ■ · ·"
    )


def test_print_statement_shows_the_grid(capsys: pytest.CaptureFixture[str]) -> None:
    print(az.masks.causal(4, 6))
    out = capsys.readouterr().out
    assert out.splitlines()[1:] == ["■ ■ ■ · · ·", "■ ■ ■ ■ · ·", "■ ■ ■ ■ ■ ·", "■ ■ ■ ■ ■ ■"]


# ---------------------------------------------------------------------------------------------
# Sliding window


def test_window_left_only() -> None:
    want = grid("""
        x . . . .
        x x . . .
        x x x . .
        . x x x .
        . . x x x""")
    assert torch.equal(dense(az.masks.window(5, 5, 2)), want)
    assert torch.equal(dense(az.masks.window(5, 5, left=2, right=0)), want)


def test_window_both_sides() -> None:
    want = grid("""
        x x . . .
        x x x . .
        x x x x .
        . x x x x
        . . x x x""")
    assert torch.equal(dense(az.masks.window(5, 5, 2, 1)), want)


def test_window_unbounded_sides() -> None:
    left_none = grid("""
        x x . .
        x x x .
        x x x x
        x x x x""")
    right_none = grid("""
        x x x x
        x x x x
        . x x x
        . . x x""")
    assert torch.equal(dense(az.masks.window(4, 4, None, 1)), left_none)
    assert torch.equal(dense(az.masks.window(4, 4, 1, None)), right_none)
    assert dense(az.masks.window(4, 4, None, None)).all()
    assert torch.equal(dense(az.masks.window(4, 4, None, 0)), dense(az.masks.causal(4)))


def test_window_is_bottom_right_aligned() -> None:
    want = grid("""
        . x x . . .
        . . x x . .
        . . . x x .
        . . . . x x""")  # query i sits at p = i + 2; keeps p - 1 <= j <= p
    assert torch.equal(dense(az.masks.window(4, 6, 1, 0)), want)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_window_rejects_bad_sides(bad: object) -> None:
    with pytest.raises(ValueError, match=r"left: expected None or an int >= 0, got"):
        az.masks.window(4, 4, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"right: expected None or an int >= 0, got"):
        az.masks.window(4, 4, 1, bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Padding and documents


def test_padding_from_lengths() -> None:
    m = az.masks.padding([2, 4, 0])
    assert m.shape == (3, 1, 1, 4)
    want = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(m.to_tensor()[:, 0, 0], want)
    m6 = az.masks.padding(torch.tensor([3, 1]), kv_len=6)
    assert m6.shape == (2, 1, 1, 6)
    assert torch.equal(m6.to_tensor()[:, 0, 0], torch.tensor([[1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]]).bool())


@pytest.mark.parametrize(
    ("lengths", "kv_len", "match"),
    [
        ([3, -1], None, "non-negative"),
        ([5], 4, "<= kv_len 4"),
        ([[1, 2]], None, "1-D"),
        ([1.5], None, "1-D"),
        ([0, 0], None, r"a length > 0 somewhere \(or kv_len given\), got \[0, 0\]"),
    ],
)
def test_padding_rejects_bad_lengths(lengths: list[int], kv_len: int | None, match: str) -> None:
    with pytest.raises(ValueError, match=rf"lengths: .*{match}"):
        az.masks.padding(lengths, kv_len)


def test_document_1d() -> None:
    want = grid("""
        x x . . .
        x x . . .
        . . x x x
        . . x x x
        . . x x x""")
    m = az.masks.document([0, 0, 1, 1, 1])
    assert m.shape == (1, 1, 5, 5)
    assert torch.equal(dense(m), want)
    assert str(m).splitlines()[1:] == ["■ ■ · · ·", "■ ■ · · ·", "· · ■ ■ ■", "· · ■ ■ ■", "· · ■ ■ ■"]


def test_document_batched_with_kv_ids() -> None:
    ids = torch.tensor([[0, 1, 1], [2, 2, 3]])  # (B=2, Lq=3)
    kv_ids = torch.tensor([[0, 0, 1, 1], [2, 3, 3, 3]])  # (B=2, Lk=4)
    m = az.masks.document(ids, kv_ids)
    assert m.shape == (2, 1, 3, 4)
    t = m.to_tensor()[:, 0]
    assert torch.equal(t[0], grid("x x . .\n. . x x\n. . x x"))
    assert torch.equal(t[1], grid("x . . .\nx . . .\n. x x x"))
    # 1-D query ids against batched key ids broadcast over the batch.
    m2 = az.masks.document([2, 3], kv_ids)
    assert m2.shape == (2, 1, 2, 4)
    assert torch.equal(m2.to_tensor()[1, 0], grid("x . . .\n. x x x"))
    assert torch.equal(m2.to_tensor()[0, 0], grid(". . . .\n. . . ."))


def test_document_combined_with_causal_packs_causal_sequences() -> None:
    m = az.masks.document([0, 0, 0, 1, 1]) & az.masks.causal(5)
    want = grid("""
        x . . . .
        x x . . .
        x x x . .
        . . . x .
        . . . x x""")
    assert torch.equal(dense(m), want)


def test_document_rejects_bad_ids() -> None:
    with pytest.raises(ValueError, match=r"ids: expected \(L,\) or \(B, L\) integer ids, got"):
        az.masks.document([0.5, 1.0])
    with pytest.raises(ValueError, match=r"kv_ids: batch 3 does not match ids' 2"):
        az.masks.document(torch.zeros(2, 4, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# and_ / or_ / ~, tensors mixed in


def test_and_of_bands_is_their_intersection_and_or_their_hull() -> None:
    """The band a combination carries is what backends skip blocks by: too wide, blocks are computed
    that could be skipped; too narrow, kept pairs are dropped."""
    a, b = az.masks.window(64, left=8, right=4), az.masks.window(64, left=20, right=1)
    assert (a.band, b.band) == ((-8, 4), (-20, 1))
    assert (a & b).band == (-8, 1) and (b & a).band == (-8, 1)
    assert (a | b).band == (-20, 4)
    assert (a & az.masks.window(64, left=None, right=2)).band == (-8, 2)


def test_and_or_not() -> None:
    c = az.masks.causal(4)
    w = az.masks.window(4, 4, 1, 1)
    tri = grid("x . . .\nx x . .\nx x x .\nx x x x")
    band = grid("x x . .\nx x x .\n. x x x\n. . x x")
    assert torch.equal(dense(az.masks.and_(c, w)), tri & band)
    assert torch.equal(dense(c & w), tri & band)
    assert torch.equal(dense(az.masks.or_(c, w)), tri | band)
    assert torch.equal(dense(c | w), tri | band)
    assert torch.equal(dense(~c), ~tri)
    assert torch.equal(dense(az.masks.and_(c, w, ~az.masks.window(4, 4, 0, 0))), tri & band & ~torch.eye(4).bool())
    assert "not" in (~c).name and "and" in (c & w).name and "or" in (c | w).name
    # a combination's name keeps its grouping: two different masks never print alike
    pad = az.masks.padding(torch.tensor([3]), 4)
    names = {m.name: m for m in ((c | w) & pad, c | (w & pad), ~(c & w), ~c & w, c & w & pad)}
    assert len(names) == 5, list(names)
    assert (c & w & pad).name == f"{c.name} and {w.name} and {pad.name}"  # (one kind: no brackets)
    assert ((c | w) & pad).name == f"({c.name} or {w.name}) and {pad.name}"
    assert (~(c & w)).name == f"not ({c.name} and {w.name})"


def test_combining_with_tensors_broadcasts() -> None:
    pad = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).view(2, 1, 1, 4)  # int 0/1, non-zero = keep
    m = az.masks.causal(4) & pad
    assert m.shape == (2, 1, 4, 4)
    t = m.to_tensor()
    tri = torch.ones(4, 4).tril().bool()
    assert torch.equal(t[0, 0], tri & pad[0, 0].bool()) and torch.equal(t[1, 0], tri & pad[1, 0].bool())
    m2 = az.masks.or_(torch.zeros(1, 3, 4, 4, dtype=torch.bool), az.masks.causal(4))
    assert m2.shape == (1, 3, 4, 4) and torch.equal(m2.to_tensor()[0, 2], tri)


def test_a_tensor_on_the_left_combines_as_on_the_right() -> None:
    """``tensor & mask`` and ``tensor | mask`` give the Mask that ``mask & tensor`` does (torch hands a
    Mask back to its reflected operators), bool and integer tensors alike."""
    c = az.masks.causal(4)
    for pad in (torch.tensor([1, 1, 1, 0]).view(1, 1, 1, 4), torch.tensor([True, True, False, True])):
        left_and, left_or = pad & c, pad | c
        assert isinstance(left_and, az.Mask) and isinstance(left_or, az.Mask)
        assert torch.equal(left_and.to_tensor(), (c & pad).to_tensor())
        assert torch.equal(left_or.to_tensor(), (c | pad).to_tensor())


def test_combining_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"and_: mask shapes .* do not broadcast together"):
        az.masks.and_(az.masks.causal(4), az.masks.causal(5))
    with pytest.raises(ValueError, match=r"or_: expected at least one mask, got none"):
        az.masks.or_()
    with pytest.raises(TypeError, match=r"mask: expected an attnzero Mask or a torch.Tensor, got list"):
        az.masks.and_(az.masks.causal(2), [[1, 0], [1, 1]])  # type: ignore[arg-type]


def test_from_tensor_any_dtype() -> None:
    t = torch.tensor([[0.0, 2.5], [-1.0, 0.0]])
    m = az.masks.from_tensor(t)
    assert m.shape == (1, 1, 2, 2)
    assert torch.equal(dense(m), t != 0)


# ---------------------------------------------------------------------------------------------
# Blocks: what backends evaluate


@pytest.mark.parametrize(
    "make",
    [
        lambda: az.masks.causal(13, 21),
        lambda: az.masks.causal(21, 13, align="top_left"),
        lambda: az.masks.window(13, 21, 3, 2),
        lambda: az.masks.padding([5, 21, 0], 21),
        lambda: az.masks.document(
            torch.randint(0, 3, (2, 13)).sort(-1).values, torch.randint(0, 3, (2, 21)).sort(-1).values
        ),
        lambda: ~az.masks.causal(13, 21) | az.masks.from_tensor(torch.rand(3, 1, 13, 21) < 0.3),
    ],
    ids=["causal", "causal_top_left", "window", "padding", "document", "combined"],
)
def test_block_equals_slice_of_dense(make: object) -> None:
    m = make()  # type: ignore[operator]
    full = m.to_tensor()
    Lq, Lk = m.shape[2], m.shape[3]
    for rows, cols in [((0, Lq), (0, Lk)), ((3, 9), (5, 12)), ((Lq - 1, Lq), (0, 1)), ((2, 3), (Lk - 4, Lk))]:
        blk = m.block(rows, cols)
        want = full[:, :, rows[0] : rows[1], cols[0] : cols[1]]
        assert torch.equal(blk.expand(want.shape), want), (rows, cols)


def test_block_of_a_broadcast_dim_is_evaluated_at_index_0() -> None:
    """A Mask of query length 1 applies its one row to every query (and likewise for keys)."""
    row = az.masks.causal(1, 6, align="top_left")  # keeps key 0 only
    assert torch.equal(row.block((2, 5), (0, 6)), row.to_tensor())
    col = az.masks.from_tensor(torch.tensor([[True], [False], [True]]))  # (3, 1): per-query
    assert torch.equal(col.block((1, 3), (4, 9))[0, 0, :, 0], torch.tensor([False, True]))
    q, k = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 6, 8)
    w = az.attention_weights(q, k, mask=row)
    assert torch.equal(w[..., 0], torch.ones(1, 1, 4)) and not w[..., 1:].any()


def test_keep_block_combines_mask_causal_and_window() -> None:
    Lq, Lk = 11, 16
    dense_mask = torch.rand(2, 1, Lq, Lk) < 0.6
    i, j = torch.arange(Lq).view(-1, 1), torch.arange(Lk).view(1, -1)
    p = i + Lk - Lq
    want = dense_mask & (j <= p) & (j >= p - 3)
    for mask in (dense_mask, az.masks.from_tensor(dense_mask)):
        for rows, cols in [((0, Lq), (0, Lk)), ((2, 7), (4, 13))]:
            got = keep_block(mask, True, (3, None), Lq, Lk, rows, cols, torch.device("cpu"))
            assert got is not None
            ref = want[:, :, rows[0] : rows[1], cols[0] : cols[1]]
            assert torch.equal(got.expand(ref.shape), ref)
    assert keep_block(None, False, None, Lq, Lk, (0, Lq), (0, Lk), torch.device("cpu")) is None


def test_block_of_keeps_broadcast_dims() -> None:
    t = torch.randn(2, 1, 1, 9)
    assert block_of(t, (3, 5), (2, 6)).shape == (2, 1, 1, 4)
    t2 = torch.randn(1, 3, 7, 9)
    assert torch.equal(block_of(t2, (3, 5), (2, 6)), t2[:, :, 3:5, 2:6])


# ---------------------------------------------------------------------------------------------
# Printing


def test_print_batched_and_truncated() -> None:
    s = str(az.masks.padding([1, 2]))
    assert s.splitlines() == ["padding 1×2 (B=2, H=1)", "[b=0, h=0]", "■ ·", "[b=1, h=0]", "■ ■"]
    big = az.masks.to_string(az.masks.causal(5, 7), max_size=3)
    lines = big.splitlines()
    assert lines[0] == "causal (bottom-right) 5×7"
    assert lines[1:4] == ["■ ■ ■ …", "■ ■ ■ …", "■ ■ ■ …"] and lines[4] == "⋮"
    assert az.masks.to_string(torch.tensor([[True, False]])).splitlines()[1] == "■ ·"
    assert repr(az.masks.causal(2, 3)) == "Mask(causal (bottom-right), shape=(1, 1, 2, 3))"


# ---------------------------------------------------------------------------------------------
# ALiBi


def test_alibi_slopes_power_of_two() -> None:
    got = alibi_slopes(8)
    assert torch.equal(got, torch.tensor([1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]))
    assert torch.allclose(alibi_slopes(16)[:2], torch.tensor([2**-0.5, 2**-1.0]))
    assert math.isclose(float(alibi_slopes(16)[-1]), 2**-8)


@pytest.mark.parametrize(
    ("n", "want"),
    [
        # The paper's rule: slopes of the largest power of two below n, then every other slope of
        # the next power of two, until there are n.
        (6, [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]),
        (12, [2.0**-e for e in range(1, 9)] + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5]),
        (3, [2**-4, 2**-8, 2**-2]),
        (1, [2**-8]),
    ],
)
def test_alibi_slopes_not_power_of_two(n: int, want: list[float]) -> None:
    torch.testing.assert_close(alibi_slopes(n), torch.tensor(want, dtype=torch.float32))


def test_alibi_values_bottom_right() -> None:
    H, Lq, Lk = 4, 3, 5
    b = az.masks.alibi(H, Lq, Lk)
    assert b.shape == (1, H, Lq, Lk) and b.dtype == torch.float32
    slopes = [2**-2, 2**-4, 2**-6, 2**-8]
    for h in range(H):
        for i in range(Lq):
            p = i + Lk - Lq  # the query's position, bottom-right aligned
            for j in range(Lk):
                assert math.isclose(float(b[0, h, i, j]), -slopes[h] * abs(p - j), abs_tol=1e-7)
    # The last query sits at the last key: its own position gets 0.
    assert not b[0, :, -1, -1].any()
    assert torch.equal(az.masks.alibi(2, 4), az.masks.alibi(2, 4, 4))


def test_alibi_as_bias_prefers_near_keys() -> None:
    q = torch.zeros(1, 8, 1, 4)  # uniform scores: only the bias speaks
    k = torch.randn(1, 8, 6, 4)
    w = az.attention_weights(q, k, bias=az.masks.alibi(8, 1, 6))
    assert bool((w[0, :, 0].diff(dim=-1) > 0).all())  # weight grows toward the query's position


def test_builders_reject_bad_lengths() -> None:
    with pytest.raises(ValueError, match=r"q_len: expected a positive int, got 0"):
        az.masks.causal(0)
    with pytest.raises(ValueError, match=r"kv_len: expected a positive int, got -2"):
        az.masks.window(3, -2)
    with pytest.raises(ValueError, match=r"align: expected 'bottom_right' or 'top_left', got 'left'"):
        az.masks.causal(3, align="left")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"num_heads: expected a positive int, got 0"):
        az.masks.alibi(0, 3)


@settings(max_examples=40, deadline=None)
@given(
    Lq=st.integers(1, 9),
    Lk=st.integers(1, 9),
    left=st.none() | st.integers(0, 4),
    right=st.none() | st.integers(0, 4),
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=3),
    data=st.data(),
)
def test_property_block_equals_slice(
    Lq: int, Lk: int, left: int | None, right: int | None, lengths: list[int], data: st.DataObject
) -> None:
    """Any combination of builders, any block: block() equals the slice of to_tensor(), and
    causal/window follow their index rules."""
    lengths = [min(n, Lk) for n in lengths]
    m = (az.masks.causal(Lq, Lk) | az.masks.window(Lq, Lk, left, right)) & az.masks.padding(lengths, Lk)
    i, j = torch.arange(Lq).view(-1, 1), torch.arange(Lk).view(1, -1)
    p = i + Lk - Lq
    win = torch.ones(Lq, Lk, dtype=torch.bool)
    if left is not None:
        win &= j >= p - left
    if right is not None:
        win &= j <= p + right
    pad = j.view(1, 1, 1, -1) < torch.tensor(lengths).view(-1, 1, 1, 1)
    full = m.to_tensor()
    assert torch.equal(full, ((j <= p) | win) & pad)
    r0 = data.draw(st.integers(0, Lq - 1))
    r1 = data.draw(st.integers(r0 + 1, Lq))
    c0 = data.draw(st.integers(0, Lk - 1))
    c1 = data.draw(st.integers(c0 + 1, Lk))
    want = full[:, :, r0:r1, c0:c1]
    assert torch.equal(m.block((r0, r1), (c0, c1)).expand(want.shape), want)


# ---------------------------------------------------------------------------------------------
# Masks broadcast like tensors, and a predicate's non-zero means "may attend" whatever its dtype.

BACKENDS = ["reference", "flash", "triton"]


def _run(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        absent("backend='triton' needs `pip install triton`")
    out = az.attention(q, k, v, mask=mask, backend=backend)  # type: ignore[arg-type]
    assert isinstance(out, torch.Tensor)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_masks_of_batch_one_and_batch_b_combine(backend: str) -> None:
    """padding of batch 1 and document ids of batch 2: the combination has batch 2, and each part
    is read at its own batch (index 0 where it has batch 1) — in to_tensor, in print, in attention."""
    ids = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]])
    m = az.masks.and_(az.masks.padding([5], kv_len=6), az.masks.document(ids))
    assert m.shape == (2, 1, 6, 6)
    same_doc = ids[:, :, None] == ids[:, None, :]  # (2, 6, 6)
    want = (same_doc & (torch.arange(6) < 5)).unsqueeze(1)  # (2, 1, 6, 6)
    assert torch.equal(m.to_tensor(), want)
    assert "[b=1, h=0]" in str(m)
    q, k, v = (torch.randn(2, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    got = _run(backend, q.float(), k.float(), v.float(), m)
    ref = az.attention(q, k, v, mask=want, backend="reference")
    assert isinstance(ref, torch.Tensor)
    assert (got.double() - ref).abs().max().item() < 1e-5
    or_ = az.masks.or_(az.masks.causal(6), az.masks.document(ids))  # batch 1 with batch 2, the other way
    assert torch.equal(or_.to_tensor(), torch.tril(torch.ones(6, 6, dtype=torch.bool)) | same_doc.unsqueeze(1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.float32])
def test_a_predicate_returning_numbers_keeps_the_non_zero_pairs(backend: str, dtype: torch.dtype) -> None:
    """A custom az.Mask whose predicate returns integers (or floats): non-zero = may attend, on every
    backend and in to_tensor / print / ~mask — never a crash, never bytes of an int read as bools."""
    m = Mask(lambda b, h, q, kv: ((kv <= q) * 3 + (kv == q + 1) * 256).to(dtype), (1, 1, 9, 9), "numbers")
    keep = (torch.arange(9)[None, :] <= torch.arange(9)[:, None] + 1).view(1, 1, 9, 9)  # j <= i + 1
    if dtype == torch.uint8:  # 256 wraps to 0 in uint8: only j <= i is non-zero
        keep = torch.tril(torch.ones(9, 9, dtype=torch.bool)).view(1, 1, 9, 9)
    assert torch.equal(m.to_tensor(), keep)
    assert torch.equal((~m).to_tensor(), ~keep)
    assert str(m).count("■") == int(keep.sum())
    q, k, v = (torch.randn(1, 2, 9, 8, dtype=torch.float64) for _ in range(3))
    got = _run(backend, q.float(), k.float(), v.float(), m)
    ref = az.attention(q, k, v, mask=keep, backend="reference")
    assert isinstance(ref, torch.Tensor)
    assert (got.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "build",
    [
        lambda: az.masks.window(4, 4, 2**63),
        lambda: az.masks.window(4, 4, 0, 2**64),
        lambda: az.masks.causal(2**63),
        lambda: az.masks.causal(4, 2**63),
        lambda: az.masks.padding([2**63]),
        lambda: az.masks.padding([1], kv_len=2**70),
        lambda: az.masks.document([0, 2**63]),
        lambda: az.masks.document([0, 1], [-(2**64), 0]),
        lambda: az.masks.alibi(2**63, 4),
    ],
)
def test_integers_too_large_are_refused_by_name(build: object) -> None:
    """An integer argument at or past 2**63 gives a ValueError naming it, not an OverflowError."""
    with pytest.raises(ValueError, match=r"^(left|right|q_len|kv_len|lengths|ids|kv_ids|num_heads): expected"):
        build()  # type: ignore[operator]


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: az.masks.alibi_slopes(0), ValueError, "num_heads: expected a positive int, got 0"),
        (lambda: az.masks.alibi_slopes(2.5), ValueError, "num_heads: expected a positive int, got 2.5"),
        (lambda: az.masks.from_tensor([[1, 0], [1, 1]]), TypeError, "mask: expected a torch.Tensor, got list"),
        (lambda: az.Mask(lambda b, h, q, kv: q >= kv, (1, 1, -4, 4)), ValueError, "none negative"),
        (lambda: az.masks.to_string(az.masks.causal(4), max_size=-1), ValueError, "max_size: expected a positive"),
    ],
    ids=["slopes_0", "slopes_float", "from_list", "negative_shape", "max_size"],
)
def test_mask_helpers_refuse_bad_arguments_by_name(build: Any, error: type[Exception], message: str) -> None:
    """Each had raised a math domain error, an AttributeError, a failure only when drawn, or drawn
    a cropped grid. (Document masks whose queries and keys hold different numbers of documents are
    masks like any other: a document the other side lacks sees nothing.)"""
    with pytest.raises(error, match=message):
        build()


def prefix_lm(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (kv_idx < 3) | (kv_idx <= q_idx)


def _packed_batch(_: list[int]) -> Mask:
    """A DataLoader collate_fn building a packed batch's mask (run in a worker process)."""
    return az.masks.document(cu_seqlens=[0, 3, 8]) & az.masks.causal(8)


def test_masks_pickle_as_the_builder_call_that_made_them() -> None:
    """A Mask's predicate is a local function, which pickle cannot store: every built-in mask
    (and their &, |, ~) failed in pickle, torch.save and a DataLoader worker's batch — which hung
    without a timeout. They are pickled as their builder call, and rebuilt with their structure."""
    import copy
    import io
    import pickle

    made = {
        "causal": az.masks.causal(5, 7, align="top_left"),
        "window": az.masks.window(7, 7, 2, 1),
        "window unbounded": az.masks.window(7, 7, None, None),
        "padding": az.masks.padding(torch.tensor([3, 7])),
        "document": az.masks.document([0, 0, 1, 1, 1, 2, 2]),
        "document cu": az.masks.document(cu_seqlens=[0, 2, 7], cu_seqlens_kv=[0, 4, 7]),
        "tensor": az.masks.from_tensor(torch.rand(2, 1, 7, 7) > 0.5),
        "from_mod": az.masks.from_mod(prefix_lm, 1, 2, 7, 7, block_size=4),
        "and": az.masks.document([0, 0, 1, 1, 1, 2, 2]) & az.masks.causal(7),
        "or": az.masks.or_(az.masks.window(7, 7, 1, 0), torch.eye(7, dtype=torch.bool)),
        "not": ~az.masks.causal(7),
    }
    for name, mask in made.items():
        for back in (
            pickle.loads(pickle.dumps(mask)),
            torch.load(io.BytesIO(_saved(mask)), weights_only=False),
            copy.deepcopy(mask),
        ):
            assert isinstance(back, Mask), name
            assert back.shape == mask.shape and back.name == mask.name, name
            assert torch.equal(back.to_tensor(), mask.to_tensor()), name
            assert back.band == mask.band and back.exact == mask.exact, name
            assert (back.segments is None) == (mask.segments is None) and (back.table is None) == (mask.table is None)
    plain = Mask(lambda b, h, q, kv: q >= kv, (1, 1, 3, 3))  # not a builder's: deepcopy only, as any object
    assert torch.equal(copy.deepcopy(plain).to_tensor(), plain.to_tensor())
    loader = torch.utils.data.DataLoader(range(2), batch_size=2, num_workers=1, collate_fn=_packed_batch, timeout=60)
    (got,) = list(loader)
    assert torch.equal(got.to_tensor(), _packed_batch([]).to_tensor())


def _saved(x: Any) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(x, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("kind", ["padding", "document"])
def test_a_padding_or_document_mask_is_the_mask_as_made(kind: str) -> None:
    """The lengths or ids tensor changed in place after the Mask is made: the Mask stays what it was
    made as on every backend (its block structure was a snapshot while its predicate read the tensor
    live: the compiled kernel and flash.py followed neither the old nor the new lengths)."""
    B, L = 2, 200
    q, k, v = (torch.randn(B, 1, L, 8) for _ in range(3))
    if kind == "padding":
        source = torch.tensor([3, L])
        mask = az.masks.padding(source, L)
        source.copy_(torch.tensor([150, L]))
    else:
        source = torch.repeat_interleave(torch.tensor([0, 1]), torch.tensor([60, L - 60]))
        mask = az.masks.document(source)
        source.zero_()  # one document now
    want = mask.to_tensor()
    assert int(want[0, 0, -1].sum()) == (3 if kind == "padding" else L - 60)
    for backend in ("reference", "flash", "auto"):
        got = az.attention(q, k, v, mask=mask, backend=backend)
        torch.testing.assert_close(got, az.attention(q, k, v, mask=want, backend="reference"), atol=1e-5, rtol=1e-5)
