"""az.attention_varlen: packed sequences (FlashAttention's layout) equal az.attention on each sequence
alone — empty sequences, sequences without keys, Lq_n ≠ Lk_n, GQA, causal / window / softcap / sinks,
forward and backward — and cost what the sequences cost."""

from __future__ import annotations

import pytest
import torch
from conftest import BACKENDS, randn

import attnzero as az
from attnzero import flash


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _per_sequence(q, k, v, cu_q, cu_k, sinks=None, **kw):  # type: ignore[no-untyped-def]
    """The expected result: az.attention (reference, float64) per sequence, back to back."""
    outs, lses = [], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for n in range(len(cq) - 1):
        a, b, c, d = cq[n], cq[n + 1], ck[n], ck[n + 1]
        s = sinks if sinks is None or sinks.ndim == 1 else sinks[:, a:b].unsqueeze(0)
        o, l = az.attention(
            q[a:b].transpose(0, 1)[None], k[c:d].transpose(0, 1)[None], v[c:d].transpose(0, 1)[None],
            sinks=s, backend="reference", return_lse=True, **kw,
        )  # fmt: skip
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


CASES = {
    "self": ([5, 0, 17, 1, 9], None),
    "all empty": ([0, 0, 0], None),
    "cross": ([3, 0, 12, 7], [9, 4, 0, 7]),
    "one": ([13], [20]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "kw",
    [{}, {"causal": True}, {"window": (3, 1)}, {"softcap": 2.0, "causal": True}, {"sinks": "head"}, {"sinks": "query"}],
    ids=["plain", "causal", "window", "softcap", "sinks_head", "sinks_query"],
)
def test_varlen_equals_per_sequence_attention(backend: str, case: str, kw: dict[str, object]) -> None:
    lq, lk = CASES[case]
    lk = lq if lk is None else lk
    Hq, Hkv, D = 4, 2, 8
    cu_q, cu_k = _cu(lq), _cu(lk)
    Tq, Tk = sum(lq), sum(lk)
    q = (randn(Tq, Hq, D) * 2).requires_grad_()
    k, v = randn(Tk, Hkv, D).requires_grad_(), randn(Tk, Hkv, D).requires_grad_()
    kw = dict(kw)
    leaves = [q, k, v]
    if kw.get("sinks") == "head":
        kw["sinks"] = randn(Hq).requires_grad_()
    elif kw.get("sinks") == "query":
        kw["sinks"] = randn(Hq, Tq).requires_grad_()
    if "sinks" in kw:
        leaves.append(kw["sinks"])  # type: ignore[arg-type]
    out, lse = az.attention_varlen(q, k, v, cu_q, cu_k, backend=backend, return_lse=True, **kw)  # type: ignore[arg-type]
    want_out, want_lse = _per_sequence(q, k, v, cu_q, cu_k, **kw)
    assert out.shape == (Tq, Hq, D) and lse.shape == (Hq, Tq)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(want_out, leaves, dout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["self", "cross"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_score_mod_sees_positions_within_each_sequence(backend: str, case: str, causal: bool) -> None:
    """A score_mod of attention_varlen gets b = the sequence's index and q_idx / kv_idx within it
    (as torch's Flex did for jagged tensors): the same as a relative bias built per sequence and a
    per-sequence temperature, forward and backward (q, k, v and the two captured tensors). "self"
    packs queries and keys alike (one call over the packed row); "cross" runs each sequence alone."""
    lq, lk = CASES[case]
    lk = lq if lk is None else lk
    Hq, Hkv, D, N = 4, 2, 8, len(lq)
    M = max(*lq, *lk)  # positions within a sequence: q_idx - kv_idx in (-M, M)
    cu_q, cu_k = _cu(lq), _cu(lk)
    q = (randn(sum(lq), Hq, D) * 2).requires_grad_()
    k, v = randn(sum(lk), Hkv, D).requires_grad_(), randn(sum(lk), Hkv, D).requires_grad_()
    table = randn(Hq, 2 * M - 1).requires_grad_()  # relative bias per head
    temp = (torch.rand(N, dtype=torch.float64) + 0.5).requires_grad_()  # one per sequence

    def mod(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return s * temp[b] + table[h, i - j + M - 1]

    out = az.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, score_mod=mod, backend=backend)
    assert isinstance(out, torch.Tensor)
    # The same, written without a mod: sequence n alone, q scaled by temp[n], the bias of its positions.
    outs = []
    for n, (a, b, c, d) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())):
        i, j = torch.arange(b - a).view(-1, 1), torch.arange(d - c).view(1, -1)
        bias = table[:, i - j + M - 1].unsqueeze(0)  # (1, Hq, Lq_n, Lk_n)
        o = az.attention(
            (q[a:b] * temp[n]).transpose(0, 1)[None], k[c:d].transpose(0, 1)[None], v[c:d].transpose(0, 1)[None],
            bias=bias, causal=causal, scale=D**-0.5, backend="reference",
        )  # fmt: skip
        assert isinstance(o, torch.Tensor)
        outs.append(o[0].transpose(0, 1))
    want = torch.cat(outs)
    torch.testing.assert_close(out, want)
    dout = torch.randn_like(out)
    leaves = [q, k, v, table, temp]
    for g, w, name in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(want, leaves, dout), "qkvTt"):
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"d{name}: {m}")


def test_varlen_cost_is_that_of_the_sequences() -> None:
    """8 sequences of 16 packed into 128 tokens: the flash backend visits about 1/8 of the blocks of
    one 128-token sequence."""
    cu = _cu([16] * 8)
    q, k, v = randn(128, 2, 8), randn(128, 2, 8), randn(128, 2, 8)
    with flash.block_sizes(rows=16, cols=16):
        flash.COUNTS.update(forward=0)
        az.attention_varlen(q, k, v, cu, cu, backend="flash")
        packed = flash.COUNTS["forward"]
        flash.COUNTS.update(forward=0)
        az.attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], backend="flash")
        whole = flash.COUNTS["forward"]
    assert packed <= whole / 8


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        ({"cu_seqlens_q": [0, 3, 9]}, TypeError, "cu_seqlens_q"),
        ({"cu_seqlens_q": torch.tensor([0.0, 9.0])}, TypeError, "integer"),
        ({"cu_seqlens_q": torch.tensor([1, 9], dtype=torch.int32)}, ValueError, "from 0 to 9"),
        ({"cu_seqlens_q": torch.tensor([0, 5, 3, 9], dtype=torch.int32)}, ValueError, "non-decreasing"),
        ({"cu_seqlens_k": torch.tensor([0, 9], dtype=torch.int32)}, ValueError, "as many sequences"),
        ({"max_seqlen_q": 2}, ValueError, "max_seqlen_q"),
        ({"max_seqlen_k": 5, "cu_seqlens_k": torch.tensor([0, 2, 9], dtype=torch.int32)}, ValueError, "max_seqlen_k"),
        ({"v": torch.zeros(10, 2, 4)}, ValueError, "10 packed keys"),
        ({"q": torch.zeros(1, 9, 2, 4)}, ValueError, r"\(T, H, D\)"),
        ({"sinks": torch.zeros(2, 3)}, ValueError, "sinks"),
        ({"sinks": torch.zeros(3)}, ValueError, r"\(Hq,\) = \(2,\) or \(Hq, Tq\) = \(2, 9\), got \(3,\)"),
    ],
)
def test_varlen_refuses_bad_input(change: dict[str, object], error: type[Exception], words: str) -> None:
    args: dict[str, object] = {
        "q": torch.zeros(9, 2, 4), "k": torch.zeros(9, 2, 4), "v": torch.zeros(9, 2, 4),
        "cu_seqlens_q": torch.tensor([0, 4, 9], dtype=torch.int32),
        "cu_seqlens_k": torch.tensor([0, 4, 9], dtype=torch.int32),
    }  # fmt: skip
    args |= change
    with pytest.raises(error, match=words):
        az.attention_varlen(**args)  # type: ignore[arg-type]


def test_max_seqlen_equal_to_the_longest_sequence_is_taken() -> None:
    """FlashAttention's usual max_seqlen_q / _k: exactly the longest sequence (a bound, not a length)."""
    q, k, v = torch.randn(9, 2, 4), torch.randn(11, 2, 4), torch.randn(11, 2, 4)
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 7, 11], dtype=torch.int32)
    got = az.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=5, max_seqlen_k=7)
    torch.testing.assert_close(got, az.attention_varlen(q, k, v, cu_q, cu_k))


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_with_no_sequences(backend: str) -> None:
    """N = 0 (cu_seqlens [0], zero-size inputs: valid, DESIGN.md): out (0, Hq, Dv), lse (Hq, 0), and
    a backward of zero-size gradients."""
    q, k, v = (torch.zeros(0, 2, 4, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0], dtype=torch.int32)
    out, lse = az.attention_varlen(q, k, v, cu, cu, backend=backend, return_lse=True, causal=True)
    assert out.shape == (0, 2, 4) and lse.shape == (2, 0)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == (0, 2, 4)
    with pytest.raises(ValueError, match=r"expected shape \(N \+ 1,\)"):
        az.attention_varlen(q, k, v, torch.zeros(0, dtype=torch.int32), cu)
