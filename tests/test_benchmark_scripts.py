"""benchmarks/shapes.py and benchmarks/features.py run (at the smallest of their cases): the scripts
behind docs/benchmarks.md do not rot."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import shapes  # noqa: E402


def test_shapes_times_both_sides_of_every_case_kind() -> None:
    for key in ("tiny", "decode"):
        got = shapes.measure(shapes.CASES[key], repeats=1)
        assert set(got) == {"attnzero", "torch"} and all(t > 0 for t in got.values())
    small = shapes.Shape("small training", 1, 2, 1, 8, 8, 4, causal=True, train=True, dropout_p=0.1)
    runs = shapes.runs(small)
    for fn in runs.values():
        fn()  # forward and backward, with dropout, GQA, causal


def test_features_benchmark_runs_each_table_at_a_small_size() -> None:
    import features

    rows = features.softcap_sinks(64, repeats=1)
    names = ("softcap", "sinks", "both", "softcap, q × 8", "softcap, q × 32")
    assert [r[0] for r in rows] == [f"{n}, {c}" for c in ("full", "causal") for n in names]
    assert all(r[1] > 0 and r[2] > 0 for r in rows)
    skip = {name: blocks for name, _, _, blocks in features.skipping(256, repeats=1)}
    assert skip["causal Mask"] == skip["causal=True"] == skip["drop-in is_causal=True"]
    assert all(r[2] > 0 for r in features.varlen(64, repeats=1))
