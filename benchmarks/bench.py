"""Attention throughput and memory: our backends vs torch's fused SDPA vs the seeds' naive formula.

    .venv/bin/python benchmarks/bench.py            # L = 512 … 16384 (takes a while)
    .venv/bin/python benchmarks/bench.py --quick    # L = 512 … 4096, fewer repeats, no memory

B = 1, H = 8, D = 64, float32 by default; forward and forward+backward, full and causal. Prints a
table, writes JSON and a log-log PNG of time and memory against L (see ``attnzero.bench`` for how
each number is measured: interleaved medians, ratios from the same run, peak memory in a fresh
subprocess).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from attnzero import bench

FULL = [512, 1024, 2048, 4096, 8192, 16384]
QUICK = [512, 1024, 2048, 4096]


def table(rows: Sequence[bench.Row]) -> str:
    """A markdown table (it reads fine on a terminal and pastes into docs/benchmarks.md)."""
    head = "| L | pass | mask | impl | ms | GFLOP/s | × torch | peak extra MB | note |"
    lines = [head, "|---:|:--|:--|:--|---:|---:|---:|---:|:--|"]
    for r in rows:
        lines.append(
            f"| {r.L} | {r.mode} | {r.mask} | {r.impl} | "
            + (f"{r.seconds * 1e3:.1f}" if r.seconds is not None else "–")
            + " | "
            + (f"{r.gflops:.1f}" if r.gflops is not None else "–")
            + " | "
            + (f"{r.vs_torch:.3f}" if r.vs_torch is not None else "")
            + " | "
            + (f"{r.peak_mb:.0f}" if r.peak_mb is not None else "")
            + f" | {r.note} |"
        )
    return "\n".join(lines)


def plot(rows: Sequence[bench.Row], path: Path) -> None:
    """Log-log time and memory against L, one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("fwd", "full"), ("fwd", "causal"), ("fwd+bwd", "full"), ("fwd+bwd", "causal")]
    fig, axes = plt.subplots(1, 5, figsize=(22, 4.2))
    impls = sorted({r.impl for r in rows})
    for ax, (mode, mask) in zip(axes, panels):
        for impl in impls:
            pts = [(r.L, r.seconds) for r in rows if r.impl == impl and r.mode == mode and r.mask == mask and r.seconds]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set(xscale="log", yscale="log", xlabel="L", ylabel="seconds", title=f"time, {mode}, {mask}")
        ax.grid(True, which="both", alpha=0.3)
    ax = axes[-1]
    for impl in impls:
        for mode, style in (("fwd", "-"), ("fwd+bwd", "--")):
            pts = [(r.L, r.peak_mb) for r in rows if r.impl == impl and r.mode == mode and r.peak_mb]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", label=f"{impl} {mode}")
    ax.set(xscale="log", yscale="log", xlabel="L", ylabel="MB", title="extra peak memory (full)")
    ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    if ax.get_legend_handles_labels()[0]:  # no memory lines after --no-memory
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="L up to 4096, 3 repeats, no memory")
    ap.add_argument("--lengths", type=int, nargs="+", help="sequence lengths (default 512 … 16384)")
    ap.add_argument("--impls", nargs="+", default=list(bench.IMPLS), choices=bench.IMPLS)
    ap.add_argument("--repeats", type=int, help="timed repeats per case (median reported)")
    ap.add_argument("--no-memory", action="store_true", help="skip the subprocess memory measurements")
    ap.add_argument("--fwd-only", action="store_true", help="forward only")
    ap.add_argument("--causal-only", action="store_true", help="causal only")
    ap.add_argument("--full-only", action="store_true", help="full (non-causal) only")
    ap.add_argument("--out", type=Path, default=Path("out/bench"), help="folder for JSON and PNG (out/ is git-ignored)")
    args = ap.parse_args(argv)

    lengths = args.lengths or (QUICK if args.quick else FULL)
    repeats = args.repeats or (3 if args.quick else 5)
    masks = [True] if args.causal_only else [False] if args.full_only else [False, True]
    info = bench.machine()
    print(f"# {info['cpu']}, {info['cores']}, torch {info['torch']}, {info['date']}", flush=True)
    rows = bench.sweep(
        lengths,
        args.impls,
        modes=[False] if args.fwd_only else [False, True],
        masks=masks,
        repeats=repeats,
        memory=not (args.quick or args.no_memory),
        log=lambda s: print(s, flush=True),
    )
    print()
    print(table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps({"machine": info, "rows": [asdict(r) for r in rows]}, indent=1))
    plot(rows, args.out / "bench.png")
    print(f"\nwrote {args.out / 'bench.json'} and {args.out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
