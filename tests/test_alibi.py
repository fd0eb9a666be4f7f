"""ALiBi (Press et al. 2022): ``az.masks.alibi`` against the paper's slopes for any head count and
bottom-right positions, and passed as ``bias=`` on every backend."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import BACKENDS, DTYPE_IDS, DTYPES, check_against_golden, dense_keep, naive_attention

import attnzero as az


def paper_slopes(n: int) -> list[float]:
    """The paper's recipe, written from its description: for n a power of two, the geometric
    sequence that starts at 2^(-8/n) with that same ratio; otherwise the slopes of the nearest
    smaller power of two m, then every other slope of 2m."""

    def power_of_two(m: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(m) - 3)))  # = 2^(-8/m)
        return [start * start**i for i in range(m)]

    if math.log2(n).is_integer():
        return power_of_two(n)
    m = 2 ** int(math.log2(n))
    return power_of_two(m) + power_of_two(2 * m)[0::2][: n - m]


def test_slopes_known_values() -> None:
    """The paper's examples: 8 heads → 1/2, 1/4, …, 1/256; 16 heads → 1/√2, 1/2, …, 1/256."""
    torch.testing.assert_close(az.masks.alibi_slopes(8), torch.tensor([2.0**-i for i in range(1, 9)]))
    torch.testing.assert_close(az.masks.alibi_slopes(16), torch.tensor([2.0 ** (-i / 2) for i in range(1, 17)]))
    # 12 heads: the 8 slopes of 8 heads, then slopes 1, 3, 5, 7 (1-based) of 16 heads' sequence
    want12 = [2.0**-i for i in range(1, 9)] + [2.0 ** (-i / 2) for i in (1, 3, 5, 7)]
    torch.testing.assert_close(az.masks.alibi_slopes(12), torch.tensor(want12))


@pytest.mark.parametrize("n", range(1, 41))
def test_slopes_any_head_count(n: int) -> None:
    got = az.masks.alibi_slopes(n)
    assert got.shape == (n,) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(paper_slopes(n), dtype=torch.float32), rtol=1e-7, atol=0)
    assert len(set(got.tolist())) == n  # every head its own slope
    assert bool((got > 0).all() and (got < 1).all())


@pytest.mark.parametrize(("H", "Lq", "Lk"), [(1, 1, 1), (8, 5, 5), (6, 3, 11), (12, 1, 17), (5, 7, 4)])
def test_bias_bottom_right_positions(H: int, Lq: int, Lk: int) -> None:
    bias = az.masks.alibi(H, Lq, Lk)
    assert bias.shape == (1, H, Lq, Lk) and bias.dtype == torch.float32
    slopes = paper_slopes(H)
    for h in range(H):
        for i in range(Lq):
            p = i + Lk - Lq  # bottom-right: the last query sits at the last key
            for j in range(Lk):
                assert float(bias[0, h, i, j]) == pytest.approx(-slopes[h] * abs(p - j), rel=1e-6)


def test_one_query_row_of_a_decode_step_is_the_last_row_of_the_full_bias() -> None:
    """What a KV cache needs: the bias of the newest token over all cached keys."""
    full = az.masks.alibi(8, 20, 20)
    torch.testing.assert_close(az.masks.alibi(8, 1, 20), full[:, :, -1:], rtol=0, atol=0)
    torch.testing.assert_close(az.masks.alibi(8, 4, 20), full[:, :, -4:], rtol=0, atol=0)
    assert torch.equal(az.masks.alibi(8, 20), full)  # kv_len defaults to q_len


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_heads: expected a positive int, got 0"):
        az.masks.alibi(0, 4, 4)
    with pytest.raises(ValueError, match="q_len: expected a positive int"):
        az.masks.alibi(4, -1, 4)
    with pytest.raises(ValueError, match="kv_len: expected a positive int"):
        az.masks.alibi(4, 4, 2.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    ("B", "Hq", "Hkv", "Lq", "Lk", "D", "causal"),
    [
        (2, 8, 8, 17, 17, 64, True),  # a power of two, causal
        (1, 6, 2, 1, 113, 40, True),  # GQA, non-power of two, one decode step
        (1, 12, 4, 33, 70, 96, False),  # Lq < Lk, non-causal (symmetric |p - j|)
        (1, 5, 1, 113, 113, 8, True),  # MQA, 5 heads
    ],
)
def test_alibi_as_bias_on_every_backend(
    backend: str, dtype: torch.dtype, B: int, Hq: int, Hkv: int, Lq: int, Lk: int, D: int, causal: bool
) -> None:
    """Golden comparison with the tolerance rule (outputs, lse, and gradients including the bias's),
    the golden itself checked against a naive attention that adds the bias by hand."""
    q = torch.randn(B, Hq, Lq, D, dtype=torch.float64)
    k = torch.randn(B, Hkv, Lk, D, dtype=torch.float64)
    v = torch.randn(B, Hkv, Lk, D, dtype=torch.float64)
    bias = az.masks.alibi(Hq, Lq, Lk).to(torch.float64)
    keep = dense_keep(Lq, Lk, causal=causal)

    def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return naive_attention(q, k, v, keep=keep, bias=b)

    check_against_golden(backend, dtype, q, k, v, bias=bias, causal=causal, naive=naive)


def test_alibi_changes_the_output() -> None:
    """A sanity check that the bias reaches the scores: nearby keys get more weight."""
    q = torch.zeros(1, 4, 1, 8, dtype=torch.float64)  # equal scores without a bias
    k = torch.randn(1, 4, 10, 8, dtype=torch.float64)
    w = az.attention_weights(q, k, bias=az.masks.alibi(4, 1, 10).double())
    assert bool((w[..., 1:] > w[..., :-1]).all())  # weight rises towards the query's own position
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 4, 1, dtype=torch.float64))
