"""Scaling efficiency of ring attention on this machine's CPUs (gloo).

    efficiency = T(1 process, 1 thread, whole sequence) / (W · T(W processes, 1 thread each))

1.0 means W processes finish the whole sequence W times faster than one. T(1) is the flash backend
on the whole sequence (``az.attention(..., backend="flash")``); T(W) is ``ring_attention`` with
the zigzag layout, timed from a barrier to the slowest rank's finish. Both run the same causal
attention, B = 1, H heads, head dim D: forward FLOPs = 4·B·H·L²·D·0.5 (MATH.md), forward+backward
≈ 3.5× that. Medians over the repeats; run with nothing else on the cores, or read it knowing what
else was running (the load average is printed).

    .venv/bin/python benchmarks/ring.py                      # L = 8192, W = 2, forward and fwd+bwd
    .venv/bin/python benchmarks/ring.py --length 4096 --world 2 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import attnzero as az

ROOT = Path(__file__).resolve().parents[1]


def inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whole-sequence q, k, v (B, H, L, D) and an output gradient, the same in every process."""
    torch.manual_seed(0)
    shape = (1, args.heads, args.length, args.head_dim)
    return torch.randn(shape), torch.randn(shape), torch.randn(shape), torch.randn(shape)


def timed(fn: Any, repeats: int, sync: Any = None) -> list[tuple[float, float]]:
    """(wall seconds, CPU seconds of this process, all its threads) of ``fn()`` per repeat, after one
    warm-up call (``sync()`` before each start)."""
    fn()
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    return times


def one_process(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    torch.set_num_threads(1)
    q, k, v, dout = inputs(args)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)

    def fwd() -> None:
        with torch.no_grad():
            az.attention(q, k, v, causal=True, backend="flash")

    def fwd_bwd() -> None:
        out = az.attention(q, k, v, causal=True, backend="flash")
        assert isinstance(out, torch.Tensor)
        torch.autograd.grad(out, (q, k, v), dout)

    return {"forward": timed(fwd, args.repeats), "forward+backward": timed(fwd_bwd, args.repeats)}


def ring_worker(args: argparse.Namespace) -> None:
    """One rank of the ring (run by :func:`ring`); prints its times as JSON."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=600),
    )
    D = az.distributed
    q, k, v, dout = (D.shard(x, layout="zigzag").contiguous() for x in inputs(args))  # (1, H, L/W, D)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)

    def fwd() -> None:
        with torch.no_grad():
            D.ring_attention(q, k, v, causal=True, layout="zigzag")

    def fwd_bwd() -> None:
        out = D.ring_attention(q, k, v, causal=True, layout="zigzag")
        torch.autograd.grad(out, (q, k, v), dout)

    times = {
        "forward": timed(fwd, args.repeats, dist.barrier),
        "forward+backward": timed(fwd_bwd, args.repeats, dist.barrier),
    }
    print(json.dumps(times), flush=True)
    dist.destroy_process_group()


def ring(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """Launch ``args.world`` ranks; per repeat, the slowest rank's wall and CPU time."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    common = [sys.executable, __file__, "--length", str(args.length), "--heads", str(args.heads),
              "--head-dim", str(args.head_dim), "--repeats", str(args.repeats), "--world", str(args.world),
              "--port", str(port)]  # fmt: skip
    procs = [
        subprocess.Popen([*common, "--rank", str(r)], env=env, stdout=subprocess.PIPE, text=True)
        for r in range(args.world)
    ]
    per_rank = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"a ring rank failed (exit {p.returncode})")
        per_rank.append(json.loads(out.strip().splitlines()[-1]))
    return {
        key: [(max(r[key][i][0] for r in per_rank), max(r[key][i][1] for r in per_rank)) for i in range(args.repeats)]
        for key in per_rank[0]
    }


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} logical CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        ring_worker(args)
        return

    L, H, Dh, W = args.length, args.heads, args.head_dim, args.world
    flops = 4 * H * L * L * Dh * 0.5  # forward, causal
    print(f"# ring attention scaling, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"# {machine()}; torch {torch.__version__}; load average before: {os.getloadavg()[0]:.2f}")
    print(f"# causal, zigzag, B=1, H={H}, D={Dh}, L={L}, W={W}, {args.repeats} repeats (medians)")
    t1 = one_process(args)
    tw = ring(args)
    print(f"# load average after: {os.getloadavg()[0]:.2f}")
    print("| pass | T(1) s | T(W) s | efficiency T1/(W·TW) | CPU s 1 / W (slowest rank) | CPU-time efficiency |")
    print("|---|---|---|---|---|---|")
    for key in ("forward", "forward+backward"):
        a, b = (statistics.median(t[0] for t in ts[key]) for ts in (t1, tw))
        ca, cb = (statistics.median(t[1] for t in ts[key]) for ts in (t1, tw))
        print(f"| {key} | {a:.3f} | {b:.3f} | {a / (W * b):.2f} | {ca:.3f} / {cb:.3f} | {ca / (W * cb):.2f} |")
    print(f"# forward {flops / 1e9:.1f} GFLOP (forward+backward ≈ 3.5×)")
    print(f"# all times (s): one process {json.dumps(t1)}; ring {json.dumps(tw)}")


if __name__ == "__main__":
    main()
