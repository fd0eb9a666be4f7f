"""benchmarks/shapes.py and benchmarks/runtime_ab.py run (at the smallest of their cases), and the
A/B's switches put the runtime back as it was: the scripts behind docs/benchmarks.md do not rot."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import runtime_ab  # noqa: E402
import shapes  # noqa: E402

from attnzero import flash, parallel  # noqa: E402


def test_shapes_times_both_sides_of_every_case_kind() -> None:
    for key in ("tiny", "decode"):
        got = shapes.measure(shapes.CASES[key], repeats=1)
        assert set(got) == {"attnzero", "torch"} and all(t > 0 for t in got.values())
    small = shapes.Shape("small training", 1, 2, 1, 8, 8, 4, causal=True, train=True, dropout_p=0.1)
    runs = shapes.runs(small)
    for fn in runs.values():
        fn()  # forward and backward, with dropout, GQA, causal


def test_runtime_ab_variants_switch_one_piece_and_restore_it() -> None:
    before = (flash.arena, parallel.ONE_THREAD_OPS, parallel.QUIET_OPENMP)
    seen = {}
    for name in runtime_ab.NAMES:
        with runtime_ab.variant(name):
            seen[name] = (flash.arena is before[0], parallel.ONE_THREAD_OPS, parallel.QUIET_OPENMP)
            q = torch.randn(1, 2, 40, 8)
            with flash.block_sizes(rows=16):
                flash.forward(q, q, q, mask=None, bias=None, causal=True, window=None, scale=0.3, dropout_p=0.0,
                              dropout_seed=0)  # fmt: skip
        assert (flash.arena, parallel.ONE_THREAD_OPS, parallel.QUIET_OPENMP) == before
    assert seen["default"] == (True, True, True)
    assert seen["no pause"] == (True, True, False)
    assert seen["fresh scratch"] == (False, True, True)
    assert seen["ops on torch's threads"] == (True, False, True)


def test_features_benchmark_runs_each_table_at_a_small_size() -> None:
    import features

    rows = features.softcap_sinks(64, repeats=1)
    names = ("softcap", "sinks", "both", "softcap, q × 8", "softcap, q × 32")
    assert [r[0] for r in rows] == [f"{n}, {c}" for c in ("full", "causal") for n in names]
    assert all(r[1] > 0 and r[2] > 0 for r in rows)
    routes, ways = features.tanh_ways(64, repeats=1)
    assert routes[-2:] == ["expm1", "torch"] and len(ways) == 8
    assert all(len(ratios) == len(routes) and min(ratios) > 0 for _, _, ratios in ways)
    skip = {name: blocks for name, _, _, blocks in features.skipping(256, repeats=1)}
    assert skip["causal Mask"] == skip["causal=True"] == skip["drop-in is_causal=True"]
    assert all(r[2] > 0 for r in features.varlen(64, repeats=1))
