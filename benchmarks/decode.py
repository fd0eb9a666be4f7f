"""Decode cost per token: one step of ``MultiHeadAttention`` with a KV cache vs full recompute.

    .venv/bin/python benchmarks/decode.py                      # lengths 128 .. 4096, markdown table
    .venv/bin/python benchmarks/decode.py --lengths 128 256 --repeats 3 --threads 1

A decode step produces the output of one new token at position L (L tokens before it):

* with the cache: project the one token, append its key/value, attend 1 query over L + 1 keys —
  attention costs 4·H·(L+1)·D FLOPs, O(L), and the projections 8·d_model² do not grow with L;
* full recompute: run the layer over all L + 1 tokens again (causal) and keep the last row —
  attention costs 4·H·(L+1)²·D / 2 FLOPs (causal half), O(L²), plus 8·(L+1)·d_model² projections.

The table gives the median CPU time of a step (and its wall time, which on a shared machine also
counts waiting for a core), steps/s from the CPU time, and the growth factor from the previous
length (×2 tokens): about 1 while the cached step is dominated by fixed costs (the projections), at
most ~2 for O(L), approaching 4 for O(L²).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

import attnzero as az


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def median_time(
    fn: Callable[[], object], repeats: int, reset: Callable[[], None] = lambda: None
) -> tuple[float, float]:
    """Median (CPU seconds, wall seconds) of ``fn()`` over ``repeats`` runs after one warm-up;
    ``reset()`` runs before each call, untimed. CPU time is the process's, so it leaves out the time
    the process waits for a core on a shared machine; wall time includes it."""
    reset()
    fn()
    cpu, wall = [], []
    for _ in range(repeats):
        reset()
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steady numbers on a shared machine)")
    p.add_argument("--backend", default="auto", choices=az.functional.BACKENDS)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    m = az.MultiHeadAttention(
        args.d_model, args.heads, 0.0, num_kv_heads=args.kv_heads, rope=True, backend=args.backend
    ).to(dtype).eval()
    B, Hkv, D = args.batch, m.num_kv_heads, m.d_k
    max_len = max(args.lengths) + 1
    cache = az.KVCache(B, max_len, Hkv, D, dtype=dtype)
    k_fill = torch.randn(B, Hkv, max_len, D, dtype=dtype)  # stands for the keys/values of a prompt
    v_fill = torch.randn(B, Hkv, max_len, D, dtype=dtype)

    print(f"# decode.py — {cpu_model()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"{datetime.date.today().isoformat()}")
    print(f"# MultiHeadAttention(d_model={args.d_model}, heads={args.heads}, kv_heads={Hkv}, rope=True, "
          f"backend={args.backend!r}), batch {B}, {args.dtype}, median of {10 * args.repeats} cached / "
          f"{args.repeats} recomputed steps")
    print()
    print("| context L | cached step CPU (ms) | cached steps/s | ×prev | wall (ms) "
          "| recompute step CPU (ms) | recompute steps/s | ×prev | wall (ms) | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    prev: tuple[float, float] | None = None
    with torch.no_grad():
        for L in args.lengths:
            x_new = torch.randn(B, 1, args.d_model, dtype=dtype)
            x_all = torch.randn(B, L + 1, args.d_model, dtype=dtype)

            def refill(L: int = L) -> None:
                cache.reset()
                cache.update(k_fill[:, :, :L], v_fill[:, :, :L])  # L tokens already cached

            c_cache, w_cache = median_time(lambda x=x_new: m(x, cache=cache), 10 * args.repeats, refill)
            c_full, w_full = median_time(lambda x=x_all: m(x, causal=True)[:, -1], args.repeats)
            g_cache = f"{c_cache / prev[0]:.2f}" if prev else ""
            g_full = f"{c_full / prev[1]:.2f}" if prev else ""
            print(f"| {L} | {c_cache * 1e3:.3f} | {1 / c_cache:,.0f} | {g_cache} | {w_cache * 1e3:.3f} "
                  f"| {c_full * 1e3:.1f} | {1 / c_full:,.1f} | {g_full} | {w_full * 1e3:.1f} "
                  f"| {c_full / c_cache:,.0f}× |", flush=True)
            prev = (c_cache, c_full)

if __name__ == "__main__":
    main()
