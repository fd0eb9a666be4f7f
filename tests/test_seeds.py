"""The seeds, run as written (tests/seeds/), and the seeds' own classes side by side with attnzero.

The two classes below are the seeds' code, copied verbatim from ../shared/seeds/ (000: the blog
post's MultiHeadAttention; 002: the page's ScaledDotProductAttention), so that attnzero is checked
against exactly what the seeds compute wherever the seeds do not produce NaN.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import attnzero as az

SEEDS = Path(__file__).parent / "seeds"


# ---------------------------------------------------------------------------------------------
# Seed 000's class, verbatim.
class MultiHeadAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.1):
        super().__init__()
        assert d_model % num_heads == 0, "d_model must be divisible by num_heads"

        self.d_model = d_model
        self.num_heads = num_heads
        self.d_k = d_model // num_heads  # 每个头的维度

        # Q、K、V 的线性投影
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, d_model)
        self.W_v = nn.Linear(d_model, d_model)

        # 最后的输出投影
        self.W_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch_size = query.size(0)

        # 1. 线性投影 + 拆成多头
        # (batch, seq_len, d_model) → (batch, num_heads, seq_len, d_k)
        Q = self.W_q(query).view(batch_size, -1, self.num_heads, self.d_k).transpose(1, 2)
        K = self.W_k(key).view(batch_size, -1, self.num_heads, self.d_k).transpose(1, 2)
        V = self.W_v(value).view(batch_size, -1, self.num_heads, self.d_k).transpose(1, 2)

        # 2. Scaled Dot-Product Attention
        scores = torch.matmul(Q, K.transpose(-2, -1)) / math.sqrt(self.d_k)

        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))

        attn_weights = F.softmax(scores, dim=-1)
        attn_weights = self.dropout(attn_weights)

        # 3. 加权求和
        attn_output = torch.matmul(attn_weights, V)

        # 4. 合并多头 + 最终投影
        # (batch, num_heads, seq_len, d_k) → (batch, seq_len, d_model)
        attn_output = attn_output.transpose(1, 2).contiguous().view(
            batch_size, -1, self.d_model
        )
        output = self.W_o(attn_output)

        return output


# Seed 002's class, verbatim.
class ScaledDotProductAttention(nn.Module):
    def __init__(self, d_k=64):
        super().__init__()
        self.d_k = d_k

    def forward(self, Q, K, V, mask=None):
        """
        Q, K, V: (batch_size, seq_len, d_k)
        """
        # 1. 计算注意力分数
        scores = torch.matmul(Q, K.transpose(-2, -1))  # (B, L, L)

        # 2. 缩放
        scores = scores / math.sqrt(self.d_k)

        # 3. Mask（可选，Decoder 中用于遮挡未来位置）
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float('-inf'))

        # 4. Softmax
        attn_weights = F.softmax(scores, dim=-1)

        # 5. 加权求和
        output = torch.matmul(attn_weights, V)  # (B, L, d_k)

        return output, attn_weights


# ---------------------------------------------------------------------------------------------
# The seeds' programs, run as written


def run_seed(name: str) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONIOENCODING="utf-8")
    done = subprocess.run(
        [sys.executable, str(SEEDS / name)], capture_output=True, text=True, encoding="utf-8", env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_seed_000_test_program_runs() -> None:
    assert run_seed("seed_000_test_attention.py").strip() == "✅ All tests passed!"


def test_seed_002_usage_example_prints_its_shapes() -> None:
    lines = run_seed("seed_002_usage_example.py").strip().splitlines()
    assert lines == ["输出形状: torch.Size([2, 10, 64])", "注意力权重形状: torch.Size([2, 10, 10])"]


def test_seed_000_test_function_in_process() -> None:
    spec = importlib.util.spec_from_file_location("seed_000", SEEDS / "seed_000_test_attention.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.MultiHeadAttention is az.MultiHeadAttention
    out, out_masked = mod.test_attention()
    assert out.shape == out_masked.shape == (2, 10, 512)
    assert torch.isfinite(out).all() and torch.isfinite(out_masked).all()


# ---------------------------------------------------------------------------------------------
# The seeds' classes and attnzero on the same weights


def seed_and_ours(d_model: int = 512, num_heads: int = 8) -> tuple[MultiHeadAttention, az.MultiHeadAttention]:
    seed = MultiHeadAttention(d_model, num_heads).eval()
    ours = az.MultiHeadAttention(d_model, num_heads).eval()
    ours.load_state_dict(seed.state_dict())  # the same names: W_q, W_k, W_v, W_o
    return seed, ours


def test_seed_000_side_by_side() -> None:
    seed, ours = seed_and_ours()
    x = torch.randn(2, 10, 512)
    torch.testing.assert_close(ours(x, x, x), seed(x, x, x), rtol=1e-5, atol=1e-6)
    causal_mask = torch.tril(torch.ones(10, 10)).unsqueeze(0).unsqueeze(0)  # the seed's float mask
    torch.testing.assert_close(ours(x, x, x, mask=causal_mask), seed(x, x, x, mask=causal_mask), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours(x, causal=True), seed(x, x, x, mask=causal_mask), rtol=1e-5, atol=1e-6)
    # Cross-attention and a per-batch padding mask (B, 1, 1, Lk).
    mem = torch.randn(2, 7, 512)
    pad = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]]).view(2, 1, 1, 7)
    torch.testing.assert_close(ours(x, mem, mem, mask=pad), seed(x, mem, mem, mask=pad), rtol=1e-5, atol=1e-6)


def test_seed_000_fully_masked_row_is_nan_in_the_seed_and_zero_here() -> None:
    seed, ours = seed_and_ours(64, 4)
    x = torch.randn(2, 6, 64)
    mask = torch.tril(torch.ones(6, 6)).unsqueeze(0).unsqueeze(0).repeat(2, 1, 1, 1)
    mask[1, 0, 2] = 0  # batch 1, query 2: nothing to attend to
    theirs = seed(x, x, x, mask=mask)
    mine = ours(x, x, x, mask=mask)
    nan_rows = torch.isnan(theirs).any(-1)
    assert nan_rows[1, 2] and nan_rows.sum() == 1  # the seed's NaN
    assert torch.isfinite(mine).all()
    torch.testing.assert_close(mine[~nan_rows], theirs[~nan_rows], rtol=1e-5, atol=1e-6)
    # attnzero's blocked row: attention output 0, so the module returns W_o's bias.
    torch.testing.assert_close(mine[1, 2], ours.W_o.bias.detach(), rtol=0, atol=0)


def test_seed_002_side_by_side() -> None:
    seed, ours = ScaledDotProductAttention(64), az.ScaledDotProductAttention(64)
    Q, K, V = torch.randn(2, 10, 64), torch.randn(2, 10, 64), torch.randn(2, 10, 64)
    for mask in (None, torch.tril(torch.ones(10, 10)), torch.rand(2, 10, 10) < 0.8):
        if mask is not None:
            mask[..., 0] = 1  # no fully masked row (the seed would give NaN there)
        (o1, w1), (o2, w2) = ours(Q, K, V, mask), seed(Q, K, V, mask)
        torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w1, w2, rtol=1e-5, atol=1e-6)
    # 4-D inputs work with both (matmul broadcasts); d_k of the constructor sets the scale in both.
    Q4, K4, V4 = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 7, 16), torch.randn(2, 3, 7, 4)
    torch.testing.assert_close(
        az.ScaledDotProductAttention(64)(Q4, K4, V4)[0], ScaledDotProductAttention(64)(Q4, K4, V4)[0]
    )
    # A fully masked row: NaN in the seed, 0 in attnzero, the same elsewhere.
    m = torch.tril(torch.ones(10, 10))
    m[4] = 0
    (o1, w1), (o2, w2) = ours(Q, K, V, m), seed(Q, K, V, m)
    assert torch.isnan(o2[:, 4]).all() and not o1[:, 4].any() and not w1[:, 4].any()
    keep = torch.arange(10) != 4
    torch.testing.assert_close(o1[:, keep], o2[:, keep], rtol=1e-5, atol=1e-6)
