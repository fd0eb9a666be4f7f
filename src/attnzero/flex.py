"""``attnzero.flex``: a drop-in for ``torch.nn.attention.flex_attention`` (torch 2.13).

Code written for Flex runs by changing its import::

    from attnzero.flex import flex_attention, create_block_mask   # was: torch.nn.attention.flex_attention

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = create_block_mask(causal, None, None, L, L, device="cpu")
    out = flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask)   # forward and backward, eager

``flex_attention`` has torch's signature, defaults, return types and results: ``(out, lse)`` with
``return_lse``, ``(out, AuxOutput)`` with ``return_aux``; lse in natural log, float32 (float64 for
float64 inputs); a row with no kept key gives output 0 and lse −inf. It runs eagerly (no
``torch.compile`` needed), with a backward on every device, through ``az.attention``: the block
mask becomes an attnzero ``Mask`` whose block table *is* the BlockMask's (``to_mask``): a block it
does not list is blocked, even where its ``mask_mod`` would keep a pair, and is never evaluated; a
"full" block is kept whole without its mask_mod; a partial one is its mask_mod. The mask utilities
(``BlockMask``, ``create_block_mask``, ``create_mask``, ``and_masks``, ``or_masks``, ``noop_mask``,
``AuxRequest``, ``AuxOutput``) are torch's own, re-exported.

These are the semantics of torch's kernels (its compiled Flex). torch's *eager* CPU path, which
materialises the scores, evaluates the mask_mod on every pair and ignores the block table, so a
hand-made BlockMask (a top-k block map, a full block whose mask_mod would block pairs) gives other
results there than in torch's compiled Flex; attnzero gives the compiled one's, eager.

Which backend runs: what ``az.attention``'s "auto" picks — with a ``score_mod``, on CUDA the Triton
kernels running code generated from it (kernels/codegen.py) when it can be generated, else flash.py's
tiles (the reference under torch.compile / torch.func), else the compiled CPU kernel / flash / triton
with the block table skipping blocks. ``kernel_options``: the keys in ``IGNORED_KERNEL_OPTIONS``
tune torch's kernels and cannot change the result, so they are accepted and ignored; any other key
raises, naming it.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import (
    AuxOutput,
    AuxRequest,
    BlockMask,
    FlexKernelOptions,
    and_masks,
    create_block_mask,
    create_mask,
    noop_mask,
    or_masks,
)

from . import blocks, mods
from .checks import ArgumentError
from .functional import attention
from .masks import COMPARED_MAX, Mask, ModSource, copies, equal_values

# kernel_options that tune torch's kernels (tile sizes, warps, pipelining, promises that let a
# kernel skip a check) and so cannot change what attention computes: accepted, ignored. A key may
# carry torch's ``fwd_`` / ``bwd_`` prefix.
IGNORED_KERNEL_OPTIONS: dict[str, str] = {
    "num_warps": "GPU tuning", "num_stages": "GPU tuning", "BLOCK_M": "tile size", "BLOCK_N": "tile size",
    "BLOCK_M1": "tile size", "BLOCK_N1": "tile size", "BLOCK_M2": "tile size", "BLOCK_N2": "tile size",
    "PRESCALE_QK": "rounding only: q is scaled before the matmul", "USE_TMA": "GPU tuning",
    "ROWS_GUARANTEED_SAFE": "a promise that no row is fully masked: such rows are 0 here anyway",
    "BLOCKS_ARE_CONTIGUOUS": "a promise about the block mask's layout",
    "WRITE_DQ": "which loop of torch's backward scatters captured tensors' gradients",
    "kpack": "GPU tuning", "matrix_instr_nonkdim": "GPU tuning", "waves_per_eu": "GPU tuning",
    "BACKEND": "which of torch's kernels (attnzero chooses its own)",
    "FORCE_USE_FLEX_ATTENTION": "which of torch's kernels", "SPLIT_KV": "decode split count",
}  # fmt: skip
_BACKENDS = ("AUTO", "TRITON", "FLASH", "TRITON_DECODE")  # torch 2.13's valid BACKEND values
_LARGE = 1 << 30  # torch's BLOCK_SIZE of the "no block mask" BlockMask


def _kernel_options(options: Any) -> None:
    """torch's checks of ``kernel_options``, then attnzero's: every key must be an ignored one."""
    if options is None:
        return
    opts = dict(options)
    if "BACKEND" in opts and opts.get("FORCE_USE_FLEX_ATTENTION", False):
        raise RuntimeError(
            "BACKEND cannot be combined with legacy FORCE_USE_FLEX_ATTENTION. BACKEND supersedes the legacy knob; "
            "please drop FORCE_USE_FLEX_ATTENTION and only specify the desired BACKEND."
        )
    if "BACKEND" in opts and opts["BACKEND"] not in _BACKENDS:
        raise ValueError(f"Invalid BACKEND value '{opts['BACKEND']}'. Must be one of {_BACKENDS}")
    for word in ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX"):  # (set by torch itself, AssertionError as torch's)
        if word in opts:
            raise AssertionError(f"{word} must not be in kernel_options")
    for key in opts:
        base = key[4:] if key.startswith(("fwd_", "bwd_")) else key
        if base not in IGNORED_KERNEL_OPTIONS:
            raise ValueError(
                f"kernel_options: attnzero.flex does not take {key!r} (it could change the result); the options it "
                f"ignores, as they only tune torch's kernels: {sorted(IGNORED_KERNEL_OPTIONS)}"
            )


# The stub torch puts in a sliced BlockMask's mask_mod (``block_mask[:, :, :n]``): torch refuses such a
# mask, whose mod no longer fits its blocks (private in torch, hence looked up).
_SLICED = getattr(torch.nn.attention.flex_attention, "_sliced_mask_mod_error", None)


def _validate(query: Any, key: Any, value: Any, block_mask: Any, enable_gqa: bool) -> None:
    """torch's input checks, in torch's order, with torch's error types and messages."""
    for x in (query, key, value):
        if not isinstance(x, Tensor):
            raise TypeError(f"flex_attention: expected query, key and value tensors, got {type(x).__name__}")
    if query.is_nested or key.is_nested or value.is_nested:
        raise ValueError("FlexAttention does not support nested tensors. Try using padded tensors.")
    if query.device != key.device or query.device != value.device:
        raise ValueError(
            f"Expected query, key, and value to have the same device type, but got query.device: {query.device}, "
            f"key.device: {key.device}, and value.device: {value.device} instead."
        )
    if query.dim() < 2 or key.dim() < 2 or value.dim() < 2:
        raise ValueError(
            f"Expected query, key, and value to all be  at least 2 dimensional, but got query.dim: {query.dim()}, "
            f"key.dim: {key.dim()} and value.dim: {value.dim()} instead."
        )
    if query.size(-1) != key.size(-1):
        raise ValueError(
            f"Expect query and key/value to have the same embedding dimension but got E={query.size(-1)} and "
            f"E={key.size(-1)}."
        )
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise NotImplementedError("NYI: query, key, and value must be 4D tensors")
    if not enable_gqa and query.size(-3) != key.size(-3):
        raise ValueError(
            f"Expect query and key/value to have the same number of heads but got Hq={query.size(-3)} and "
            f"Hkv={key.size(-3)}. Try setting enable_gqa=True for GQA."
        )
    if enable_gqa and query.size(1) % key.size(1) != 0:
        raise ValueError(
            f"Expect number of query heads to be a multiple of kv heads for GQA but got Hq={query.size(1)} and "
            f"Hkv={key.size(1)}."
        )
    if query.size(0) != key.size(0):
        if block_mask is None:
            raise ValueError(
                f"Expect query and key/value to have the same batch size, or non-none block_mask, but got "
                f"block_mask=None, Bq={query.size(0)}, and Bkv={key.size(0)}."
            )
        if block_mask.kv_num_blocks.size(0) != query.size(0):
            raise ValueError(
                f"Expect query and key/value to have the same batch size, or block_mask and query to have the same "
                f"batch size, but got Bq={query.size(0)}, Bkv={key.size(0)}, "
                f"B_block_mask={block_mask.kv_num_blocks.size(0)}."
            )
        if key.size(0) != 1:
            raise RuntimeError(f"Bq and Bkv must broadcast. Got Bq={query.size(0)} and Bkv={key.size(0)}")
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask: expected a torch BlockMask or None, got {type(block_mask).__name__}")
        if _SLICED is not None and block_mask.mask_mod is _SLICED:  # (torch's words; before any shape check)
            raise RuntimeError("Cannot use mask_mod from a sliced BlockMask")
        if tuple(block_mask.BLOCK_SIZE) != (_LARGE, _LARGE):
            Lq_m, Lk_m = block_mask.shape[-2], block_mask.shape[-1]
            if query.size(-2) > Lq_m or key.size(-2) > Lk_m:
                raise ValueError(
                    f"block_mask was created for block_mask.shape={block_mask.shape} but got q_len={query.size(-2)} "
                    f"and kv_len={key.size(-2)}. As the block mask was created for a smaller length than you're "
                    "using it for, you likely need to create a new block mask."
                )
            if query.size(-2) < Lq_m or key.size(-2) < Lk_m:
                raise ValueError(
                    f"block_mask was created for block_mask.shape={block_mask.shape} but got q_len={query.size(-2)} "
                    f"and kv_len={key.size(-2)}. As the block mask was created for a larger length than you're using "
                    "it for, you can either 1. create a new block mask with the correct length, or 2. 'adjust' the "
                    "existing block mask to the correct length by calling block_mask._adjust(q_len, kv_len). This "
                    "essentially 'crops' the block mask to the upper left corner, which does not work for all "
                    "mask_mods!"
                )
        if query.device != block_mask.kv_num_blocks.device:
            raise RuntimeError(
                f"Expect q/k/v and block_mask to be on the same device but got {query.device} and "
                f"{block_mask.kv_num_blocks.device}."
            )


def _kinds(block_mask: BlockMask, n_q: int, n_k: int) -> Tensor:
    """The BlockMask's table as int8 kinds (B|1, H|1, n_q, n_k): listed partial blocks PARTIAL, listed
    full blocks FULL, every other block SKIP."""

    def mark(kinds: Tensor, num: Tensor, idx: Tensor, code: int) -> Tensor:
        num, idx = num.to("cpu", torch.int64), idx.to("cpu", torch.int64)  # (B, H, nQ'), (B, H, nQ', nK')
        listed = torch.arange(idx.shape[-1]).view(1, 1, 1, -1) < num[..., :n_q].unsqueeze(-1)  # (B, H, n_q, nK')
        cols = torch.where(listed, idx[..., :n_q, :].clamp(0, n_k), n_k)  # unlisted → a spare column
        hit = torch.zeros(*kinds.shape[:3], n_k + 1, dtype=torch.bool).scatter_(-1, cols, True)[..., :n_k]
        return torch.where(hit, code, kinds).to(torch.int8)

    B, H = block_mask.kv_num_blocks.shape[:2]
    kinds = torch.zeros(B, H, n_q, n_k, dtype=torch.int8)
    kinds = mark(kinds, block_mask.kv_num_blocks, block_mask.kv_indices, blocks.PARTIAL)
    if block_mask.full_kv_num_blocks is not None and block_mask.full_kv_indices is not None:
        kinds = mark(kinds, block_mask.full_kv_num_blocks, block_mask.full_kv_indices, blocks.FULL)
    return kinds


def _over(kinds: Tensor, B: int, H: int) -> Tensor:
    """The table (Bt, Ht, n_q, n_k) over a call's B batches and H query heads as torch's kernels read
    it: batch b at the table's b % Bt, head h at h % Ht (a GQA block mask built with the key heads'
    count, say); a table of 1 along a dim broadcasts as it is."""
    Bt, Ht = kinds.shape[:2]
    if Bt not in (1, B):
        kinds = kinds.index_select(0, torch.arange(B, device=kinds.device) % Bt)  # (B, Ht, n_q, n_k)
    if Ht not in (1, H):
        kinds = kinds.index_select(1, torch.arange(H, device=kinds.device) % Ht)  # (B|1, H, n_q, n_k)
    return kinds


def to_mask(block_mask: BlockMask, B: int, H: int, Lq: int, Lk: int) -> Mask:
    """torch's ``BlockMask`` as an attnzero ``Mask`` of shape (B, H, Lq, Lk) whose block table is the
    BlockMask's (``blocks.BlockTable``, its B or H of 1 broadcast): unlisted blocks blocked, full
    blocks kept whole, partial blocks its ``mask_mod`` — evaluated on partial blocks only, at the
    real batch and head indices. The Mask keeps the mod gated by that table (``ModSource``, gated),
    which the Triton kernels run as generated code (``kernels/triton_backend.py``)."""
    bq, bk = (int(x) for x in block_mask.BLOCK_SIZE)
    n_q, n_k = -(-Lq // bq), -(-Lk // bk)
    table = blocks.BlockTable(_over(_kinds(block_mask, n_q, n_k), B, H), (bq, bk), (Lq, Lk))
    # the mod as it is now, for this call's forward and backward (a loop variable it reads stays)
    mask_mod = None if block_mask.mask_mod is noop_mask else mods.own_closure(block_mask.mask_mod)

    def keep(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return table.keep(mask_mod, b, h, q, kv)

    name = f"block_mask({getattr(mask_mod, '__name__', 'noop_mask')})"
    return Mask(keep, (B, H, Lq, Lk), name, table=table, mod=ModSource(mask_mod, gated=True))


class _Masks(dict):  # type: ignore[type-arg]
    """A BlockMask's attnzero Masks (``_mask_of``), kept on the BlockMask itself — one BlockMask
    usually serves every layer of every step, and a new Mask each call rebuilt the CPU kernel's block
    table and partial tiles (its cache is per Mask): 30× the attention's own time at L = 128. Kept on
    it, not in a table of weak keys: the Mask holds the mask_mod, which may hold the module that
    holds the BlockMask, and such an entry would never be released. A copy or a pickle of the
    BlockMask starts empty."""

    def __reduce__(self) -> Any:
        return (_Masks, ())

    def __copy__(self) -> _Masks:
        return _Masks()

    def __deepcopy__(self, memo: Any) -> _Masks:
        return _Masks()


_MASKS_PER_BLOCK_MASK = 4


def _mask_of(block_mask: BlockMask, B: int, H: int, Lq: int, Lk: int) -> Mask:
    """``to_mask(block_mask, B, H, Lq, Lk)``, the one made for an earlier call when nothing it depends
    on changed since: the call's sizes, the BlockMask's tensors (the same objects, not changed in
    place), the mask_mod's code and numbers (``mods.fingerprint``) and the values of the tensors it
    reads (compared with a copy: a write through ``.data`` or numpy changes no version)."""
    mask_mod = block_mask.mask_mod
    fp, reached = (None, []) if mask_mod is noop_mask else mods.fingerprint(mask_mod)
    if (mask_mod is not noop_mask and fp is None) or sum(t.numel() for t in reached) > COMPARED_MAX:
        return to_mask(block_mask, B, H, Lq, Lk)  # (the walk cannot vouch for the mod, or too much to compare)
    parts = [t for t in (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                         block_mask.full_kv_indices) if t is not None]  # fmt: skip
    versions = [-1 if t.is_inference() else t._version for t in parts]  # (inference tensors have none)
    key = (B, H, Lq, Lk, tuple(block_mask.BLOCK_SIZE), mask_mod, fp)
    per = vars(block_mask).get("_attnzero_masks")
    if not isinstance(per, _Masks):
        per = _Masks()
        block_mask._attnzero_masks = per  # type: ignore[attr-defined]
    got = per.get(key)
    if got is not None and _same(got[0], parts) and got[1] == versions and equal_values(got[2], reached):
        return got[3]  # type: ignore[no-any-return]
    if len(per) >= _MASKS_PER_BLOCK_MASK:
        per.pop(next(iter(per)))
    mask = to_mask(block_mask, B, H, Lq, Lk)
    per[key] = (parts, versions, copies(reached), mask)
    return mask


def _same(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _dense_mask(block_mask: BlockMask, B: int, H: int, Lq: int, Lk: int, device: torch.device) -> Tensor:
    """The block mask as a dense (B, H, Lq, Lk) bool tensor by tensor ops only (what a compiled
    graph can trace): table kinds spread to pairs, partial ones from the vmapped mask_mod."""
    bq, bk = (int(x) for x in block_mask.BLOCK_SIZE)
    n_q, n_k = -(-Lq // bq), -(-Lk // bk)
    kinds = _over(_kinds_traced(block_mask, n_q, n_k), B, H).to(device)  # (B|1, H|1, n_q, n_k)
    spread = kinds.repeat_interleave(bq, dim=2)[:, :, :Lq].repeat_interleave(bk, dim=3)[:, :, :, :Lk]
    keep = mods.mask_grid(block_mask.mask_mod, B, H, Lq, Lk, device)  # (B, H, Lq, Lk)
    return (spread == blocks.FULL) | ((spread == blocks.PARTIAL) & keep)


def _kinds_traced(block_mask: BlockMask, n_q: int, n_k: int) -> Tensor:
    """``_kinds`` on the BlockMask's own device, without leaving the graph."""

    def mark(kinds: Tensor, num: Tensor, idx: Tensor, code: int) -> Tensor:
        listed = torch.arange(idx.shape[-1], device=idx.device).view(1, 1, 1, -1) < num[..., :n_q].unsqueeze(-1)
        cols = torch.where(listed, idx[..., :n_q, :].long().clamp(0, n_k), n_k)
        hit = torch.zeros(*kinds.shape[:3], n_k + 1, dtype=torch.bool, device=idx.device).scatter(-1, cols, True)
        return torch.where(hit[..., :n_k], code, kinds)

    num, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    kinds = torch.zeros(*num.shape[:2], n_q, n_k, dtype=torch.int8, device=num.device)
    kinds = mark(kinds, num, idx, blocks.PARTIAL)
    if block_mask.full_kv_num_blocks is not None and block_mask.full_kv_indices is not None:
        kinds = mark(kinds, block_mask.full_kv_num_blocks, block_mask.full_kv_indices, blocks.FULL)
    return kinds


def _scale(scale: Any, query: Tensor) -> tuple[Any, Tensor]:
    """``(scale, query)`` as attnzero takes them: torch's flex also takes a one-element tensor as
    ``scale`` — its value, or, traced by torch.compile (where reading it would break the graph),
    query times it and a scale of 1. One that asks for a gradient is refused: the scale gets none."""
    if not isinstance(scale, Tensor):
        return scale, query
    if scale.numel() != 1 or scale.requires_grad or scale.is_complex():
        raise ArgumentError(
            f"scale: expected a float or a one-element tensor without requires_grad, got a tensor of shape "
            f"{tuple(scale.shape)}{' that requires grad' if scale.requires_grad else ''}"
        )
    if torch.compiler.is_compiling():
        return 1.0, query * scale.reshape(()).to(query.dtype)
    return scale.item(), query


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: mods.ScoreMod | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: FlexKernelOptions | None = None,
    *,
    return_aux: AuxRequest | None = None,
) -> Any:
    """torch's ``flex_attention`` (see the module docstring): query (B, Hq, L, E), key (B|1, Hkv, S, E),
    value (B|1, Hkv, S, Ev) → out (B, Hq, L, Ev); ``(out, lse (B, Hq, L))`` with ``return_lse``;
    ``(out, AuxOutput(lse, max_scores))`` with ``return_aux``."""
    _validate(query, key, value, block_mask, enable_gqa)
    mods.check_callable("score_mod", score_mod)
    if return_lse and return_aux is not None:
        raise ValueError(
            "Cannot specify both return_lse and return_aux. return_lse is deprecated, please use "
            "return_aux=AuxRequest(lse=True) instead."
        )
    if return_lse and not torch.compiler.is_compiling():  # (as torch's: dynamo cannot trace a warning)
        warnings.warn(
            "return_lse is deprecated and will be removed in v2.10. Please use return_aux=AuxRequest(lse=True) "
            "instead.",
            FutureWarning,
            stacklevel=2,
        )
    _kernel_options(kernel_options)
    B, Hq, Lq, E = query.shape
    Lk = key.shape[2]
    # torch takes key / value in other dtypes than query's (low-precision KV); attnzero computes in
    # query's dtype (its accumulators are float32, float64 for float64, as torch's working precision)
    key, value = key.to(query.dtype), value.to(query.dtype)
    if key.shape[0] != B:  # Bkv = 1 broadcast against Bq
        key, value = key.expand(B, *key.shape[1:]), value.expand(B, *value.shape[1:])
    sc, query = (1.0 / math.sqrt(E), query) if scale is None else _scale(scale, query)
    mask: Tensor | Mask | None = None
    if block_mask is not None and tuple(block_mask.BLOCK_SIZE) != (_LARGE, _LARGE) and Lq > 0 and Lk > 0:
        if torch.compiler.is_compiling():
            mask = _dense_mask(block_mask, B, Hq, Lq, Lk, query.device)
        else:
            mask = _mask_of(block_mask, B, Hq, Lq, Lk)
    lse_asked = return_lse or (return_aux is not None and bool(return_aux.lse))
    res = attention(query, key, value, mask=mask, scale=sc, score_mod=score_mod, return_lse=lse_asked)
    out, lse = res if isinstance(res, tuple) else (res, None)
    if lse is not None and lse.numel() == 0:
        lse = None  # (torch returns None for an empty lse or max_scores: a zero-size call)
    if return_aux is not None:
        max_scores = _max_scores(query, key, mask, sc, score_mod) if return_aux.max_scores else None
        max_scores = None if max_scores is None or max_scores.numel() == 0 else max_scores
        return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=max_scores)
    if return_lse:
        return out, lse
    return out


def _max_scores(q: Tensor, k: Tensor, mask: Tensor | Mask | None, scale: float, score_mod: Any) -> Tensor:
    """Each row's largest kept score after the score_mod (B, Hq, L), −inf for a row with none — as
    torch's ``max_scores``; dense (B, Hq, L, S), without gradients."""
    with torch.no_grad():
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        if 0 in (q.shape[1], k.shape[2]):  # no heads (empty), or no keys (every row −inf)
            return q.new_full(q.shape[:3], float("-inf"), dtype=acc)
        G = q.shape[1] // k.shape[1]
        s = q.to(acc) @ k.to(acc).repeat_interleave(G, dim=1).transpose(-2, -1) * scale  # (B, Hq, L, S)
        if score_mod is not None:
            s = mods.score_grid(score_mod, s)
        if mask is not None:
            keep = mask.to_tensor(q.device) if isinstance(mask, Mask) else mask
            s = s.masked_fill(~keep, float("-inf"))
        return s.amax(dim=-1)


__all__ = [
    "IGNORED_KERNEL_OPTIONS",
    "AuxOutput",
    "AuxRequest",
    "BlockMask",
    "FlexKernelOptions",
    "and_masks",
    "create_block_mask",
    "create_mask",
    "flex_attention",
    "noop_mask",
    "or_masks",
    "to_mask",
]
