"""benchmarks/shapes.py, features.py, cpu_kernel.py's and mods.py's tables run (at the smallest of their cases):
the scripts behind docs/benchmarks.md do not rot. cpu_kernel.py's memory table is not run here (four
fresh processes; tests/test_memory.py runs its method) nor its Flex table compiled (minutes)."""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

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


def test_cpu_kernel_tables_time_every_implementation_at_a_small_size() -> None:
    """benchmarks/cpu_kernel.py (issue 22's tables): the sdpa table's calls, dropout and GQA
    included; the GEMM-peak line; the table printer. (The flex and memory tables: below.)"""
    import cpu_kernel
    import cpu_peak

    small = cpu_kernel.Shape("small", 1, 2, 1, 8, 8, 4, causal=True, dropout_p=0.1)
    assert small.passes == (True,)
    for backward in (False, True):
        for fn in cpu_kernel.calls(small, backward).values():
            fn()
    lines = list(cpu_kernel.sdpa_section(["tiny"], repeats=1))
    assert lines[2].startswith("| case |") and len(lines) == 6  # title, blank, header, rule, fwd, fwd+bwd
    peak = list(cpu_peak.section(quick=True, repeats=1))
    assert peak[-1].startswith("causal L=512 forward") and "% of the GEMM peak" in peak[-1]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_table_rows_compute_the_same_attention_on_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row of the Flex table gives attnzero and Flex the same attention (eager Flex here:
    the compiled one takes minutes to compile on a small CI machine; a window shorter than L)."""
    import flex_table
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex_table, "WINDOW", 20)

    rows = flex_table.rows(1, 2, 128, 16, flex_attention) + flex_table.rows(2, 2, 128, 16, flex_attention, True)
    assert len(rows) == 7
    with torch.no_grad():
        for row in rows:
            flex_table._checked(row)


def test_cpu_models_run_each_attention_variant() -> None:
    """benchmarks/cpu_models.py: every model's step runs with torch's SDPA, attnzero's drop-in and
    no attention, and ViT-Tiny has timm's vit_tiny_patch16_224 size (5.7 M parameters)."""
    import cpu_models

    assert round(sum(p.numel() for p in cpu_models.ViTTiny().parameters()) / 1e6, 1) == 5.7
    for build in cpu_models.ROWS.values():
        _, model, step = build(True)
        for fn in cpu_models.variants(model, step).values():
            fn()


def test_busy_load_stops_when_its_block_raises() -> None:
    import harness

    with pytest.raises(KeyboardInterrupt), harness.busy_load():
        kids = mp.active_children()
        assert [p.name for p in kids] == ["busy-load"] and kids[0].is_alive()
        raise KeyboardInterrupt
    assert not kids[0].is_alive() and mp.active_children() == []


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_mods_benchmark_runs_its_tables_at_a_small_size() -> None:
    """benchmarks/mods.py (issue 23's numbers): the cost and masks tables, every training step of
    the training table (its memory, fresh processes, is not measured here), and the attention-gym
    rows' two sides agreeing (eager Flex here; the script compiles it)."""
    import mods

    cost = list(mods.cost(64, repeats=1))
    assert cost[2].startswith("| pass | case |") and len(cost) == 4 + 2 * 10
    masks = list(mods.masks(64, repeats=1))
    assert any(line.startswith("| prefix-LM from_mod ÷ its kept blocks") for line in masks)
    for case in ("alibi", "relative", "prefix"):
        for impl in ("attnzero", "torch"):
            mods._training_case(f"{case}/{impl}", 64)()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import attnzero as az

    L = 64
    q, k, v = (torch.randn(1, 8, L, 64) for _ in range(3))
    with torch.no_grad():
        for name, (ours, theirs) in mods._gym(L).items():
            bm = create_block_mask(theirs["mask_mod"], None, None, L, L, device="cpu", BLOCK_SIZE=16)
            want = flex_attention(q, k, v, score_mod=theirs.get("score_mod"), block_mask=bm)
            torch.testing.assert_close(az.attention(q, k, v, **ours), want, rtol=1e-4, atol=1e-4, msg=name)


def test_cpu_models_rows_run_in_a_fresh_process() -> None:
    """The models table runs each row in fresh processes (cpu_models.py as a script): one process's
    samples come back, one per round for each variant."""
    import cpu_models

    label, times = cpu_models.in_fresh_process("nanogpt", True, 2)
    assert label.startswith("nanoGPT") and set(times) == set(cpu_models.MODES)
    assert all(len(ts) == 2 and min(ts) > 0 for ts in times.values())
    assert len(cpu_models.paired(times, "attnzero", "torch")) == 2


def test_cpu_models_fixed_heap_reaches_the_row_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """--heap fixed: the row's process gets glibc's fixed-heap variables on top of this environment;
    as it comes, this environment alone."""
    import cpu_models

    envs = []

    def run(command: list[str], **kw: Any) -> SimpleNamespace:
        envs.append(kw["env"])
        return SimpleNamespace(stdout='["label", {}]')

    monkeypatch.setattr(cpu_models.subprocess, "run", run)
    monkeypatch.setenv("ATTNZERO_SEEN", "1")
    cpu_models.in_fresh_process("vit", True, 1, "fixed")
    cpu_models.in_fresh_process("vit", True, 1)
    assert envs[0]["ATTNZERO_SEEN"] == "1" and envs[0]["MALLOC_TRIM_THRESHOLD_"] == str(1 << 30)
    assert envs[1] is None


def test_cpu_models_interval_resamples_whole_processes() -> None:
    """The models table's 95 % interval: processes that agree give a point; one process in ten far
    from the others barely moves it, four in ten stretch it to them."""
    import cpu_models

    assert cpu_models.interval([[0.9, 0.9]] * 5) == (0.9, 0.9)
    assert cpu_models.interval([[0.9, 0.91]] * 9 + [[1.3, 1.4]]) == (0.905, 0.91)
    low, high = cpu_models.interval([[0.9, 0.91]] * 6 + [[1.3, 1.4]] * 4)
    assert low <= 0.91 and high >= 1.3


def test_cpu_faults_counts_each_variants_page_faults() -> None:
    """benchmarks/cpu_faults.py's process: each variant's median page faults and step time."""
    import cpu_faults

    got = cpu_faults.one_process(steps=1, rows_full=None, quick=True)
    assert set(got) == set(cpu_faults.VARIANTS)
    assert all(float(r["faults"]) >= 0 and float(r["ms"]) > 0 for r in got.values())  # type: ignore[arg-type]
