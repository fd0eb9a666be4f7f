"""The drop-in for ``torch.nn.functional.scaled_dot_product_attention``: torch's arguments and
conventions — inputs (..., L, E) with any leading dims that broadcast, a bool ``attn_mask`` kept where
True and a float one added, ``is_causal`` top-left aligned, ``CausalBias``, ``enable_gqa`` — turned
into attnzero's (a keep-mask, a bias, bottom-right causal, (B, H, L, D)), then ``functional``'s
``attention`` after its checks. Misuse raises what torch raises, with torch's own phrase after
"torch:", so that code matching torch's messages keeps working."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend
from torch.overrides import handle_torch_function

from . import autocast, checks, functional
from .checks import ArgumentError, ArgumentTypeError
from .masks import Mask
from .masks import causal as causal_mask


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``, with torch's semantics:
    inputs (..., L, E) with any leading dims (heads at dim -3), a bool ``attn_mask`` keeps True
    entries, a float ``attn_mask`` is added to the scores, ``is_causal`` is top-left aligned
    (query i sees keys 0..i), ``attn_mask=torch.nn.attention.bias.causal_upper_left(L, S)`` /
    ``causal_lower_right(L, S)`` is the causal pattern it names, ``enable_gqa`` lets key/value have
    fewer heads. Misuse raises what torch raises (``except RuntimeError`` catches it): an
    ``attn_mask`` together with ``is_causal=True``, mismatched shapes, dtypes or devices. Zero
    sizes and autocast behave as torch's; a row with every key blocked gives 0 (torch's CPU path
    too), never NaN. Dropout drops other entries than torch's would (its own random stream)."""
    if functional._dispatches(query, key, value, attn_mask):  # a __torch_function__ subclass: as torch's
        mask = None if autocast.is_causal_bias(attn_mask) else attn_mask  # (a CausalBias is read here)
        if functional._dispatches(query, key, value, mask):
            return handle_torch_function(  # type: ignore[no-any-return]
                scaled_dot_product_attention, (query, key, value, mask), query, key, value, attn_mask=attn_mask,
                dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
            )  # fmt: skip
    if not autocast.active():  # the common call: nothing to cast, nothing to turn off
        return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    query, key, value, attn_mask = autocast.cast(query, key, value, attn_mask)
    with autocast.as_given(query):
        return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _same_sizes(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(checks.holds(x == y) for x, y in zip(a, b))


# The names torch's messages give dtypes (c10's TypeMeta), so that a message matched against
# torch's text reads the same here.
_TORCH_DTYPE_NAMES = {
    torch.float64: "double", torch.float32: "float", torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16",
    torch.bool: "bool", torch.int64: "long int", torch.int32: "int", torch.int16: "short int",
    torch.int8: "signed char", torch.uint8: "unsigned char",
}  # fmt: skip


def _dtype_name(dtype: torch.dtype) -> str:
    return _TORCH_DTYPE_NAMES.get(dtype, str(dtype))


def _plainly_equal(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two shapes are equal without deciding anything symbolic: the same ints, or the very
    same size objects."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):  # (a loop, not all() over a generator: every drop-in call asks)
        if x is not y and not (type(x) is int and type(y) is int and x == y):
            return False
    return True


def _broadcast(shapes: dict[str, tuple[Any, ...]]) -> tuple[Any, ...]:
    """The broadcast of the leading-dim shapes of ``shapes`` (aligned from the right, a size of 1
    stretches), as torch broadcasts the leading dims of query, key and value; a pair that does not
    broadcast raises torch's phrase beside the names of the arguments."""
    first, *rest = shapes.values()
    if all(_plainly_equal(s, first) for s in rest):  # the common call: nothing to broadcast
        return tuple(first)
    out: list[Any] = []
    owner: list[str] = []
    for name, shape in shapes.items():
        for i in range(1, len(shape) + 1):
            size = shape[-i]
            if len(out) < i:
                out.insert(0, size)
                owner.insert(0, name)
            elif checks.known(size == out[-i]):  # first: a size that depends on data equals itself
                continue
            elif checks.known(out[-i] == 1):
                out[-i], owner[-i] = size, name
            elif not checks.known(size == 1) and not checks.holds(size == out[-i]):
                dim = len(out) - i
                raise ArgumentError(
                    f"{name}: leading dims {tuple(shape)} do not broadcast with {owner[-i]}'s at dim {dim} "
                    f"({size} against {out[-i]}). torch: {_size_phrase(out[-i], size, dim)}"
                )
    return tuple(out)


# The kind torch's argument parser names for each of the drop-in's arguments, and the position of
# the tensors (``_torch_words``).
_TORCH_KINDS = {"query": "Tensor", "key": "Tensor", "value": "Tensor", "is_causal": "bool", "enable_gqa": "bool",
                "dropout_p": "float", "scale": "float"}  # fmt: skip
_TORCH_POSITIONS = {"query": " (position 1)", "key": " (position 2)", "value": " (position 3)"}


def _torch_words(e: Exception, name: str, x: Any) -> Exception:
    """A check's error on the drop-in's argument ``name`` (given ``x``) with torch's phrase for the
    same misuse after "torch:" — a wrong kind of argument as torch's argument parser says it (for
    every argument), a wrong value as torch says it (for ``dropout_p``) — so that code matching
    torch's messages matches attnzero's too; any other error as it is. Built only when a check
    failed: the drop-in's common call pays nothing for it."""
    if isinstance(e, ArgumentTypeError):
        where = f"argument '{name}'{_TORCH_POSITIONS.get(name, '')}"
        return ArgumentTypeError(
            f"{e}. torch: scaled_dot_product_attention(): {where} must be {_TORCH_KINDS[name]}, not {type(x).__name__}"
        )
    if isinstance(e, ArgumentError) and name == "dropout_p" and x > 1:  # (torch takes a negative one)
        return ArgumentError(f"{e}. torch: dropout probability has to be between 0 and 1, but got {x}")
    return e


def _count(sizes: tuple[Any, ...]) -> Any:
    n = 1
    for s in sizes:
        n = n * s
    return n


def _size_phrase(a: Any, b: Any, dim: int) -> str:
    return f"The size of tensor a ({a}) must match the size of tensor b ({b}) at non-singleton dimension {dim}"


def _size_mismatch(shape: tuple[Any, ...], full: tuple[Any, ...]) -> str:
    """torch's broadcasting message for the first dim (from the right) where ``shape`` does not
    broadcast to ``full``."""
    for i in range(1, min(len(shape), len(full)) + 1):
        if not (checks.known(shape[-i] == 1) or checks.known(shape[-i] == full[-i])):
            return _size_phrase(full[-i], shape[-i], len(full) - i)
    return f"output with shape {list(full)} doesn't match the broadcast shape {list(shape)}"


def _heads_to(x: Tensor, heads: Any) -> Tensor:
    """``x`` (..., h, L, E) with its h heads made ``heads``: a single head is stretched (a view, no
    copy); otherwise each of the h heads serves heads // h consecutive ones (GQA's grouping)."""
    h = x.shape[-3]
    if checks.known(h == heads):
        return x
    if checks.known(h == 1):
        return x.expand(*x.shape[:-3], heads, *x.shape[-2:])  # (..., heads, L, E): a view
    return x.repeat_interleave(heads // h, dim=-3)  # (..., heads, L, E)


def _sdpa(
    query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: Any, is_causal: Any, scale: Any, enable_gqa: Any
) -> Tensor:
    """The drop-in after autocast: torch's checks and conventions, then ``functional.run``. Messages
    name this function's arguments (query/key/value/attn_mask, not q/k/v/mask/bias) and carry
    torch's own phrase after "torch:", so that code matching torch's text keeps working."""
    name, x = "query", query  # the argument checked, for torch's words when a check fails
    if isinstance(scale, Tensor) and scale.ndim == 0 and not scale.requires_grad:
        scale = float(scale)  # torch's argument parser takes a 0-d tensor as the float (not one asking for a grad)
    if isinstance(dropout_p, bool) or (
        isinstance(dropout_p, Tensor) and dropout_p.ndim == 0 and not dropout_p.requires_grad
    ):
        dropout_p = float(dropout_p)  # (so it takes a bool: True drops every weight)
    drop_all = not isinstance(dropout_p, Tensor) and dropout_p == 1.0  # torch: every entry dropped, the output 0
    try:
        for name, x in (("query", query), ("key", key), ("value", value)):
            checks.tensor(name, x, empty_ok=True)
        name, x = "is_causal", is_causal
        wants_causal = checks.flag(name, x)
        name, x = "enable_gqa", enable_gqa
        gqa = checks.flag(name, x)
        name, x = "dropout_p", dropout_p
        checks.dropout_p(0.0 if drop_all else x)
        name, x = "scale", scale
        checks.scale(x, query.shape[-1])
    except (ArgumentTypeError, ArgumentError) as e:
        worded = _torch_words(e, name, x)
        if worded is e:
            raise
        raise worded from None
    qs, ks, vs = query.shape, key.shape, value.shape  # (each read once: a read costs ~0.1 µs)
    nq, nk, nv = len(qs), len(ks), len(vs)
    if nq < 2 or nk < 2 or nv < 2:
        name = next(n for n, x in (("query", query), ("key", key), ("value", value)) if x.ndim < 2)
        raise ArgumentError(
            f"{name}: expected at least 2 dims (..., L, E), got {min(query.ndim, key.ndim, value.ndim)}. torch: "
            f"Expected query, key, and value to all be  at least 2 dimensional, but got query.dim: {query.ndim} "
            f"key.dim: {key.ndim} and value.dim: {value.ndim} instead."
        )
    dtype, device = query.dtype, query.device
    for name, x in (("key", key), ("value", value)):
        if x.dtype == dtype and x.device == device:
            continue
        if x.dtype != query.dtype:
            raise ArgumentTypeError(
                f"{name}: dtype {x.dtype} does not match query's {query.dtype}. torch: Expected query, key, and value "
                f"to have the same dtype, but got query.dtype: {_dtype_name(query.dtype)} key.dtype: "
                f"{_dtype_name(key.dtype)} and value.dtype: {_dtype_name(value.dtype)} instead."
            )
        if x.device != query.device:
            raise ArgumentError(
                f"{name}: device {x.device} does not match query's {query.device}. torch: Expected query, key, and "
                f"value to have the same device type, but got query.device: {query.device} key.device: {key.device} "
                f"and value.device: {value.device} instead."
            )
    if not checks.holds(ks[-1] == qs[-1]):
        raise ArgumentError(
            f"key: head dim {ks[-1]} does not match query's {qs[-1]}. torch: Expected size for first "
            f"two dimensions of batch2 tensor to be: [{_count(qs[:-2])}, {qs[-1]}] but got: "
            f"[{_count(ks[:-2])}, {ks[-1]}]."
        )
    if not checks.holds(vs[-2] == ks[-2]):
        raise ArgumentError(f"value: length {vs[-2]} does not match key's {ks[-2]}")

    # The leading dims broadcast as torch's do: (*batch, heads). With enable_gqa the heads are
    # grouped (key and value heads each divide query's) and only the batch dims broadcast. The
    # common call (all 4-D, one (B, H)) has nothing to broadcast, spread or fold: ``plain``.
    plain = False
    if nq == nk == nv == 4:
        (B, H, _, _), (Bk, Hk, _, _), (Bv, Hv, _, _) = qs, ks, vs  # (unpacked: a slice of a Size costs ~0.3 µs)
        plain = _plainly_equal((B, H, B, H), (Bk, Hk, Bv, Hv))
    if gqa and nq >= 3 and nk >= 3 and nv >= 3:
        batch = (B,) if plain else _broadcast({"query": qs[:-3], "key": ks[:-3], "value": vs[:-3]})
        Hq = qs[-3]
        for name, heads in (("key", ks[-3]), ("value", vs[-3])):
            checks.groups(
                Hq, heads,
                f"{name}: expected a number of heads that divides query's {{Hq}} (enable_gqa), got {{Hkv}}. torch: "
                "Number of heads in key and value must divide the number of heads in query",
            )  # fmt: skip
    else:
        lead = (B, H) if plain else _broadcast({"query": qs[:-2], "key": ks[:-2], "value": vs[:-2]})
        batch, Hq = (lead[:-1], lead[-1]) if lead else ((), 1)  # all 2-D: one head, dropped again below
    hk = ks[-3] if nk >= 3 else 1
    hv = vs[-3] if nv >= 3 else 1
    # Key and value get one head count: a single head stays single (MQA, read by every query head
    # without a copy) or is stretched as a view; otherwise the fewer heads are spread over the more
    # (GQA's grouping), or over every query head when neither count divides the other.
    if checks.is_zero(hk) != checks.is_zero(hv):  # (enable_gqa: each count divides Hq = 0; none spreads over 0)
        raise ArgumentError(f"value: {hv} heads cannot be grouped with key's {hk}")
    if checks.known(hk == hv) or checks.known(hv == 1):
        Hkv = hk
    elif checks.known(hk == 1) or hv % hk == 0:
        Hkv = hv
    else:
        Hkv = hk if hk % hv == 0 else Hq
    Lq, Lk = qs[-2], ks[-2]
    full = (*batch, Hq, Lq, Lk)  # (..., Hq, Lq, Lk)

    def four(x: Tensor, heads: Any) -> Tensor:
        """(…, h, L, E) or (L, E) → (N, heads, L, E) over the broadcast batch: views unless heads
        must be spread; as it is in the ``plain`` call."""
        if plain:
            return x  # (B, H, L, E) already
        x = x if x.ndim >= 3 else x.unsqueeze(0)  # (1, L, E): one head
        x = _heads_to(x, heads)
        x = x.expand(*batch, *x.shape[-3:]) if not _same_sizes(tuple(x.shape[:-3]), batch) else x
        return _to4(x)  # (N, heads, L, E)

    # What to attend to, in attnzero's terms: a keep-mask, a bias, or causal (bottom-right).
    mask_arg: Tensor | Mask | None = None
    bias_arg: Tensor | None = None
    causal_arg = False
    if autocast.is_causal_bias(attn_mask):
        from torch.nn.attention.bias import CausalVariant

        if wants_causal:
            raise ArgumentError(
                "is_causal: expected False with a CausalBias attn_mask (it is the causal pattern already), got True. "
                "torch: CausalBias should not be used with causal=True"
            )
        if not (checks.holds(attn_mask.seq_len_q == Lq) and checks.holds(attn_mask.seq_len_kv == Lk)):
            raise ArgumentError(
                f"attn_mask: a CausalBias of (L, S) = ({attn_mask.seq_len_q}, {attn_mask.seq_len_kv}) does not "
                f"match query's and key's lengths ({Lq}, {Lk}). torch: "
                + _size_mismatch((attn_mask.seq_len_q, attn_mask.seq_len_kv), full)
            )
        if attn_mask.variant == CausalVariant.LOWER_RIGHT:
            causal_arg = True  # bottom-right: attnzero's own causal
        elif attn_mask.variant == CausalVariant.UPPER_LEFT:
            mask_arg, causal_arg = _top_left(Lq, Lk, query.device)
        else:
            raise ArgumentError(f"attn_mask: expected a CausalBias of a known variant, got {attn_mask.variant!r}")
    elif attn_mask is not None:
        if wants_causal:
            raise ArgumentError(
                "is_causal: expected False when attn_mask is given (as torch), got True. torch: "
                "_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True"
            )
        if not isinstance(attn_mask, Tensor):
            raise ArgumentTypeError(f"attn_mask: expected a torch.Tensor, got {type(attn_mask).__name__}")
        torch_says = (
            "torch: Expected attn_mask dtype to be bool or float or to match query dtype, but got attn_mask.dtype: "
            f"{_dtype_name(attn_mask.dtype)} and  query.dtype: {_dtype_name(query.dtype)} instead."
        )
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            raise ArgumentTypeError(
                f"attn_mask: expected a bool or floating tensor, got {attn_mask.dtype}. {torch_says}"
            )
        if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):  # torch's rule for a float mask
            raise ArgumentTypeError(
                f"attn_mask: expected dtype bool, float32 or query's {query.dtype}, got {attn_mask.dtype}. {torch_says}"
            )
        if not checks.broadcastable(tuple(attn_mask.shape), full):
            raise ArgumentError(
                f"attn_mask: shape {tuple(attn_mask.shape)} is not broadcastable to {full}. torch: "
                + _size_mismatch(tuple(attn_mask.shape), full)
            )
        if attn_mask.device != query.device:
            raise ArgumentError(f"attn_mask: device {attn_mask.device} does not match query's {query.device}")
        m = attn_mask.expand(full) if len(batch) > 1 else attn_mask  # extra batch dims, to fold below
        if attn_mask.dtype == torch.bool:
            mask_arg = _to4(m)
        else:
            bias_arg = _to4(m)
    elif wants_causal:
        mask_arg, causal_arg = _top_left(Lq, Lk, query.device)

    out = functional.run(
        four(query, Hq), four(key, Hkv), four(value, Hkv), mask=mask_arg, bias=bias_arg, causal=causal_arg,
        scale=scale, dropout_p=0.0 if drop_all else dropout_p, qkv_checked=True,
    )  # fmt: skip
    assert isinstance(out, Tensor)
    if drop_all:
        out = (out * 0.0).contiguous()  # every weight dropped: 0, with zero gradients, laid out as torch's
    if plain or nq == nk == nv == 4:
        # (B, Hq, Lq, Ev): functional.run's shape
        return _laid_out_as_torch(out, query, key, value, attn_mask, dropout_p, wants_causal, gqa)
    lead_out = full[:-2] if nq > 2 or nk > 2 or nv > 2 else ()
    shape = (*lead_out, Lq, vs[-1])  # (..., Hq, Lq, Ev), or (Lq, Ev) when all are 2-D
    out = out if _plainly_equal(tuple(out.shape), shape) else out.reshape(shape)
    return out.contiguous()  # (torch's math path, which takes every call not 4-D: contiguous)


_FLASH = int(SDPBackend.FLASH_ATTENTION.value)  # what torch._fused_sdp_choice answers for its flash kernel


def _laid_out_as_torch(
    out: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_mask: Any, dropout_p: float, is_causal: bool, gqa: bool
) -> Tensor:
    """``out`` in the memory order torch's CPU SDPA gives, which code after the call may rely on
    (``out.permute(2, 0, 1, 3).view(L * B, H * D)`` after a sequence-first projection; ``out.view(B,
    H * L, D)`` after a call torch sends to its math path): ``torch.empty_like(q)``'s where torch
    runs its flash kernel, contiguous elsewhere. Which of the two is torch's own choice
    (``torch._fused_sdp_choice``: no dropout, 4-D, equal batch and heads, a mask needing no
    gradient, ...). attnzero's CPU kernel allocates q's order; other outputs are copied."""
    if torch.compiler.is_compiling() or (q.is_contiguous() and out.is_contiguous()) or out.device.type != "cpu":
        return out  # (q contiguous: both orders are contiguous)
    mask, causal = attn_mask, is_causal
    if autocast.is_causal_bias(attn_mask):  # as CausalBias dispatches on CPU: causal, or its pattern as a mask
        from torch.nn.attention.bias import CausalVariant

        Lq, Lk = attn_mask.seq_len_q, attn_mask.seq_len_kv
        full = Lq == Lk or attn_mask.variant == CausalVariant.UPPER_LEFT
        mask, causal = (None, True) if full else (torch.ones((), dtype=torch.bool).expand(Lq, Lk), False)
    choice = torch._fused_sdp_choice(q, k, v, mask, dropout_p, causal, enable_gqa=gqa)
    if choice != _FLASH:
        return out.contiguous()
    if out.stride() == q.stride():  # (q dense in some order: the kernel's output has it)
        return out
    want = torch.empty_like(q, device="meta").stride()  # (asked of a meta tensor: no memory taken)
    if all(a == b or n <= 1 for a, b, n in zip(out.stride(), want, out.shape, strict=True)):
        return out
    return torch.empty_strided(q.shape, want, dtype=out.dtype).copy_(out)


def _to4(x: Tensor) -> Tensor:
    """(..., H, L, E) → (N, H, L, E): missing dims added in front as 1, extra batch dims folded."""
    if x.ndim <= 4:
        return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))  # (1.., H, L, E)
    n = 1
    for size in x.shape[:-3]:
        n = n * size
    return x.reshape(n, *x.shape[-3:])  # (N, H, L, E)


def _top_left(Lq: int, Lk: int, device: torch.device) -> tuple[Tensor | Mask | None, bool]:
    """torch's causal pattern, top-left aligned (query ``i`` sees keys ``0..i``), as a ``(mask,
    causal)`` pair of attnzero: ``causal=True`` when Lq == Lk (the two alignments agree, and backends
    skip the blocked blocks; also when a length is 0, where nothing is attended anyway), else the
    top-left mask — a ``Mask`` in eager mode, its dense (1, 1, Lq, Lk) tensor when compiling."""
    if checks.is_zero(Lq) or checks.is_zero(Lk) or checks.surely(Lq == Lk):  # (no guard: any Lq, Lk still run)
        return None, True
    if torch.compiler.is_compiling():
        keep = torch.arange(Lk, device=device) <= torch.arange(Lq, device=device).unsqueeze(1)  # (Lq, Lk)
        return keep.view(1, 1, Lq, Lk), False
    return causal_mask(Lq, Lk, align="top_left"), False


__all__ = ["scaled_dot_product_attention"]
