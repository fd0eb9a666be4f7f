"""Hugging Face transformers models with attnzero as their attention.

::

    from transformers import AutoModel
    from attnzero.integrations.transformers import register

    name = register()                 # "attnzero"; backend="auto" picks the fastest correct one
    model = AutoModel.from_pretrained(path, attn_implementation=name)
    # or, on a model already loaded:  model.set_attn_implementation(name)

transformers builds the mask of a model in one place (``masking_utils``) and calls the attention of
every layer through one signature; :func:`register` plugs into both:

* a **mask function** (``AttentionMaskInterface``) that turns the model's 2-D padding mask, causal
  pattern, sliding window, packed sequences, ... into a bool keep-mask ``(B, 1, Lq, Lk)``, True =
  may attend — attnzero's convention. Without one, transformers would hand a custom attention no
  mask at all and padding would be silently lost. When there is nothing to mask beyond the plain
  causal triangle (no padding) it returns None, as transformers' own ``sdpa`` does, and the attention
  function draws the causal mask itself (cheap: backends skip fully blocked blocks);
* an **attention function** (``AttentionInterface``) that receives ``query (B, Hq, Lq, D)``,
  ``key``/``value (B, Hkv, Lk, D)`` — Hkv < Hq for GQA models, handed over as is, attnzero reads
  the shared heads without copying — and returns ``(B, Lq, Hq, Dv)`` plus the attention weights
  when ``output_attentions=True``.

A float mask that transformers hands over (a user's own 4-D additive mask, T5-style position
biases) is additive: it goes to ``bias=``, never to ``mask=``.

**Every keyword a model passes is accounted for.** Honoured: ``attention_mask``, ``scaling``,
``dropout``, ``is_causal``, ``position_bias`` (added to the bias), ``output_attentions``,
``softcap`` (Gemma 2's logit soft-capping, ``softcap·tanh(s/softcap)`` before the mask),
``s_aux`` / ``sinks`` (attention sinks: a virtual key of value 0 whose logit joins each softmax
denominator — one per query head, gpt-oss's ``s_aux`` ``(Hq,)``, or one per query, Inkling 2's
``sinks`` ``(B, Hq, Lq, 1)``; the weights returned for ``output_attentions`` are those of the real
keys, as eager's, which drop the sink's column), ``indices`` (DeepSeek-V3.2-style top-k key
selection: the keys each query may attend, combined with the mask), ``cu_seq_lens_q``/
``cu_seq_lens_k`` and ``seq_idx`` (packed sequences: a query attends only within its own sequence).
Refused with an error naming them while attnzero cannot compute them (:data:`UNSUPPORTED_KEYWORDS`:
``block_indices``), unless None. Ignored: only the keywords of :data:`IGNORED_KEYWORDS`, each with the
reason it cannot change the result. Any other keyword raises ``TypeError`` naming it, rather than
being dropped.

**Packed sequences cost what the sequences cost.** A batch flattened into one row
(``DataCollatorWithFlattening``: positions that restart, optionally ``cu_seq_lens_q/k``) runs through
:func:`attnzero.attention_varlen` — Σ Lᵢ² work instead of the packed length squared — when the call
is exactly what it computes: one row, the sequences from ``cu_seq_lens_q/k`` (or from where
``position_ids`` restart), and the mask transformers built for the layer equal to those sequences' blocks
cut by the layer's causal triangle and sliding window (it is compared, not assumed). Anything else
— padding inside the row, another pattern, a bias — takes the dense path with the same result.

**Models whose own code bypasses the interface are refused when the implementation is set** —
``from_pretrained`` / ``from_config`` / the model's constructor / ``set_attn_implementation`` raise
``ValueError`` saying why and what to use instead. Some transformers models (BLOOM, MPT, RoFormer,
MPNet, ...) compute attention in their own layers yet build their mask through ``masking_utils``
keyed by the implementation name: with attnzero's name they would receive its bool keep-mask where
they expect eager's additive one (padding lost, or the mask inverted). Others (GPT-Neo, Falcon before transformers 5.25,
SAM, ...) pick their attention classes from their own table keyed by the name, which has no entry
for attnzero. :func:`refusal` gives the reason for a model, or None when every attention it computes
goes through the interface (see its docstring for the criterion).
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from .. import masks
from ..functional import BACKENDS, attention, attention_varlen, attention_weights

INSTALL_HINT = 'transformers is not installed: pip install -e ".[hf]" (or pip install "transformers>=5")'

# ------------------------------------------------------------------------------ keywords
#: Keywords a model may pass to the attention function that cannot change its result, with why.
#: Only these are ignored; any keyword neither honoured, listed here, nor in
#: :data:`UNSUPPORTED_KEYWORDS` raises ``TypeError`` naming it.
IGNORED_KEYWORDS: Mapping[str, str] = MappingProxyType(
    {
        "sliding_window": "the window is already in the mask: transformers' mask builder draws it for the "
        "sliding layers through attnzero's mask function (eager and sdpa ignore the keyword too); it is only "
        "read to recognise a packed row's mask for attention_varlen, which the mask must then equal",
        "position_ids": "positions are applied to the queries and keys before attention; packed sequences "
        "(positions that restart, no cache, no 2-D mask) are already in the mask transformers builds from them "
        "(otherwise eager and sdpa ignore the restarts too; cu_seq_lens_q/k are honoured); where they restart is "
        "only read to recognise a packed row's mask for attention_varlen, which the mask must then equal",
        "max_length_q": "a size hint for FlashAttention's varlen kernels, implied by cu_seq_lens_q",
        "max_length_k": "a size hint for FlashAttention's varlen kernels, implied by cu_seq_lens_k",
        "deterministic": "selects deterministic FlashAttention kernels; the value computed is the same",
        "output_hidden_states": "what the model returns, not what attention computes",
        "output_router_logits": "what a mixture-of-experts model returns, not what attention computes",
        "num_items_in_batch": "the loss normalisation of a training step",
        "use_cache": "whether the model keeps a cache; the keys and values handed over already hold it",
        "cache": "the key/value cache, already read: the keys and values handed over hold what it held",
        "past_key_values": "the key/value cache, already read: the keys and values handed over hold what it held",
        "cache_position": "positions of the queries in the cache; the mask already places them",
        "encoder_hidden_states": "cross-attention's keys and values handed over are already projected from them",
        "labels": "the training targets of the loss; attention does not read them",
    }
)

#: Keywords that change the result and that attnzero cannot compute yet: refused when not None,
#: with what they are and which implementation to use meanwhile.
UNSUPPORTED_KEYWORDS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "block_indices": ("block-sparse key selection (as in MiniMax-M3)", "attn_implementation='eager' or 'sdpa'"),
    }
)


def _check_keywords(module: torch.nn.Module, kwargs: Mapping[str, Any]) -> None:
    """Refuse every keyword that could change the result and is not honoured — before any work."""
    who = type(module).__name__
    for name, value in kwargs.items():
        if name in IGNORED_KEYWORDS:
            continue
        if name in UNSUPPORTED_KEYWORDS:
            if value is None:
                continue
            what, instead = UNSUPPORTED_KEYWORDS[name]
            raise ValueError(
                f"{name}: {who} asks for {what}, which attnzero does not support yet; use {instead} for this model"
            )
        raise TypeError(
            f"{name}: {who} passed a keyword attnzero does not know (got {type(value).__name__}); attnzero refuses it "
            "rather than drop something that may change the result. Use attn_implementation='eager' or 'sdpa' "
            "for this model"
        )


def keep_mask(**kwargs: Any) -> Tensor | None:
    """transformers' mask hook: a bool keep-mask (B, 1, Lq, Lk), True = may attend, or None.

    transformers calls it with keywords only: ``batch_size``, the query positions (``q_length`` and
    ``q_offset`` in recent versions, ``cache_position`` in older ones), ``kv_length``,
    ``kv_offset``, ``mask_function`` — its index predicate for this layer (causal, sliding window,
    chunked, packed sequences, ...) — and ``attention_mask``, the 2-D padding mask
    (B, kv_offset + Lk), 1 = real token. transformers' own bool builder combines them into one
    tensor, whatever the version's arguments. None comes back only where sdpa's mask also skips: no
    padding and a plain causal or full pattern, which the attention function then redraws from
    ``module.is_causal`` — as transformers' sdpa does. A model without sdpa support (NLLB-MoE,
    PEGASUS-X, ...) was never written for that: its decoder layers need not say they are causal, so
    for its config (``config`` comes along) the mask is always built.
    """
    from transformers.masking_utils import sdpa_mask

    kwargs.pop("dtype", None)  # eager's float masks need it; a keep-mask is bool
    config = kwargs.pop("config", None)
    if config is not None and id(config) in _EXPLICIT_MASKS:
        kwargs["allow_is_causal_skip"] = False
        kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(**kwargs)  # type: ignore[no-any-return]


#: ids of the configs of models without sdpa support: their masks are always built (see
#: :func:`keep_mask`); an id leaves when its config is collected. A set of ints, which torch.compile
#: reads in the graph (a WeakValueDictionary's lookup broke it at every mask).
_EXPLICIT_MASKS: set[int] = set()


def _note_mask_needs(model: Any) -> None:
    if not getattr(type(model), "_supports_sdpa", False) and id(model.config) not in _EXPLICIT_MASKS:
        _EXPLICIT_MASKS.add(id(model.config))
        weakref.finalize(model.config, _EXPLICIT_MASKS.discard, id(model.config))


def _int_tensor(name: str, value: Any) -> Tensor:
    if (
        not isinstance(value, Tensor)
        or value.dtype.is_floating_point
        or value.dtype.is_complex
        or value.dtype == torch.bool
    ):
        got = f"{value.dtype} tensor" if isinstance(value, Tensor) else type(value).__name__
        raise TypeError(f"{name}: expected an integer tensor, got {got}")
    return value


def _selected_keys(indices: Any, B: int, Hq: int, Lq: int, Lk: int, device: torch.device) -> Tensor:
    """DeepSeek-V3.2-style sparse attention (and GLM-MoE-DSA, Mistral Large 3, ...): ``indices``
    (B, Lq, topk) — or (B, 1|Hq, Lq, topk) — lists, for each query, the key positions (0..Lk-1,
    positions in the key tensor handed over, cache included) its indexer selected; the query attends
    those keys only, within what the mask allows. This is what transformers' eager and sdpa paths
    do with them (a keep-mask scattered from the indices, and-ed with the attention mask). Entries
    outside 0..Lk-1 (-1 pads a short selection) select nothing. Returns (B, 1|Hq, Lq, Lk) bool."""
    idx = _int_tensor("indices", indices)
    if idx.dim() == 3:
        idx = idx.unsqueeze(1)  # (B, 1, Lq, topk)
    if idx.dim() != 4 or idx.shape[0] not in (1, B) or idx.shape[1] not in (1, Hq) or idx.shape[2] != Lq:
        raise ValueError(
            f"indices: expected shape ({B}, {Lq}, topk) or ({B}, 1|{Hq}, {Lq}, topk), got {tuple(indices.shape)}"
        )
    idx = idx.to(device=device, dtype=torch.long)
    inside = (idx >= 0) & (idx < Lk)
    spill = torch.where(inside, idx, torch.full_like(idx, Lk))  # out-of-range picks land in column Lk
    keep = torch.zeros(*idx.shape[:3], Lk + 1, dtype=torch.bool, device=device)
    keep.scatter_(-1, spill, True)
    return keep[..., :Lk]


def _sequence_ids(name: str, cu_seqlens: Any, length: int, device: torch.device) -> Tensor:
    """(length,) index of the packed sequence each token belongs to, from ``cu_seqlens`` (N + 1,):
    0, the running ends of the sequences, ``length``."""
    cu = _int_tensor(name, cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name}: expected a 1-D tensor (number of sequences + 1,), got shape {tuple(cu.shape)}")
    cu = cu.to(device=device, dtype=torch.long)
    if bool((cu[0] != 0) | (cu[-1] != length) | (cu.diff() < 0).any()):
        raise ValueError(
            f"{name}: expected cumulative sequence lengths from 0, non-decreasing, ending at {length} (the packed "
            f"length), got {cu.tolist()}"
        )
    return torch.searchsorted(cu[1:].contiguous(), torch.arange(length, device=device), right=True)


def _packed_ids(cu_q: Any, cu_k: Any, B: int, Lq: int, Lk: int, device: torch.device) -> Tensor:
    """FlashAttention's varlen keywords on a packed batch (transformers' DataCollatorWithFlattening):
    the sequences ``cu_seq_lens_q`` delimits lie back to back in one row, and a query attends only
    keys of its own sequence. (L,) the sequence of each token, after checking the keywords."""
    name = "cu_seq_lens_q" if cu_q is not None else "cu_seq_lens_k"
    if B != 1 or Lq != Lk:
        raise ValueError(
            f"{name}: packed sequences are supported as one row of queries against the same keys "
            f"(batch size 1, Lq == Lk), got batch size {B}, Lq {Lq}, Lk {Lk}; use attn_implementation='eager' or 'sdpa'"
        )
    ids_q = _sequence_ids("cu_seq_lens_q", cu_q, Lq, device) if cu_q is not None else None
    ids_k = _sequence_ids("cu_seq_lens_k", cu_k, Lk, device) if cu_k is not None else None
    if ids_q is not None and ids_k is not None and not torch.equal(ids_q, ids_k):
        raise ValueError(
            "cu_seq_lens_k: expected the same sequences as cu_seq_lens_q for queries and keys of one packed row"
        )
    ids = ids_q if ids_q is not None else ids_k
    assert ids is not None
    return ids


def _restarts(position_ids: Any, L: int, device: torch.device) -> Tensor | None:
    """(L,) the sequence of each token of one row whose positions restart — where transformers'
    mask builder finds packed sequences (a step other than +1 starts one) — or None: not one row
    of L positions, or a single sequence."""
    if not isinstance(position_ids, Tensor) or position_ids.dtype.is_floating_point or position_ids.numel() != L:
        return None
    if position_ids.dim() > 2 or (position_ids.dim() == 2 and position_ids.shape[0] != 1) or L < 2:
        return None  # several rows, or multimodal (3, B, L) positions: no packed row to read
    pos = position_ids.reshape(L).to(device)  # (1, L) -> (L,)
    starts = torch.cat([pos.new_zeros(1), (pos.diff() != 1).long()])  # 1 where a sequence starts
    ids = starts.cumsum(0)
    return ids if bool(ids[-1] > 0) else None


def _varlen_plan(
    attention_mask: Tensor | None,
    ids: Tensor,
    causal: bool,
    sliding_window: Any,
    from_positions: bool,
) -> tuple[Tensor, bool, int | tuple[int, int] | None] | None:
    """How to run one packed row (sequence ids ``ids`` (L,)) through :func:`attention_varlen`, or
    None when the call is not exactly what it computes.

    The mask transformers built for the layer decides: None — nothing beyond the layer's causal
    triangle, within each sequence (only when the sequences come from ``cu_seq_lens``, which
    transformers' mask never shows: sequences read from restarting positions are only real if
    transformers drew them in the mask too) — or a bool keep-mask (1, 1, L, L) equal to the
    sequences' blocks cut by the causal triangle and, when the layer says ``sliding_window`` w,
    by the window of transformers' mask (a query sees the w keys up to itself). Returns
    (cu_seqlens int32 (N + 1,), causal, window)."""
    L = ids.shape[0]
    if L == 0:
        return None  # nothing packed: the dense path answers zero sizes
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=ids.device), ids.diff() != 0])  # (L,)
    ends = torch.cat([starts.nonzero().flatten(), torch.full((1,), L, device=ids.device)])
    cu = ends.to(torch.int32)  # (N + 1,): 0, ..., L
    if attention_mask is None:
        return None if from_positions else (cu, causal, None)
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape != (1, 1, L, L):
        return None
    windows: list[int | tuple[int, int] | None] = [None]
    if isinstance(sliding_window, int) and not isinstance(sliding_window, bool) and sliding_window > 0:
        reach = sliding_window - 1  # transformers' sliding mask: key j is seen from i iff j > i - sliding_window
        windows.insert(0, reach if causal else (reach, reach))
    i = torch.arange(L, device=ids.device)
    keep = ids[:, None] == ids[None, :]  # (L, L): within one sequence
    if causal:
        keep &= i[None, :] <= i[:, None]
    given = attention_mask.reshape(L, L)  # (1, 1, L, L) -> (L, L)
    for window in windows:
        expected = keep
        if window is not None:
            left, right = (window, 0) if isinstance(window, int) else window
            gap = i[:, None] - i[None, :]  # (L, L): query minus key position
            expected = keep & (gap <= left) & (-gap <= right)
        if torch.equal(given, expected):
            return cu, causal, window
    return None


def _sink_logits(s_aux: Any, sinks: Any, B: int, Hq: int, Lq: int) -> Tensor | None:
    """The attention sinks a model passes — gpt-oss-style ``s_aux`` (Hq,), one logit per query
    head (a parameter of the layer), or ``sinks``, per head or per query (Inkling 2's
    (B, Hq, Lq, 1)) — as :func:`attnzero.attention` takes them: (Hq,) or (B|1, Hq, Lq)."""
    if s_aux is not None and sinks is not None:
        raise ValueError("s_aux: expected attention sinks as s_aux or as sinks, got both")
    name, given = ("s_aux", s_aux) if s_aux is not None else ("sinks", sinks)
    if given is None:
        return None
    if not isinstance(given, Tensor) or not given.dtype.is_floating_point:
        got = f"{given.dtype} tensor" if isinstance(given, Tensor) else type(given).__name__
        raise TypeError(f"{name}: expected a floating-point tensor of sink logits, got {got}")
    if given.dim() == 4 and given.shape[-1] == 1:
        given = given.squeeze(-1)  # (B, Hq, Lq, 1) -> (B, Hq, Lq): one sink column beside the keys
    if not (
        (given.dim() == 1 and given.shape[0] == Hq)
        or (given.dim() == 3 and given.shape[0] in (1, B) and given.shape[1:] == (Hq, Lq))
    ):
        raise ValueError(
            f"{name}: expected sink logits of shape ({Hq},) or ({B}, {Hq}, {Lq}[, 1]), got {tuple(given.shape)}"
        )
    if given.dim() == 3 and given.shape[0] != B:
        given = given.expand(B, Hq, Lq)  # one row of sinks for the whole batch: az.attention takes (B, Hq, Lq)
    return given


def _document_keep(ids: Tensor, causal: bool) -> Tensor:
    """(1, 1, L, L) bool: a query attends only keys of its own packed sequence (``ids`` (L,)), and
    only those up to itself when ``causal``."""
    keep = ids[:, None] == ids[None, :]  # (L, L)
    if causal:
        keep = keep.tril()
    return keep[None, None]


def _seq_idx_keep(seq_idx: Any, B: int, Lq: int, Lk: int, device: torch.device) -> Tensor:
    """``seq_idx`` (B, L): the packed sequence of each token (transformers' flattening collator);
    a query attends only keys with the same index. (B, 1, L, L) bool."""
    ids = _int_tensor("seq_idx", seq_idx)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] not in (1, B) or ids.shape[1] != Lq or Lq != Lk:
        raise ValueError(
            f"seq_idx: expected shape ({B}, {Lq}) for queries against the same {Lq} keys, got "
            f"{tuple(seq_idx.shape)} with Lk {Lk}"
        )
    ids = ids.to(device)
    return (ids[:, :, None] == ids[:, None, :]).unsqueeze(1)


def make_attention_forward(backend: str = "auto") -> Callable[..., tuple[Tensor, Tensor | None]]:
    """An attention function for transformers' ``AttentionInterface`` that runs ``backend``."""

    def attention_forward(
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None = None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        position_bias: Tensor | None = None,
        output_attentions: bool = False,
        indices: Tensor | None = None,
        cu_seq_lens_q: Tensor | None = None,
        cu_seq_lens_k: Tensor | None = None,
        seq_idx: Tensor | None = None,
        softcap: float | None = None,
        s_aux: Tensor | None = None,
        sinks: Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        """query (B, Hq, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv) ->
        out (B, Lq, Hq, Dv) and, when ``output_attentions``, weights (B, Hq, Lq, Lk)."""
        _check_keywords(module, kwargs)
        B, Hq, Lq = query.shape[0], query.shape[1], query.shape[2]
        Lk = key.shape[2]
        sink = _sink_logits(s_aux, sinks, B, Hq, Lq)  # (Hq,) or (B|1, Hq, Lq), or None
        wants_causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        want_weights = output_attentions or _collecting_attentions()

        packed = (
            None
            if cu_seq_lens_q is None and cu_seq_lens_k is None
            else _packed_ids(cu_seq_lens_q, cu_seq_lens_k, B, Lq, Lk, query.device)
        )  # (L,) sequence of each token of the one packed row
        if indices is None and seq_idx is None and position_bias is None:
            ids = packed
            if ids is None and B == 1 and Lq == Lk and attention_mask is not None:
                ids = _restarts(kwargs.get("position_ids"), Lq, query.device)
            plan = (
                None
                if ids is None
                else _varlen_plan(attention_mask, ids, wants_causal, kwargs.get("sliding_window"), packed is None)
            )
            if plan is not None and ids is not None:
                cu, causal, window = plan
                packed_sinks = sink if sink is None or sink.dim() == 1 else sink[0]  # (1, Hq, L) -> (Hq, L)
                out = attention_varlen(
                    query[0].transpose(0, 1),  # (1, Hq, L, D) -> (L, Hq, D)
                    key[0].transpose(0, 1),  # (1, Hkv, L, D) -> (L, Hkv, D)
                    value[0].transpose(0, 1),  # (1, Hkv, L, Dv) -> (L, Hkv, Dv)
                    cu,
                    cu,
                    causal=causal,
                    window=window,
                    scale=scaling,
                    softcap=softcap,
                    sinks=packed_sinks,
                    dropout_p=dropout,
                    backend=backend,  # type: ignore[arg-type]
                )
                assert isinstance(out, Tensor)
                weights = None
                if want_weights:
                    keep_w = attention_mask if attention_mask is not None else _document_keep(ids, causal)
                    weights = attention_weights(query, key, mask=keep_w, scale=scaling, softcap=softcap, sinks=sink)
                return out.unsqueeze(0), weights  # (L, Hq, Dv) -> (1, L, Hq, Dv)

        # Keep-masks the keywords add to the model's mask: top-k selections, packed sequences.
        extra: Tensor | None = None
        for part in (
            None if indices is None else _selected_keys(indices, B, Hq, Lq, Lk, query.device),
            None if packed is None else _document_keep(packed, False),
            None if seq_idx is None else _seq_idx_keep(seq_idx, B, Lq, Lk, query.device),
        ):
            if part is not None:
                extra = part if extra is None else extra & part

        keep: Tensor | masks.Mask | None = None
        bias: Tensor | None = None
        causal = False
        if attention_mask is None:
            # No mask built (no padding): the causal pattern, if any, is ours to draw. A single query
            # (decoding with a cache) sees every key; a block of queries is top-left aligned, which
            # is the lower triangle when Lq == Lk and correct for a prefill into a static cache.
            if wants_causal and Lq > 1:
                if Lq == Lk:
                    causal = True
                elif extra is None:
                    keep = masks.causal(Lq, Lk, align="top_left")
                else:
                    keep = torch.ones(Lq, Lk, dtype=torch.bool, device=query.device).tril()  # top-left
        elif attention_mask.dtype == torch.bool:
            keep = attention_mask  # (B|1, 1|H, Lq, Lk), True = may attend
        elif not attention_mask.is_floating_point() and position_bias is None:
            # (named here: as a bias it is refused as `bias`; T5's position_bias makes it a float bias, as
            # in transformers' eager and SDPA paths)
            raise TypeError(
                f"attention_mask: expected a bool mask (True = may attend) or a floating additive one, "
                f"got {attention_mask.dtype}"
            )
        else:
            bias = attention_mask  # additive float mask (0 = keep, large negative = block)
        if extra is not None:
            assert not isinstance(keep, masks.Mask)
            keep = extra if keep is None else keep & extra
        if position_bias is not None:
            bias = position_bias if bias is None else bias + position_bias

        out = attention(
            query,
            key,
            value,
            mask=keep,
            bias=bias,
            causal=causal,
            scale=scaling,
            softcap=softcap,
            sinks=sink,
            dropout_p=dropout,
            backend=backend,  # type: ignore[arg-type]
        )
        assert isinstance(out, Tensor)
        out = out.transpose(1, 2).contiguous()  # (B, Hq, Lq, Dv) -> (B, Lq, Hq, Dv)
        weights = None
        if want_weights:
            weights = attention_weights(
                query, key, mask=keep, bias=bias, causal=causal, scale=scaling, softcap=softcap, sinks=sink
            )
        return out, weights

    attention_forward.__name__ = f"attnzero_{backend}_attention_forward"
    return attention_forward


def _collecting_attentions() -> bool:
    """Whether transformers is collecting attention weights in this call. Some models (GPT-2)
    drop ``output_attentions`` before it reaches the attention function and read the weights from
    its output through a hook; the hook's collector says whether they were asked for. Not while
    torch.compile traces (it cannot read a ContextVar: a graph break at every layer)."""
    if torch.compiler.is_compiling():
        return False
    try:
        from transformers.utils.output_capturing import _active_collector

        collected = _active_collector.get()
    except (ImportError, LookupError, AttributeError):
        return False
    return isinstance(collected, dict) and ("attentions" in collected or "cross_attentions" in collected)


def name_for(backend: str) -> str:
    """A name to register a backend under, beside the default "attnzero": "attnzero" for "auto",
    else "attnzero-<backend>" — with "flash" spelled "tiled", because transformers treats any name
    containing "flash" as its own FlashAttention kernels."""
    return "attnzero" if backend == "auto" else f"attnzero-{backend.replace('flash', 'tiled')}"


def register(name: str = "attnzero", backend: str = "auto") -> str:
    """Register attnzero with transformers under ``name`` and return the name.

    Afterwards ``from_pretrained(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)`` sends every attention call of the model through
    ``attnzero.attention(..., backend=backend)``. Registering a name again replaces the earlier
    entry; to keep several backends side by side, give each its own name (:func:`name_for`).

    Raises:
        TypeError / ValueError: ``name`` is not a non-empty string, contains "flash" (transformers
            would take it for its own FlashAttention), or ``backend`` is unknown.
        ImportError: transformers is not installed, with how to install it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty str, got {name!r}")
    if "flash" in name:
        raise ValueError(
            f"name: expected a name without 'flash' (transformers routes those to its FlashAttention kernels), "
            f"got {name!r}"
        )
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    AttentionInterface.register(name, make_attention_forward(backend))
    AttentionMaskInterface.register(name, keep_mask)
    _install_guard().add(name)
    return name


# ------------------------------------------------------------ models that bypass the interface
#: transformers' mask builders: the mask a model gets from them is in the convention of the
#: implementation named in its config (for attnzero: a bool keep-mask, or None without padding).
_MASK_BUILDERS = re.compile(
    r"\b(create_causal_mask|create_bidirectional_mask|create_sliding_window_causal_mask|"
    r"create_bidirectional_sliding_window_mask|create_chunked_causal_mask|create_masks_for_generate|"
    r"ALL_MASK_ATTENTION_FUNCTIONS)\b"
)
#: Code that turns scores into attention probabilities, or calls a fused attention, by itself.
_OWN_ATTENTION = re.compile(
    r"\bsoftmax\(|scaled_dot_product_attention\(|flex_attention\(|flash_attn_(?:varlen_)?func\("
)
#: A layer that rewrites the mask it is handed by concatenating or padding it — values in eager's
#: additive convention (DeepSeek-V4 appends its compressor's float block bias, cast to the mask's
#: dtype: with a bool keep-mask, every blocked slot becomes kept and every kept one blocked).
_MASK_REWRITE = re.compile(
    r"\b(?:attention_mask|causal_mask)\s*=\s*(?:torch\.cat|(?:torch\.nn\.functional|nn\.functional|F)\.pad)\("
    r"\s*\[?\s*(?:attention_mask|causal_mask)\b"
)
#: A lookup keyed by the implementation name: ``FALCON_ATTENTION_CLASSES[config._attn_implementation]``.
_NAME_TABLE = re.compile(r"\b([A-Za-z_]\w*)\[\s*(?:self\.)?(?:config\.)?_?attn_implementation\s*\]")
#: An attention layer class, as transformers' own ``_can_set_attn_implementation`` spots them.
_ATTENTION_CLASS = re.compile(r"^class \w*Attention\w*\(nn\.Module\):", re.MULTILINE)
_INTERFACES = frozenset({"ALL_ATTENTION_FUNCTIONS", "ALL_MASK_ATTENTION_FUNCTIONS"})
#: The parameter names transformers' models pass the built mask under.
_MASK_PARAMETERS = frozenset({"attention_mask", "encoder_attention_mask", "causal_mask"})

#: Attention layers that compute attention themselves on a mask parameter and yet are safe: read
#: in transformers' source, the mask they receive is built by their own model code, never by the
#: mask builder (so it does not depend on the implementation name). Found by the same scan
#: :func:`refusal` applies, among the models that otherwise route attention through the interface.
OWN_MASK_ATTENTION: Mapping[str, str] = MappingProxyType(
    {
        "PegasusXGlobalLocalAttention": "PegasusXEncoder builds its additive block mask itself",
        "DetrMHAttentionMap": "DETR's segmentation head builds its additive mask from the pixel mask",
        "ConditionalDetrMHAttentionMap": "the segmentation head builds its additive mask from the pixel mask",
        "MaskFormerDetrMHAttentionMap": "the segmentation head builds its additive mask from the pixel mask",
        "ClapAudioSelfAttention": "the Swin-style audio encoder builds its shifted-window mask itself",
        "EsmFold2RowAttentionPooling": "pools over a 2-D bool residue mask it is handed by its own model",
        "PPDocLayoutV2MultiscaleDeformableAttention": "deformable attention over the flattened 2-D pixel mask",
    }
)


@functools.cache
def _module_source(module_name: str) -> str:
    module = sys.modules.get(module_name)
    try:
        return inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return ""


def _model_code(cls: type) -> list[type]:
    """``cls`` and its bases that are model code: transformers' ``models`` package or a model's own
    (remote) code — not torch, nor transformers' machinery (``PreTrainedModel``, ``GenerationMixin``)."""

    def is_model_code(c: type) -> bool:
        top = c.__module__.split(".")[0]
        if top == "transformers":
            return c.__module__.startswith("transformers.models.")
        return top not in ("torch", "builtins", "typing", "abc")

    return [c for c in cls.__mro__ if is_model_code(c)]


@functools.cache
def _top_level_classes(module_name: str) -> dict[str, str]:
    """The source of each class defined at the top of a module, from one parse of the module
    (``inspect.getsource`` on a class parses the whole module again, each time)."""
    source = _module_source(module_name)
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    lines = source.splitlines(keepends=True)
    return {
        node.name: "".join(lines[node.lineno - 1 : node.end_lineno])
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }


def _own_source(cls: type) -> str:
    found = _top_level_classes(cls.__module__).get(cls.__qualname__)
    if found is not None:
        return found
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def _class_source(cls: type) -> str:
    """The source of ``cls`` and of its model-code bases (an attention may inherit its code)."""
    return "\n".join(_own_source(c) for c in _model_code(cls))


_TABLES: dict[type, str | None] = {}
_BYPASSES: dict[type, bool] = {}  # class -> computes attention on a built mask


def _name_table(cls: type) -> str | None:
    """The name of a table keyed by the implementation name in the modeling code of ``cls``."""
    if cls not in _TABLES:
        found = (t for c in _model_code(cls) for t in _NAME_TABLE.findall(_module_source(c.__module__)))
        _TABLES[cls] = next((str(t) for t in found if t not in _INTERFACES), None)
    return _TABLES[cls]


def _bypassing_layer(cls: type) -> type | None:
    """``cls`` if it computes attention itself on a built mask (see ``_computes_own_attention``),
    else such a class of its modeling file that its code names — a layer it may build or swap in
    later (BigBird-Pegasus' encoder attention switches to a full attention of its own on short
    inputs) — else None."""
    if cls not in _BYPASSES:
        _BYPASSES[cls] = _computes_own_attention(cls)
    if _BYPASSES[cls]:
        return cls
    from transformers import PreTrainedModel

    if issubclass(cls, PreTrainedModel):
        return None  # a model names every class it may hold (weight init, ...): its layers are checked
    namespace = vars(sys.modules[cls.__module__]) if cls.__module__ in sys.modules else {}
    for word in dict.fromkeys(re.findall(r"\b[A-Z]\w*", _own_source(cls))):
        named = namespace.get(word)
        if isinstance(named, type) and named is not cls and named.__module__ == cls.__module__:
            if named not in _BYPASSES:
                _BYPASSES[named] = _computes_own_attention(named)
            if _BYPASSES[named]:
                return named
    return None


def _computes_own_attention(cls: type) -> bool:
    """Whether a layer of class ``cls`` computes attention itself on a mask built by transformers'
    mask builder: its name says attention, its code computes the probabilities (softmax, or torch's
    / flash's fused attention) without calling ``ALL_ATTENTION_FUNCTIONS``, its forward takes the
    built mask (``attention_mask`` / ``encoder_attention_mask`` / ``causal_mask``), and its modeling
    file builds masks with ``masking_utils``."""
    if not re.search("attention|attn", cls.__name__, re.IGNORECASE) or cls.__name__ in OWN_MASK_ATTENTION:
        return False
    source = _class_source(cls)
    if "ALL_ATTENTION_FUNCTIONS" in source or not _OWN_ATTENTION.search(source):
        return False
    forward = getattr(cls, "forward", None)
    try:
        parameters = set(inspect.signature(forward).parameters) if forward is not None else set()
    except (TypeError, ValueError):
        return False
    return bool(parameters & _MASK_PARAMETERS) and bool(_MASK_BUILDERS.search(_module_source(cls.__module__)))


_REWRITES: dict[type, bool] = {}  # class -> rewrites the built mask before the interface call


def _rewrites_mask(cls: type) -> bool:
    """Whether a layer of class ``cls`` calls the interface on a mask it first rewrote in eager's
    convention: its name says attention, its code calls ``ALL_ATTENTION_FUNCTIONS`` and extends
    the mask it is handed with ``torch.cat`` / ``pad`` (see ``_MASK_REWRITE``), and its modeling
    file builds masks with ``masking_utils`` (so the mask it rewrites is the one built for the
    implementation's name)."""
    if cls not in _REWRITES:
        source = _class_source(cls) if re.search("attention|attn", cls.__name__, re.IGNORECASE) else ""
        _REWRITES[cls] = (
            "ALL_ATTENTION_FUNCTIONS" in source
            and bool(_MASK_REWRITE.search(source))
            and bool(_MASK_BUILDERS.search(_module_source(cls.__module__)))
        )
    return _REWRITES[cls]


def _own_modules(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` and its submodules, without the submodels (PreTrainedModels) inside it that have a
    config of their own (a vision tower, ...): those are checked on their own."""
    from transformers import PreTrainedModel

    config = getattr(model, "config", None)
    stack = [model]
    while stack:
        module = stack.pop()
        yield module
        stack.extend(
            child
            for child in module.children()
            if not isinstance(child, PreTrainedModel) or getattr(child, "config", None) is config
        )


def _instead(model_class: type) -> str:
    sdpa = " or 'sdpa'" if getattr(model_class, "_supports_sdpa", False) else ""
    return f"attn_implementation='eager'{sdpa}"


def refusal(model: torch.nn.Module, name: str = "attnzero") -> str | None:
    """Why ``model`` (a transformers ``PreTrainedModel``) cannot run with attnzero registered as
    ``name``, or None when it can.

    transformers itself has no flag for "this model routes attention through AttentionInterface"
    (``_supports_attention_backend`` is False for T5, BART and Whisper, which do), so attnzero reads
    the modeling code, as transformers' own ``_can_set_attn_implementation`` does. A model is refused
    when its modeling file looks its attention classes up in its own table keyed by the
    implementation name (``FALCON_ATTENTION_CLASSES[config._attn_implementation]``: no entry for
    attnzero), or when one of its layers computes attention itself on the mask that
    ``masking_utils`` builds for the implementation named in its config (see ``_bypassing_layer``; layers
    verified to build their own masks are listed in :data:`OWN_MASK_ATTENTION`), or when one of its
    attention layers extends the built mask with values of eager's additive convention before
    calling the interface (see ``_rewrites_mask``), or when its
    modeling file has attention layer classes and never calls ``ALL_ATTENTION_FUNCTIONS`` — the
    check transformers' own ``_can_set_attn_implementation`` makes — so attnzero would not run.
    Submodels inside ``model`` (a vision tower, ...) are judged on their own.
    """
    cls = type(model)
    table = _name_table(cls)
    if table is not None:
        return (
            f"{cls.__name__} cannot use attn_implementation={name!r}: its modeling code "
            f"({cls.__module__}) picks its attention layers from its own table {table} keyed by the implementation "
            f"name instead of transformers' AttentionInterface, so attnzero cannot be plugged in. "
            f"Use {_instead(cls)} for this model"
        )
    for module in _own_modules(model):
        layer = _bypassing_layer(type(module))
        if layer is not None:
            return (
                f"{cls.__name__} cannot use attn_implementation={name!r}: its attention layer {layer.__name__} "
                f"({layer.__module__}) computes attention in its own code instead of calling transformers' "
                f"AttentionInterface, and would receive the mask transformers builds for {name!r} (attnzero's bool "
                f"keep-mask) where it expects another convention, which gives wrong results. "
                f"Use {_instead(cls)} for this model"
            )
        if _rewrites_mask(type(module)):
            return (
                f"{cls.__name__} cannot use attn_implementation={name!r}: its attention layer {type(module).__name__} "
                f"({type(module).__module__}) extends the mask transformers builds for {name!r} with values in eager's "
                f"additive convention before calling transformers' AttentionInterface; on attnzero's bool keep-mask "
                f"that would keep blocked keys and block kept ones, which gives wrong results. "
                f"Use {_instead(cls)} for this model"
            )
    source = _module_source(cls.__module__)
    if _ATTENTION_CLASS.search(source) and "ALL_ATTENTION_FUNCTIONS" not in source:
        subs = [k for k in getattr(getattr(model, "config", None), "sub_configs", {}) if k]
        partial = (
            f" (a submodel may still use attnzero: pass a dict, e.g. attn_implementation={{'': 'eager', "
            f"{subs[0]!r}: {name!r}}})"
            if subs
            else ""
        )
        return (
            f"{cls.__name__} cannot use attn_implementation={name!r}: its modeling code ({cls.__module__}) has "
            f"attention layers that never call transformers' AttentionInterface, so attnzero would not run in them. "
            f"Use {_instead(cls)} for this model{partial}"
        )
    return None


_GUARD = "_attnzero_names"


def _install_guard() -> set[str]:
    """Make transformers refuse a model :func:`refusal` refuses, when attnzero's name is set as its
    implementation: at construction (``from_pretrained``, ``from_config``, the constructor — a
    model whose own table has no entry for the name fails before its layers are built, any other
    once they are) and in ``set_attn_implementation`` (which leaves the model as it was when it
    raises). Installed once; returns the set of names it guards."""
    from transformers import PreTrainedModel

    names: set[str] | None = PreTrainedModel.__dict__.get(_GUARD)
    if names is not None:
        return names
    names = set()
    get_correct = PreTrainedModel.get_correct_attn_implementation
    post_init = PreTrainedModel.post_init
    set_implementation = PreTrainedModel.set_attn_implementation

    def check(model: Any, name: str) -> None:
        reason = refusal(model, name)
        if reason is not None:
            raise ValueError(f"attn_implementation: {reason}")

    @functools.wraps(get_correct)
    def get_correct_attn_implementation(self: Any, requested_attention: str | None, *args: Any, **kwargs: Any) -> str:
        applicable: str = get_correct(self, requested_attention, *args, **kwargs)
        if applicable in names and _name_table(type(self)) is not None:
            check(self, applicable)  # before the constructor looks its table up (KeyError)
        return applicable

    @functools.wraps(post_init)
    def guarded_post_init(self: Any) -> None:
        name = getattr(self.config, "_attn_implementation", None)
        if name in names:
            check(self, name)  # the layers are built; nothing is initialised yet
            _note_mask_needs(self)
        post_init(self)

    @functools.wraps(set_implementation)
    def set_attn_implementation(
        self: Any, attn_implementation: str | dict[str, Any], *args: Any, **kwargs: Any
    ) -> None:
        saved = _implementations(self)
        try:
            set_implementation(self, attn_implementation, *args, **kwargs)
            models = [m for m in self.modules() if isinstance(m, PreTrainedModel)]
            everywhere = attn_implementation if isinstance(attn_implementation, str) else None
            for model in models:
                name = model.config._attn_implementation
                if everywhere in names:
                    # asked of the whole model: a submodel transformers declined to switch (it only
                    # warns for one outside the interface) is refused with the reason
                    check(model, everywhere)
                elif name in names:
                    check(model, name)
                if name in names:
                    _note_mask_needs(model)
            top = attn_implementation.get("") if isinstance(attn_implementation, dict) else attn_implementation
            if top in names and self.config._attn_implementation != top:
                raise ValueError(
                    f"attn_implementation: transformers does not let {type(self).__name__} switch to {top!r} after "
                    f"loading; load it with attn_implementation={top!r} instead"
                )
        except BaseException:
            for config, value in saved:
                config._attn_implementation_internal = value
            raise

    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation  # type: ignore[method-assign]
    PreTrainedModel.post_init = guarded_post_init  # type: ignore[method-assign]
    PreTrainedModel.set_attn_implementation = set_attn_implementation  # type: ignore[method-assign]
    setattr(PreTrainedModel, _GUARD, names)
    return names


def _implementations(model: Any) -> list[tuple[Any, Any]]:
    """Every config of ``model`` and its submodels (and their sub-configs) with its implementation."""
    from transformers import PreTrainedModel

    seen: dict[int, Any] = {}
    stack = [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    while stack:
        config = stack.pop()
        if id(config) in seen:
            continue
        seen[id(config)] = config
        for key in getattr(config, "sub_configs", {}):
            sub = getattr(config, key, None)
            if sub is not None and hasattr(sub, "_attn_implementation_internal"):
                stack.append(sub)
    return [(c, getattr(c, "_attn_implementation_internal", None)) for c in seen.values()]
