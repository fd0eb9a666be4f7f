"""Same-run A/B of the CPU runtime's optional pieces (``attnzero.parallel``):

* ``pause``: before the workers start, torch's spinning OpenMP threads are let go
  (``omp_pause_resource_all``; ``parallel.QUIET_OPENMP``); B = without it;
* ``kept``: each thread keeps its scratch buffers between calls; B = fresh buffers every call;
* ``one thread``: while the workers run, torch is set to 1 intra-op thread (process-wide, restored
  afterwards; ``parallel.ONE_THREAD_OPS``); B = each worker's ops on torch's intra-op threads.

Two tables: (1) the attention call alone at the shapes of benchmarks/shapes.py where flash runs on
its workers, each call after a little untimed model work on torch's threads; (2) a whole training
step (forward, backward, AdamW) of a 4-layer nanoGPT (B = 12, L = 256, d = 128, 4 heads), which also
counts what a piece costs the model's other ops. Each variant runs interleaved with the default
(every piece on), float32, ``backend="auto"``, the machine's torch threads; the tables give variant
time / default time (> 1: the variant is slower, so the piece pays). Results: docs/benchmarks.md
(a piece stays only where it gains >= 3%).

    .venv/bin/python benchmarks/runtime_ab.py [--repeats 15] [--cases gpt2 nanogpt] [--steps 15]
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
    saved = flash.arena, parallel.ONE_THREAD_OPS, parallel.QUIET_OPENMP
    if name == "no pause":
        parallel.QUIET_OPENMP = False
    elif name == "fresh scratch":
        flash.arena = lambda dtype, device: parallel.Arena(dtype, device)  # type: ignore[assignment]
    elif name == "ops on torch's threads":
        parallel.ONE_THREAD_OPS = False
    try:
        yield
    finally:
        flash.arena, parallel.ONE_THREAD_OPS, parallel.QUIET_OPENMP = saved


NAMES = ("default", "no pause", "fresh scratch", "ops on torch's threads")
_W = torch.randn(512, 512)


def model_work() -> None:
    """A projection's worth of torch work on the intra-op threads (a 512 × 512 matmul and a GELU),
    as a model runs between two attention calls: it leaves torch's OpenMP threads as a real call
    finds them, whichever variant ran before."""
    torch.nn.functional.gelu(_W @ _W)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=15, help="timed training steps per variant (0: none)")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=["bert", "gpt2", "llama", "nanogpt"])
    args = parser.parse_args()
    torch.manual_seed(0)
    info = machine()
    print(f"{info['date']} · {info['cpu']} · {info['cores']} · torch {info['torch']}")
    print("| case | default |" + "".join(f" {n} |" for n in NAMES[1:]) + "\n|---|---|" + "---|" * (len(NAMES) - 1))
    names = NAMES
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
    if args.steps:
        training_step(args.steps)


def training_step(steps: int) -> None:
    """Table (2): a whole nanoGPT training step per variant, interleaved step by step."""
    from compile import GPT  # benchmarks/compile.py's model

    torch.manual_seed(0)
    model = GPT(65, 256, 128, 4, 4, (0.0, 0.0), "auto")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx, target = torch.randint(0, 65, (12, 256)), torch.randint(0, 65, (12, 256))

    def step() -> None:
        loss = model(idx, target)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for name in NAMES:  # warm-up
        with variant(name):
            step()
    times: dict[str, list[float]] = {name: [] for name in NAMES}
    for _ in range(steps):
        for name in NAMES:
            with variant(name):
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print("\n| whole step | default |" + "".join(f" {n} |" for n in NAMES[1:]))
    print("|---|---|" + "---|" * (len(NAMES) - 1))
    cells = [f"{med['default'] * 1e3:.1f} ms"] + [f"{med[n] / med['default']:.3f}×" for n in NAMES[1:]]
    print("| nanoGPT, 4 layers, B=12, L=256 | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
