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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import masks
from ..functional import BACKENDS, attention, attention_weights

INSTALL_HINT = 'transformers is not installed: pip install -e ".[hf]" (or pip install "transformers>=5")'


def keep_mask(**kwargs: Any) -> Tensor | None:
    """transformers' mask hook: a bool keep-mask (B, 1, Lq, Lk), True = may attend, or None.

    transformers calls it with keywords only: ``batch_size``, the query positions (``q_length`` and
    ``q_offset`` in recent versions, ``cache_position`` in older ones), ``kv_length``,
    ``kv_offset``, ``mask_function`` — its index predicate for this layer (causal, sliding window,
    chunked, packed sequences, ...) — and ``attention_mask``, the 2-D padding mask
    (B, kv_offset + Lk), 1 = real token. transformers' own bool builder combines them into one
    tensor, whatever the version's arguments. None comes back only where sdpa's mask also skips: no
    padding and a plain causal or full pattern, which the attention function then redraws from
    ``module.is_causal``.
    """
    from transformers.masking_utils import sdpa_mask

    kwargs.pop("dtype", None)  # eager's float masks need it; a keep-mask is bool
    kwargs.pop("config", None)
    return sdpa_mask(**kwargs)  # type: ignore[no-any-return]


def make_attention_forward(backend: str = "auto") -> Callable[..., tuple[Tensor, Tensor | None]]:
    """An attention function for transformers' ``AttentionInterface`` that runs ``backend``."""

    def attention_forward(
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        position_bias: Tensor | None = None,
        output_attentions: bool = False,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        """query (B, Hq, Lq, D), key (B, Hkv, Lk, D), value (B, Hkv, Lk, Dv) ->
        out (B, Lq, Hq, Dv) and, when ``output_attentions``, weights (B, Hq, Lq, Lk)."""
        if kwargs.get("softcap") is not None:
            raise ValueError("softcap: attnzero has no logit soft-capping; use attn_implementation='eager'")
        if kwargs.get("s_aux") is not None:
            raise ValueError("s_aux: attnzero has no attention sinks; use attn_implementation='eager'")
        Lq, Lk = query.shape[2], key.shape[2]

        keep: Tensor | masks.Mask | None = None
        bias: Tensor | None = None
        causal = False
        if attention_mask is None:
            # No mask built (no padding): the causal pattern, if any, is ours to draw. A single query
            # (decoding with a cache) sees every key; a block of queries is top-left aligned, which
            # is the lower triangle when Lq == Lk and correct for a prefill into a static cache.
            wants_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
            if wants_causal and Lq > 1:
                if Lq == Lk:
                    causal = True
                else:
                    keep = masks.causal(Lq, Lk, align="top_left")
        elif attention_mask.dtype == torch.bool:
            keep = attention_mask  # (B|1, 1|H, Lq, Lk), True = may attend
        else:
            bias = attention_mask  # additive float mask (0 = keep, large negative = block)
        if position_bias is not None:
            bias = position_bias if bias is None else bias + position_bias

        out = attention(
            query, key, value, mask=keep, bias=bias, causal=causal, scale=scaling, dropout_p=dropout,
            backend=backend,  # type: ignore[arg-type]
        )
        assert isinstance(out, Tensor)
        out = out.transpose(1, 2).contiguous()  # (B, Hq, Lq, Dv) -> (B, Lq, Hq, Dv)
        weights = None
        if output_attentions or _collecting_attentions():
            weights = attention_weights(query, key, mask=keep, bias=bias, causal=causal, scale=scaling)
        return out, weights

    attention_forward.__name__ = f"attnzero_{backend}_attention_forward"
    return attention_forward


def _collecting_attentions() -> bool:
    """Whether transformers is collecting attention weights in this call. Some models (GPT-2)
    drop ``output_attentions`` before it reaches the attention function and read the weights from
    its output through a hook; the hook's collector says whether they were asked for."""
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
    return name
