"""Same-run A/B of the CPU runtime's optional pieces (``attnzero.parallel``), at the shapes of
benchmarks/shapes.py where the flash backend runs on its worker threads:

* ``kept``: each thread keeps its scratch buffers between calls; B = fresh buffers every call;
* ``one thread``: while the workers run, torch is set to 1 intra-op thread (process-wide, restored
  afterwards); B = each worker's ops on torch's intra-op threads.

Each variant runs interleaved with the default (every piece on), float32, ``backend="auto"``, the
machine's torch threads, each call after a little untimed model work on torch's threads; the table
gives variant time / default time (> 1: the variant is slower, so the piece pays). Results:
docs/benchmarks.md (a piece stays only where it gains >= 3%). A third piece, releasing torch's
spinning OpenMP threads before the workers start (``omp_pause_resource_all``), was measured here too
and removed: with model work between calls it gained nothing (0.94–1.01×).

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
    saved = flash.arena, parallel.ONE_THREAD_OPS
    if name == "fresh scratch":
        flash.arena = lambda dtype, device: parallel.Arena(dtype, device)  # type: ignore[assignment]
    elif name == "ops on torch's threads":
        parallel.ONE_THREAD_OPS = False
    try:
        yield
    finally:
        flash.arena, parallel.ONE_THREAD_OPS = saved


_W = torch.randn(512, 512)


def model_work() -> None:
    """A projection's worth of torch work on the intra-op threads (a 512 × 512 matmul and a GELU),
    as a model runs between two attention calls: it leaves torch's OpenMP threads as a real call
    finds them, whichever variant ran before."""
    torch.nn.functional.gelu(_W @ _W)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=["bert", "gpt2", "llama", "nanogpt"])
    args = parser.parse_args()
    torch.manual_seed(0)
    info = machine()
    print(f"{info['date']} · {info['cpu']} · {info['cores']} · torch {info['torch']}")
    names = ("default", "fresh scratch", "ops on torch's threads")
    print("| case | default | fresh scratch | ops on torch's threads |\n|---|---|---|---|")
    for key in args.cases:
        fn: Callable[[], None] = runs(CASES[key])["attnzero"]
        for name in names:  # warm-up
            with variant(name):
                fn()
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.repeats):
            for name in names:
                with variant(name):
                    model_work()  # untimed: what a model runs between two attention calls
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        cells = [f"{med['default'] * 1e3:.1f} ms"] + [f"{med[n] / med['default']:.3f}×" for n in names[1:]]
        print(f"| {CASES[key].name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
