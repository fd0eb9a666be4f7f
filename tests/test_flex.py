"""``attnzero.flex.flex_attention`` against torch's own ``flex_attention``: the same results where torch
runs (CPU forward, eager), gradients where torch refuses (CPU backward) against the golden dense
formula, torch's return types, errors and BlockMask semantics (unlisted blocks blocked and never
evaluated), attention-gym's mods, kernel_options, and tracing under torch.compile(fullgraph=True)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.attention.flex_attention as TF
from conftest import flash_py

import attnzero as az
from attnzero import flex

Tensor = torch.Tensor


def _torch_flex(*args: Any, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        return TF.flex_attention(*args, **kw)


def _qkv(B: int, Hq: int, Hkv: int, L: int, S: int, D: int, dtype: torch.dtype = torch.float32) -> list[Tensor]:
    return [torch.randn(B, Hq, L, D, dtype=dtype), torch.randn(B, Hkv, S, D, dtype=dtype),
            torch.randn(B, Hkv, S, D, dtype=dtype)]  # fmt: skip


H, L = 4, 96
SLOPES = torch.exp2(-torch.arange(1, H + 1, dtype=torch.float32))  # ALiBi
REL = torch.randn(H, 2 * L - 1)  # a relative-position bias table
DOC = torch.repeat_interleave(torch.arange(4), torch.tensor([10, 40, 1, 45]))  # (96,) jagged documents


def causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return q >= kv


def sliding_window(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return (q >= kv) & (q - kv <= 20)


def prefix_lm(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return (kv < 24) | (q >= kv)


def document(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return (DOC[q] == DOC[kv]) & (q >= kv)


def alibi(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return s - SLOPES[h] * (q - kv).abs()


def softcap(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return 5.0 * torch.tanh(s / 5.0)


def rel_bias(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return s + REL[h, q - kv + L - 1]


MASKS: dict[str, Callable[..., Tensor] | None] = {
    "none": None, "causal": causal, "sliding_window": sliding_window, "prefix_lm": prefix_lm, "document": document,
}  # fmt: skip
SCORES: dict[str, Callable[..., Tensor] | None] = {"none": None, "alibi": alibi, "softcap": softcap, "rel": rel_bias}


@pytest.mark.parametrize(
    ("mask_name", "score_name"),
    [
        ("none", "none"),
        ("causal", "alibi"),
        ("sliding_window", "softcap"),
        ("prefix_lm", "rel"),
        ("document", "none"),
        ("document", "alibi"),
    ],
)
def test_forward_equals_torchs_flex(mask_name: str, score_name: str) -> None:
    mm, sm = MASKS[mask_name], SCORES[score_name]
    q, k, v = _qkv(2, H, 2, L, L, 16)
    bm = None if mm is None else TF.create_block_mask(mm, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    want = _torch_flex(q, k, v, score_mod=sm, block_mask=bm, enable_gqa=True, return_aux=TF.AuxRequest(lse=True))
    got = flex.flex_attention(q, k, v, score_mod=sm, block_mask=bm, enable_gqa=True,
                              return_aux=flex.AuxRequest(lse=True))  # fmt: skip
    assert isinstance(got[1], TF.AuxOutput) and got[1].max_scores is None
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[1].lse, want[1].lse, atol=2e-5, rtol=2e-5)


def _golden(q: Tensor, k: Tensor, v: Tensor, mask_mod: Any, score_mod: Any, B: int, L_: int, S: int) -> Tensor:
    """The dense float64 formula (independent of attnzero): where(mask, mod(scale·q·k), −inf), then a
    softmax whose fully blocked rows are 0."""
    G = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ kk.transpose(-2, -1)) / q.shape[-1] ** 0.5  # (B, H, L, S)
    b, h, i, j = torch.meshgrid(torch.arange(B), torch.arange(q.shape[1]), torch.arange(L_), torch.arange(S),
                                indexing="ij")  # fmt: skip
    if score_mod is not None:
        s = torch.vmap(torch.vmap(torch.vmap(torch.vmap(score_mod))))(s, b, h, i, j)
    if mask_mod is not None:
        s = s.masked_fill(~torch.vmap(torch.vmap(torch.vmap(torch.vmap(mask_mod))))(b, h, i, j), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ vv


@pytest.mark.parametrize(
    ("mask_name", "score_name"), [("causal", "alibi"), ("document", "rel"), ("prefix_lm", "softcap")]
)
def test_it_trains_where_torch_refuses(mask_name: str, score_name: str) -> None:
    mm, sm = MASKS[mask_name], SCORES[score_name]
    q, k, v = (t.double().requires_grad_() for t in _qkv(1, H, H, L, L, 8))
    bm = TF.create_block_mask(mm, None, None, L, L, device="cpu", BLOCK_SIZE=32)
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        _torch_flex(q, k, v, score_mod=sm, block_mask=bm)
    # float64 captured tensors for the golden, so that nothing is rounded to float32 there
    out = flex.flex_attention(q, k, v, score_mod=sm, block_mask=bm)
    grads = torch.autograd.grad((out * out).sum(), (q, k, v))
    gold = _golden(q, k, v, mm, sm, 1, L, L)
    ggrads = torch.autograd.grad((gold * gold).sum(), (q, k, v))
    torch.testing.assert_close(out, gold)
    for a, b in zip(grads, ggrads):
        torch.testing.assert_close(a, b)


def test_a_learnable_bias_table_gets_its_gradient() -> None:
    rel = torch.zeros(H, 2 * L - 1, requires_grad=True)
    q, k, v = _qkv(1, H, H, L, L, 8)

    def score_mod(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return s + rel[h, qi - kv + L - 1]

    bm = flex.create_block_mask(causal, None, None, L, L, device="cpu")
    flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm).sum().backward()
    assert rel.grad is not None and rel.grad[:, L - 1 :].abs().sum() > 0
    assert (rel.grad[:, : L - 1] == 0).all()  # q < kv: blocked by causal, no gradient


def test_cross_attention_bkv_broadcast_and_fully_masked_rows() -> None:
    Lq, S = 40, 72
    q, k, v = _qkv(3, 2, 2, Lq, S, 16)
    k, v = k[:1], v[:1]  # Bkv = 1 against Bq = 3

    def late(b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return (kv > qi + 40) & (qi % 7 != 3)  # rows 32..39 see nothing; rows ≡ 3 mod 7 neither

    bm = TF.create_block_mask(late, 3, None, Lq, S, device="cpu", BLOCK_SIZE=16)
    want, wlse = _torch_flex(q, k, v, block_mask=bm, return_aux=TF.AuxRequest(lse=True))
    got, glse = flex.flex_attention(q, k, v, block_mask=bm, return_aux=flex.AuxRequest(lse=True))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert (got[:, :, 35] == 0).all() and (glse.lse[:, :, 35] == float("-inf")).all()
    torch.testing.assert_close(glse.lse, wlse.lse, atol=2e-5, rtol=2e-5)


def test_unlisted_blocks_are_blocked_and_never_evaluated() -> None:
    """A top-k-ish block map built by hand: only some blocks listed, a mask_mod that keeps every pair
    and reads a table that only exists for the listed query blocks (an IndexError elsewhere)."""
    Lq = S = 64
    small = torch.ones(32, S, dtype=torch.bool)  # rows 0..31 only

    def mm(b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return small[qi, kv]

    nq = 4  # 16-row blocks; query blocks 2 and 3 list nothing
    num = torch.tensor([2, 1, 0, 0], dtype=torch.int32).view(1, 1, nq)
    idx = torch.tensor([[3, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.int32).view(1, 1, nq, 4)
    bm = TF.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16, mask_mod=mm, seq_lengths=(Lq, S))
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 2, Lq, S, 8))
    got, lse = flex.flex_attention(q, k, v, block_mask=bm, return_aux=flex.AuxRequest(lse=True))
    keep = torch.zeros(Lq, S, dtype=torch.bool)
    keep[0:16, 48:64] = keep[0:16, 0:16] = keep[16:32, 16:32] = True
    want = az.attention(q, k, v, mask=keep, backend="reference")
    torch.testing.assert_close(got, want)
    assert (lse.lse[:, :, 32:] == float("-inf")).all()
    got.sum().backward()  # the backward evaluates the same blocks only


def test_full_blocks_skip_the_mask_mod() -> None:
    """A block listed as full is kept whole even where the mask_mod says otherwise: the rule of torch's
    kernels (its eager CPU path evaluates the mask_mod on every pair instead, so it is not compared)."""
    Lq = S = 32
    num = torch.tensor([0, 0], dtype=torch.int32).view(1, 1, 2)
    idx = torch.zeros(1, 1, 2, 2, dtype=torch.int32)
    full_num = torch.tensor([1, 2], dtype=torch.int32).view(1, 1, 2)
    full_idx = torch.tensor([[0, 0], [0, 1]], dtype=torch.int32).view(1, 1, 2, 2)
    bm = TF.BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=16, mask_mod=causal,
                                     seq_lengths=(Lq, S))  # fmt: skip
    q, k, v = _qkv(1, 1, 1, Lq, S, 8)
    keep = torch.ones(Lq, S, dtype=torch.bool)
    keep[:16, 16:] = False  # the one unlisted block; the diagonal blocks are full: no causal inside
    torch.testing.assert_close(flex.flex_attention(q, k, v, block_mask=bm), az.attention(q, k, v, mask=keep))


def test_return_types_and_dtypes() -> None:
    q, k, v = _qkv(1, 2, 2, 16, 16, 8, torch.float64)
    with pytest.warns(FutureWarning, match="return_lse is deprecated"):
        out, lse = flex.flex_attention(q, k, v, return_lse=True)
    assert out.dtype == lse.dtype == torch.float64 and lse.shape == (1, 2, 16)
    q16, k16, v16 = (t.to(torch.bfloat16) for t in (q, k, v))
    out16, aux = flex.flex_attention(q16, k16, v16, return_aux=flex.AuxRequest(lse=True, max_scores=True))
    assert out16.dtype == torch.bfloat16 and aux.lse.dtype == torch.float32 and aux.max_scores.dtype == torch.float32
    s = (q16.float() @ k16.float().transpose(-2, -1)) / 8**0.5
    torch.testing.assert_close(aux.max_scores, s.amax(-1))
    # with a block mask and a score_mod: the largest kept score after the mod (−inf where none is kept)
    bm = TF.create_block_mask(lambda b, h, i, j: (j <= i) & (i != 3), 1, 1, 16, 16, device="cpu", BLOCK_SIZE=8)
    _, aux = flex.flex_attention(q, k, v, block_mask=bm, score_mod=lambda s, b, h, i, j: s * 2.0,
                                 return_aux=flex.AuxRequest(max_scores=True))  # fmt: skip
    i, j = torch.arange(16).view(-1, 1), torch.arange(16)
    s = (q @ k.transpose(-2, -1) / 8**0.5 * 2.0).masked_fill(~((j <= i) & (i != 3)), float("-inf"))
    torch.testing.assert_close(aux.max_scores, s.amax(-1))
    plain = flex.flex_attention(q, k, v)
    assert isinstance(plain, Tensor)
    with pytest.raises(ValueError, match="Cannot specify both return_lse and return_aux"):
        flex.flex_attention(q, k, v, return_lse=True, return_aux=flex.AuxRequest(lse=True))


def _error(fn: Callable[..., Any], *args: Any, **kw: Any) -> tuple[type, str]:
    try:
        fn(*args, **kw)
    except Exception as e:  # the error itself is what is compared
        return type(e), str(e)
    raise AssertionError("no error")


@pytest.mark.parametrize(
    "case",
    ["heads", "gqa", "embed", "batch", "ndim", "length", "shorter mask", "device", "sliced", "sliced, all full"],
)
def test_errors_are_torchs(case: str) -> None:
    q, k, v = _qkv(2, 4, 4, 16, 16, 8)
    kw: dict[str, Any] = {}
    if case == "heads":
        k, v = k[:, :2], v[:, :2]
    elif case == "gqa":
        k, v, kw = k[:, :3], v[:, :3], {"enable_gqa": True}
    elif case == "embed":
        k = k[..., :4]
    elif case == "batch":
        k, v = k[:1], v[:1]
    elif case == "ndim":
        q, k, v = q[0], k[0], v[0]
    elif case == "length":
        kw = {"block_mask": TF.create_block_mask(causal, None, None, 32, 32, device="cpu")}
    elif case == "shorter mask":  # made for 8 rows and keys, used for 16 (its rows past 8 came out 0)
        kw = {"block_mask": TF.create_block_mask(causal, None, None, 8, 8, device="cpu", BLOCK_SIZE=4)}
    elif case == "device":
        v = v.to("meta")
    elif case == "sliced":  # a mask for 64 query rows cut to the first 16: its mask_mod no longer fits
        kw = {"block_mask": TF.create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)[:, :, :1]}
    elif case == "sliced, all full":  # (ran: every block full, the mod never called)
        full = TF.create_block_mask(lambda b, h, i, j: j >= 0, 2, 1, 16, 16, device="cpu", BLOCK_SIZE=8)
        kw = {"block_mask": full[0:2]}
    theirs = _error(_torch_flex, q, k, v, **kw)
    ours = _error(flex.flex_attention, q, k, v, **kw)
    assert ours == theirs


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_block_table_with_fewer_heads_or_batches_wraps_as_torchs_kernels(compiled: bool) -> None:
    """A BlockMask whose H (or B) is neither 1 nor the query's — a GQA mask built with the key
    heads' count — is read as torch's kernels read it (head h at h % H, batch b at b % B); it had
    crashed with an indexing error. The mask differs along the table's dim (odd h, or odd b: every
    key), so a table read at the wrong head or batch skips blocks the mod keeps."""
    by_head = lambda b, h, q, kv: (q >= kv) | (h % 2 == 1)  # noqa: E731
    by_batch = lambda b, h, q, kv: (q >= kv) | (b % 2 == 1)  # noqa: E731
    run = torch.compile(flex.flex_attention, fullgraph=True, backend="eager") if compiled else flex.flex_attention
    cases = [((2, 4, 2), (None, 2), by_head, {"enable_gqa": True}), ((3, 2, 2), (2, None), by_batch, {})]
    for (B, Hq, Hkv), (mB, mH), mask_mod, kw in cases:
        q, k, v = torch.randn(B, Hq, 32, 8), torch.randn(B, Hkv, 32, 8), torch.randn(B, Hkv, 32, 8)
        bm = TF.create_block_mask(mask_mod, mB, mH, 32, 32, device="cpu", BLOCK_SIZE=16)
        torch.testing.assert_close(run(q, k, v, block_mask=bm, **kw), TF.flex_attention(q, k, v, block_mask=bm, **kw))


def test_key_and_value_may_have_another_dtype() -> None:
    q, k, v = _qkv(1, 2, 2, 16, 16, 8)
    got = flex.flex_attention(q, k.double(), v.to(torch.bfloat16))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _torch_flex(q, k.double(), v.to(torch.bfloat16)), atol=1e-2, rtol=1e-2)


def test_kernel_options() -> None:
    q, k, v = _qkv(1, 1, 1, 16, 16, 8)
    base = flex.flex_attention(q, k, v)
    opts = {"BLOCK_M": 64, "fwd_num_warps": 4, "PRESCALE_QK": True, "BACKEND": "TRITON", "ROWS_GUARANTEED_SAFE": True,
            "WRITE_DQ": False}  # fmt: skip
    torch.testing.assert_close(flex.flex_attention(q, k, v, kernel_options=opts), base)
    # every option of torch's FlexKernelOptions is one that cannot change the result
    assert all(key in flex.IGNORED_KERNEL_OPTIONS for key in TF.FlexKernelOptions.__annotations__)
    with pytest.raises(ValueError, match=r"kernel_options: attnzero\.flex does not take 'SOME_NEW_OPTION'"):
        flex.flex_attention(q, k, v, kernel_options={"SOME_NEW_OPTION": False})
    with pytest.raises(ValueError, match="Invalid BACKEND value 'CUTE'"):
        flex.flex_attention(q, k, v, kernel_options={"BACKEND": "CUTE"})
    for word in ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX"):  # torch sets them itself: an AssertionError, as torch's
        for fn in (flex.flex_attention, TF.flex_attention):
            with pytest.raises(AssertionError, match=f"{word} must not be in kernel_options"):
                fn(q, k, v, kernel_options={word: True})


@pytest.mark.parametrize(("shape", "Lk"), [((0, 2, 5, 8), 5), ((1, 2, 0, 8), 5), ((1, 2, 3, 8), 0)])
def test_a_zero_size_call_returns_no_lse_as_torch(shape: tuple[int, ...], Lk: int) -> None:
    """torch returns None for an lse (or max_scores) with no entries; attnzero's output is torch's.
    (With no keys torch itself fails: the output 0 there and each row's lse −inf, attnzero's own.)"""
    q, k = torch.randn(*shape), torch.randn(*shape[:2], Lk, shape[3])
    v = k
    for fn in (flex.flex_attention, TF.flex_attention) if Lk else (flex.flex_attention,):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (return_lse's deprecation)
            out, lse = fn(q, k, v, return_lse=True)
        _, aux = fn(q, k, v, return_aux=TF.AuxRequest(lse=True))
        assert out.shape == shape and not out.any() and aux.max_scores is None
        if Lk:
            assert lse is None and aux.lse is None
        else:  # rows with no key: an lse of −inf, out 0
            assert lse is not None and aux.lse is not None and bool((lse == float("-inf")).all())
    for qq in (q, torch.randn(1, 0, 3, 8)):  # max_scores too (attnzero's: torch has none on CPU); no heads
        kk = torch.randn(qq.shape[0], qq.shape[1], Lk, 8)
        _, aux = flex.flex_attention(qq, kk, kk, return_aux=TF.AuxRequest(max_scores=True))
        if qq.numel() and not Lk:
            assert aux.max_scores is not None and bool((aux.max_scores == float("-inf")).all())
        else:
            assert aux.max_scores is None


def test_the_mask_utilities_are_torchs() -> None:
    assert flex.BlockMask is TF.BlockMask and flex.create_block_mask is TF.create_block_mask
    assert flex.and_masks is TF.and_masks and flex.or_masks is TF.or_masks and flex.noop_mask is TF.noop_mask
    assert flex.create_mask is TF.create_mask


def test_an_and_masks_block_mask_and_a_noop_one() -> None:
    q, k, v = _qkv(1, H, H, L, L, 16)
    for mm in (flex.or_masks(prefix_lm, flex.and_masks(causal, document)), flex.noop_mask):
        bm = flex.create_block_mask(mm, 1, 1, L, L, device="cpu", BLOCK_SIZE=16)
        got = flex.flex_attention(q, k, v, block_mask=bm, score_mod=alibi)
        want = _torch_flex(q, k, v, block_mask=bm, score_mod=alibi)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("score", ["alibi"])
def test_it_traces_under_torch_compile_fullgraph(score: str | None) -> None:
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 2, 32, 32, 8))
    sm = None if score is None else alibi
    bm = TF.create_block_mask(causal, None, None, 32, 32, device="cpu", BLOCK_SIZE=16)
    torch._dynamo.reset()
    compiled = torch.compile(flex.flex_attention, fullgraph=True, backend="eager")  # tracing, not inductor's build
    out = compiled(q, k, v, score_mod=sm, block_mask=bm)
    torch.testing.assert_close(out, flex.flex_attention(q, k, v, score_mod=sm, block_mask=bm))
    out.sum().backward()
    assert q.grad is not None
    # return_lse (deprecated by torch, which warns only outside a trace): it broke the graph on the warning
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        got, lse = compiled(q, k, v, score_mod=sm, block_mask=bm, return_lse=True)
        want, want_lse = flex.flex_attention(q, k, v, score_mod=sm, block_mask=bm, return_lse=True)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(lse, want_lse)


def test_flash_visits_exactly_the_listed_blocks() -> None:
    """Without a score_mod the block mask runs on flash, which visits the blocks the BlockMask lists
    (partial or full) and no other: B = H = 1 and flash's blocks = the BlockMask's."""
    from attnzero import flash

    q, k, v = _qkv(1, 1, 1, L, L, 8)
    for mm in (causal, document, prefix_lm):
        bm = TF.create_block_mask(mm, 1, 1, L, L, device="cpu", BLOCK_SIZE=16)
        assert bm.full_kv_num_blocks is not None
        listed = int(bm.kv_num_blocks.sum()) + int(bm.full_kv_num_blocks.sum())
        flash.COUNTS.update(forward=0)
        with flash_py(), flash.block_sizes(rows=16, cols=16):  # flash.py's own counters
            got = flex.flex_attention(q, k, v, block_mask=bm)
        assert flash.COUNTS["forward"] == listed < (L // 16) ** 2
        torch.testing.assert_close(got, _torch_flex(q, k, v, block_mask=bm), atol=2e-5, rtol=2e-5)


def test_a_top_k_block_map() -> None:
    """attention-gym's top-k block sparsity: per (head, query block), the k key blocks of largest
    mean score, as a hand-made BlockMask (noop mask_mod) — the attention equals the dense mask of
    those blocks, forward and backward."""
    Lq, S, bs, top = 64, 96, 16, 2
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 2, Lq, S, 8))
    with torch.no_grad():
        qb, kb = q.view(1, 2, Lq // bs, bs, 8).mean(3), k.view(1, 2, S // bs, bs, 8).mean(3)
        idx = (qb @ kb.transpose(-2, -1)).topk(top, dim=-1).indices.to(torch.int32)  # (1, 2, 4, top)
    num = torch.full((1, 2, Lq // bs), top, dtype=torch.int32)
    padded = torch.cat([idx, torch.zeros(1, 2, Lq // bs, S // bs - top, dtype=torch.int32)], -1)  # (.., nK)
    bm = TF.BlockMask.from_kv_blocks(num, padded, BLOCK_SIZE=bs, seq_lengths=(Lq, S))
    keep = torch.zeros(1, 2, Lq, S, dtype=torch.bool)
    for h in range(2):
        for i in range(Lq // bs):
            for j in idx[0, h, i].tolist():
                keep[0, h, i * bs : (i + 1) * bs, j * bs : (j + 1) * bs] = True
    got = flex.flex_attention(q, k, v, block_mask=bm)
    want = az.attention(q, k, v, mask=keep, backend="reference")
    torch.testing.assert_close(got, want)
    g1 = torch.autograd.grad(got.sum(), (q, k, v))
    g2 = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_a_one_element_tensor_scale_is_its_value() -> None:
    """torch's flex takes ``scale=torch.tensor(0.5)`` (refused before); one asking for a gradient is
    refused by name, as the scale would get none."""
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    got = flex.flex_attention(q, k, v, scale=torch.tensor(0.5))
    torch.testing.assert_close(got, flex.flex_attention(q, k, v, scale=0.5))
    with pytest.raises(ValueError, match="scale: expected a float or a one-element tensor without requires_grad"):
        flex.flex_attention(q, k, v, scale=torch.tensor(0.5, requires_grad=True))
    # traced: q times the scale, no graph break (its value read by .item() broke a fullgraph compile)
    compiled = torch.compile(flex.flex_attention, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v, scale=torch.tensor(0.5)), got, rtol=1e-5, atol=1e-6)


def test_a_block_mask_serves_many_calls_with_one_mask_until_what_it_reads_changes() -> None:
    """The same BlockMask call after call is one attnzero Mask (its block table and partial tiles
    built once: a new one per call cost 30× the attention at L = 128); a document-id tensor its
    mask_mod reads changed in place, or rebound, gives the new mask's result, as torch's Flex."""
    L = 64
    docs = torch.zeros(L, dtype=torch.int64)
    docs[40:] = 1
    holder = {"docs": docs}

    def same_doc(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return holder["docs"][q_idx] == holder["docs"][kv_idx]

    bm = flex.create_block_mask(same_doc, None, None, L, L, device="cpu", BLOCK_SIZE=16)
    q, k, v = (torch.randn(1, 2, L, 8) for _ in range(3))

    def check() -> None:
        want = TF.flex_attention(q, k, v, block_mask=bm)
        torch.testing.assert_close(flex.flex_attention(q, k, v, block_mask=bm), want, rtol=1e-5, atol=1e-5)

    check()
    check()
    assert len(vars(bm)["_attnzero_masks"]) == 1
    assert flex._mask_of(bm, 1, 2, L, L) is flex._mask_of(bm, 1, 2, L, L)
    docs[36:] = 1  # in place, inside the blocks the table lists as partial: another mask there
    check()
    holder["docs"] = torch.where(torch.arange(L) < 40, 0, 1)  # rebound
    docs.zero_()
    check()
    holder["docs"].data[38:] = 1  # through .data: no version changes
    check()
    holder["docs"].numpy()[39:] = 1  # a numpy view's write (a data loader's buffer)
    check()
    import copy
    import pickle

    twin = copy.deepcopy(bm)  # the cache stays behind, empty
    assert not vars(twin)["_attnzero_masks"]
    torch.testing.assert_close(flex.flex_attention(q, k, v, block_mask=twin), TF.flex_attention(q, k, v, block_mask=bm))
    assert bm.full_kv_num_blocks is not None
    bm.full_kv_num_blocks.zero_()  # the table itself changed in place: its full blocks now unlisted
    fresh = TF.BlockMask.from_kv_blocks(  # (the same table in a BlockMask attnzero has not seen)
        bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices, BLOCK_SIZE=16, mask_mod=same_doc
    )
    got = flex.flex_attention(q, k, v, block_mask=bm)
    torch.testing.assert_close(got, flex.flex_attention(q, k, v, block_mask=fresh))
    bm = flex.create_block_mask(_causal, None, None, L, L, device="cpu", BLOCK_SIZE=16)
    flex.flex_attention(q, k, v, block_mask=bm)
    twin = pickle.loads(pickle.dumps(bm))  # (its Masks' predicates are local functions: not pickled)
    assert not vars(twin)["_attnzero_masks"]
    torch.testing.assert_close(flex.flex_attention(q, k, v, block_mask=twin), TF.flex_attention(q, k, v, block_mask=bm))


def _causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx >= kv_idx


def test_a_number_the_mask_mod_reads_changes_the_mask() -> None:
    """The same BlockMask, its mask_mod reading a Python number that changes between calls (causal,
    then strictly causal: the same blocks partial): the new number's mask, as torch's."""
    cfg = {"shift": 0}

    def shifted(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx >= kv_idx + cfg["shift"]

    bm = flex.create_block_mask(shifted, None, None, 48, 48, device="cpu", BLOCK_SIZE=16)
    q, k, v = (torch.randn(1, 2, 48, 8) for _ in range(3))
    for shift in (0, 1):
        cfg["shift"] = shift
        want = TF.flex_attention(q, k, v, block_mask=bm)
        torch.testing.assert_close(flex.flex_attention(q, k, v, block_mask=bm), want, rtol=1e-5, atol=1e-5)


def test_a_block_mask_kept_by_a_module_leaves_with_it_and_serves_inference_mode() -> None:
    """The Masks a BlockMask serves are kept on it: a module whose BlockMask's mask_mod reads the module
    is collected with it (a table of weak keys kept it for good); inference tensors (no version
    counter) are served too."""
    import gc
    import weakref

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("limit", torch.tensor(5))
            self.block_mask = flex.create_block_mask(lambda b, h, q, kv: (q >= kv) | (kv < self.limit), None, None,
                                                     32, 32, device="cpu", BLOCK_SIZE=16)  # fmt: skip

        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return flex.flex_attention(q, q, q, block_mask=self.block_mask)  # type: ignore[no-any-return]

    model = Model()
    model(torch.randn(1, 2, 32, 8))
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
    with torch.inference_mode():
        model = Model()
        q = torch.randn(1, 2, 32, 8)
        first, again = model(q), model(q)
    torch.testing.assert_close(first, again)
