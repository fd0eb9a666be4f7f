"""dropout.keep_mask against an independent int64 statement of its hash, bit for bit: the int32
arithmetic of keep_mask (wrapping products, masked shifts, carries across 2^32) is an optimisation,
and the Triton kernels compute the same bits."""

from __future__ import annotations

import pytest
import torch

from attnzero import dropout

M32 = 0xFFFFFFFF


def mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def spec(seed: int, p: float, shape: tuple[int, int, int, int], idx: tuple[slice, ...]) -> torch.Tensor:
    """Entry (b, h, i, j) kept iff hash(seed, counter) >= round(p · 2^32), all in int64."""
    _, H, Lq, Lk = shape
    b, h, i, j = (torch.arange(n)[s] for n, s in zip(shape, idx))
    counter = ((b.view(-1, 1, 1, 1) * H + h.view(1, -1, 1, 1)) * Lq + i.view(1, 1, -1, 1)) * Lk + j.view(1, 1, 1, -1)
    x = mix((counter & M32) ^ (seed & M32))
    x = mix(x ^ (counter >> 32) ^ ((seed >> 32) & M32))
    return x >= min(round(p * 2.0**32), 2**32)


CASES = [
    ((2, 3, 40, 50), (0, 2), (0, 3), (0, 40), (0, 50)),
    ((2, 3, 40, 50), (1, 2), (1, 3), (5, 17), (3, 44)),
    ((3, 5, 100, 300), (1, 3), (2, 4), (2, 90), (0, 300)),
    # counters beyond 2^32: rows whose high 32 bits change along the row (a carry inside the block)
    ((1, 1, 70000, 70000), (0, 1), (0, 1), (61356, 61400), (0, 70000)),
    ((2, 1, 66000, 66000), (1, 2), (0, 1), (30, 40), (65000, 66000)),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 123, 2**40 + 7, 2**62 - 1])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_mask_matches_the_int64_hash(case, seed, p) -> None:  # type: ignore[no-untyped-def]
    """With the seed an int, and as a 0-d int64 tensor (what a compiled graph draws: read by tensor
    ops only, the counters always in int64)."""
    shape, bs, hs, rs, cs = case
    want = spec(seed, p, shape, tuple(slice(*r) for r in (bs, hs, rs, cs)))
    for s in (seed, torch.tensor(seed, dtype=torch.int64)):
        got = dropout.keep_mask(s, p, shape, rows=rs, cols=cs, batches=bs, heads=hs)
        assert got.shape == want.shape
        assert torch.equal(got, want)


def test_a_block_crossing_two_to_the_32_takes_the_carry_path() -> None:
    """The case list really contains a row whose counters cross a multiple of 2^32."""
    shape, _, _, (r0, r1), (c0, c1) = CASES[3]
    Lk = shape[3]
    crossing = [i for i in range(r0, r1) if (i * Lk + c0) >> 32 != (i * Lk + c1 - 1) >> 32]
    assert crossing


@pytest.mark.parametrize("p", [1 - 1e-12, 1 - 2.0**-34, 1e-12])
def test_p_within_two_to_the_minus_33_of_0_or_1(p: float) -> None:
    # round(p · 2^32) = 2^32 near 1: compared in int32 it wrapped to -2^31 and every entry was kept
    # (the kernel's uint64 comparison dropped every one); near 0 every entry is kept
    for shape, bs, hs, rs, cs in (CASES[0], CASES[3]):
        want = spec(5, p, shape, tuple(slice(*r) for r in (bs, hs, rs, cs)))
        got = dropout.keep_mask(5, p, shape, rows=rs, cols=cs, batches=bs, heads=hs)
        assert torch.equal(got, want) and bool(want.all() if p < 0.5 else not want.any())
    import attnzero as az

    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    for backend in ("reference", "flash", "auto"):
        torch.manual_seed(0)
        out = az.attention(q, k, v, dropout_p=p, backend=backend)  # type: ignore[arg-type]
        assert isinstance(out, torch.Tensor)
        if p > 0.5:
            assert torch.equal(out, torch.zeros_like(out)), backend
        else:
            torch.testing.assert_close(out, az.attention(q, k, v, backend="reference"))
