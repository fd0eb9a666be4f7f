"""Ring attention across processes: a long causal sequence split over the ranks, checked against
one process computing the whole sequence.

    torchrun --nproc-per-node 2 examples/ring_attention.py            # 2 processes, L = 16384
    torchrun --nproc-per-node 2 examples/ring_attention.py --length 4096 --layout contiguous

Every rank builds the same whole-sequence q, k, v (same seed), keeps only its slice
(``az.distributed.shard``), runs ``ring_attention`` forward and backward, and rank 0 compares the
gathered output and gradients with ``az.attention`` on the whole sequence in one process.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import attnzero as az


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=16384, help="whole sequence length L")
    parser.add_argument("--heads", type=int, default=4, help="query heads (key/value heads: half of them)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # one core per process

    # The whole sequence, identical on every rank (same seed); GQA with two query heads per K/V head.
    torch.manual_seed(0)
    B, Hq, Hkv, L, D = 1, args.heads, max(1, args.heads // 2), args.length, args.head_dim
    q, k, v = torch.randn(B, Hq, L, D), torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
    dout = torch.randn(B, Hq, L, D)

    # This rank's slice: (B, H, L / W, D). Only these slices take part in the ring.
    q_r, k_r, v_r = (az.distributed.shard(x, layout=args.layout).clone().requires_grad_(True) for x in (q, k, v))
    start = time.perf_counter()
    out_r = az.distributed.ring_attention(q_r, k_r, v_r, causal=True, layout=args.layout)
    out_r.backward(az.distributed.shard(dout, layout=args.layout))
    seconds = time.perf_counter() - start
    assert q_r.grad is not None and k_r.grad is not None and v_r.grad is not None

    # Gather the slices (every rank takes part), then rank 0 checks against one process.
    ring = {n: az.distributed.gather(t.detach(), layout=args.layout) for n, t in
            (("out", out_r), ("dq", q_r.grad), ("dk", k_r.grad), ("dv", v_r.grad))}  # fmt: skip
    if rank == 0:
        print(f"{world} processes, L = {L}, {args.layout}: ring forward + backward took {seconds:.2f} s")
        q1, k1, v1 = (x.clone().requires_grad_(True) for x in (q, k, v))
        start = time.perf_counter()
        out1 = az.attention(q1, k1, v1, causal=True, backend="flash")
        out1.backward(dout)
        print(f"1 process (this one, 1 thread): {time.perf_counter() - start:.2f} s")
        one = {"out": out1, "dq": q1.grad, "dk": k1.grad, "dv": v1.grad}
        for name, want in one.items():
            assert want is not None
            err = (ring[name] - want).abs().max().item()
            print(f"  {name}: max |ring - one process| = {err:.2e}")
            torch.testing.assert_close(ring[name], want, rtol=1e-4, atol=1e-4)
        print("ring attention matches one process")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
