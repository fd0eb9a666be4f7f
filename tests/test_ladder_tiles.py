"""Rungs 5 and 6 of the ladder (the flash backend's tiles, forward and backward), and the flash
backend's instrumentation: the tiles it records are the blocks it counts, and the blocks a
document mask lets it skip are the ones ``Mask.classify`` says."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import absent, torch_threads

import attnzero as az
from attnzero import flash, geometry, ladder, trace
from attnzero.ladder import docs
from attnzero.ladder.common import pictures_available
from attnzero.ladder.r5_tiles import SKIPPED, tile_map


def _need_pictures() -> None:
    if not pictures_available():
        absent("matplotlib is not installed (pip install matplotlib)")


@contextmanager
def counted(key: str) -> Iterator[dict[str, int]]:
    """``flash.COUNTS[key]``'s growth over the block, in the yielded dict's "delta"."""
    got = {"delta": 0}
    before = flash.COUNTS[key]
    yield got
    got["delta"] = flash.COUNTS[key] - before


def _qkv(B: int, H: int, L: int, D: int = 16, dtype: torch.dtype = torch.float64, grad: bool = False) -> list[Any]:
    return [torch.randn(B, H, L, D, dtype=dtype, requires_grad=grad) for _ in range(3)]


def _ids(*lengths: int) -> list[int]:
    return [i for i, n in enumerate(lengths) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# The rungs


@pytest.mark.parametrize("n", [5, 6])
def test_rung_runs_small_and_its_check_passes(n: int, tmp_path: Path) -> None:
    _need_pictures()
    result = ladder.run(n, tmp_path, small=True, quiet=True)
    assert result.ok, (result.check, result.error)
    assert result.rung == n and result.pictures
    for path in result.pictures:
        assert path.is_file() and path.stat().st_size > 0 and path.name.startswith(f"r{n}-")
    assert any(line.startswith("check: ") for line in result.lines)


def test_rungs_run_without_pictures() -> None:
    for n in (5, 6):
        result = ladder.run(n, None, small=True, quiet=True)
        assert result.ok and result.pictures == []


def test_rung5_counts_are_the_recorded_tiles() -> None:
    result = ladder.run(5, None, small=True, quiet=True)
    nums = result.numbers
    for name in ("full", "causal", "window", "document"):  # the recorded tiles are the blocks counted
        assert nums[f"recorded_{name}"] == nums[f"counted_{name}"] > 0, name
    assert nums["tiles_full"] == nums["tiles_grid"]  # no mask: every tile
    assert nums["tiles_window"] < nums["tiles_causal"] < nums["tiles_full"]
    assert nums["tiles_document"] < nums["tiles_full"]


def test_docs_included_code_exists() -> None:
    # the functions the sections of rungs 5 and 6 include
    for ref in (
        "attnzero/flash.py::_forward_block",
        "attnzero/flash.py::_forward",
        "attnzero/flash.py::_Problem.key_blocks",
        "attnzero/flash.py::_backward_block",
        "attnzero/ladder/r5_tiles.py::tiled_forward",
        "attnzero/ladder/r5_tiles.py::rung4_on_every_row",
        "attnzero/ladder/r5_tiles.py::tile_map",
        "attnzero/ladder/r6_backward.py::flash_grads",
        "attnzero/ladder/r6_backward.py::saved_mb",
    ):
        assert docs.source_of(ref).strip()


# ---------------------------------------------------------------------------------------------
# The instrumentation against the counters


MASKS = {
    "causal": lambda L: {"causal": True},
    "window": lambda L: {"window": (L // 4, 3)},
    "document": lambda L: {"mask": az.masks.document(_ids(L // 3, L // 2, L - L // 3 - L // 2))},
    "causal document": lambda L: {"causal": True, "mask": az.masks.document(_ids(L // 2, L - L // 2))},
    "dense": lambda L: {"mask": torch.rand(L, L) < 0.8},
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(MASKS))
def test_forward_tiles_recorded_are_the_blocks_counted(name: str, threads: int) -> None:
    L = 96
    q, k, v = _qkv(2, 2, L)
    with flash.block_sizes(rows=16, cols=16), torch_threads(threads):
        with counted("forward") as n, trace.recording() as rec:
            az.attention(q, k, v, backend="flash", **MASKS[name](L))
    tiles = rec.of("flash.tile")
    assert n["delta"] > 0 and len(tiles) == n["delta"]
    assert all(e["pass_"] == "forward" for e in tiles)
    if name in ("causal", "window"):  # no mask to evaluate: causal / window cut through the edge tiles only
        assert not any(e["masked"] for e in tiles) and any(e["edge"] for e in tiles)
    if name == "dense":  # a dense mask is evaluated on every block
        assert all(e["masked"] for e in tiles)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(MASKS))
def test_backward_tiles_recorded_are_the_blocks_counted(name: str, threads: int) -> None:
    L = 80
    q, k, v = _qkv(1, 2, L, grad=True)
    with flash.block_sizes(rows=16, cols=16), torch_threads(threads):
        out = az.attention(q, k, v, backend="flash", **MASKS[name](L))
        with counted("backward") as n, trace.recording() as rec:
            out.sum().backward()
    tiles = rec.of("flash.tile")
    assert len(tiles) == n["delta"] > 0
    assert all(e["pass_"] == "backward" for e in tiles)


def test_skipped_tiles_of_a_document_mask_are_what_classify_says() -> None:
    L, t = 128, 16
    mask = az.masks.document(_ids(32, 48, 16, 32))  # borders on tile borders: the tiles form a grid
    q, k, v = _qkv(1, 1, L)
    with flash.block_sizes(rows=t, cols=t), trace.recording() as rec:
        az.attention(q, k, v, backend="flash", mask=mask)
    got = {(e["rows"], e["cols"]): e["masked"] for e in rec.of("flash.tile")}
    want = {}
    for i0 in range(0, L, t):
        for j0 in range(0, L, t):
            rows, cols = (i0, i0 + t), (j0, j0 + t)
            kind = mask.classify((0, 1), rows, cols)
            if kind is not geometry.SKIP:
                want[(rows, cols)] = kind is geometry.PARTIAL
    assert got == want
    assert len(got) < (L // t) ** 2  # some were skipped


@pytest.mark.parametrize("causal", [False, True])
def test_tiles_of_any_document_mask_cover_every_kept_pair_once(causal: bool) -> None:
    L = 100
    mask = az.masks.document(_ids(21, 40, 9, 30))  # borders inside tiles
    q, k, v = _qkv(1, 1, L)
    with flash.block_sizes(rows=16, cols=16), trace.recording() as rec:
        az.attention(q, k, v, backend="flash", mask=mask, causal=causal)
    tiles = rec.of("flash.tile")
    cover = torch.zeros(L, L, dtype=torch.int64)
    for e in tiles:
        (r0, r1), (c0, c1) = e["rows"], e["cols"]
        assert mask.classify((0, 1), e["rows"], e["cols"]) is not geometry.SKIP
        cover[r0:r1, c0:c1] += 1
    keep = mask.to_tensor().reshape(L, L)
    if causal:
        keep = keep & torch.ones(L, L, dtype=torch.bool).tril()
    assert int(cover.max()) == 1  # no pair computed twice
    assert bool((cover[keep] == 1).all())  # every kept pair computed
    assert bool(((tile_map(tiles, L, L) != SKIPPED) == (cover == 1)).all())


def test_rows_that_see_no_key_are_recorded_in_both_passes() -> None:
    L = 64
    mask = az.masks.document(_ids(32, 32), kv_ids=[0] * L)  # queries of document 1 see no key
    q, k, v = _qkv(1, 1, L, grad=True)
    with flash.block_sizes(rows=16, cols=16), trace.recording() as rec:
        out = az.attention(q, k, v, backend="flash", mask=mask)
        out.sum().backward()
    for pass_ in ("forward", "backward"):
        empty = sorted(e["rows"] for e in rec.of("flash.rows_empty") if e["pass_"] == pass_)
        assert empty == [(32, 48), (48, 64)]
        assert all(e["rows"][1] <= 32 for e in rec.of("flash.tile") if e["pass_"] == pass_)


def test_nothing_is_recorded_when_not_recording() -> None:
    q, k, v = _qkv(1, 2, 64)
    with flash.block_sizes(rows=16, cols=16):
        assert not trace.active()
        plain = az.attention(q, k, v, backend="flash", causal=True)
        with trace.recording() as rec:
            pass
        assert rec.events == []
        with trace.recording() as rec:
            recorded = az.attention(q, k, v, backend="flash", causal=True)
        assert not trace.active()
        after = az.attention(q, k, v, backend="flash", causal=True)
    assert len(rec.of("flash.tile")) == 10
    assert torch.equal(plain, recorded) and torch.equal(plain, after)  # recording changes nothing computed


def test_rung_5_times_flash_py_s_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    # it timed az.attention(backend="flash"), which in float32 runs the compiled CPU kernel, while its
    # text and picture are about flash.py's tiles
    from attnzero import flash, ladder

    shapes: list[tuple[int, ...]] = []
    real = flash.attention
    monkeypatch.setattr(flash, "attention", lambda q, *a, **kw: shapes.append(tuple(q.shape)) or real(q, *a, **kw))
    result = ladder.run(5, None, small=True, quiet=True)
    assert (1, 4, 256, 64) in shapes and "time_flash.py_s" in result.numbers
