"""``attnzero tour``: a short walk-through of attnzero itself (no extra packages).

The seeds' example, a causal mask in both alignments, a fully-masked row, a check against torch's
``scaled_dot_product_attention`` and the seeds' ``MultiHeadAttention`` with its float mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import masks
from .functional import attention
from .modules import MultiHeadAttention, ScaledDotProductAttention


def main() -> int:
    """Print the tour; exit status 0, or 1 when attnzero and torch disagree."""
    torch.manual_seed(0)
    print("1. The seed's example: ScaledDotProductAttention(64) on (2, 10, 64) inputs")
    Q, K, V = (torch.randn(2, 10, 64) for _ in range(3))
    output, weights = ScaledDotProductAttention(64)(Q, K, V)
    print(f"   output {tuple(output.shape)}, weights {tuple(weights.shape)}, rows sum to "
          f"{weights.sum(-1).mean().item():.4f}")

    print("\n2. Causal masks (■ = may attend). attnzero's causal=True is bottom-right aligned:")
    print("   " + str(masks.causal(4, 6)).replace("\n", "\n   "))
    print("   torch's is_causal=True is top-left aligned:")
    print("   " + str(masks.causal(4, 6, align="top_left")).replace("\n", "\n   "))

    print("\n3. A query row with every key masked (here: row 0 of a padded batch)")
    q, k, v = (torch.randn(1, 1, 3, 8) for _ in range(3))
    keep = torch.tensor([[False, False, False], [True, True, False], [True, True, True]])
    scores = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(~keep, float("-inf"))
    seed_out = F.softmax(scores, dim=-1) @ v  # what the seeds' masked_fill + softmax does
    ours = attention(q, k, v, mask=keep)
    assert isinstance(ours, torch.Tensor)
    print(f"   seeds' masked_fill(-inf) + softmax, row 0: {seed_out[0, 0, 0, :4].tolist()}")
    print(f"   attnzero, row 0:                          {ours[0, 0, 0, :4].tolist()}")

    print("\n4. Against torch.nn.functional.scaled_dot_product_attention (float64, GQA, causal)")
    q = torch.randn(2, 8, 33, 64, dtype=torch.float64)
    k = torch.randn(2, 2, 40, 64, dtype=torch.float64)
    v = torch.randn(2, 2, 40, 64, dtype=torch.float64)
    ours = attention(q, k, v, mask=masks.causal(33, 40).to_tensor())
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=masks.causal(33, 40).to_tensor(), enable_gqa=True)
    assert isinstance(ours, torch.Tensor)
    err = (ours - theirs).abs().max().item()
    print(f"   max |attnzero - torch| = {err:.2e}  {'OK' if err < 1e-10 else 'MISMATCH'}")

    print("\n5. The seed's MultiHeadAttention(512, 8) with its float tril mask")
    mha = MultiHeadAttention(512, 8).eval()
    x = torch.randn(2, 10, 512)
    out = mha(x, x, x, mask=torch.tril(torch.ones(10, 10)).unsqueeze(0).unsqueeze(0))
    assert isinstance(out, torch.Tensor)
    print(f"   output {tuple(out.shape)}, finite: {bool(torch.isfinite(out).all())}")
    print("\nNext: `attnzero ladder` climbs from the seeds' code to the kernel, one checked step at a time;")
    print("`attnzero demo` runs a real model (all-MiniLM-L6-v2) through attnzero.")
    return 0 if err < 1e-10 else 1
