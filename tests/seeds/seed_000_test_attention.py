# Seed 000 (../../../shared/seeds/000_*.txt): the blog post's test program, run as written.
# Every line below is the seed's own, except that its MultiHeadAttention class definition is
# replaced by the import from attnzero.
# ruff: noqa: F401, I001
import torch
import torch.nn as nn
import torch.nn.functional as F
import math

from attnzero import MultiHeadAttention


def test_attention():
    d_model = 512
    num_heads = 8
    seq_len = 10
    batch_size = 2

    mha = MultiHeadAttention(d_model, num_heads)
    x = torch.randn(batch_size, seq_len, d_model)

    # 1. 自注意力：Q=K=V
    out = mha(x, x, x)
    assert out.shape == (batch_size, seq_len, d_model), f"Shape mismatch: {out.shape}"

    # 2. 因果 mask：每个位置只能看到自己及之前
    causal_mask = torch.tril(torch.ones(seq_len, seq_len)).unsqueeze(0).unsqueeze(0)
    out_masked = mha(x, x, x, mask=causal_mask)
    assert out_masked.shape == (batch_size, seq_len, d_model)

    print("✅ All tests passed!")
    return out, out_masked


if __name__ == "__main__":
    test_attention()
