"""Same-run A/B of the CPU runtime's two optional pieces (``attnzero.parallel``), at the shapes of
benchmarks/shapes.py where the flash backend runs on its worker threads:

* ``pause``: before the workers start, torch's OpenMP threads are told to stop spinning
  (``omp_pause_resource_all``); B = without it;
* ``kept``: each thread keeps its scratch buffers between calls; B = fresh buffers every call.

Each variant runs interleaved with the default (both pieces on), float32, ``backend="auto"``, the
machine's torch threads; the table gives variant time / default time (> 1: the variant is slower,
so the piece pays). Results: docs/benchmarks.md (a piece stays only where it gains >= 3%).

    .venv/bin/python benchmarks/runtime_ab.py [--repeats 15] [--cases gpt2 nanogpt]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from shapes import CASES, runs

from attnzero import flash, parallel
from attnzero.bench import machine


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """The runtime with one piece off (``name``), or as it is ("default")."""
    saved = parallel._quiet_openmp, flash.arena
    if name == "no pause":
        parallel._quiet_openmp = lambda: None
    elif name == "fresh scratch":
        flash.arena = lambda dtype, device: parallel.Arena(dtype, device)  # type: ignore[assignment]
    try:
        yield
    finally:
        parallel._quiet_openmp, flash.arena = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=["bert", "gpt2", "llama", "nanogpt"])
    args = parser.parse_args()
    torch.manual_seed(0)
    info = machine()
    print(f"{info['date']} · {info['cpu']} · {info['cores']} · torch {info['torch']}")
    names = ("default", "no pause", "fresh scratch")
    print("| case | default | no pause | fresh scratch |\n|---|---|---|---|")
    for key in args.cases:
        fn: Callable[[], None] = runs(CASES[key])["attnzero"]
        for name in names:  # warm-up
            with variant(name):
                fn()
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.repeats):
            for name in names:
                with variant(name):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        cells = [f"{med['default'] * 1e3:.1f} ms"] + [f"{med[n] / med['default']:.3f}×" for n in names[1:]]
        print(f"| {CASES[key].name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
