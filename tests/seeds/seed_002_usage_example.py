# Seed 002 (../../../shared/seeds/002_*.txt): the page's usage example, run as written.
# Every line below is the seed's own, except that its ScaledDotProductAttention class definition
# is replaced by the import from attnzero.
# ruff: noqa: F401, I001
import torch
import torch.nn as nn
import torch.nn.functional as F
import math

from attnzero import ScaledDotProductAttention


# 使用示例
d_k = 64
batch_size, seq_len = 2, 10
attn = ScaledDotProductAttention(d_k)

Q = torch.randn(batch_size, seq_len, d_k)
K = torch.randn(batch_size, seq_len, d_k)
V = torch.randn(batch_size, seq_len, d_k)

output, weights = attn(Q, K, V)
print(f"输出形状: {output.shape}")   # (2, 10, 64)
print(f"注意力权重形状: {weights.shape}")  # (2, 10, 10)
