"""``az.masks.from_mod``: a Mask from a FlexAttention mask_mod, its block table evaluated once per
block and chunked. Every claim it makes (classify, key_range, at the table's blocks or any other
partition, finer or coarser) is checked against the dense golden mask written independently;
attention with it equals attention with the dense mask on every backend that exists; the flash
backend visits exactly the blocks it keeps; and_/or_ keep what their parts know."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from conftest import flash_py, qkv

import attnzero as az
from attnzero import blocks, flash, geometry, mods
from attnzero import masks as M

Tensor = torch.Tensor


def _grid(B: int, H: int, Lq: int, Lk: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in (B, H, Lq, Lk)), indexing="ij")
    return b, h, i, j


def _cases() -> dict[str, tuple[Callable[..., Tensor], Callable[..., Tensor], tuple[int, int, int, int]]]:
    """name → (mask_mod written for one pair, the same written densely on index grids, (B, H, Lq, Lk))."""
    torch.manual_seed(1)
    side = 6  # a 6 × 6 image of tokens, row-major: 36 tokens
    doc_lens = [5, 1, 13, 0, 9, 9]  # jagged documents, one empty
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))  # (37,)
    blockmap = torch.rand(2, 3, 5, 5) < 0.4  # random block sparsity, 8 × 8 blocks, per batch and head

    def prefix(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (kv < 11) | (kv <= q)

    def dilated(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return ((q - kv) % 3 == 0) & (kv <= q)

    def natten(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        qr, qc, kr, kc = q // side, q % side, kv // side, kv % side
        return ((qr - kr).abs() <= 1) & ((qc - kc).abs() <= 1)

    def documents(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (doc[q] == doc[kv]) & (kv <= q)

    def sparse(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return blockmap[b, h, q // 8, kv // 8]

    def per_head(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (q - kv).abs() <= h + 2 * b  # a window per head and batch

    return {
        "prefix_lm": (prefix, lambda b, h, i, j: (j < 11) | (j <= i), (1, 1, 40, 40)),
        "dilated": (dilated, lambda b, h, i, j: ((i - j) % 3 == 0) & (j <= i), (1, 1, 29, 29)),
        "natten_2d": (
            natten,
            lambda b, h, i, j: ((i // side - j // side).abs() <= 1) & ((i % side - j % side).abs() <= 1),
            (1, 1, 36, 36),
        ),
        "jagged_documents": (documents, lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i), (1, 1, 37, 37)),
        "block_sparse": (sparse, lambda b, h, i, j: blockmap[b, h, i // 8, j // 8], (2, 3, 40, 40)),
        "per_head_cross": (per_head, lambda b, h, i, j: (i - j).abs() <= h + 2 * b, (2, 3, 23, 41)),
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("block_size", [8, (4, 16)], ids=["8", "4x16"])
def test_every_claim_holds_on_the_golden_dense_mask(name: str, block_size: int | tuple[int, int]) -> None:
    mod, dense_of, shape = CASES[name]
    mask = M.from_mod(mod, *shape, block_size=block_size)
    gold = dense_of(*_grid(*shape))  # (B, H, Lq, Lk) bool
    assert torch.equal(mask.to_tensor(), gold)
    B, _, Lq, Lk = shape
    rng = random.Random(0)
    for _ in range(60):  # random blocks of rows × cols, aligned or not, finer or coarser than the table
        r0, c0 = rng.randrange(Lq), rng.randrange(Lk)
        rows, cols = (r0, rng.randint(r0 + 1, Lq)), (c0, rng.randint(c0 + 1, Lk))
        b0 = rng.randrange(B)
        batches = (b0, rng.randint(b0 + 1, B))
        part = gold[batches[0] : batches[1], :, rows[0] : rows[1], cols[0] : cols[1]]
        kind = mask.classify(batches, rows, cols)
        if kind is geometry.SKIP:
            assert not part.any()
        elif kind is geometry.FULL:
            assert part.all()
        lo, hi = mask.key_range(batches, rows)
        seen = gold[batches[0] : batches[1], :, rows[0] : rows[1]].any(dim=(0, 1, 2)).nonzero()
        if len(seen):
            assert lo <= int(seen.min()) and int(seen.max()) < hi
        else:
            assert lo == hi
    # at the table's own blocks the answers are exact: skip iff nothing kept, full iff all kept
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    for i0 in range(0, Lq, bq):
        for j0 in range(0, Lk, bk):
            part = gold[:, :, i0 : i0 + bq, j0 : j0 + bk]
            kind = mask.classify((0, B), (i0, min(Lq, i0 + bq)), (j0, min(Lk, j0 + bk)))
            assert (kind is geometry.SKIP) == (not part.any()) and (kind is geometry.FULL) == bool(part.all())


@pytest.mark.parametrize("backend", ["reference", "flash"])
@pytest.mark.parametrize("name", list(CASES))
def test_attention_with_it_equals_attention_with_the_dense_mask(backend: str, name: str) -> None:
    mod, dense_of, (B, H, Lq, Lk) = CASES[name]
    mask = M.from_mod(mod, B, H, Lq, Lk, block_size=8)
    gold = dense_of(*_grid(B, H, Lq, Lk))
    q, k, v = (t.requires_grad_() for t in qkv(B, H, 1 if H == 1 else 3, Lq, Lk, 8))
    with flash.block_sizes(rows=8, cols=8):
        out, lse = az.attention(q, k, v, mask=mask, backend=backend, return_lse=True)  # type: ignore[misc]
        got = torch.autograd.grad(out.sum() + (out * out).sum(), (q, k, v))
    want, wlse = az.attention(q, k, v, mask=gold, backend="reference", return_lse=True)  # type: ignore[misc]
    wgot = torch.autograd.grad(want.sum() + (want * want).sum(), (q, k, v))
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, wlse)
    for a, b in zip(got, wgot):
        torch.testing.assert_close(a, b)


def _visited(mask: M.Mask | Tensor, shape: tuple[int, int, int, int]) -> int:
    B, H, Lq, Lk = shape
    q, k, v = qkv(B, H, H, Lq, Lk, 8)
    flash.COUNTS.update(forward=0)
    with flash_py(), flash.block_sizes(rows=8, cols=8):
        az.attention(q, k, v, mask=mask, backend="flash")
    return flash.COUNTS["forward"]


@pytest.mark.parametrize("name", ["prefix_lm", "natten_2d", "jagged_documents", "dilated"])
@pytest.mark.parametrize("table", [8, 4], ids=["same_blocks", "finer_table"])
def test_flash_visits_exactly_the_blocks_with_a_kept_pair(name: str, table: int) -> None:
    """B = H = 1: one chunk, so flash's forward visits one block per (8-row block, 8-key block) it
    does not skip — which must be exactly those with a kept pair in the golden mask."""
    mod, dense_of, shape = CASES[name]
    gold = dense_of(*_grid(*shape))[0, 0]  # (Lq, Lk)
    Lq, Lk = gold.shape
    exact = sum(
        bool(gold[i : i + 8, j : j + 8].any()) for i in range(0, Lq, 8) for j in range(0, Lk, 8)
    )  # blocks with a kept pair
    assert _visited(M.from_mod(mod, *shape, block_size=table), shape) == exact
    every = -(-Lq // 8) * -(-Lk // 8)
    assert exact < every and _visited(gold, shape) == every  # the dense mask visits all of them


def test_a_coarser_table_is_still_right_and_visits_what_it_keeps() -> None:
    mod, dense_of, shape = CASES["prefix_lm"]
    mask = M.from_mod(mod, *shape, block_size=16)
    gold = dense_of(*_grid(*shape))[0, 0]
    n16 = mask.table.counts()  # type: ignore[union-attr]
    # each 16-block not skipped holds four 8-blocks (fewer at the edge of 40)
    expect = sum(
        min(8, 40 - i) > 0 and bool(gold[i // 16 * 16 : i // 16 * 16 + 16, j // 16 * 16 : j // 16 * 16 + 16].any())
        for i in range(0, 40, 8)
        for j in range(0, 40, 8)
    )
    assert _visited(mask, shape) == expect and n16["skip"] > 0


def test_the_mod_is_evaluated_in_chunks_never_densely(monkeypatch: pytest.MonkeyPatch) -> None:
    tiles: list[int] = []
    real = mods.mask_block

    def spy(*args: object, **kw: object) -> Tensor:
        out = real(*args, **kw)  # type: ignore[arg-type]
        tiles.append(out.numel())
        return out

    monkeypatch.setattr(mods, "mask_block", spy)
    L = 4096
    mask = M.from_mod(lambda b, h, q, kv: kv <= q, 1, 1, L, L)
    assert max(tiles) <= blocks._CHUNK < L * L and sum(tiles) == L * L
    counts = mask.table.counts()  # type: ignore[union-attr]
    assert counts == {"skip": 32 * 31 // 2, "partial": 32, "full": 32 * 31 // 2}
    # a tiny chunk gives the same table
    small = blocks.evaluate(lambda b, h, q, kv: kv <= q, (1, 1, 300, 200), (16, 32), torch.device("cpu"), chunk=600)
    big = blocks.evaluate(lambda b, h, q, kv: kv <= q, (1, 1, 300, 200), (16, 32), torch.device("cpu"))
    assert torch.equal(small.kinds, big.kinds)


def test_one_batch_and_head_broadcast() -> None:
    mask = M.from_mod(lambda b, h, q, kv: kv <= q, 1, 1, 12, 12, block_size=4)
    q, k, v = qkv(3, 4, 2, 12, 12, 8)
    torch.testing.assert_close(az.attention(q, k, v, mask=mask, backend="flash"), az.attention(q, k, v, causal=True))


def test_and_or_keep_what_their_parts_know() -> None:
    L = 32
    lower = M.from_mod(lambda b, h, q, kv: kv <= q, 1, 1, L, L, block_size=8)
    prefix = M.from_mod(lambda b, h, q, kv: kv < 8, 1, 1, L, L, block_size=8)
    both, either = M.and_(lower, prefix), M.or_(lower, prefix)
    assert both.table is not None and either.table is not None  # two tables of one grid: one table
    C = geometry.classify
    assert both.classify((0, 1), (8, 16), (0, 8)) is geometry.FULL  # full ∧ full
    assert both.classify((0, 1), (8, 16), (8, 16)) is geometry.SKIP  # partial ∧ skip
    assert either.classify((0, 1), (0, 8), (8, 16)) is geometry.SKIP  # skip ∨ skip
    assert either.classify((0, 1), (0, 8), (0, 8)) is geometry.FULL  # partial ∨ full
    # with a built-in (no table): the parts answer
    win = M.window(L, L, 3, 0)
    mixed, mixed_or = M.and_(prefix, win), M.or_(prefix, win)
    assert mixed.parts is not None and mixed.band is not None  # the window's band is kept
    assert mixed.classify((0, 1), (16, 24), (0, 8)) is geometry.SKIP  # window skips it
    assert mixed.classify((0, 1), (0, 8), (8, 16)) is geometry.SKIP  # prefix skips it
    assert mixed_or.classify((0, 1), (8, 16), (0, 8)) is geometry.FULL  # prefix keeps it whole
    assert mixed_or.classify((0, 1), (0, 8), (24, 32)) is geometry.SKIP  # both skip
    assert C((0, 8), (0, 8), L, L, True, None) is geometry.PARTIAL  # (the diagonal: a sanity check)
    for m in (both, either, mixed, mixed_or):
        dense_parts = [p.to_tensor() for p in (lower, prefix)] if m in (both, either) else [
            prefix.to_tensor(), win.to_tensor()]  # fmt: skip
        want = dense_parts[0] & dense_parts[1] if m in (both, mixed) else dense_parts[0] | dense_parts[1]
        assert torch.equal(m.to_tensor(), want)
        q, k, v = qkv(1, 2, 2, L, L, 8)
        with flash.block_sizes(rows=8, cols=8):
            got = az.attention(q, k, v, mask=m, backend="flash")
        torch.testing.assert_close(got, az.attention(q, k, v, mask=want, backend="reference"))


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match=r"mask_mod: expected a function .* got int"):
        M.from_mod(3, 1, 1, 4, 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mask_mod: expected a function"):
        M.from_mod(None, 1, 1, 4, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Lk: expected a positive int"):
        M.from_mod(lambda b, h, q, kv: q >= kv, 1, 1, 4, 0)
    with pytest.raises(ValueError, match="block_size: expected"):
        M.from_mod(lambda b, h, q, kv: q >= kv, 1, 1, 4, 4, block_size=0)
    with pytest.raises(TypeError, match="mask_mod: expected a 0-d"):
        M.from_mod(lambda b, h, q, kv: torch.stack([q, kv]) > 0, 1, 1, 4, 4)


def test_backends_evaluate_the_mod_on_partial_blocks_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the table is built, attention calls the mask_mod only on table blocks that are partial:
    not on skipped ones (nor full ones, which need no mask)."""
    mod, _, shape = CASES["prefix_lm"]
    mask = M.from_mod(mod, *shape, block_size=8)
    table = mask.table
    assert table is not None
    calls: list[tuple[int, int]] = []
    real = mods.mask_on

    def spy(mm: object, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        qb, kb = {int(x) // 8 for x in q}, {int(x) // 8 for x in kv}
        assert len(qb) == len(kb) == 1  # one table block per call
        calls.append((qb.pop(), kb.pop()))
        return real(mm, b, h, q, kv)  # type: ignore[arg-type]

    monkeypatch.setattr(mods, "mask_on", spy)
    q, k, v = qkv(1, 1, 1, shape[2], shape[3], 8)
    for backend in ("reference", "flash"):
        calls.clear()
        with flash.block_sizes(rows=16, cols=16):  # flash blocks of 2 × 2 table blocks
            az.attention(q, k, v, mask=mask, backend=backend)
        assert calls and all(int(table.kinds[0, 0, i, j]) == blocks.PARTIAL for i, j in calls)
