"""The flash backend's parts of issue 13: logit soft-capping (forward and backward, on every path
of the backend), masks that skip blocks by their block structure, and head dims beyond 256.

The golden here is an independent float64 formula written in this file (``capped_attention``:
scores, tanh cap, bias, mask, softmax, @ v; gradients by autograd through it), judged by the
tolerance rule of ``attnzero.testing``. Sizes stay tiny, and blocks are forced tiny so that every
boundary and skip is crossed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import dense_keep, flash_py, qkv, torch_threads

import attnzero as az
from attnzero import dropout, flash, geometry
from attnzero.testing import assert_close_to_golden, magnitude

F64 = torch.float64
NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# The independent formula


def capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    drop: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of softmax(softcap·tanh(scale·QKᵀ / softcap) + bias, blocked pairs removed) V,
    in q's dtype, written from the definition: K/V heads repeated for GQA, the dense keep-mask
    ``keep`` (True = attend), dropout's keep-mask ``drop`` scaled by 1/(1 - p). A row with no kept
    key gives 0 and lse −inf."""
    G = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(G, dim=1)  # (B, Hq, Lk, D)
    v = v.repeat_interleave(G, dim=1)  # (B, Hq, Lk, Dv)
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale  # (B, Hq, Lq, Lk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    kept = torch.ones_like(s, dtype=torch.bool) if keep is None else keep.expand_as(s)
    row_any = kept.any(dim=-1, keepdim=True)  # (B, Hq, Lq, 1)
    s = torch.where(kept, s, NEG_INF)
    s = torch.where(row_any, s, 0.0)  # an empty row: a harmless softmax, multiplied by 0 below
    p = torch.softmax(s, dim=-1) * row_any
    lse = torch.where(row_any.squeeze(-1), torch.logsumexp(s, dim=-1), NEG_INF)
    if drop is not None:
        p = p * drop / (1.0 - dropout_p)
    return p @ v, lse


def formula_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    bias: torch.Tensor | None = None,
    **kw: Any,
) -> dict[str, torch.Tensor]:
    """out, lse and the gradients of <out, dout> w.r.t. q, k, v (and bias), by autograd through
    ``capped_attention``."""
    leaves = {"q": q, "k": k, "v": v} | ({} if bias is None else {"bias": bias})
    xs = {n: t.detach().clone().requires_grad_(True) for n, t in leaves.items()}
    out, lse = capped_attention(xs["q"], xs["k"], xs["v"], bias=xs.get("bias"), **kw)
    gs = torch.autograd.grad(out, list(xs.values()), dout)
    res = {"out": out.detach(), "lse": lse.detach()}
    for n, g in zip(xs, gs):
        res[f"d{n}"] = g.sum_to_size(leaves[n].shape) if g.shape != leaves[n].shape else g
    return res


def judge(
    got: dict[str, torch.Tensor | None],
    gold: dict[str, torch.Tensor],
    ref: dict[str, torch.Tensor] | None = None,
    terms: float = 0.0,
) -> None:
    """The tolerance rule for every result in ``gold``: ``ref`` is the reference run in the
    result's dtype (the golden itself for float64)."""
    ref = gold if ref is None else ref
    for name, want in gold.items():
        have = got[name]
        assert have is not None, name
        assert have.shape == want.shape, (name, have.shape, want.shape)
        if name in ("out", "lse"):
            assert_close_to_golden(have, ref[name], want, kind="lse" if name == "lse" else "out", name=name)
        else:
            assert_close_to_golden(have, ref[name], want, kind="grad", name=name, size=magnitude(want, terms))


def flash_run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    **kw: Any,
) -> dict[str, torch.Tensor | None]:
    """flash.forward, then flash.backward, the plain functions."""
    opts = {"mask": None, "causal": False, "window": None, "dropout_p": 0.0, "dropout_seed": 0, **kw}
    out, lse = flash.forward(q, k, v, bias=bias, **opts)
    res: dict[str, torch.Tensor | None] = {"out": out, "lse": lse}
    if dout is not None:
        dq, dk, dv, db = flash.backward(dout, q, k, v, out, lse, bias=bias, **opts)
        res |= {"dq": dq, "dk": dk, "dv": dv, "dbias": db}
    return res


def reset_counts() -> None:
    for key in flash.COUNTS:
        flash.COUNTS[key] = 0


def test_the_formula_is_the_plain_softmax_without_softcap_and_caps_with_it() -> None:
    """The test's own golden: without softcap it is torch's softmax attention, a huge cap changes
    nothing, and a small one bounds every score: the lse stays below cap + log Lk."""
    q, k, v = qkv(1, 2, 1, 5, 7, 8)
    plain, _ = capped_attention(q, k, v, scale=0.5)
    k2 = k.repeat_interleave(2, dim=1)  # (1, 2, 7, 8)
    want = torch.softmax(q @ k2.transpose(-1, -2) * 0.5, dim=-1) @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(plain, want, rtol=1e-13, atol=1e-13)
    loose, _ = capped_attention(q, k, v, scale=0.5, softcap=1e6)
    torch.testing.assert_close(loose, plain, rtol=1e-9, atol=1e-9)
    _, lse = capped_attention(q * 100.0, k, v, scale=0.5, softcap=2.0)  # scores in the hundreds
    assert bool((lse <= 2.0 + torch.log(torch.tensor(7.0, dtype=F64)) + 1e-12).all())
    assert not torch.allclose(capped_attention(q, k, v, scale=0.5, softcap=0.5)[0], plain)


# ---------------------------------------------------------------------------------------------
# softcap against the formula, float64, tiny blocks

# (B, Hq, Hkv, Lq, Lk, D, Dv) and forced (rows, cols): blocks that do not divide the lengths,
# a single query, Lq > Lk, GQA / MQA, L = 113 and D = 40.
CASES = [
    ((2, 4, 2, 17, 23, 8, 12), (4, 5)),
    ((1, 3, 1, 1, 29, 8, 8), (4, 5)),
    ((1, 2, 2, 113, 113, 40, 40), (32, 16)),
    ((2, 2, 1, 19, 7, 64, 8), (8, 3)),
]
ARGS = [
    {},
    {"causal": True},
    {"window": (5, 2)},
    {"window": (3, None), "causal": True},
    {"mask": True},
    {"mask": True, "causal": True, "bias": True},
    {"bias": True},
    {"dropout_p": 0.3, "causal": True},
]


def _args_id(a: dict[str, Any]) -> str:
    return "-".join(k if v is True else f"{k}{v}" for k, v in a.items()) or "full"


def _problem(case: Any, args: dict[str, Any], softcap: float) -> tuple[Any, ...]:
    """Inputs, flash keywords and the formula's keywords of one case."""
    (B, Hq, Hkv, Lq, Lk, D, Dv), _ = case
    q, k, v = qkv(B, Hq, Hkv, Lq, Lk, D, Dv)
    dout = torch.randn(B, Hq, Lq, Dv, dtype=F64)
    kw: dict[str, Any] = {"scale": 0.4, "softcap": softcap, "causal": args.get("causal", False),
                          "window": args.get("window")}  # fmt: skip
    mask = torch.rand(B, 1, Lq, Lk) < 0.7 if args.get("mask") else None
    bias = torch.randn(1, Hq, Lq, Lk, dtype=F64) if args.get("bias") else None
    p = args.get("dropout_p", 0.0)
    drop = dropout.keep_mask(77, p, (B, Hq, Lq, Lk)) if p > 0 else None
    keep = dense_keep(Lq, Lk, mask=mask, causal=kw["causal"], window=kw["window"])
    flash_kw = {**kw, "mask": mask, "dropout_p": p, "dropout_seed": 77}
    formula_kw = {"scale": 0.4, "softcap": softcap, "keep": keep, "drop": drop, "dropout_p": p}
    return q, k, v, dout, bias, flash_kw, formula_kw


@pytest.mark.parametrize("softcap", [0.5, 5.0], ids=["cap0.5", "cap5"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[0])))
@pytest.mark.parametrize("args", ARGS, ids=_args_id)
def test_softcap_matches_the_formula(case: Any, args: dict[str, Any], softcap: float) -> None:
    """flash.forward / flash.backward with softcap against the float64 formula: causal / window
    (masked after the tanh), masks, bias (its gradient is the capped score's), dropout, GQA."""
    q, k, v, dout, bias, fkw, gkw = _problem(case, args, softcap)
    gold = formula_grads(q, k, v, dout, bias, **gkw)
    rows, cols = case[1]
    with flash.block_sizes(rows=rows, cols=cols):
        got = flash_run(q, k, v, dout, bias, **fkw)
    judge(got, gold)


def test_softcap_changes_the_result() -> None:
    """The cap is applied (a test that could pass with softcap ignored would prove nothing)."""
    q, k, v = qkv(1, 2, 2, 9, 11, 8)
    with_cap = flash.forward(q, k, v, mask=None, bias=None, causal=True, window=None, scale=1.0,
                             dropout_p=0.0, dropout_seed=0, softcap=0.5)[0]  # fmt: skip
    without = flash.forward(q, k, v, mask=None, bias=None, causal=True, window=None, scale=1.0,
                            dropout_p=0.0, dropout_seed=0)[0]  # fmt: skip
    assert (with_cap - without).abs().max() > 1e-2


@pytest.mark.parametrize("causal", [False, True])
def test_softcap_causal_and_window_block_after_the_tanh(causal: bool) -> None:
    """With softcap, causal / window must block after the tanh (tanh(−inf) = −1 would give a
    blocked pair the weight of the lowest score): the blocked pairs carry no weight — changing a
    blocked key's value changes nothing."""
    q, k, v = qkv(1, 1, 1, 12, 12, 8)
    kw = {"mask": None, "bias": None, "causal": causal, "window": (2, 1), "scale": 0.3, "dropout_p": 0.0,
          "dropout_seed": 0, "softcap": 1.0}  # fmt: skip
    with flash.block_sizes(rows=4, cols=4):
        out, _ = flash.forward(q, k, v, **kw)
        v2 = v.clone()
        v2[..., 11, :] += 100.0  # key 11: outside every window of rows 0..7
        out2, _ = flash.forward(q, k, v2, **kw)
    assert torch.equal(out[..., :8, :], out2[..., :8, :])
    keep = dense_keep(12, 12, causal=causal, window=(2, 1))
    want, _ = capped_attention(q, k, v, scale=0.3, softcap=1.0, keep=keep)
    judge({"out": out}, {"out": want})


def test_softcap_with_a_huge_bias() -> None:
    """A bias with finfo.min entries (a float mask), one row huge everywhere but one key (so its
    scores are shifted by the row's largest bias, ``_Problem.shift``); the cap applies before that
    bias. (Rows whose every entry is huge: see
    ``test_rows_whose_whole_bias_is_huge_get_the_references_gradients``.)"""
    B, H, Lq, Lk = 2, 2, 13, 17
    q, k, v = qkv(B, H, 1, Lq, Lk, 8)
    bias = torch.randn(B, 1, Lq, Lk, dtype=F64)
    bias[torch.rand(B, 1, Lq, Lk) < 0.3] = torch.finfo(F64).min
    bias[0, 0, 4, 1:] = torch.finfo(F64).min  # all but one key of a row
    dout = torch.randn(B, H, Lq, 8, dtype=F64)
    for causal in (False, True):
        gold = formula_grads(q, k, v, dout, bias, scale=0.5, softcap=2.0,
                             keep=dense_keep(Lq, Lk, causal=causal))  # fmt: skip
        with flash.block_sizes(rows=4, cols=5):
            got = flash_run(q, k, v, dout, bias, scale=0.5, softcap=2.0, causal=causal)
        judge(got, gold)


def test_softcap_fully_blocked_rows() -> None:
    """Rows with no key (a mask row, causal with Lq > Lk): 0, lse −inf, zero gradients, no NaN."""
    B, H, Lq, Lk = 1, 2, 20, 12
    q, k, v = qkv(B, H, H, Lq, Lk, 8)
    mask = torch.rand(B, 1, Lq, Lk) < 0.8
    mask[..., 13, :] = False
    dout = torch.randn(B, H, Lq, 8, dtype=F64)
    gold = formula_grads(q, k, v, dout, scale=0.3, softcap=0.8, keep=dense_keep(Lq, Lk, mask=mask, causal=True))
    with flash.block_sizes(rows=4, cols=4):
        got = flash_run(q, k, v, dout, mask=mask, causal=True, scale=0.3, softcap=0.8)
    blocked = torch.isinf(gold["lse"])
    assert blocked[0, 0, :8].all() and blocked[0, 0, 13]
    assert got["out"] is not None and (got["out"][blocked] == 0).all()
    judge(got, gold)


def test_softcap_scores_far_past_exp_range_stay_exact() -> None:
    """A cap of 100 lets scores reach 100 (e^100 is past float32's range without the max): exact."""
    q, k, v = qkv(1, 1, 1, 8, 32, 4)
    q, k = q.abs() * 10, k.abs() * 10
    dout = torch.randn(1, 1, 8, 4, dtype=F64)
    gold = formula_grads(q, k, v, dout, scale=1.0, softcap=100.0)
    assert float(gold["lse"].max()) > 64
    with flash.block_sizes(rows=8, cols=8):
        got = flash_run(q, k, v, dout, scale=1.0, softcap=100.0)
    judge(got, gold)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_with_keys_in_one_block(causal: bool, threads: int) -> None:
    """Problems whose keys fit one block cap too (before the causal −inf), with and without the
    lse, on one or two torch threads."""
    q, k, v = qkv(2, 4, 2, 9, 16, 8)
    gold = formula_grads(q, k, v, torch.randn(2, 4, 9, 8, dtype=F64), scale=0.7, softcap=0.9,
                         keep=dense_keep(9, 16, causal=causal))  # fmt: skip
    gold = {"out": gold["out"], "lse": gold["lse"]}
    with torch_threads(threads):
        got = flash_run(q, k, v, None, scale=0.7, softcap=0.9, causal=causal)
        judge(got, gold)
        out, _ = flash.attention(q, k, v, causal=causal, scale=0.7, softcap=0.9, need_lse=False)
        judge({"out": out}, {"out": gold["out"]})


def test_softcap_through_flash_attention_autograd() -> None:
    """flash.attention's autograd Function carries softcap into the backward."""
    q, k, v = qkv(1, 4, 2, 21, 30, 16)
    bias = torch.randn(1, 4, 21, 30, dtype=F64)
    dout = torch.randn(1, 4, 21, 16, dtype=F64)
    gold = formula_grads(q, k, v, dout, bias, scale=0.5, softcap=1.5, keep=dense_keep(21, 30, window=(6, 0)))
    xs = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
    with flash.block_sizes(rows=8, cols=8):
        out, lse = flash.attention(xs[0], xs[1], xs[2], bias=xs[3], window=(6, 0), scale=0.5, softcap=1.5)
        grads = torch.autograd.grad(out, xs, dout)
    got = {"out": out.detach(), "lse": lse, **dict(zip(["dq", "dk", "dv", "dbias"], grads))}
    judge(got, gold)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_softcap_in_lower_precision(dtype: torch.dtype) -> None:
    """Inputs in float32 / bfloat16, judged by the tolerance rule: the golden is the formula in
    float64 on the rounded inputs, the reference run in X is the formula in float32 (the
    accumulator dtype) with its results rounded to X."""
    B, Hq, Hkv, Lq, Lk, D = 2, 4, 2, 33, 41, 16
    q, k, v = (t.to(dtype).to(F64) for t in qkv(B, Hq, Hkv, Lq, Lk, D))
    bias = torch.randn(1, Hq, Lq, Lk, dtype=F64).to(dtype).to(F64)
    dout = torch.randn(B, Hq, Lq, D, dtype=F64).to(dtype).to(F64)
    gkw = {"scale": 0.5, "softcap": 1.3, "keep": dense_keep(Lq, Lk, causal=True)}
    gold = formula_grads(q, k, v, dout, bias, **gkw)
    f32 = formula_grads(*(t.to(torch.float32) for t in (q, k, v, dout, bias)), **gkw)
    ref = {n: t.to(dtype) if n != "lse" else t for n, t in f32.items()}
    x = [t.to(dtype) for t in (q, k, v, dout, bias)]
    with flash.block_sizes(rows=8, cols=16):
        got = flash_run(x[0], x[1], x[2], x[3], x[4], scale=0.5, softcap=1.3, causal=True)
    assert got["out"] is not None and got["out"].dtype == dtype
    judge(got, gold, ref, terms=float(dout.abs().max() * v.abs().max()))


# ---------------------------------------------------------------------------------------------
# Head dims beyond 256


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("dims", [(512, 512), (320, 24), (8, 512)], ids=lambda d: f"D{d[0]}-Dv{d[1]}")
def test_head_dims_beyond_256(dims: tuple[int, int], softcap: float | None) -> None:
    """D = 512 (and Dv = 512) on the forward and the backward, tiny blocks and one key block."""
    D, Dv = dims
    q, k, v = qkv(1, 2, 1, 9, 13, D, Dv)
    dout = torch.randn(1, 2, 9, Dv, dtype=F64)
    scale = D**-0.5
    for causal in (False, True):
        gold = formula_grads(q, k, v, dout, scale=scale, softcap=softcap, keep=dense_keep(9, 13, causal=causal))
        with flash.block_sizes(rows=4, cols=5):
            judge(flash_run(q, k, v, dout, scale=scale, softcap=softcap, causal=causal), gold)
        got = flash_run(q, k, v, None, scale=scale, softcap=softcap, causal=causal)  # one key block
        judge(got, {"out": gold["out"], "lse": gold["lse"]})


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_head_dim_512_through_attention_against_the_reference(dtype: torch.dtype) -> None:
    """az.attention(backend="flash") at D = Dv = 512 against the reference's golden, GQA, causal
    with Lq ≠ Lk, with and without softcap, forward and backward."""
    from conftest import check_against_golden

    q, k, v = qkv(1, 4, 2, 9, 21, 512)
    with flash.block_sizes(rows=4, cols=8):
        check_against_golden("flash", dtype, q, k, v, causal=True)
        check_against_golden("flash", dtype, q, k, v, causal=True, softcap=2.0)


# ---------------------------------------------------------------------------------------------
# Masks that skip blocks


class _Dense(az.Mask):
    """A Mask over a dense keep-tensor (B|1, 1, Lq, Lk) that reports its block structure
    (``key_range``, ``classify``) read straight off the tensor, and records every block it is
    evaluated on: flash must honour whatever a Mask says of itself."""

    def __init__(self, keep: torch.Tensor) -> None:
        self.dense = keep
        self.evaluated: list[tuple[tuple[int, int], tuple[int, int]]] = []

        def pred(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return keep[b if keep.shape[0] > 1 else torch.zeros_like(b), 0, qi, kv]

        super().__init__(pred, keep.shape, "dense-with-blocks")

    def block(self, rows: Any = None, cols: Any = None, device: Any = None) -> torch.Tensor:
        self.evaluated.append((rows, cols))
        return super().block(rows, cols, device)

    def _part(self, batches: tuple[int, int], rows: tuple[int, int]) -> torch.Tensor:
        b = slice(*batches) if self.dense.shape[0] > 1 else slice(None)
        return self.dense[b, :, rows[0] : rows[1]]  # (nb, 1, r, Lk)

    def key_range(self, batches: tuple[int, int], rows: tuple[int, int]) -> tuple[int, int]:
        cols = self._part(batches, rows).flatten(0, 2).any(dim=0).nonzero().flatten()  # kept columns
        return (int(cols.min()), int(cols.max()) + 1) if len(cols) else (0, 0)

    def classify(self, batches: tuple[int, int], rows: tuple[int, int], cols: tuple[int, int]) -> geometry.Kind:
        part = self._part(batches, rows)[..., cols[0] : cols[1]]
        return geometry.SKIP if not part.any() else geometry.FULL if part.all() else geometry.PARTIAL


def _documents(B: int, L: int, bounds: list[list[int]]) -> torch.Tensor:
    """(B, 1, L, L) keep-tensor of documents ending at ``bounds[b]`` (exclusive, increasing)."""
    ids = torch.zeros(B, L, dtype=torch.long)
    for b in range(B):
        for end in bounds[b][:-1]:
            ids[b, end:] += 1
    return (ids[:, :, None] == ids[:, None, :]).unsqueeze(1)


def test_a_document_mask_visits_only_its_documents() -> None:
    """4 equal documents over L = 64 with 16 × 16 blocks: 4 of the 16 blocks, forward and
    backward, and the mask is evaluated on none of them (each is FULL); the result is exact."""
    keep = _documents(1, 64, [[16, 32, 48, 64]])
    mask = _Dense(keep)
    q, k, v = qkv(1, 2, 2, 64, 64, 8)
    dout = torch.randn(1, 2, 64, 8, dtype=F64)
    gold = formula_grads(q, k, v, dout, scale=0.3, keep=keep)
    with flash.block_sizes(rows=16, cols=16):
        reset_counts()
        got = flash_run(q, k, v, dout, scale=0.3, mask=mask)
        assert flash.COUNTS["forward"] == flash.COUNTS["backward"] == 4
        assert mask.evaluated == []
        judge(got, gold)
        reset_counts()
        flash_run(q, k, v, dout, scale=0.3)
        assert flash.COUNTS["forward"] == flash.COUNTS["backward"] == 16


@pytest.mark.parametrize("softcap", [None, 0.8])
@pytest.mark.parametrize("causal", [False, True])
def test_uneven_documents_per_batch_skip_and_stay_exact(causal: bool, softcap: float | None) -> None:
    """Documents that do not line up with the blocks, different per batch, with GQA, causal and
    chunks of one or all batches: every visited block is one the mask does not call SKIP, it is
    evaluated only where PARTIAL, and out / lse / gradients match the formula."""
    B, Hq, Hkv, L = 2, 4, 2, 45
    keep = _documents(B, L, [[7, 20, 21, 45], [30, 45]])
    q, k, v = qkv(B, Hq, Hkv, L, L, 8)
    dout = torch.randn(B, Hq, L, 8, dtype=F64)
    gold = formula_grads(q, k, v, dout, scale=0.3, softcap=softcap, keep=dense_keep(L, L, mask=keep, causal=causal))
    for kv in (10**6, 60):  # chunks of every batch, chunks of one head
        mask = _Dense(keep)
        with flash.block_sizes(rows=8, cols=8):
            got = flash_run(q, k, v, dout, scale=0.3, softcap=softcap, mask=mask, causal=causal)
        judge(got, gold)
        for rows, cols in mask.evaluated:
            part = keep[..., rows[0] : rows[1], cols[0] : cols[1]]
            assert part.any(), f"a SKIP block was evaluated: rows {rows} cols {cols}"
            if kv == 10**6:  # both batches in a chunk: PARTIAL means partial over both
                assert not part.all(), f"a FULL block was evaluated: rows {rows} cols {cols}"


def test_rows_whose_mask_blocks_every_key_are_zero_without_a_block() -> None:
    """A row block whose keys the mask blocks all (key range empty) writes 0 and lse −inf
    directly: no block computed, zero gradients."""
    keep = torch.ones(1, 1, 24, 24, dtype=torch.bool)
    keep[..., 8:16, :] = False
    q, k, v = qkv(1, 2, 1, 24, 24, 8)
    dout = torch.randn(1, 2, 24, 8, dtype=F64)
    gold = formula_grads(q, k, v, dout, scale=0.3, keep=keep)
    reset_counts()
    with flash.block_sizes(rows=8, cols=8):
        got = flash_run(q, k, v, dout, scale=0.3, mask=_Dense(keep))
    assert flash.COUNTS["forward"] == flash.COUNTS["backward"] == 2 * 3
    judge(got, gold)


def test_blocks_inside_the_key_range_that_the_mask_blocks_whole_are_skipped() -> None:
    """A mask with a hole (every query sees the first 8 and the last 8 keys, as attention sinks
    plus a recent window would): the key range is all 64 keys, but only the 2 blocks at its ends
    are computed, forward and backward, and neither is masked."""
    keep = torch.zeros(1, 1, 32, 64, dtype=torch.bool)
    keep[..., :8] = keep[..., 56:] = True
    mask = _Dense(keep)
    q, k, v = qkv(1, 2, 1, 32, 64, 8)
    dout = torch.randn(1, 2, 32, 8, dtype=F64)
    gold = formula_grads(q, k, v, dout, scale=0.3, softcap=2.0, keep=keep)
    reset_counts()
    with flash.block_sizes(rows=8, cols=8):
        got = flash_run(q, k, v, dout, scale=0.3, softcap=2.0, mask=mask)
    assert flash.COUNTS["forward"] == flash.COUNTS["backward"] == 4 * 2
    assert mask.evaluated == []
    judge(got, gold)


# ---------------------------------------------------------------------------------------------
# Through az.attention, against the reference backend (the golden) by the tolerance rule


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["f64", "f32", "bf16"])
@pytest.mark.parametrize(
    "shape", [(1, 2, 2, 1, 17, 8), (2, 4, 2, 17, 17, 40), (1, 3, 1, 113, 29, 64)], ids=lambda s: "x".join(map(str, s))
)
def test_softcap_against_the_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """az.attention(backend="flash", softcap=...) against the reference's golden: awkward sizes,
    Lq ≠ Lk, GQA / MQA, causal, a mask with a fully blocked row, a bias, tiny blocks."""
    from conftest import check_against_golden

    B, Hq, Hkv, Lq, Lk, D = shape
    q, k, v = qkv(B, Hq, Hkv, Lq, Lk, D)
    mask = torch.rand(B, 1, Lq, Lk) < 0.8
    mask[..., 0, :] = False
    bias = torch.randn(1, Hq, Lq, Lk, dtype=F64)
    with flash.block_sizes(rows=8, cols=8):
        check_against_golden("flash", dtype, q, k, v, bias=bias, mask=mask, causal=True, softcap=1.5)
        check_against_golden("flash", dtype, q, k, v, softcap=0.7, window=(4, 1))
    check_against_golden("flash", dtype, q, k, v, softcap=0.7, grads=False)  # one key block


def test_softcap_with_sinks_and_double_backward() -> None:
    """softcap with sinks (folded on flash's lse by attnzero.sinks) against the reference, and a
    gradient of a gradient (create_graph: autograd through the reference's formula)."""
    from conftest import check_against_golden

    q, k, v = qkv(1, 4, 2, 19, 23, 8)
    with flash.block_sizes(rows=8, cols=8):
        check_against_golden("flash", torch.float32, q, k, v, causal=True, softcap=2.0, sinks=torch.randn(4, dtype=F64))
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    res = {}
    for backend in ("reference", "flash"):
        out = az.attention(*xs, causal=True, softcap=2.0, backend=backend)
        assert isinstance(out, torch.Tensor)
        (gq,) = torch.autograd.grad(out.square().sum(), xs[0], create_graph=True)
        res[backend] = torch.autograd.grad(gq.square().sum(), xs)
    for a, b in zip(res["flash"], res["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# The mask builders' block structure, through az.attention


@pytest.fixture
def evaluated(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, Any]]:
    """Every block any Mask is evaluated on, during the test."""
    seen: list[tuple[Any, Any]] = []
    original = az.Mask.block

    def block(self: az.Mask, rows: Any = None, cols: Any = None, device: Any = None) -> torch.Tensor:
        seen.append((rows, cols))
        return original(self, rows, cols, device)

    monkeypatch.setattr(az.Mask, "block", block)
    return seen


def _blocks_visited(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> tuple[int, int]:
    """Forward and backward blocks of one az.attention call on flash (16 × 16 blocks)."""
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    reset_counts()
    with flash.block_sizes(rows=16, cols=16):
        out = az.attention(*xs, backend="flash", **kw)
        assert isinstance(out, torch.Tensor)
        out.sum().backward()
    return flash.COUNTS["forward"], flash.COUNTS["backward"]


def test_a_document_mask_costs_its_documents(evaluated: list[tuple[Any, Any]]) -> None:
    """az.masks.document of 4 equal documents over L = 64: 4 of the 16 blocks, no mask evaluated;
    and with causal (az.masks.and_ with a causal Mask): the 4 diagonal blocks, masked by position
    only — what causal=True costs inside each document."""
    ids = torch.arange(64) // 16
    q, k, v = qkv(1, 2, 2, 64, 64, 8)
    assert _blocks_visited(q, k, v, mask=az.masks.document(ids)) == (4, 4)
    assert evaluated == []
    both = az.masks.and_(az.masks.document(ids), az.masks.causal(64))
    assert _blocks_visited(q, k, v, mask=both) == (4, 4)
    assert evaluated == []
    want = az.attention(q, k, v, mask=both.to_tensor(), backend="reference")
    got = az.attention(q, k, v, mask=both, backend="flash")
    assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
    judge({"out": got}, {"out": want})


def test_a_causal_mask_costs_what_causal_costs(evaluated: list[tuple[Any, Any]]) -> None:
    """A causal Mask (both alignments) and torch's drop-in is_causal visit the blocks causal=True
    visits (36 of 64 at L = 128), and never evaluate a mask."""
    q, k, v = qkv(1, 2, 2, 128, 128, 8)
    want = _blocks_visited(q, k, v, causal=True)
    assert want == (36, 36)
    for align in ("bottom_right", "top_left"):
        assert _blocks_visited(q, k, v, mask=az.masks.causal(128, align=align)) == want  # type: ignore[arg-type]
    xs = [t.clone().float().requires_grad_(True) for t in (q, k, v)]
    reset_counts()
    with flash_py(), flash.block_sizes(rows=16, cols=16):  # (auto is flash on the CPU: flash.py pinned)
        az.scaled_dot_product_attention(*xs, is_causal=True).sum().backward()
    assert (flash.COUNTS["forward"], flash.COUNTS["backward"]) == want
    assert evaluated == []


def test_padding_masks_visit_only_the_real_keys(evaluated: list[tuple[Any, Any]]) -> None:
    """az.masks.padding: a batch's row blocks visit only its real keys (chunks of one batch), with
    no mask evaluated, and the result equals the reference's."""
    q, k, v = qkv(2, 2, 2, 32, 64, 8)
    mask = az.masks.padding([16, 64])
    with flash.block_sizes(rows=16, cols=16):  # chunks of one batch
        reset_counts()
        got = az.attention(q, k, v, mask=mask, backend="flash")
    assert flash.COUNTS["forward"] == 2 * (1 + 4)  # per row block: batch 0 one key block, batch 1 four
    assert evaluated == []
    want = az.attention(q, k, v, mask=mask.to_tensor(), backend="reference")
    assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
    judge({"out": got}, {"out": want})


FINFO32_MIN = -3.4028234663852886e38


@pytest.mark.parametrize(
    ("dtype", "value"), [(torch.float32, FINFO32_MIN), (torch.float64, FINFO32_MIN), (torch.float64, -1e20)],
    ids=["f32-finfo", "f64-finfo32", "f64-1e20"],
)
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
def test_rows_whose_whole_bias_is_huge_get_the_references_gradients(
    dtype: torch.dtype, value: float, with_sinks: bool
) -> None:
    """An additive mask writes a fully masked row as finfo.min everywhere: its scores all round to one
    number and the reference's P is uniform. The lse (≈ finfo.min) keeps none of log Lk's bits, so a
    backward that took P from it would be off by a factor of Lk — flash recomputes that row's lse."""
    from conftest import check_against_golden, randn

    q, k, v = (randn(1, 2, 9, 8) for _ in range(3))
    bias = torch.zeros(1, 1, 9, 9, dtype=torch.float64)
    bias[..., 3, :] = value  # a fully masked row, as an additive mask writes it
    bias[..., 5, 4:] = value
    extra = {"sinks": randn(2)} if with_sinks else {}
    check_against_golden("flash", dtype, q, k, v, bias=bias, **extra)


@pytest.mark.parametrize("value", [-1e9, -1e6, -3e4])
def test_rows_whose_whole_bias_is_large_round_as_the_reference_does(value: float) -> None:
    """float32 rows whose every bias is −1e9 (the seeds' masked_fill value used additively): the
    reference's scores q·k + bias round q·k away (an ulp of 64), the golden's do not — so flash is
    held to the float32 reference, whose rounding it reproduces (scores in natural units, less the
    row's bias max), forward and backward. Before, the backward folded −lse into the score matmul
    before the bias and its gradients were off by 1e6."""
    from conftest import run_attention

    q, k, v = (torch.randn(1, 2, 9, 8, dtype=torch.float64) for _ in range(3))
    bias = torch.zeros(1, 1, 9, 9, dtype=torch.float64)
    bias[..., 3, :] = value
    dout = torch.randn(1, 2, 9, 8, dtype=torch.float64)
    ref = run_attention("reference", torch.float32, q, k, v, dout, bias=bias)
    got = run_attention("flash", torch.float32, q, k, v, dout, bias=bias)
    torch.testing.assert_close(got.out, ref.out, rtol=1e-5, atol=1e-5)
    for name in ("q", "k", "v", "bias"):
        torch.testing.assert_close(got.grads[name], ref.grads[name], rtol=1e-4, atol=1e-4)
