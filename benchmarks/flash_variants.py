"""Same-run A/B of the flash forward's two paths: the unshifted variant (tried first) against the
online softmax alone (``flash.block_sizes()``). CPU time of one thread, medians of
interleaved calls, float32. Results: docs/benchmarks.md.

    .venv/bin/python benchmarks/flash_variants.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attnzero import flash

CASES = [((1, 8, 4096, 64), True), ((4, 12, 1024, 64), True), ((8, 12, 512, 64), False), ((1, 8, 2048, 64), False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # thread_time of one thread: other processes on the machine count less
    print("| case | unshifted | online softmax only | time ratio |\n|---|---|---|---|")
    for (B, H, L, D), causal in CASES:
        q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
        kw = dict(mask=None, bias=None, causal=causal, window=None, scale=D**-0.5, dropout_p=0.0, dropout_seed=0)
        times: dict[bool, list[float]] = {True: [], False: []}
        with flash.block_sizes():
            for _ in range(args.repeats):
                for unshifted in (True, False):
                    with flash.block_sizes():
                        start = time.thread_time()
                        flash.forward(q, k, v, **kw)  # type: ignore[arg-type]
                        times[unshifted].append(time.thread_time() - start)
        a, b = statistics.median(times[True]), statistics.median(times[False])
        name = f"B={B}, H={H}, L={L}" + (", causal" if causal else "")
        print(f"| {name} | {a * 1e3:.1f} ms | {b * 1e3:.1f} ms | {b / a:.2f} |")


if __name__ == "__main__":
    main()
