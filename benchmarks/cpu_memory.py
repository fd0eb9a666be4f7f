"""The extra memory of a long forward: B1 H8 L16384 D64, float32, inference, causal and full,
attnzero (``backend="auto"``: the compiled kernel) against torch's SDPA. Measured as tests/test_memory.py
does (``attnzero.bench.peak_memory_mb``): the peak resident memory of one call above what was resident
before it (the inputs), each in a fresh subprocess, after a warm-up at a small length. Linux only.

    .venv/bin/python benchmarks/cpu_kernel.py --only memory [--busy] [--quick]
"""

from __future__ import annotations

from collections.abc import Iterator

from harness import table

from attnzero.bench import Case, peak_memory_mb

B, H, D = 1, 8, 64


def section(quick: bool) -> Iterator[str]:
    L = 2048 if quick else 16384
    yield f"extra peak memory of one forward above its inputs, B{B} H{H} L{L} D{D}, float32 (fresh process each)"
    yield ""

    def cells() -> Iterator[list[str]]:
        for causal in (True, False):
            mb = {impl: peak_memory_mb(Case(impl, L, causal, False, B, H, D)) for impl in ("auto", "torch")}
            ours, theirs = mb["auto"], mb["torch"]
            mask = "causal" if causal else "full"
            if ours is None or theirs is None:
                yield [mask, "–", "–", "no /proc/self/clear_refs (not Linux)"]
                continue
            yield [mask, f"{ours:.1f}", f"{theirs:.1f}", f"{ours / max(theirs, 1e-9):.2f}"]

    yield from table(["mask", "attnzero MB", "torch SDPA MB", "attnzero ÷ torch"], cells())
