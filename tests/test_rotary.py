"""az.RotaryEmbedding: the half-split (Llama / GPT-NeoX) and interleaved (GPT-J) conventions
against formulas written here independently, float32 tables, norms, relative positions, and
``MultiHeadAttention(rope=...)``."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

import attnzero as az

D_SIZES = [2, 8, 40, 64, 96, 128]


def angles(positions: torch.Tensor, D: int, base: float = 10000.0) -> torch.Tensor:
    """p · θ_i with θ_i = base^(-2i/D), float64 (L, D/2) — the RoFormer paper's frequencies."""
    theta = torch.tensor([base ** (-2.0 * i / D) for i in range(D // 2)], dtype=torch.float64)
    return positions.to(torch.float64)[:, None] * theta[None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim (x1, x2 its two halves)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def half_split_formula(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """x · cos + rotate_half(x) · sin with the D/2 angles written twice (Llama / GPT-NeoX)."""
    a = angles(positions, x.shape[-1], base)
    emb = torch.cat((a, a), dim=-1)  # (L, D)
    return x * emb.cos() + rotate_half(x) * emb.sin()


def interleaved_formula(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """GPT-J / RoFormer: channels (2i, 2i+1) as one complex number, multiplied by e^{i·p·θ_i}."""
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())  # (..., L, D/2) complex
    a = angles(positions, x.shape[-1])  # (L, D/2)
    rotated = z * torch.polar(torch.ones_like(a), a)
    return torch.view_as_real(rotated).reshape(x.shape)


@pytest.mark.parametrize("D", D_SIZES)
@pytest.mark.parametrize("L", [1, 17, 113])
def test_half_split_equals_rotate_half_formula(D: int, L: int) -> None:
    x = torch.randn(2, 3, L, D, dtype=torch.float64)
    positions = torch.randperm(5 * L)[:L]  # arbitrary, unsorted positions
    rot = az.RotaryEmbedding(D)
    torch.testing.assert_close(rot(x, positions), half_split_formula(x, positions), rtol=0, atol=1e-12)


@pytest.mark.parametrize("base", [10000.0, 500000.0, 10.0])
def test_base(base: float) -> None:
    x = torch.randn(4, 33, 64, dtype=torch.float64)
    positions = torch.arange(33) * 7
    got = az.RotaryEmbedding(64, base=base)(x, positions)
    torch.testing.assert_close(got, half_split_formula(x, positions, base), rtol=0, atol=1e-12)


def _transformers_required() -> bool:
    return importlib.util.find_spec("transformers") is not None or os.environ.get("CI") == "true"


@pytest.mark.skipif(not _transformers_required(), reason="transformers is not installed (pip install transformers)")
@pytest.mark.parametrize("D", [8, 64, 128])
def test_half_split_equals_transformers_llama(D: int) -> None:
    """The default convention is transformers' ``apply_rotary_pos_emb`` (Llama), fed the cos/sin that
    Llama's rotary module builds: cat(freqs, freqs)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    B, H, L = 2, 4, 37
    q = torch.randn(B, H, L, D, dtype=torch.float64)
    k = torch.randn(B, H, L, D, dtype=torch.float64)
    positions = torch.arange(L) + 11
    a = angles(positions, D)
    emb = torch.cat((a, a), dim=-1)[None]  # (1, L, D), as Llama's rotary module returns it
    q_hf, k_hf = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
    rot = az.RotaryEmbedding(D)
    torch.testing.assert_close(rot(q, positions), q_hf, rtol=0, atol=1e-12)
    torch.testing.assert_close(rot(k, positions), k_hf, rtol=0, atol=1e-12)


@pytest.mark.parametrize("D", D_SIZES)
def test_interleaved_equals_complex_formula(D: int) -> None:
    x = torch.randn(3, 29, D, dtype=torch.float64)
    positions = torch.arange(29) * 3 + 1
    rot = az.RotaryEmbedding(D, interleaved=True)
    torch.testing.assert_close(rot(x, positions), interleaved_formula(x, positions), rtol=0, atol=1e-12)


def test_conventions_differ_by_a_channel_permutation() -> None:
    """Interleaved on x equals half-split on x with channels (0, 2, 4, …, 1, 3, 5, …) regrouped."""
    D = 16
    x = torch.randn(5, 9, D, dtype=torch.float64)
    pos = torch.arange(9)
    perm = torch.cat((torch.arange(0, D, 2), torch.arange(1, D, 2)))  # interleaved -> halves
    inter = az.RotaryEmbedding(D, interleaved=True)(x, pos)
    half = az.RotaryEmbedding(D)(x[..., perm], pos)
    torch.testing.assert_close(inter[..., perm], half, rtol=0, atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
def test_norms_preserved_and_position_zero_is_identity(interleaved: bool) -> None:
    D = 96
    x = torch.randn(2, 4, 50, D, dtype=torch.float64)
    rot = az.RotaryEmbedding(D, interleaved=interleaved)
    positions = torch.randint(0, 100_000, (50,))
    y = rot(x, positions)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)
    torch.testing.assert_close(rot(x, torch.zeros(50, dtype=torch.long)), x, rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_scores_depend_only_on_relative_position(interleaved: bool) -> None:
    """<rot(q, p), rot(k, s)> is the same for every shift of both p and s."""
    D = 64
    rot = az.RotaryEmbedding(D, interleaved=interleaved)
    q = torch.randn(1, 12, D, dtype=torch.float64)
    k = torch.randn(1, 12, D, dtype=torch.float64)
    p = torch.randint(0, 50, (12,))
    s = torch.randint(0, 50, (12,))
    base = (rot(q, p) * rot(k, s)).sum(-1)  # (1, 12)
    for shift in (1, 7, 1000, 31337):
        shifted = (rot(q, p + shift) * rot(k, s + shift)).sum(-1)
        torch.testing.assert_close(shifted, base, rtol=1e-9, atol=1e-9)
    # and they do depend on it: another relative offset gives other scores
    other = (rot(q, p + 1) * rot(k, s)).sum(-1)
    assert (other - base).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_table_in_float32_output_in_input_dtype(dtype: torch.dtype) -> None:
    """The rotation runs in float32 (never in the input's low precision) and is rounded once."""
    D = 64
    rot = az.RotaryEmbedding(D)
    x = torch.randn(2, 3, 40, D).to(dtype)
    positions = torch.arange(40) + 2000
    y = rot(x, positions)
    assert y.dtype == dtype and y.shape == x.shape
    cos, sin = rot.cos_sin(10, x.device, torch.float32)
    assert cos.dtype == sin.dtype == torch.float32
    torch.testing.assert_close(y, rot(x.float(), positions).to(dtype), rtol=0, atol=0)
    exact = half_split_formula(x.double(), positions)
    tol = 2 * torch.finfo(dtype).eps * float(x.abs().max()) * 2
    assert float((y.double() - exact).abs().max()) <= tol


def test_table_is_cached_and_grows() -> None:
    rot = az.RotaryEmbedding(8)
    x = torch.randn(3, 8, dtype=torch.float64)
    rot(x, torch.tensor([0, 1, 2]))
    table = rot._cos64
    assert table is not None
    rot(x, torch.tensor([3, 4, 5]))
    assert rot._cos64 is table  # reused, not rebuilt
    big = torch.tensor([500, 10, 2345])
    torch.testing.assert_close(rot(x, big), half_split_formula(x, big), rtol=0, atol=1e-12)
    assert rot._cos64 is not None and rot._cos64.shape[0] > 2345
    assert rot.state_dict() == {}  # a cache, not state: module.half() cannot touch it


@pytest.mark.parametrize("interleaved", [False, True])
def test_a_few_far_positions_take_their_own_angles_not_a_table(interleaved: bool) -> None:
    # A table up to position 10⁹ would hold every position below it (10⁷ at D = 128 was 10 GB).
    rot = az.RotaryEmbedding(8, interleaved=interleaved)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    far = torch.tensor([10**9 + 1, 5, 2**24 + 1])  # (odd: float32 would round them)
    want = half_split_formula(x, far) if not interleaved else None
    got = rot(x, far)
    assert rot._cos64 is None or rot._cos64.shape[0] <= 65536
    if want is not None:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)  # (angles of 10⁹ lose ~1e-7 to float64)
    # the same values as the table's, bit for bit, where a table holds them
    x32, mid = torch.randn(2, 3, 8), torch.tensor([70000, 3, 9000])
    direct = rot(x32, mid)
    rot.cos_sin(70001, x32.device, torch.float32)
    torch.testing.assert_close(rot(x32, mid), direct, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_positions_of_any_integer_dtype_rotate_as_int64(dtype: torch.dtype) -> None:
    # uint8 positions were read as a boolean mask ([1, 2, 2] rotated as [0, 1, 2]); int8 / int16 raised
    rot = az.RotaryEmbedding(8)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    for pos in ([1, 2, 2], [2, 0, 1], [0, 0, 0]):
        want = rot(x, torch.tensor(pos))
        torch.testing.assert_close(rot(x, torch.tensor(pos, dtype=dtype)), want, rtol=0, atol=0)


def test_rotate_from_equals_explicit_positions() -> None:
    rot = az.RotaryEmbedding(40)
    x = torch.randn(2, 5, 13, 40)
    torch.testing.assert_close(rot.rotate_from(x, 300), rot(x, torch.arange(300, 313)), rtol=0, atol=0)


def test_non_contiguous_input() -> None:
    x = torch.randn(2, 13, 4, 64, dtype=torch.float64).transpose(1, 2)  # (2, 4, 13, 64) strided
    pos = torch.arange(13)
    torch.testing.assert_close(az.RotaryEmbedding(64)(x, pos), half_split_formula(x.contiguous(), pos))


def test_bad_arguments() -> None:
    for bad in (7, 0, -2, 2.0, True):
        with pytest.raises(ValueError, match="head_dim: expected a positive even int"):
            az.RotaryEmbedding(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="base"):
        az.RotaryEmbedding(8, base=float("inf"))
    rot = az.RotaryEmbedding(8)
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"x: expected shape \(\.\.\., L, 8\), got \(2, 5, 6\)"):
        rot(torch.randn(2, 5, 6), torch.arange(5))
    with pytest.raises(TypeError, match="x: expected a floating dtype"):
        rot(torch.ones(2, 5, 8, dtype=torch.long), torch.arange(5))
    with pytest.raises(TypeError, match=r"positions: expected an integer dtype, got torch\.float32"):
        rot(x, torch.arange(5.0))
    with pytest.raises(TypeError, match=r"positions: expected an integer torch\.Tensor"):
        rot(x, [0, 1, 2, 3, 4])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"positions: expected shape \(L,\) = \(5,\), got \(4,\)"):
        rot(x, torch.arange(4))
    with pytest.raises(ValueError, match="positions: expected integers >= 0, got a minimum of -1"):
        rot(x, torch.arange(-1, 4))
    with pytest.raises(ValueError, match="positions: device meta does not match x's cpu"):
        rot(x, torch.arange(5, device="meta"))


# ---------------------------------------------------------------------------------------------
# MultiHeadAttention(rope=...)


def manual_mha(m: az.MultiHeadAttention, x: torch.Tensor, rot: az.RotaryEmbedding) -> torch.Tensor:
    """Self-attention with rotary positions 0..L-1 written out: project, rotate, attend, merge."""
    B, L, _ = x.shape
    H, Hkv, d = m.num_heads, m.num_kv_heads, m.d_k
    q = m.W_q(x).view(B, L, H, d).transpose(1, 2)  # (B, H, L, d)
    k = m.W_k(x).view(B, L, Hkv, d).transpose(1, 2)  # (B, Hkv, L, d)
    v = m.W_v(x).view(B, L, Hkv, d).transpose(1, 2)  # (B, Hkv, L, d)
    pos = torch.arange(L)
    q, k = rot(q, pos), rot(k, pos)
    k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, L, d)
    v = v.repeat_interleave(H // Hkv, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(d)  # (B, H, L, L)
    s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    out = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, L, H * d)  # (B, L, H·d)
    return m.W_o(out)


@pytest.mark.parametrize("Hkv", [4, 2, 1])
@pytest.mark.parametrize("rope", ["true", "interleaved"])
def test_module_rope_equals_manual(Hkv: int, rope: str) -> None:
    rot = az.RotaryEmbedding(8, interleaved=rope == "interleaved")
    m = az.MultiHeadAttention(32, 4, 0.0, num_kv_heads=Hkv, rope=True if rope == "true" else rot).double()
    assert isinstance(m.rope, az.RotaryEmbedding) and m.rope.interleaved == rot.interleaved
    x = torch.randn(2, 23, 32, dtype=torch.float64)
    torch.testing.assert_close(m(x, causal=True), manual_mha(m, x, rot), rtol=0, atol=1e-12)


def test_module_rope_off_by_default_and_state_dict_unchanged() -> None:
    m = az.MultiHeadAttention(32, 4)
    assert m.rope is None
    r = az.MultiHeadAttention(32, 4, rope=True)
    assert set(r.state_dict()) == set(m.state_dict())  # rotary adds no parameters or buffers


def test_module_rope_bad_arguments() -> None:
    with pytest.raises(ValueError, match="rope: head_dim 16 does not match the module's head dim 8"):
        az.MultiHeadAttention(32, 4, rope=az.RotaryEmbedding(16))
    with pytest.raises(TypeError, match="rope: expected a bool or an attnzero RotaryEmbedding, got str"):
        az.MultiHeadAttention(32, 4, rope="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rope: expected an even head dim \(d_model // num_heads\) .* got 5"):
        az.MultiHeadAttention(20, 4, rope=True)  # d_k = 5 cannot be rotated in pairs


def test_module_rope_cross_attention_uses_bottom_right_positions() -> None:
    """Queries at Lk - Lq + i, keys at j: the last query row of a cross call equals the last row
    of full self-attention over the keys' sequence."""
    m = az.MultiHeadAttention(32, 4, 0.0, rope=True).double()
    x = torch.randn(1, 10, 32, dtype=torch.float64)
    full = m(x, causal=True)
    tail = m(x[:, -3:], x, x, causal=True)  # 3 queries over 10 keys
    torch.testing.assert_close(tail, full[:, -3:], rtol=0, atol=1e-12)
    # more queries than keys: a common shift keeps positions >= 0; scores see differences only
    out = m(torch.randn(1, 6, 32, dtype=torch.float64), x[:, :4], x[:, :4])
    assert out.shape == (1, 6, 32) and torch.isfinite(out).all()


def test_a_table_built_under_inference_mode_serves_a_later_call_with_gradients() -> None:
    """The cos/sin table outlives the call: built under torch.inference_mode (a first decode step),
    it was an inference tensor, and the next call recording gradients could not save it."""
    rope = az.RotaryEmbedding(8)
    x = torch.randn(1, 2, 5, 8)
    with torch.inference_mode():
        rope.rotate_from(x, 0)
    y = x.clone().requires_grad_(True)
    rope.rotate_from(y, 3).sum().backward()
    assert y.grad is not None and not rope.cos_sin(8, y.device, torch.float32)[0].is_inference()
