"""The seeds' modules: ScaledDotProductAttention (seed 002) and MultiHeadAttention (seed 000), and
MultiHeadAttention.from_torch(nn.MultiheadAttention)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import BACKENDS
from torch import nn

import attnzero as az

backends = pytest.mark.parametrize("backend", BACKENDS)


def naive_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, d_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, weights) of softmax(q kᵀ / sqrt(d_k)) v with blocked pairs dropped; blocked rows 0."""
    s = q @ k.transpose(-1, -2) / math.sqrt(d_k)
    if keep is not None:
        keep = keep.expand_as(s)
        s = s.masked_fill(~keep, float("-inf"))
    w = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no key: NaN -> 0
    return w @ v, w


# ---------------------------------------------------------------------------------------------
# ScaledDotProductAttention


@pytest.mark.parametrize(
    ("lead", "mask_shape"),
    [((2,), None), ((2,), (10, 12)), ((2, 3), (2, 1, 10, 12)), ((2, 3, 4), (3, 1, 10, 12)), ((), (10, 12))],
    ids=["3d", "3d_mask2d", "4d_mask_bcast_heads", "5d_mask_bcast", "2d"],
)
def test_sdpa_module_leading_dims(lead: tuple[int, ...], mask_shape: tuple[int, ...] | None) -> None:
    Q = torch.randn(*lead, 10, 16, dtype=torch.float64)
    K = torch.randn(*lead, 12, 16, dtype=torch.float64)
    V = torch.randn(*lead, 12, 7, dtype=torch.float64)
    mask = None if mask_shape is None else (torch.rand(mask_shape) < 0.7).double()  # float 0/1 like the seed's
    out, w = az.ScaledDotProductAttention()(Q, K, V, mask)
    want_out, want_w = naive_sdpa(Q, K, V, None if mask is None else mask != 0, 16)
    assert out.shape == (*lead, 10, 7) and w.shape == (*lead, 10, 12)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w, want_w, rtol=1e-12, atol=1e-12)


def test_sdpa_module_d_k() -> None:
    Q, K, V = torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    default = az.ScaledDotProductAttention()
    assert default.d_k is None
    torch.testing.assert_close(default(Q, K, V)[0], naive_sdpa(Q, K, V, None, 8)[0])
    torch.testing.assert_close(az.ScaledDotProductAttention(8)(Q, K, V)[0], default(Q, K, V)[0])
    # An explicit d_k sets the scale even when it is not Q's last dim (as the seed's module does).
    torch.testing.assert_close(az.ScaledDotProductAttention(64)(Q, K, V)[0], naive_sdpa(Q, K, V, None, 64)[0])


def test_sdpa_module_seed_causal_mask_and_blocked_row() -> None:
    Q, K, V = torch.randn(2, 6, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    tril = torch.tril(torch.ones(6, 6))
    out, w = az.ScaledDotProductAttention(8)(Q, K, V, mask=tril)
    torch.testing.assert_close(out, naive_sdpa(Q, K, V, tril != 0, 8)[0])
    assert not w.triu(1).any()
    m = tril.clone()
    m[3] = 0  # a row with every key masked: the seed gives NaN, attnzero gives 0
    out, w = az.ScaledDotProductAttention(8)(Q, K, V, mask=m)
    assert not torch.isnan(out).any() and not out[:, 3].any() and not w[:, 3].any()


def test_sdpa_module_dropout_only_in_training() -> None:
    Q, K, V = torch.randn(2, 9, 8), torch.randn(2, 9, 8), torch.randn(2, 9, 8)
    m = az.ScaledDotProductAttention(8, dropout=0.5)
    plain_out, plain_w = az.ScaledDotProductAttention(8)(Q, K, V)
    m.eval()
    out, w = m(Q, K, V)
    assert torch.equal(out, plain_out) and torch.equal(w, plain_w)
    m.train()
    torch.manual_seed(0)
    out_a, w_a = m(Q, K, V)
    torch.manual_seed(0)
    out_b, _ = m(Q, K, V)
    assert not torch.allclose(out_a, plain_out)
    assert torch.equal(out_a, out_b)
    torch.testing.assert_close(w_a, plain_w)  # the returned weights are those before dropout


# ---------------------------------------------------------------------------------------------
# MultiHeadAttention: what it computes, written out by hand


def manual_mha(
    m: az.MultiHeadAttention, q_in: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor, keep: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    B, Lq, _ = q_in.shape
    Lk = k_in.shape[1]
    H, Hkv, dk = m.num_heads, m.num_kv_heads, m.d_k
    q = m.W_q(q_in).view(B, Lq, H, dk).transpose(1, 2)  # (B, H, Lq, dk)
    k = m.W_k(k_in).view(B, Lk, Hkv, dk).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)  # (B, H, Lk, dk)
    v = m.W_v(v_in).view(B, Lk, Hkv, dk).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)  # (B, H, Lk, dk)
    out, w = naive_sdpa(q, k, v, keep, dk)
    return m.W_o(out.transpose(1, 2).reshape(B, Lq, H * dk)), w


def test_mha_attributes() -> None:
    m = az.MultiHeadAttention(64, 8)
    assert (m.d_model, m.num_heads, m.d_k) == (64, 8, 8)
    for lin in (m.W_q, m.W_k, m.W_v, m.W_o):
        assert isinstance(lin, nn.Linear) and lin.bias is not None
    assert m.W_q.in_features == 64 and m.W_o.out_features == 64
    nb = az.MultiHeadAttention(64, 8, bias=False)
    assert all(lin.bias is None for lin in (nb.W_q, nb.W_k, nb.W_v, nb.W_o))
    assert az.MultiHeadAttention(64, 8).dropout == 0.1  # the seed's default


@backends
@pytest.mark.parametrize("num_kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("bias", [True, False])
def test_mha_self_attention_matches_manual(backend: str, num_kv_heads: int | None, bias: bool) -> None:
    m = az.MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, bias=bias, backend=backend).double().eval()
    kv = 4 if num_kv_heads is None else num_kv_heads
    assert m.num_kv_heads == kv and m.W_k.out_features == kv * 8 and m.W_v.out_features == kv * 8
    x = torch.randn(3, 11, 32, dtype=torch.float64)
    out = m(x)
    assert isinstance(out, torch.Tensor) and out.shape == (3, 11, 32)
    torch.testing.assert_close(out, m(x, x, x), rtol=0, atol=0)  # key/value omitted = self-attention
    torch.testing.assert_close(out, manual_mha(m, x, x, x, None)[0], rtol=1e-12, atol=1e-12)


@backends
def test_mha_cross_attention_kdim_vdim(backend: str) -> None:
    m = az.MultiHeadAttention(24, 3, kdim=10, vdim=6, num_kv_heads=1, backend=backend).double().eval()
    assert m.W_k.in_features == 10 and m.W_v.in_features == 6
    q, k, v = torch.randn(2, 5, 24).double(), torch.randn(2, 9, 10).double(), torch.randn(2, 9, 6).double()
    torch.testing.assert_close(m(q, k, v), manual_mha(m, q, k, v, None)[0], rtol=1e-12, atol=1e-12)


def test_mha_masks_key_padding_and_causal() -> None:
    m = az.MultiHeadAttention(32, 4).double().eval()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    # The seed's float tril mask.
    tril = torch.tril(torch.ones(7, 7)).unsqueeze(0).unsqueeze(0)
    torch.testing.assert_close(m(x, x, x, mask=tril), manual_mha(m, x, x, x, tril != 0)[0])
    torch.testing.assert_close(m(x, causal=True), m(x, x, x, mask=tril))
    # key_padding_mask: True = a real token; equals the explicit (B, 1, 1, Lk) keep-mask.
    kpm = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    out = m(x, key_padding_mask=kpm)
    torch.testing.assert_close(out, m(x, mask=kpm.view(2, 1, 1, 7)))
    torch.testing.assert_close(out, manual_mha(m, x, x, x, kpm.view(2, 1, 1, 7))[0])
    torch.testing.assert_close(m(x, key_padding_mask=kpm, causal=True), m(x, mask=kpm.view(2, 1, 1, 7) & (tril != 0)))
    # Cross-attention with causal: bottom-right aligned.
    mem = torch.randn(2, 10, 32, dtype=torch.float64)
    keep = torch.ones(7, 10, dtype=torch.bool).tril(diagonal=3)
    torch.testing.assert_close(m(x, mem, mem, causal=True), manual_mha(m, x, mem, mem, keep)[0])


def test_mha_need_weights() -> None:
    m = az.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    x, mem = torch.randn(2, 5, 32), torch.randn(2, 8, 32)
    kpm = torch.ones(2, 8, dtype=torch.bool)
    kpm[1] = False  # batch 1 has no real key: its rows are blocked
    out, w = m(x, mem, mem, key_padding_mask=kpm, need_weights=True)
    assert w.shape == (2, 4, 5, 8)
    torch.testing.assert_close(w[0].sum(-1), torch.ones(4, 5))
    assert not w[1].any() and not out.isnan().any()
    torch.testing.assert_close(out, m(x, mem, mem, key_padding_mask=kpm))
    torch.testing.assert_close(w, manual_mha(m, x, mem, mem, kpm.view(2, 1, 1, 8))[1])


def test_mha_dropout_only_in_training() -> None:
    torch.manual_seed(0)
    m = az.MultiHeadAttention(32, 4, dropout=0.5)
    plain = az.MultiHeadAttention(32, 4, dropout=0.0)
    plain.load_state_dict(m.state_dict())
    x = torch.randn(2, 9, 32)
    m.eval()
    torch.testing.assert_close(m(x), plain(x))
    m.train()
    torch.manual_seed(1)
    a = m(x)
    torch.manual_seed(1)
    b = m(x)
    assert torch.equal(a, b) and not torch.allclose(a, plain(x))
    plain.train()  # dropout=0 in training: no change
    torch.testing.assert_close(plain(x), m.eval()(x))


def test_mha_gradients_flow() -> None:
    m = az.MultiHeadAttention(16, 2, num_kv_heads=1).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    m.eval()(x, causal=True).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(p.grad is not None for p in m.parameters())


# ---------------------------------------------------------------------------------------------
# from_torch(nn.MultiheadAttention)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kvdim", [None, (12, 20)], ids=["same_dim", "kdim_vdim"])
def test_from_torch_same_outputs(batch_first: bool, bias: bool, kvdim: tuple[int, int] | None) -> None:
    E, H, B, Lq, Lk = 32, 4, 3, 6, 9
    kdim, vdim = kvdim if kvdim is not None else (None, None)
    theirs = nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first).eval()
    ours = az.MultiHeadAttention.from_torch(theirs)
    assert isinstance(ours, az.MultiHeadAttention) and not ours.training
    assert (ours.d_model, ours.num_heads, ours.d_k) == (E, H, E // H)
    q = torch.randn(B, Lq, E)
    k = torch.randn(B, Lk, kdim or E)
    v = torch.randn(B, Lk, vdim or E)

    def torch_call(**kw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        args = (q, k, v) if batch_first else (q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # (L, B, E)
        out, w = theirs(*args, need_weights=True, average_attn_weights=False, **kw)
        return (out if batch_first else out.transpose(0, 1)), w

    t_out, t_w = torch_call()
    o_out, o_w = ours(q, k, v, need_weights=True)
    torch.testing.assert_close(o_out, t_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(o_w, t_w, rtol=1e-6, atol=1e-6)

    # Padding: torch's key_padding_mask has True = ignore, ours True = real token.
    ignore = torch.zeros(B, Lk, dtype=torch.bool)
    ignore[1, 5:] = True
    ignore[2, 2:] = True
    t_out, t_w = torch_call(key_padding_mask=ignore)
    o_out, o_w = ours(q, k, v, key_padding_mask=~ignore, need_weights=True)
    torch.testing.assert_close(o_out, t_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(o_w, t_w, rtol=1e-6, atol=1e-6)

    # attn_mask: torch's bool True = not allowed, ours True = may attend.
    blocked = torch.rand(Lq, Lk) < 0.3
    blocked[:, 0] = False
    t_out, _ = torch_call(attn_mask=blocked)
    torch.testing.assert_close(ours(q, k, v, mask=~blocked), t_out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("packed", [True, False], ids=["in_proj", "kdim_vdim"])
def test_from_torch_keeps_frozen_parameters_frozen(packed: bool) -> None:
    """A parameter the source does not train stays untrained: the copy made every weight trainable."""
    theirs = nn.MultiheadAttention(16, 2) if packed else nn.MultiheadAttention(16, 2, kdim=8, vdim=8)
    frozen = theirs.in_proj_weight if packed else theirs.k_proj_weight
    assert frozen is not None
    frozen.requires_grad_(False)
    theirs.out_proj.bias.requires_grad_(False)
    ours = az.MultiHeadAttention.from_torch(theirs)
    trains = {name: p.requires_grad for name, p in ours.named_parameters()}
    assert trains["W_o.bias"] is False and trains["W_o.weight"] is True
    assert trains["W_k.weight"] is False and trains["W_q.bias"] is True
    assert trains["W_q.weight"] is (not packed) and trains["W_v.weight"] is (not packed)


def test_a_message_names_a_key_or_value_it_defaulted() -> None:
    """key and value default to query and key: a width that does not fit says it was defaulted."""
    mha = az.MultiHeadAttention(16, 4, kdim=10, vdim=6)
    q, k = torch.randn(2, 3, 16), torch.randn(2, 5, 10)
    with pytest.raises(ValueError, match=r"value: expected last dim 6, got 10 \(value defaults to key\)"):
        mha(q, k)
    with pytest.raises(ValueError, match=r"key: expected last dim 10, got 16 \(key defaults to query\)"):
        mha(q)
    with pytest.raises(ValueError, match=r"value: expected last dim 6, got 10$"):
        mha(q, k, k)


def test_from_torch_self_attention_noncontiguous_sequence_first() -> None:
    """A (L, B, E) tensor made batch first by a transpose (not contiguous) works as is."""
    theirs = nn.MultiheadAttention(16, 2).eval()  # batch_first=False
    ours = az.MultiHeadAttention.from_torch(theirs)
    x = torch.randn(7, 3, 16)  # (L, B, E)
    t_out, _ = theirs(x, x, x)
    torch.testing.assert_close(ours(x.transpose(0, 1)), t_out.transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_from_torch_keeps_training_mode_dtype_and_dropout() -> None:
    theirs = nn.MultiheadAttention(16, 2, dropout=0.2, dtype=torch.float64)
    ours = az.MultiHeadAttention.from_torch(theirs, backend="reference")
    assert ours.training and ours.dropout == 0.2 and ours.backend == "reference"
    assert ours.W_q.weight.dtype == torch.float64
    # The copies are independent of the source's parameters.
    with torch.no_grad():
        theirs.in_proj_weight.zero_()
    assert ours.W_q.weight.abs().sum() > 0


def test_from_torch_rejects_what_it_cannot_convert() -> None:
    with pytest.raises(TypeError, match=r"mha: expected a torch.nn.MultiheadAttention, got Linear"):
        az.MultiHeadAttention.from_torch(nn.Linear(4, 4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"mha: expected a module without add_bias_kv"):
        az.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match=r"mha: expected a module without add_bias_kv / add_zero_attn"):
        az.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_zero_attn=True))


@pytest.mark.parametrize("shape", [(2, 1, 7), (1, 7), (2, 6), (7,)], ids=str)
def test_mha_refuses_a_key_padding_mask_of_another_shape(shape: tuple[int, ...]) -> None:
    m = az.MultiHeadAttention(16, 2, 0.0)
    x, mem, kpm = torch.randn(2, 3, 16), torch.randn(2, 7, 16), torch.ones(shape, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"key_padding_mask: expected shape \(B, Lk\) = \(2, 7\), got"):
        m(x, mem, mem, key_padding_mask=kpm)


def test_mha_mask_builder_with_key_padding_mask() -> None:
    m = az.MultiHeadAttention(32, 4).eval()
    x = torch.randn(2, 6, 32)
    kpm = torch.tensor([[True] * 4 + [False] * 2, [True] * 6])
    dense = torch.ones(6, 6, dtype=torch.bool).tril().view(1, 1, 6, 6) & kpm.view(2, 1, 1, 6)
    torch.testing.assert_close(m(x, mask=az.masks.causal(6), key_padding_mask=kpm), m(x, mask=dense))
    _, w = m(x, mask=az.masks.causal(6), key_padding_mask=kpm, need_weights=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6))
    assert not w[0, :, :, 4:].any() and not w.triu(1).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_modules_in_low_precision(dtype: torch.dtype) -> None:
    m = az.MultiHeadAttention(32, 4).eval()
    x = torch.randn(2, 6, 32)
    want = m(x, causal=True)
    got = m.to(dtype)(x.to(dtype), causal=True)
    assert isinstance(got, torch.Tensor) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.05)
    out, w = az.ScaledDotProductAttention()(x.to(dtype), x.to(dtype), x.to(dtype))
    assert out.dtype == w.dtype == dtype


def test_a_dropout_of_one_drops_every_weight_as_torchs_modules_do() -> None:
    """torch's nn.MultiheadAttention and nn.Dropout take p = 1 (the modules refused it): in training
    every attention weight is dropped — the output is the output projection's bias, the gradients
    reaching q, k, v through attention are 0 — and in eval it changes nothing."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(16, 4, dropout=1.0, batch_first=True)
    mha = az.MultiHeadAttention.from_torch(ref)
    x = torch.randn(2, 5, 16, requires_grad=True)
    out = mha(x)
    torch.testing.assert_close(out, ref(x, x, x, need_weights=False)[0])
    torch.testing.assert_close(out, mha.W_o.bias.expand_as(out))
    out.sum().backward()
    assert x.grad is not None and mha.W_q.weight.grad is not None
    assert not x.grad.any() and not mha.W_q.weight.grad.any() and not torch.isnan(x.grad).any()
    mha.eval()
    torch.testing.assert_close(mha(x), ref.eval()(x, x, x, need_weights=False)[0])
    sdpa = az.ScaledDotProductAttention(dropout=1.0)
    q = torch.randn(3, 4, 8)
    output, weights = sdpa(q, q, q)
    assert not output.any() and torch.allclose(weights.sum(-1), torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"dropout: expected a float in \[0, 1\], got 1.5"):
        az.MultiHeadAttention(16, 4, dropout=1.5)


def test_a_module_made_on_the_meta_device_is_initialised_by_reset_parameters() -> None:
    """Meta-device construction, then ``to_empty`` and each module's ``reset_parameters`` (what FSDP
    does): the sinks were left as uninitialised memory (the module had no reset_parameters)."""
    with torch.device("meta"):
        model = az.MultiHeadAttention(16, 4, sinks=True, num_kv_heads=2)
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert model.sinks is not None and not model.sinks.any()
    fresh = az.MultiHeadAttention(16, 4, sinks=True, num_kv_heads=2)
    for (name, p), (_, p0) in zip(model.named_parameters(), fresh.named_parameters()):
        assert p.shape == p0.shape and torch.isfinite(p).all(), name
        if p.ndim == 2:  # nn.Linear's init: uniform within ±1/sqrt(fan_in)
            assert p.abs().max() <= 1 / math.sqrt(p.shape[1]) + 1e-6, name
    x = torch.randn(2, 5, 16)
    assert torch.isfinite(model(x)).all()
