"""Logit soft-capping, attention sinks and packed training through transformers, against eager.

Gemma 2 (soft-capping, a sliding window on alternate layers, GQA), gpt-oss (attention sinks — a
learned logit per head —, a sliding window, GQA) and Inkling 2 (sinks computed per query) with
attnzero as their attention give what transformers' eager attention gives: logits, greedy
``generate()`` with left padding and a static cache, ``output_attentions`` and the gradient of a
loss with respect to every parameter (the sinks included). A batch flattened by
``DataCollatorWithFlattening`` gives the loss and gradients of the same sequences padded, and runs
through ``attnzero.attention_varlen``. Everything is tiny and random; nothing is downloaded.

Tolerances are the rule of ``attnzero.testing`` with transformers' eager as the reference
implementation, on the same weights. A float64 model is not float64 end to end: every RMSNorm of
these models computes in float32 (``hidden_states.to(torch.float32)``), and Gemma 2's and Inkling 2's
eager softmax too (``softmax(..., dtype=torch.float32)``), so two float64 runs whose attention
differs in the last bits agree only to float32 roundings downstream. The baseline is therefore the
model run in float32 on the same weights: err(attnzero64) <= 2 (3 for gradients) × err(eager32) +
the float32 floor, errors measured against eager in float64 (the golden).

Each model test first checks that the feature matters in its configuration — without the cap or
the sinks eager moves by far more than the bound —, so every comparison can fail.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from conftest import BACKENDS, need

os.environ["HF_HUB_OFFLINE"] = "1"

need("transformers")

import transformers  # noqa: E402

from attnzero.integrations import transformers as hf  # noqa: E402
from attnzero.testing import assert_close_to_golden, floor, magnitude  # noqa: E402

transformers.utils.logging.set_verbosity_error()
NAME = hf.register()


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------ eager, written out
def _eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager attention as Gemma 2 / gpt-oss / Inkling 2 write it, in the inputs' dtype:
    scores, the cap, the mask added as eager's large negative number, a sink column (per head (Hq,)
    or per query (B, Hq, Lq, 1)) joined before the softmax and dropped after it.
    Returns out (B, Lq, Hq, Dv) and weights (B, Hq, Lq, Lk)."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # (B, Hq, Lk, D): GQA as repeat_kv
    s = q @ k.transpose(-1, -2) * scale  # (B, Hq, Lq, Lk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s + torch.zeros_like(s).masked_fill(~keep, torch.finfo(s.dtype).min)
    if sinks is not None:
        per_head = sinks.reshape(1, -1, 1, 1) if sinks.dim() == 1 else sinks
        column = per_head.expand(*s.shape[:3], 1)
        p = torch.softmax(torch.cat([s, column.to(s.dtype)], -1), -1)[..., :-1]  # the sink's column dropped
    else:
        p = torch.softmax(s, -1)
    return (p @ v).transpose(1, 2), p


def _inputs(B: int = 2, Hq: int = 4, Hkv: int = 2, L: int = 7, D: int = 8) -> dict[str, Any]:
    """float64 q, k, v (GQA) with scores of order 10, and a causal keep-mask (B, 1, L, L) where
    sequence 1 (if any) is left-padded: two of its query rows see no key at all."""
    q = torch.randn(B, Hq, L, D, dtype=torch.float64) * 3
    k, v = torch.randn(B, Hkv, L, D, dtype=torch.float64) * 3, torch.randn(B, Hkv, L, D, dtype=torch.float64)
    keep = torch.ones(B, 1, L, L, dtype=torch.bool).tril()
    if B > 1:
        keep[1, :, :, :2] = False  # sequence 1 is left-padded by 2: its rows 0 and 1 see no key
    return {"q": q, "k": k, "v": v, "keep": keep}


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Both in float64 on the same inputs, float64 all through (no model around them): the rule's
    float64 floor (the reference's own error is 0)."""
    assert_close_to_golden(got, want, want)


# ---------------------------------------------------------------------- the interface alone
@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_through_the_interface_is_eagers(backend: str) -> None:
    """Gemma 2's ``softcap``: s = cap·tanh(s / cap) before the mask. Rows that see no key give 0
    (attnzero's rule; eager averages the values there), every other row eager's output and weights."""
    x = _inputs()
    forward = hf.make_attention_forward(backend)
    out, weights = forward(_Module(), x["q"], x["k"], x["v"], x["keep"], scaling=0.5, softcap=2.0,
                           output_attentions=True)  # fmt: skip
    want, want_w = _eager(x["q"], x["k"], x["v"], x["keep"], 0.5, softcap=2.0)
    seen = x["keep"].any(-1)  # (B, 1, L): rows with a key
    assert weights is not None
    _same(out * seen.transpose(1, 2)[..., None], want * seen.transpose(1, 2)[..., None])
    _same(weights * seen[..., None], want_w * seen[..., None])
    assert (out[1, :2] == 0).all() and (weights[1, :, :2] == 0).all()
    uncapped, _ = _eager(x["q"], x["k"], x["v"], x["keep"], 0.5)
    assert (uncapped - want).abs().max() > 0.1  # the cap binds at these scores


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per", ["head", "query", "query (B, Hq, Lq, 1)", "query (1, Hq, Lq, 1)"])
def test_sinks_through_the_interface_are_eagers_forward_and_backward(backend: str, per: str) -> None:
    """gpt-oss's ``s_aux`` (Hq,) and Inkling 2's per-query ``sinks`` (B, Hq, Lq, 1), also given as
    (B, Hq, Lq): a virtual key of value 0 in every softmax. Output, weights (the real keys' columns,
    as eager returns them) and the gradients of q, k, v and the sinks are eager's — rows that see no
    key included: the sink takes all their weight, output 0, in both."""
    x = _inputs()
    B, Hq, L = x["q"].shape[:3]
    shape = {"head": (Hq,), "query": (B, Hq, L), "query (B, Hq, Lq, 1)": (B, Hq, L, 1),
             "query (1, Hq, Lq, 1)": (1, Hq, L, 1)}[per]  # fmt: skip
    sinks = (torch.randn(*shape, dtype=torch.float64) * 2).requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (x["q"], x["k"], x["v"])]
    forward = hf.make_attention_forward(backend)
    keyword = {"s_aux": sinks} if per == "head" else {"sinks": sinks}
    out, weights = forward(_Module(), *leaves, x["keep"], scaling=0.5, output_attentions=True, **keyword)
    column = sinks if per != "query" else sinks[..., None]  # (B, Hq, L) -> (B, Hq, L, 1) as eager takes it
    want, want_w = _eager(*leaves, x["keep"], 0.5, sinks=column)
    assert weights is not None
    _same(out, want)
    _same(weights, want_w)
    assert (weights.sum(-1) < 1 - 1e-3).any()  # the sinks take weight
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, [*leaves, sinks], dout)
    expected = torch.autograd.grad(want, [*leaves, sinks], dout)
    for name, g, e in zip(["dq", "dk", "dv", "dsinks"], got, expected, strict=True):
        assert g.shape == e.shape, name
        assert_close_to_golden(g, e, e, kind="grad", name=name)


def test_softcap_and_sinks_together_and_without_a_mask() -> None:
    """Both features at once; no mask handed over (a causal layer draws its own triangle)."""
    x = _inputs(B=1)
    module = _Module()
    module.is_causal = True
    sinks = torch.randn(4, dtype=torch.float64)
    out, weights = hf.make_attention_forward("reference")(
        module, x["q"], x["k"], x["v"], None, scaling=0.5, softcap=3.0, s_aux=sinks, output_attentions=True
    )
    tril = torch.ones(7, 7, dtype=torch.bool).tril()
    want, want_w = _eager(x["q"], x["k"], x["v"], tril, 0.5, softcap=3.0, sinks=sinks)
    assert weights is not None
    _same(out, want)
    _same(weights, want_w)


def test_sink_keywords_are_checked() -> None:
    forward = hf.make_attention_forward("reference")
    q = torch.randn(2, 4, 3, 8)
    with pytest.raises(ValueError, match=r"^s_aux: expected attention sinks as s_aux or as sinks, got both"):
        forward(_Module(), q, q, q, None, s_aux=torch.zeros(4), sinks=torch.zeros(4))
    with pytest.raises(ValueError, match=r"^s_aux: expected sink logits of shape \(4,\) or \(2, 4, 3\[, 1\]\)"):
        forward(_Module(), q, q, q, None, s_aux=torch.zeros(3))
    with pytest.raises(ValueError, match=r"^sinks: expected sink logits of shape .* got \(2, 4, 5\)"):
        forward(_Module(), q, q, q, None, sinks=torch.zeros(2, 4, 5))
    with pytest.raises(TypeError, match=r"^sinks: expected a floating-point tensor of sink logits, got torch\.int64"):
        forward(_Module(), q, q, q, None, sinks=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="softcap"):
        forward(_Module(), q, q, q, None, softcap=-1.0)


class _Module(torch.nn.Module):
    is_causal = False


# ------------------------------------------------------------------ packed rows: attention_varlen
@contextmanager
def _varlen_calls() -> Iterator[list[dict[str, Any]]]:
    """The keyword arguments of every call of attention_varlen made by the interface."""
    calls: list[dict[str, Any]] = []
    real = hf.attention_varlen

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append({"cu": args[3].tolist(), **kwargs})
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf, "attention_varlen", spy)
        yield calls


_LENGTHS = (5, 2, 6)  # three sequences back to back in one row of 13


def _document(causal: bool = True, window: int | None = None) -> torch.Tensor:
    """(1, 1, 13, 13) bool: each query sees its own sequence (causal: up to itself; window: the
    ``window`` keys up to itself, transformers' sliding mask)."""
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(_LENGTHS))
    i = torch.arange(13)
    keep = ids[:, None] == ids[None, :]
    if causal:
        keep &= i[None, :] <= i[:, None]
    if window is not None:
        keep &= i[None, :] > i[:, None] - window
    return keep[None, None]


def test_packed_row_runs_through_attention_varlen() -> None:
    """``cu_seq_lens_q/k`` with no mask, or with the mask transformers builds for the layer
    (sequences, causal triangle, sliding window), or positions that restart with that mask — with
    softcap, sinks per head or per query —: one call of attention_varlen on the sequences, whose
    result is the dense attention's."""
    x = _inputs(B=1, L=13)
    module = _Module()
    module.is_causal = True
    forward = hf.make_attention_forward("reference")
    cu = torch.tensor([0, 5, 7, 13], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in _LENGTHS])[None]  # (1, 13), restarting
    sinks = torch.randn(4, dtype=torch.float64)
    per_query = torch.randn(1, 4, 13, 1, dtype=torch.float64)  # Inkling 2's (B, Hq, Lq, 1)
    cases: list[tuple[torch.Tensor | None, dict[str, Any], Any]] = [
        (None, {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 6, "max_length_k": 6}, None),
        (_document(), {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}, None),
        (_document(window=3), {"cu_seq_lens_q": cu, "sliding_window": 3}, 2),
        (_document(), {"position_ids": positions}, None),
        (_document(window=3), {"position_ids": positions, "sliding_window": 3, "softcap": 2.0, "s_aux": sinks}, 2),
        (_document(), {"cu_seq_lens_q": cu, "sinks": per_query}, None),
    ]
    for mask, given, window in cases:
        with _varlen_calls() as calls:
            out, weights = forward(module, x["q"], x["k"], x["v"], mask, scaling=0.5, output_attentions=True, **given)
        assert [(c["cu"], c["causal"], c["window"]) for c in calls] == [([0, 5, 7, 13], True, window)], given
        keep = _document(window=None if window is None else window + 1)
        sink = given.get("s_aux", given.get("sinks"))
        want, want_w = _eager(x["q"], x["k"], x["v"], keep, 0.5, softcap=given.get("softcap"), sinks=sink)
        assert weights is not None
        _same(out, want)
        _same(weights, want_w)


def test_packed_row_takes_the_dense_path_when_the_mask_says_more() -> None:
    """A mask that is not exactly the sequences' blocks (a padded key inside the row, a window the
    layer does not declare), restarting positions without a mask (transformers did not draw the
    sequences: they see each other, as in eager), a bias, several rows: no attention_varlen, and
    the dense result."""
    x = _inputs(B=1, L=13)
    module = _Module()
    module.is_causal = True
    forward = hf.make_attention_forward("reference")
    cu = torch.tensor([0, 5, 7, 13], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in _LENGTHS])[None]
    holed = _document().clone()
    holed[..., 3] = False  # key 3 is padding
    tril = torch.ones(1, 1, 13, 13, dtype=torch.bool).tril()
    bias = torch.randn(1, 1, 13, 13, dtype=torch.float64)
    cases: list[tuple[torch.Tensor | None, dict[str, Any], torch.Tensor, torch.Tensor | None]] = [
        (holed, {"cu_seq_lens_q": cu}, holed, None),
        (_document(window=3), {"cu_seq_lens_q": cu}, _document(window=3), None),
        (None, {"position_ids": positions}, tril, None),
        (_document(), {"cu_seq_lens_q": cu, "position_bias": bias}, _document(), bias),
    ]
    for mask, given, keep, added in cases:
        with _varlen_calls() as calls:
            out, _ = forward(module, x["q"], x["k"], x["v"], mask, scaling=0.5, **given)
        assert calls == [], given
        q = x["q"]
        want, _ = _eager(q, x["k"], x["v"], keep, 0.5, sinks=given.get("sinks")) if added is None else _eager_bias(
            q, x["k"], x["v"], keep, 0.5, added
        )
        _same(out, want)
    two = {n: x[n].expand(2, -1, -1, -1) for n in ("q", "k", "v")}
    with _varlen_calls() as calls:
        forward(module, two["q"], two["k"], two["v"], _document().expand(2, -1, -1, -1), position_ids=positions)
    assert calls == []


def _eager_bias(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    G = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(G, 1).transpose(-1, -2) * scale + bias
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
    return (p @ v.repeat_interleave(G, 1)).transpose(1, 2), p


# ------------------------------------------------------------------------------ tiny models
def _gemma2() -> transformers.PreTrainedModel:
    """Soft-capping at 2 (the scores reach beyond it at this initialisation: the cap binds), a window
    of 4 keys on the sliding layer (sequences of 9), GQA 4/2. Untied embeddings: with them tied the
    tiny model's greedy tokens repeat the last one whatever its attention does."""
    config = transformers.Gemma2Config(
        vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=4, attn_logit_softcapping=2.0,
        final_logit_softcapping=None, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    assert config.layer_types == ["sliding_attention", "full_attention"]
    return transformers.Gemma2ForCausalLM(config).eval()


def _gpt_oss() -> transformers.PreTrainedModel:
    """Sinks drawn ~N(0, 1.5²) per head (the default initialisation draws them near 0), a window of
    4 keys on the sliding layer, GQA 4/2, four experts; the experts' eager loop runs float64 (the
    grouped matmul does not)."""
    config = transformers.GptOssConfig(
        vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2,
        experts_implementation="eager",
    )  # fmt: skip
    assert config.layer_types == ["sliding_attention", "full_attention"]
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.5)
    return model


def _llama() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        initializer_range=0.2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


MODELS: dict[str, Callable[[], transformers.PreTrainedModel]] = {"gemma2": _gemma2, "gpt_oss": _gpt_oss}
#: Gemma 2's eager softmax runs in float32 whatever the model's dtype: in float64 the float64 mask
#: minimum becomes -inf there, and a query row that sees no key gives NaN (which a left-padded
#: batch spreads everywhere). gpt-oss's eager stays finite (the sink column keeps such rows defined).
NAN_ON_EMPTY_ROWS = {"gemma2"}


def _pair(arch: str) -> tuple[Any, Any]:
    """The model in float32 and the same weights in float64."""
    torch.manual_seed(0)
    model32 = MODELS[arch]()
    return model32, _float64(model32)


def _float64(model: Any) -> Any:
    """A float64 copy of ``model``, but for what the model keeps in float32 (``_keep_in_fp32_modules_strict``,
    as from_pretrained keeps it: code that casts its input to float32 for it, Inkling 2's router)."""
    copied = copy.deepcopy(model).double()
    keep = getattr(copied, "_keep_in_fp32_modules_strict", None) or []
    for name, t in [*copied.named_parameters(), *copied.named_buffers()]:
        if any(k in name for k in keep):
            t.data = t.data.float()
    return copied


def _padded(side: str, lengths: tuple[int, ...] = (9, 7, 6)) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask (3, 9), padded on ``side``. Runs of at most 3 pads: on the
    right, no padded query is further than the window (4) from a real key — eager in float64 turns
    its float64 mask minimum into -inf in its float32 softmax, and a padded row that sees nothing
    would be NaN (0 × NaN reaches every gradient)."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 101, (3, 9), generator=gen)
    keep = torch.zeros(3, 9, dtype=torch.long)
    for b, n in enumerate(lengths):
        keep[b, slice(9 - n, 9) if side == "left" else slice(0, n)] = 1
    return ids.masked_fill(keep == 0, 0), keep


def _judge(got: torch.Tensor, golden: torch.Tensor, eager32: torch.Tensor, kind: Any = "out", name: str = "") -> None:
    """attnzero in float64 against eager in float64, with eager in float32 as the baseline (see the
    module docstring)."""
    assert_close_to_golden(got, eager32.double(), golden, kind=kind, name=name or kind)


def _bound(golden: torch.Tensor, eager32: torch.Tensor) -> float:
    """The most :func:`_judge` lets through for an output (for the checks that the feature matters)."""
    return 2.0 * float((eager32.double() - golden).abs().max()) + floor(torch.float32, magnitude(golden))


@contextmanager
def _without_the_feature(model: Any) -> Iterator[None]:
    """Gemma 2 without its cap, gpt-oss with sinks of -1e4 (no weight)."""
    layers = [layer.self_attn for layer in model.model.layers]
    if hasattr(layers[0], "attn_logit_softcapping"):
        saved = [a.attn_logit_softcapping for a in layers]
        for a in layers:
            a.attn_logit_softcapping = None
        yield
        for a, cap in zip(layers, saved, strict=True):
            a.attn_logit_softcapping = cap
    else:
        sinks = [a.sinks.detach().clone() for a in layers]
        with torch.no_grad():
            for a in layers:
                a.sinks.fill_(-1e4)
        yield
        with torch.no_grad():
            for a, s in zip(layers, sinks, strict=True):
                a.sinks.copy_(s)


def _run(model: Any, impl: str, run: Callable[[], Any]) -> Any:
    model.set_attn_implementation(impl)
    return run()


@pytest.mark.parametrize("arch", list(MODELS))
@torch.no_grad()
def test_logits_equal_eager(arch: str) -> None:
    """Right padding (and left for gpt-oss, whose eager stays finite on rows that see nothing)."""
    m32, m64 = _pair(arch)
    for side in ["right"] + ([] if arch in NAN_ON_EMPTY_ROWS else ["left"]):
        ids, keep = _padded(side)
        real = keep.bool()
        golden = _run(m64, "eager", lambda: m64(input_ids=ids, attention_mask=keep).logits)[real]  # noqa: B023
        eager32 = _run(m32, "eager", lambda: m32(input_ids=ids, attention_mask=keep).logits)[real]  # noqa: B023
        ours = _run(m64, NAME, lambda: m64(input_ids=ids, attention_mask=keep).logits)[real]  # noqa: B023
        _judge(ours, golden, eager32)
        with _without_the_feature(m64):
            plain = _run(m64, "eager", lambda: m64(input_ids=ids, attention_mask=keep).logits)[real]  # noqa: B023
        assert (plain - golden).abs().max() > 1e3 * _bound(golden, eager32)


@pytest.mark.parametrize("arch", list(MODELS))
@torch.no_grad()
def test_output_attentions_equal_eager(arch: str) -> None:
    """The weights of the real keys (gpt-oss's eager drops the sink's column: rows sum below 1).
    Rows that see no key are compared where eager is defined there (gpt-oss: the sink takes all)."""
    m32, m64 = _pair(arch)
    ids, keep = _padded("right" if arch in NAN_ON_EMPTY_ROWS else "left")
    batch = {"input_ids": ids, "attention_mask": keep, "output_attentions": True}
    golden = _run(m64, "eager", lambda: m64(**batch).attentions)
    eager32 = _run(m32, "eager", lambda: m32(**batch).attentions)
    ours = _run(m64, NAME, lambda: m64(**batch).attentions)
    # real query rows; gpt-oss: all rows (left padding: its empty rows are 0 in eager too)
    rows = keep.bool()[:, None, :, None] if arch in NAN_ON_EMPTY_ROWS else torch.ones((), dtype=torch.bool)
    assert len(ours) == len(golden) == 2
    for a, g, e in zip(ours, golden, eager32, strict=True):
        assert a is not None and a.shape == g.shape == (3, 4, 9, 9)
        _judge(a * rows, g * rows, e * rows, kind="weights")
    if arch == "gpt_oss":
        assert (ours[1].sum(-1) < 1 - 1e-3).any()


@pytest.mark.parametrize("arch", list(MODELS))
def test_gradients_equal_eager(arch: str) -> None:
    """The gradient of a float64 next-token loss over a right-padded batch (no real token is
    predicted from a padded position) with respect to every parameter, gpt-oss's sinks included."""
    m32, m64 = _pair(arch)
    ids, keep = _padded("right")
    labels = ids.masked_fill(keep == 0, -100)

    def grads(model: Any) -> dict[str, torch.Tensor]:
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=keep).logits
        _loss(logits, labels).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    golden = _run(m64, "eager", lambda: grads(m64))
    eager32 = _run(m32, "eager", lambda: grads(m32))
    ours = _run(m64, NAME, lambda: grads(m64))
    assert ours.keys() == golden.keys() == eager32.keys() and len(ours) > 10
    if arch == "gpt_oss":
        assert {f"model.layers.{i}.self_attn.sinks" for i in range(2)} <= ours.keys()
    for name in ours:
        _judge(ours[name], golden[name], eager32[name], kind="grad", name=name)


@pytest.mark.parametrize("arch", list(MODELS))
@torch.no_grad()
def test_greedy_generate_with_left_padding_and_a_static_cache_equals_eager(arch: str) -> None:
    """Prefill, then one query at a time against the static cache (the sliding layer's cache holds
    the window). gpt-oss in float64; Gemma 2 in float32, where eager stays finite on the rows of
    the left padding that see nothing."""
    m32, m64 = _pair(arch)
    model = m32 if arch in NAN_ON_EMPTY_ROWS else m64
    ids, keep = _padded("left")
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0, "eos_token_id": None,
              "cache_implementation": "static", "disable_compile": True}  # fmt: skip
    theirs = _run(model, "eager", lambda: model.generate(input_ids=ids, attention_mask=keep, **kwargs))
    ours = _run(model, NAME, lambda: model.generate(input_ids=ids, attention_mask=keep, **kwargs))
    assert ours.shape == (3, 9 + 8)
    assert torch.equal(ours, theirs)
    with _without_the_feature(model):
        plain = _run(model, "eager", lambda: model.generate(input_ids=ids, attention_mask=keep, **kwargs))
    assert not torch.equal(plain, theirs)  # the tokens depend on the feature


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in the logits' dtype (transformers' own loss upcasts to float32),
    the mean over the predicted tokens."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
    )


# -------------------------------------------------------------------------- packed training
_PACKED_LENGTHS = (7, 3, 6)
PACKED: dict[str, Callable[[], transformers.PreTrainedModel]] = {"llama": _llama, "gemma2": _gemma2}


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("arch", list(PACKED))
def test_packed_batch_trains_as_the_padded_batch(arch: str, flash_kwargs: bool) -> None:
    """A training step on three sequences flattened into one row by DataCollatorWithFlattening
    (positions that restart; with ``return_flash_attn_kwargs`` also cu_seq_lens_q/k and
    max_length_q/k) gives the loss and every gradient of the same sequences right-padded into a
    batch — no sequence sees another — and each attention layer runs once through
    attention_varlen on the three sequences (Gemma 2's sliding layer with its window)."""
    torch.manual_seed(0)
    model32 = PACKED[arch]().train()
    model = _float64(model32)
    for m in (model, model32):
        m.set_attn_implementation(NAME)
    gen = torch.Generator().manual_seed(3)
    sequences = [torch.randint(3, 101, (n,), generator=gen) for n in _PACKED_LENGTHS]
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    packed = collate([{"input_ids": s.tolist()} for s in sequences])
    assert packed["input_ids"].shape == (1, sum(_PACKED_LENGTHS)) and ("cu_seq_lens_q" in packed) == flash_kwargs

    ids = torch.zeros(3, max(_PACKED_LENGTHS), dtype=torch.long)
    keep = torch.zeros_like(ids)
    for b, s in enumerate(sequences):
        ids[b, : len(s)], keep[b, : len(s)] = s, 1
    labels = ids.masked_fill(keep == 0, -100)

    def step(
        model: Any, batch: dict[str, Any], targets: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        loss = _loss(model(**batch, use_cache=False).logits, targets)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    # the padded batch in float64 is the golden, in float32 the baseline (the module docstring)
    padded_loss, padded_grads = step(model, {"input_ids": ids, "attention_mask": keep}, labels)
    loss32, grads32 = step(model32, {"input_ids": ids, "attention_mask": keep}, labels)
    targets = packed.pop("labels")
    with _varlen_calls() as calls:
        packed_loss, packed_grads = step(model, packed, targets)
    window = [3, None] if arch == "gemma2" else [None, None]
    assert [(c["cu"], c["window"]) for c in calls] == [([0, 7, 10, 16], w) for w in window]
    _judge(packed_loss, padded_loss, loss32, name="loss")
    assert packed_grads.keys() == padded_grads.keys() and len(packed_grads) > 10
    for name in packed_grads:
        _judge(packed_grads[name], padded_grads[name], grads32[name], kind="grad", name=name)
    # a row where the sequences saw each other would not be close
    model.zero_grad()
    mixed = _loss(model(input_ids=packed["input_ids"], use_cache=False).logits, targets).detach()
    assert (mixed - padded_loss).abs() > 1e3 * _bound(padded_loss, loss32)


# ------------------------------------------------------------------ per-query sinks: Inkling 2
def _inkling2() -> transformers.PreTrainedModel:
    from test_model_zoo import tiny_config

    config = tiny_config(
        "inkling2_text", initializer_range=0.2, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
        experts_implementation="eager",  # the grouped matmul of the experts does not run float64
    )  # fmt: skip
    cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    return cls(config).eval()


@torch.no_grad()
def test_inkling2_per_query_sinks_equal_eager() -> None:
    """Inkling 2 computes a sink logit per query and head from the hidden state and passes
    ``sinks`` (B, Hq, Lq, 1): the logits of a right-padded batch are eager's (whose softmax runs in
    float32: the float32 baseline of the rule)."""
    torch.manual_seed(0)
    m32 = _inkling2()
    m64 = _float64(m32)
    ids, keep = _padded("right")
    real = keep.bool()
    batch = {"input_ids": ids, "attention_mask": keep}
    seen: list[tuple[int, ...]] = []
    real_sinks = hf._sink_logits

    def spy(s_aux: Any, sinks: Any, B: int, Hq: int, Lq: int) -> Any:
        seen.append(tuple(sinks.shape) if sinks is not None else ())
        return real_sinks(s_aux, sinks, B, Hq, Lq)

    golden = _run(m64, "eager", lambda: m64(**batch).logits)[real]
    eager32 = _run(m32, "eager", lambda: m32(**batch).logits)[real]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf, "_sink_logits", spy)
        ours = _run(m64, NAME, lambda: m64(**batch).logits)[real]
    assert any(s == (3, 4, 9, 1) for s in seen), seen  # per query, in some layers
    _judge(ours, golden, eager32)
    # the sinks matter: eager with every sink logit at -1e4 (no weight) is far off
    projections = [m for n, m in m64.named_modules() if n.endswith("sink_proj")]
    hooks = [m.register_forward_hook(lambda _m, _i, out: torch.full_like(out, -1e4)) for m in projections]
    try:
        plain = _run(m64, "eager", lambda: m64(**batch).logits)[real]
    finally:
        for h in hooks:
            h.remove()
    assert projections and (plain - golden).abs().max() > 1e3 * _bound(golden, eager32)


def test_a_compiled_gemma2_on_attnzero_is_one_graph() -> None:
    """Gemma 2 (sliding window, softcap, padding) compiles with fullgraph=True on attnzero as on
    eager: the mask hook read a WeakValueDictionary and the attention function a ContextVar, two
    graph breaks at every layer (13 in two layers)."""
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=6, max_position_embeddings=64,
        attn_logit_softcapping=5.0, attn_implementation=NAME,
    )  # fmt: skip
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    ids = torch.randint(1, 64, (2, 16))
    pad = torch.ones(2, 16, dtype=torch.long)
    pad[1, :3] = 0
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids, attention_mask=pad).logits,
                                   model(input_ids=ids, attention_mask=pad).logits)  # fmt: skip
