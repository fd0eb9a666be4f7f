"""The seeds' modules, made real: ``ScaledDotProductAttention`` (seed 002) and
``MultiHeadAttention`` (seed 000), built on ``functional.py``.

Modules are batch first: inputs (B, L, d_model). They keep no per-call state: weights are returned
when asked for (``need_weights=True``), never stashed on the module.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from . import autocast, checks, mods, rotary
from .cache import KVCache
from .functional import BACKENDS, BackendName, attention, attention_weights
from .masks import Mask
from .mods import ScoreMod
from .rotary import RotaryEmbedding


class ScaledDotProductAttention(nn.Module):
    """Seed 002's module: ``forward(Q, K, V, mask=None) -> (output, attn_weights)``.

    ``Q (..., Lq, d_k)``, ``K (..., Lk, d_k)``, ``V (..., Lk, d_v)`` with any leading dims (the seed
    passes (batch, seq_len, d_k)); ``mask`` broadcastable to (..., Lq, Lk), non-zero = may attend.
    Scores are scaled by ``1/sqrt(d_k)``, with ``d_k`` taken from Q when None. Returns the output
    (..., Lq, d_v) and the attention weights (..., Lq, Lk); a row with every key masked gets weights
    and output 0 instead of the seed's NaN. ``dropout`` acts on the weights in training mode only;
    the returned weights are those before dropout.
    """

    def __init__(self, d_k: int | None = None, dropout: float = 0.0) -> None:
        super().__init__()
        if d_k is not None and (isinstance(d_k, bool) or not isinstance(d_k, int) or d_k <= 0):
            raise ValueError(f"d_k: expected None or a positive int, got {d_k!r}")
        self.d_k = d_k
        self.dropout = nn.Dropout(checks.dropout_p(dropout, "dropout", one_ok=True))

    def forward(self, Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        for name, x in (("Q", Q), ("K", K), ("V", V)):
            checks.tensor(name, x, empty_ok=True)  # empty: empty outputs (Lk = 0: zeros), as torch's
            if x.ndim < 2:
                raise ValueError(f"{name}: expected at least 2 dims (..., L, d), got {x.ndim}")
        mixed = autocast.on(Q.device)  # under autocast each op casts its inputs, as torch's modules' ops do
        checks.same_kind("K", K, "Q", Q, dtypes_may_differ=mixed)
        checks.same_kind("V", V, "Q", Q, dtypes_may_differ=mixed)
        if K.shape[-1] != Q.shape[-1]:
            raise ValueError(f"K: last dim {K.shape[-1]} does not match Q's {Q.shape[-1]}")
        if V.shape[-2] != K.shape[-2]:
            raise ValueError(f"V: length {V.shape[-2]} does not match K's {K.shape[-2]}")
        try:
            lead = torch.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2])
        except RuntimeError as e:
            raise ValueError(
                f"K, V: leading dims {tuple(K.shape[:-2])}, {tuple(V.shape[:-2])} do not broadcast "
                f"with Q's {tuple(Q.shape[:-2])}"
            ) from e
        Lq, Lk, d = Q.shape[-2], K.shape[-2], Q.shape[-1]
        if mask is not None:
            if not isinstance(mask, Tensor):
                raise TypeError(f"mask: expected a torch.Tensor, got {type(mask).__name__}")
            try:
                mask = mask.expand(*lead, Lq, Lk)
            except RuntimeError as e:
                raise ValueError(
                    f"mask: shape {tuple(mask.shape)} is not broadcastable to {(*lead, Lq, Lk)}"
                ) from e
        N = math.prod(lead)  # (not -1 in the reshapes: a size may be 0)
        if mask is not None:
            mask = mask.reshape(N, 1, Lq, Lk)  # (N, 1, Lq, Lk), N = prod(leading dims)

        # Fold the leading dims into one batch axis: (..., L, d) -> (N, 1, L, d).
        q = Q.expand(*lead, Lq, d).reshape(N, 1, Lq, d)
        k = K.expand(*lead, Lk, d).reshape(N, 1, Lk, d)
        v = V.expand(*lead, Lk, V.shape[-1]).reshape(N, 1, Lk, V.shape[-1])
        scale = 1.0 / math.sqrt(self.d_k if self.d_k is not None else d)
        weights = attention_weights(q, k, mask=mask, scale=scale)  # (N, 1, Lq, Lk)
        output = self.dropout(weights) @ v  # (N, 1, Lq, d_v)
        return output.reshape(*lead, Lq, V.shape[-1]), weights.reshape(*lead, Lq, Lk)


class MultiHeadAttention(nn.Module):
    """Seed 000's multi-head attention: project with ``W_q, W_k, W_v``, split into heads, attend,
    merge heads, project with ``W_o``.

    Args:
        d_model: model width; query input (B, Lq, d_model) and output (B, Lq, d_model).
        num_heads: query heads; ``d_k = d_model // num_heads`` is the head dim.
        dropout: dropout on the attention probabilities, in training mode only.
        num_kv_heads: key/value heads for GQA (``num_heads % num_kv_heads == 0``); 1 is MQA.
        bias: whether the four projections have a bias.
        kdim, vdim: widths of the key and value inputs (default d_model).
        backend: the ``az.attention`` backend.
        rope: rotary positions on queries and keys: False (none), True (``RotaryEmbedding(d_k)``,
            half-split as Llama) or a ``RotaryEmbedding`` of head dim ``d_k``.
        softcap: None, or a float > 0: logit soft-capping (Gemma 2), each score ``s`` becomes
            ``softcap · tanh(s / softcap)`` before the softmax.
        sinks: whether each head has a learnable attention sink (gpt-oss): a parameter ``sinks``
            of shape (num_heads,), initialised to 0, the logit of a virtual key of value 0 in
            every row's softmax (the weights of a row then sum to less than 1). Without it the
            attribute ``sinks`` is None.
        score_mod: None, or FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score``
            (``az.attention``'s): an ``nn.Module`` (ALiBi slopes or a relative-bias table as its
            Parameters) becomes a submodule, so its parameters train with the rest.

    Decoding: ``forward(x, cache=az.KVCache(B, max_len, num_kv_heads, d_k))`` appends the new
    keys/values (after rotary) to the cache and attends causally to everything cached; the
    positions of the new tokens start at ``len(cache)``.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dropout: float = 0.1,
        *,
        num_kv_heads: int | None = None,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        backend: BackendName = "auto",
        rope: bool | RotaryEmbedding = False,
        softcap: float | None = None,
        sinks: bool = False,
        score_mod: ScoreMod | None = None,
    ) -> None:
        super().__init__()
        for name, val in (("d_model", d_model), ("num_heads", num_heads)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name}: expected a positive int, got {val!r}")
        if d_model % num_heads != 0:
            raise ValueError(f"num_heads: expected a divisor of d_model {d_model}, got {num_heads}")
        kv_heads: int = num_heads if num_kv_heads is None else num_kv_heads
        if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads <= 0:
            raise ValueError(f"num_kv_heads: expected None or a positive int, got {num_kv_heads!r}")
        if num_heads % kv_heads != 0:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads {num_heads}, got {kv_heads}")
        for name, width in (("kdim", kdim), ("vdim", vdim)):
            if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width <= 0):
                raise ValueError(f"{name}: expected None or a positive int, got {width!r}")
        bias = checks.flag("bias", bias)
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = kv_heads
        self.d_k = d_model // num_heads  # head dim
        self.kdim = d_model if kdim is None else kdim
        self.vdim = d_model if vdim is None else vdim
        self.dropout = checks.dropout_p(dropout, "dropout", one_ok=True)  # 1: every weight dropped, as torch's
        self.backend: BackendName = checks.choice("backend", backend, BACKENDS)  # type: ignore[assignment]

        self.W_q = nn.Linear(d_model, num_heads * self.d_k, bias=bias)
        self.W_k = nn.Linear(self.kdim, kv_heads * self.d_k, bias=bias)
        self.W_v = nn.Linear(self.vdim, kv_heads * self.d_k, bias=bias)
        self.W_o = nn.Linear(num_heads * self.d_k, d_model, bias=bias)
        self.rope: RotaryEmbedding | None = rotary.resolve(rope, self.d_k)
        self.softcap: float | None = checks.softcap(softcap)
        self.sinks: nn.Parameter | None = (
            nn.Parameter(torch.zeros(num_heads)) if checks.flag("sinks", sinks) else None
        )  # (num_heads,): exp(0) = 1, one virtual key's worth of weight, as gpt-oss starts
        self.score_mod: ScoreMod | None = mods.check_callable("score_mod", score_mod)  # a Module registers

    def reset_parameters(self) -> None:
        """The parameters as a new module has them: each projection's own init (``nn.Linear``), the
        sinks 0 — what meta-device construction asks of a module after ``to_empty`` (FSDP calls it)."""
        for linear in (self.W_q, self.W_k, self.W_v, self.W_o):
            linear.reset_parameters()
        if self.sinks is not None:
            with torch.no_grad():
                self.sinks.zero_()

    def extra_repr(self) -> str:
        parts = [f"d_model={self.d_model}", f"num_heads={self.num_heads}", f"num_kv_heads={self.num_kv_heads}"]
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap}")
        if self.sinks is not None:
            parts.append("sinks=True")
        return ", ".join(parts)

    def _split_heads(self, x: Tensor, heads: int) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, heads, self.d_k).transpose(1, 2)  # (B, L, h·d_k) -> (B, h, L, d_k)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        mask: Tensor | Mask | None = None,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
        cache: KVCache | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attention of ``query`` (B, Lq, d_model) over ``key`` (B, Lk, kdim) / ``value``
        (B, Lk, vdim); both default to ``query`` (self-attention).

        ``mask``: keep-mask broadcastable to (B, num_heads, Lq, Lk), non-zero = may attend (the
        seed's ``torch.tril(torch.ones(L, L))`` works as is). ``key_padding_mask`` (B, Lk): True =
        a real token (the opposite of ``nn.MultiheadAttention``'s). ``causal``: bottom-right causal.
        Returns (B, Lq, d_model), or ``(output, weights (B, num_heads, Lq, Lk))`` when
        ``need_weights`` — the weights before dropout (with ``sinks``, a row sums to less than 1:
        the rest is the sink's).

        ``cache``: a ``KVCache`` for decoding (self-attention only; key/value omitted or ``query``
        itself). The new L tokens take positions ``len(cache) .. len(cache)+L-1``, their keys and
        values are appended, and attention is causal (bottom-right) over all ``len(cache)+L``
        cached tokens, whatever ``causal`` says; ``mask`` then broadcasts to (B, num_heads, L,
        len(cache)+L). Everything is checked before the cache is written: a call that raises
        leaves it as it was. With ``rope``, queries sit at the bottom-right positions
        ``Lk - Lq + i`` (after the cached ones) and keys at ``j``; with a cache, a ``score_mod``
        gets ``q_idx = len(cache) + i`` too.
        """
        if cache is not None:
            self._check_cache(cache, query, key, value, key_padding_mask)
        defaulted = (key is None, value is None)
        key = query if key is None else key
        value = key if value is None else value
        self._check_inputs(query, key, value, key_padding_mask, defaulted)
        B, Lq = query.shape[0], query.shape[1]
        past = 0 if cache is None else len(cache)  # tokens cached before this call
        Lk = past + key.shape[1]  # keys attended to: the cached ones and the new ones
        keep = checks.mask(mask, (B, self.num_heads, Lq, Lk), query.device)
        is_causal = checks.flag("causal", causal) or cache is not None
        want_weights = checks.flag("need_weights", need_weights)
        if key_padding_mask is not None:
            pad = (key_padding_mask != 0).reshape(B, 1, 1, Lk)  # (B, 1, 1, Lk), True = real token
            keep = pad if keep is None else keep & pad

        q = self._split_heads(self.W_q(query), self.num_heads)  # (B, Hq, Lq, d_k)
        k = self._split_heads(self.W_k(key), self.num_kv_heads)  # (B, Hkv, Lk, d_k)
        v = self._split_heads(self.W_v(value), self.num_kv_heads)  # (B, Hkv, Lk, d_k)
        if self.rope is not None:
            # Keys at past + j, queries bottom-right at Lk - Lq + i; a shift common to both (for
            # Lq > Lk) keeps positions >= 0 and changes no score, which sees only differences.
            shift = max(0, Lq - Lk)
            q = self.rope.rotate_from(q, Lk - Lq + shift)
            k = self.rope.rotate_from(k, past + shift)
        if cache is not None:
            # what the append changes, kept to put back should attention refuse the call (its
            # backend, a score_mod): a call that raises leaves the cache as it was
            saved = cache._save(past, Lk)
            # in the cache's dtype (under autocast the projections may give another); then every cached token
            k, v = cache.update(k.to(cache.dtype), v.to(cache.dtype))  # (B, Hkv, past + Lq, d_k) each
        score_mod = self.score_mod
        if score_mod is not None and past > 0:  # q_idx: the new tokens' positions, as kv_idx the keys'
            score_mod = _from_position(score_mod, past, q.device)
        p = self.dropout if self.training else 0.0
        try:
            out = attention(
                q, k, v, mask=keep, causal=is_causal, softcap=self.softcap, sinks=self.sinks,
                dropout_p=0.0 if p == 1.0 else p, backend=self.backend, score_mod=score_mod,
            )
        except BaseException:
            if cache is not None:
                cache._restore(saved)  # undo this call's append
            raise
        assert isinstance(out, Tensor)
        if p == 1.0:
            out = out * 0.0  # every weight dropped: 0, with zero gradients (as nn.MultiheadAttention)
        out = out.transpose(1, 2).reshape(B, Lq, self.num_heads * self.d_k)  # (B, Lq, Hq·d_k)
        output = self.W_o(out)  # (B, Lq, d_model)
        if not want_weights:
            return output
        return output, attention_weights(
            q, k, mask=keep, causal=is_causal, softcap=self.softcap, sinks=self.sinks, score_mod=score_mod
        )

    def _check_inputs(
        self, query: Any, key: Any, value: Any, key_padding_mask: Any, defaulted: tuple[bool, bool]
    ) -> None:
        """``defaulted``: key, value were not given (key is query, value is key): the messages say so."""
        whence = {"query": "", "key": " (key defaults to query)" if defaulted[0] else "",
                  "value": " (value defaults to key)" if defaulted[1] else ""}  # fmt: skip
        for name, x, width in (("query", query, self.d_model), ("key", key, self.kdim), ("value", value, self.vdim)):
            checks.tensor(name, x, 3, "(B, L, d_model)", empty_ok=True)  # B or L = 0: as torch's module
            if x.shape[-1] != width:
                raise ValueError(f"{name}: expected last dim {width}, got {x.shape[-1]}{whence[name]}")
            checks.same_kind(name, x, "W_q.weight", self.W_q.weight, dtypes_may_differ=autocast.on(x.device))
        if key.shape[0] != query.shape[0] or value.shape[0] != query.shape[0]:
            raise ValueError(
                f"key, value: batch {key.shape[0]}, {value.shape[0]} do not match query's {query.shape[0]}"
            )
        if value.shape[1] != key.shape[1]:
            raise ValueError(f"value: length {value.shape[1]} does not match key's {key.shape[1]}")
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, Tensor):
                raise TypeError(f"key_padding_mask: expected a torch.Tensor, got {type(key_padding_mask).__name__}")
            if tuple(key_padding_mask.shape) != (key.shape[0], key.shape[1]):
                raise ValueError(
                    f"key_padding_mask: expected shape (B, Lk) = {(key.shape[0], key.shape[1])}, "
                    f"got {tuple(key_padding_mask.shape)}"
                )
            if key_padding_mask.device != query.device:
                raise ValueError(
                    f"key_padding_mask: device {key_padding_mask.device} does not match query's {query.device}"
                )

    def _check_cache(self, cache: Any, query: Any, key: Any, value: Any, key_padding_mask: Any) -> None:
        """``cache`` can take this call's keys/values (checked before anything is computed)."""
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache: expected an attnzero KVCache or None, got {type(cache).__name__}")
        for name, x in (("key", key), ("value", value)):
            if x is not None and x is not query:
                raise ValueError(f"{name}: expected None with cache= (self-attention), got a separate tensor")
        if key_padding_mask is not None:
            raise ValueError(
                "key_padding_mask: expected None with cache= (pass mask= broadcastable to "
                "(B, num_heads, L, len(cache) + L) instead), got a tensor"
            )
        checks.tensor("query", query, 3, "(B, L, d_model)", empty_ok=True)
        B, L = query.shape[0], query.shape[1]
        weight = self.W_q.weight
        for what, want, got in (
            ("batch_size", B, cache.batch_size),
            ("num_kv_heads", self.num_kv_heads, cache.num_kv_heads),
            ("head_dim", self.d_k, cache.head_dim),
        ):
            if want != got:
                raise ValueError(f"cache: expected {what} {want} (the module's / query's), got {got}")
        cast_to = torch.get_autocast_dtype(weight.device.type) if autocast.on(weight.device) else None
        if cache.dtype != weight.dtype and cache.dtype != cast_to:
            also = f" or {cast_to} (autocast's)" if cast_to is not None else ""
            raise TypeError(f"cache: expected dtype {weight.dtype} (the module's weights'){also}, got {cache.dtype}")
        if cache.device != weight.device:
            raise ValueError(f"cache: expected device {weight.device} (the module's weights'), got {cache.device}")
        cache.check_room(L)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, *, backend: BackendName = "auto") -> MultiHeadAttention:
        """An attnzero module computing what ``mha`` computes, with its weights copied.

        attnzero modules are always batch first: feed (B, L, E) whatever ``mha.batch_first`` was.
        Masks follow attnzero's convention (True = may attend). ``add_bias_kv`` and
        ``add_zero_attn`` have no counterpart and raise ``ValueError``.
        """
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"mha: expected a torch.nn.MultiheadAttention, got {type(mha).__name__}")
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("mha: expected a module without add_bias_kv / add_zero_attn, got one with them")
        has_bias = mha.out_proj.bias is not None
        ours = cls(
            mha.embed_dim, mha.num_heads, mha.dropout, bias=has_bias, kdim=mha.kdim, vdim=mha.vdim, backend=backend
        )
        ref = mha.out_proj.weight
        ours.to(device=ref.device, dtype=ref.dtype)
        E = mha.embed_dim
        with torch.no_grad():
            if mha.in_proj_weight is not None:  # packed (3E, E) = [W_q; W_k; W_v]
                w_q, w_k, w_v = mha.in_proj_weight.split(E, dim=0)
            else:
                w_q, w_k, w_v = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
            for lin, w in ((ours.W_q, w_q), (ours.W_k, w_k), (ours.W_v, w_v), (ours.W_o, mha.out_proj.weight)):
                lin.weight.copy_(w)
            if has_bias:
                assert mha.in_proj_bias is not None
                for lin, b in zip((ours.W_q, ours.W_k, ours.W_v), mha.in_proj_bias.split(E)):
                    lin.bias.copy_(b)
                ours.W_o.bias.copy_(mha.out_proj.bias)
        # a frozen weight stays frozen: requires_grad as the source parameter's (the packed in_proj's one flag)
        packed = mha.in_proj_weight
        weights = [packed] * 3 if packed is not None else [mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight]
        biases = [mha.in_proj_bias] * 3 + [mha.out_proj.bias]
        for lin, w, b in zip((ours.W_q, ours.W_k, ours.W_v, ours.W_o), [*weights, mha.out_proj.weight], biases):
            lin.weight.requires_grad_(w.requires_grad)
            if has_bias and b is not None:
                lin.bias.requires_grad_(b.requires_grad)
        ours.train(mha.training)
        return ours



def _from_position(score_mod: ScoreMod, first: int, device: torch.device) -> ScoreMod:
    """``score_mod`` called with each new query's position ``first + q_idx`` (the cached tokens come
    first), as ``kv_idx`` is each key's position in the cache. The offset is a captured 0-d tensor,
    not a constant: the generated kernels are not built again for every decoding step."""
    offset = torch.tensor(first, dtype=mods.INDEX_DTYPE, device=device)  # 0-d: keeps q_idx's dtype

    def at_position(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score_mod(score, b, h, q_idx + offset, kv_idx)

    return at_position
