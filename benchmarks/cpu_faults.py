"""Page faults of a ViT-Tiny forward (``cpu_models.py``'s model, batch 8), per step and per variant:
how often glibc's heap hands pages back and the next step faults them in again, with torch's SDPA,
attnzero's drop-in and no attention taking turns step by step as in ``cpu_models.py``'s rows.

Each process prints one JSON line: per variant, the median minor page faults of a forward (and the
first steps' counts) and the median step time. Counts do not depend on the machine's load, times do.
``--rows-full N`` sets the kernel's query rows per block for a full (non-causal) call
(``cpu_kernel.BLOCK_ROWS_FULL``: the call's work memory scales with it).

    .venv/bin/python benchmarks/cpu_faults.py [--processes 8] [--steps 9] [--rows-full 256]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from cpu_models import use, vit

VARIANTS = ("torch", "dropin", "none")  # cpu_models.py's switches: torch's SDPA, attnzero's drop-in, no attention


def one_process(steps: int, rows_full: int | None, quick: bool = False) -> dict[str, dict[str, object]]:
    """In this process: each variant's faults and times over ``steps`` rotated rounds (2 warm-ups);
    ``quick``: cpu_models.py's small ViT (tests)."""
    from attnzero import cpu_kernel

    if rows_full is not None:
        cpu_kernel.BLOCK_ROWS_FULL = rows_full
    torch.manual_seed(0)
    _, model, step = vit(quick, False)
    faults: dict[str, list[int]] = {m: [] for m in VARIANTS}
    times: dict[str, list[float]] = {m: [] for m in VARIANTS}
    for r in range(steps + 2):
        for i in range(len(VARIANTS)):
            m = VARIANTS[(i + r) % len(VARIANTS)]
            use(model, m)
            f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            step()
            t1, f1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if r >= 2:
                faults[m].append(f1 - f0)
                times[m].append((t1 - t0) * 1e3)
    return {
        m: {"faults": statistics.median(faults[m]), "first": faults[m][:6], "ms": round(statistics.median(times[m]), 1)}
        for m in VARIANTS
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--rows-full", type=int, default=None)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (a child process)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_process(args.steps, args.rows_full)))
        return
    me = [sys.executable, str(Path(__file__).resolve()), "--one", "--steps", str(args.steps)]
    me += [] if args.rows_full is None else ["--rows-full", str(args.rows_full)]
    print("| process | torch faults | attnzero faults | no attention faults | attnzero ÷ torch (time) |")
    print("|---|---|---|---|---|")
    for p in range(args.processes):
        got = json.loads(subprocess.run(me, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        ratio = float(got["dropin"]["ms"]) / float(got["torch"]["ms"])  # type: ignore[arg-type]
        print(f"| {p + 1} | {got['torch']['faults']:.0f} | {got['dropin']['faults']:.0f} | "
              f"{got['none']['faults']:.0f} | {ratio:.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
