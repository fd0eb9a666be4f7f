"""``backend="triton"``: the Triton kernels behind the backend signature, as torch custom ops.

Letters: B batch, Hq / Hkv query / key-value heads (G = Hq // Hkv query heads share one key/value
head), Lq / Lk query / key length, D head dim of q and k, Dv head dim of v.

``attention(q, k, v, *, mask, bias, causal, window, scale, softcap, dropout_p, dropout_seed)`` returns
``(out (B, Hq, Lq, Dv), lse (B, Hq, Lq) float32, natural log)`` like ``reference.attention``, on
trusted inputs (``functional.py`` validated them). Under the hood:

* ``attnzero::triton_fwd`` (forward.py) and ``attnzero::triton_bwd`` (backward.py) — registered
  with ``torch.library.custom_op``, fake implementations and ``register_autograd``, so that
  ``torch.compile`` traces through them without graph breaks;
* ``attnzero::triton_decode`` (decode.py), the split-KV kernel, for ``Lq <= 16``,
  ``Lk >= DECODE_MIN_LK`` and at most ``DECODE_MAX_ROWS`` query rows (G·Lq) in a GQA group;
  ``functional.choose`` takes it (``decode``) only when no input requires grad (it has no
  backward).

The backend interface (``ops.Backend``): ``attention`` (eager, differentiable), ``forward`` and
``backward`` (plain functions; the backward from any ``out`` and ``lse``, a ring's global ones too).
This module runs what it is given: which backend runs — float64, the decode path — is decided
in ``functional.choose``.

Inputs: float16, bfloat16 and float32 (float32 accumulation always; float32 products are IEEE
unless ``torch.backends.cuda.matmul.allow_tf32`` is set). As in FlashAttention, P is rounded to
the input dtype before P·V and dS before dS·K / dSᵀ·Q; when a 16-bit input requires grad the
forward also keeps O in float32 for the backward's Δ = rowsum(dO·O).

float64 is not a GPU-kernel dtype: ``backend="triton"`` computes it with the plain-PyTorch ``flash``
backend, in float64, on the same device — the same answer, with gradients, just not by a Triton
kernel (``functional.choose`` routes it; it never reaches this module).

A mask given as an ``az.masks.Mask`` whose ``segments`` are known ("pair kept iff the query's and the
key's ids are equal": documents, padding) is never materialised: the ids go to the kernels as int32
ranks (``_segment_ids``), each pair is decided by comparing two ids, and each program visits only
the blocks of its range (``_segment_ranges``: the keys a block of query rows may see, and for the
dK/dV kernel the queries that may see a block of keys). Any other ``Mask`` is materialised to a dense
bool tensor (broadcast dims kept at size 1) and read per block. Causal and window are never
materialised — they drive block skipping; their sides may be any ints (negative ones included, as
``geometry`` reads them).

Softcap (``softcap > 0``): every kernel caps the raw score ``scale·q·k`` to
``softcap·tanh(score / softcap)`` before the bias and the masking, and the backward recomputes the
tanh ``t`` to take ``dS ∘ (1 - t²)`` to q and k (the bias receives dS).

Head dims: D and Dv up to 256 (``forward.MAX_HEAD_DIM``; the tiles of ``TILES``); larger ones are
refused with a ValueError that names the flash backend, which takes any head dim.
A bias that requires grad gets its gradient through a float32 (B, Hq, Lq, Lk) buffer summed over
its broadcast dims (O(Lq·Lk) memory, as the bias itself).

Deterministic backward: by default dQ is accumulated with float32 atomics inside the dK/dV kernel
(one pass; the last bits of dQ may vary run to run). Set ``DETERMINISTIC = True`` in this module,
the environment variable ``ATTNZERO_DETERMINISTIC=1``, or ``torch.use_deterministic_algorithms(True)``
to compute dQ in a separate kernel without atomics (bitwise reproducible, one more recompute of P).

Runs on CUDA tensors, or on CPU tensors with ``TRITON_INTERPRET=1`` set before this module is
imported (Triton's interpreter: slow, for tests).

Instrumentation (``attnzero.trace``, for the ladder's rungs 7 and 8): only while a recording is open,
the forward and split-KV kernels are launched with ``TRACE=True`` (each program writes the key blocks
it visits into an int32 tensor) and one "triton.program" / "decode.split" event per program is noted
from that tensor (the split events also carry copies of the partial results). Otherwise
``TRACE=False``: nothing of the record is compiled.
``decode_splits(n)`` forces the number of split-KV splits (the device decides otherwise).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

try:
    import triton
except ImportError as e:  # pragma: no cover - exercised only without triton
    raise ImportError(
        "attnzero backend='triton' needs the `triton` package: pip install triton "
        "(on a CUDA machine it comes with torch; for CPU tests install it and set TRITON_INTERPRET=1)"
    ) from e

from .. import geometry, ops, reference, trace
from ..masks import Mask, Segments
from . import backward as bwd_k
from . import decode as dec_k
from . import forward as fwd_k
from .codegen import Generated

LOG2E = fwd_k.LOG2E
DECODE_MAX_LQ = 16  # the split-KV path serves at most this many queries
DECODE_MIN_LK = 1024  # ... against at least this many keys
DECODE_MAX_ROWS = 128  # ... and G·Lq query rows per key/value head (one program holds them all)
DETERMINISTIC: bool = os.environ.get("ATTNZERO_DETERMINISTIC", "0") not in ("", "0")
# Split-KV: force this many splits of the keys (``decode_splits``) instead of the device's choice
# (``decode.splits_for``: about two waves over the GPU's multiprocessors; on the CPU interpreter,
# which has none, it pretends there are 2). None: the device's choice.
DECODE_SPLITS: int | None = None


@contextmanager
def decode_splits(n: int) -> Iterator[None]:
    """Cut the keys of every split-KV launch into ``n`` splits (fewer when there are fewer key
    blocks, see ``decode.split_keys``) while the block runs — for the ladder and tests, which show
    the merge with several splits whatever the device."""
    global DECODE_SPLITS
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"decode_splits: expected a positive int, got {n!r}")
    before, DECODE_SPLITS = DECODE_SPLITS, n
    try:
        yield
    finally:
        DECODE_SPLITS = before


def interpreting() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(fwd_k.fwd_kernel).__name__ == "InterpretedFunction"


def unsupported_device_reason(device: torch.device) -> str | None:
    """Why this backend cannot run on ``device``, or None when it can."""
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return None
    if device.type == "cpu":
        return (
            "backend='triton' runs on CUDA tensors; for CPU tensors set the environment variable "
            "TRITON_INTERPRET=1 before importing attnzero (Triton's interpreter, slow, for tests)"
        )
    return f"backend='triton' runs on CUDA tensors (or CPU under TRITON_INTERPRET=1), got device {device}"


# ---------------------------------------------------------------------------------------------
# Launch helpers


# Launch settings on CUDA per kernel and head-dim class (16-bit inputs, then float32 inputs whose
# tiles take twice the registers and shared memory). Chosen for Hopper by compiling for sm_90
# without a GPU (triton 3.6), preferring tiles whose products lower to Hopper's wgmma (every tile
# dim of a product >= 64 rows) and little local memory: with 16-bit inputs at D <= 128 only dK/dV at
# D = 128 spills (about 200 bytes per thread). Not yet timed on a GPU.
# (BLOCK_M, BLOCK_N, num_warps, num_stages); set TILES[...] to override.
TILES: dict[tuple[str, int, bool], tuple[int, int, int, int]] = {
    ("fwd", 64, False): (128, 64, 8, 3), ("fwd", 128, False): (128, 64, 8, 3), ("fwd", 256, False): (64, 32, 8, 2),
    ("fwd", 64, True): (64, 64, 4, 2), ("fwd", 128, True): (64, 32, 4, 2), ("fwd", 256, True): (32, 32, 4, 1),
    ("dkdv", 64, False): (32, 64, 8, 3), ("dkdv", 128, False): (32, 64, 8, 2), ("dkdv", 256, False): (16, 32, 8, 2),
    ("dkdv", 64, True): (16, 64, 4, 2), ("dkdv", 128, True): (16, 32, 8, 2), ("dkdv", 256, True): (16, 16, 8, 1),
    ("dq", 64, False): (128, 32, 8, 3), ("dq", 128, False): (64, 32, 8, 3), ("dq", 256, False): (32, 16, 8, 2),
    ("dq", 64, True): (32, 32, 4, 2), ("dq", 128, True): (32, 16, 8, 2), ("dq", 256, True): (16, 16, 8, 1),
    ("decode", 64, False): (0, 128, 4, 3), ("decode", 128, False): (0, 64, 4, 3), ("decode", 256, False): (0, 32, 4, 2),
    ("decode", 64, True): (0, 64, 4, 2), ("decode", 128, True): (0, 32, 4, 2), ("decode", 256, True): (0, 16, 4, 2),
}


def _blocks(kind: str, D: int, Dv: int, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    """Tile sizes and launch settings for ``kind`` in fwd / dkdv / dq / decode (tiny tiles under the
    interpreter, so that tests cross many block boundaries)."""
    BD, BDV = fwd_k.next_pow2(D), fwd_k.next_pow2(Dv)
    if device.type != "cuda":
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_D": BD, "BLOCK_DV": BDV}
    wide = max(64, BD, BDV)
    bm, bn, warps, stages = TILES[(kind, wide, dtype == torch.float32)]
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "BLOCK_D": BD, "BLOCK_DV": BDV}


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.bfloat16 and interpreting():
        return "upcast"  # see forward.mm
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"  # float32 with TF32 allowed; ignored for 16-bit inputs


def _strides4(t: Tensor | None) -> tuple[int, int, int, int]:
    """Strides of a (B|1, H|1, Lq|1, Lk|1) tensor with 0 on broadcast (size-1) dims."""
    if t is None:
        return (0, 0, 0, 0)
    return tuple(0 if n == 1 else s for n, s in zip(t.shape, t.stride()))  # type: ignore[return-value]


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _side_arg(side: int | None) -> int:
    """A window side as an op's int argument (``ops.UNBOUNDED`` for None)."""
    return ops.UNBOUNDED if side is None else side


def _side(arg: int) -> int | None:
    """An op's int argument back to a window side (None: unbounded)."""
    return None if arg == ops.UNBOUNDED else arg


def _window(causal: bool, left: int | None, right: int | None, Lq: int, Lk: int) -> tuple[int | None, int | None]:
    """The kernels' band ``p - left <= j <= p + right`` (``p = i + Lk - Lq``): causal folded into the
    window (``geometry.band``), sides any ints or None (unbounded). A side that keeps every key of
    every row becomes None, and one that keeps none is clamped to the nearest such value, so that the
    kernels' index arithmetic stays within ±(Lq + Lk): ``left >= Lk - 1`` or ``right >= Lq - 1``
    bounds nothing (``0 <= j <= Lk - 1``, ``Lk - Lq <= p <= Lk - 1``); ``left <= -Lq`` or
    ``right <= -Lk`` keeps nothing, as does any smaller value."""
    wl, wr = geometry.band(causal, (left, right))
    if wl is not None:
        wl = None if wl >= Lk - 1 else max(wl, -Lq)
    if wr is not None:
        wr = None if wr >= Lq - 1 else max(wr, -Lk)
    return wl, wr


def _check_head_dims(D: int, Dv: int) -> None:
    """The tiles hold head dims up to ``forward.MAX_HEAD_DIM``: refuse larger ones clearly."""
    for name, n in (("D (q, k)", D), ("Dv (v)", Dv)):
        if n > fwd_k.MAX_HEAD_DIM:
            raise ValueError(
                f"backend='triton': head dim {name} = {n} is larger than the {fwd_k.MAX_HEAD_DIM} its kernels' "
                f"tiles hold; use backend='flash' (any head dim) or backend='auto'"
            )


def _segment_ids(seg: Segments, B: int, Lq: int, Lk: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """A mask's segments as the kernels read them: int32 ranks (equal ids ↔ equal ranks, so ids
    anywhere in int64 fit), expanded to q_ids (B, Lq) and k_ids (B, Lk), contiguous, on ``device``."""
    qi = seg.q_ids.to(device).expand(B, Lq)  # (B|1, Lq|1) -> (B, Lq)
    ki = seg.k_ids.to(device).expand(B, Lk)  # (B|1, Lk|1) -> (B, Lk)
    _, ranks = torch.unique(torch.cat([qi.reshape(-1), ki.reshape(-1)]), return_inverse=True)  # (B·(Lq + Lk),)
    ranks = ranks.to(torch.int32)
    return ranks[: B * Lq].view(B, Lq).contiguous(), ranks[B * Lq :].view(B, Lk).contiguous()


def _segment_ranges(row_ids: Tensor, col_ids: Tensor, block: int) -> Tensor:
    """For each batch and block of ``block`` rows, the columns ``[lo, hi)`` outside which no row of the
    block has a column of its own id: int32 (B, cdiv(Lr, block), 2), ``lo = hi = 0`` when none.
    ``row_ids`` (B, Lr) and ``col_ids`` (B, Lc) are int32 ranks (>= 0); any order of ids works (the
    range runs from the first to the last column of any id of the block). Memory O(B·(Lr + Lc)):
    the (batch, id) pairs of the columns are numbered by ``torch.unique``, and each row finds its
    pair among them by binary search."""
    B, Lr = row_ids.shape
    Lc = col_ids.shape[1]
    dev = col_ids.device
    batch = torch.arange(B, device=dev).view(B, 1) * 2**31  # a rank is < 2**31: (batch, rank) as one int64
    key_c = (batch + col_ids).reshape(-1)  # (B·Lc,)
    key_r = (batch + row_ids).reshape(-1)  # (B·Lr,)
    pairs, which = torch.unique(key_c, return_inverse=True)  # sorted (batch, id) pairs of the columns
    cols = torch.arange(Lc, device=dev).repeat(B)  # (B·Lc,): each column's index within its batch
    first = torch.full((len(pairs),), Lc, dtype=torch.int64, device=dev).scatter_reduce_(0, which, cols, "amin")
    last = torch.full((len(pairs),), -1, dtype=torch.int64, device=dev).scatter_reduce_(0, which, cols, "amax")
    at = torch.searchsorted(pairs, key_r).clamp_(max=len(pairs) - 1)  # (B·Lr,)
    found = pairs[at] == key_r  # the row's id has columns in its batch
    f = torch.where(found, first[at], Lc).view(B, Lr)  # (B, Lr): each row's first column (Lc: none)
    z = torch.where(found, last[at], -1).view(B, Lr)  # (B, Lr): each row's last column (-1: none)
    n = triton.cdiv(Lr, block)
    pad = n * block - Lr
    f = torch.nn.functional.pad(f, (0, pad), value=Lc).view(B, n, block)  # (B, n, block)
    z = torch.nn.functional.pad(z, (0, pad), value=-1).view(B, n, block)
    lo, hi = f.amin(dim=2), z.amax(dim=2) + 1  # (B, n) each
    empty = hi <= lo
    lo, hi = lo.masked_fill(empty, 0), hi.masked_fill(empty, 0)
    return torch.stack([lo, hi], dim=2).to(torch.int32).contiguous()  # (B, n, 2)


def _dropout_args(dropout_p: float, seed: int) -> tuple[int, int, int, float]:
    """(seed_lo, seed_hi, threshold, 1/(1-p)) exactly as dropout.keep_mask uses them."""
    if dropout_p <= 0.0:
        return 0, 0, 0, 1.0
    threshold = min(round(dropout_p * 2.0**32), 2**32)
    return seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, threshold, 1.0 / (1.0 - dropout_p)


def _common(
    q: Tensor, k: Tensor, mask: Tensor | None, bias: Tensor | None, q_ids: Tensor | None, causal: bool, left: int,
    right: int, scale: float, softcap: float, dropout_p: float, seed: int, score_gen: Generated | None = None,
) -> tuple[dict[str, Any], list[Any], Tensor, Tensor]:
    """Constexpr flags, the scalar arguments after ``qk_scale`` (and ``scale``), and the mask/bias
    pointers. ``left`` / ``right`` are op arguments (``ops.UNBOUNDED``: no bound). With a generated
    score_mod the softcap divides the mod's output, not ``scale·q·k`` (``forward.mod_scores``)."""
    wl, wr = _window(causal, _side(left), _side(right), q.shape[2], k.shape[2])
    seed_lo, seed_hi, threshold, keep_scale = _dropout_args(dropout_p, seed)
    flags = {
        "HAS_LEFT": wl is not None, "HAS_RIGHT": wr is not None, "HAS_MASK": mask is not None,
        "HAS_BIAS": bias is not None, "HAS_SEGMENTS": q_ids is not None, "HAS_SOFTCAP": softcap > 0.0,
        "HAS_DROPOUT": dropout_p > 0.0, "PRECISION": _precision(q.dtype),
    }
    # softcap: t = tanh(q·k · scale / softcap), base-2 score t · softcap · log2 e
    cap_in, cap_out = (scale / softcap, softcap * LOG2E) if softcap > 0.0 else (0.0, 0.0)
    if score_gen is not None and softcap > 0.0:
        cap_in = 1.0 / softcap  # t = tanh(score_mod(scale·q·k) / softcap)
    sides = [0 if wl is None else wl, 0 if wr is None else wr]  # read only where HAS_LEFT / HAS_RIGHT
    scalars = [cap_in, cap_out, *sides, seed_lo, seed_hi, threshold, keep_scale]
    mask_t = mask.view(torch.uint8) if mask is not None else q  # q: a placeholder pointer, never read
    bias_t = bias if bias is not None else q
    return flags, scalars, mask_t, bias_t


def _qk_scale(scale: float, score_gen: Generated | None) -> float:
    """The kernels' ``qk_scale``: ``scale · log2 e`` (base-2 scores), or ``scale`` when a generated
    score_mod must see the natural-scale score (``forward.mod_scores``)."""
    return scale if score_gen is not None else scale * LOG2E


def _mod_args(
    q: Tensor, score_gen: Generated | None, mask_gen: Generated | None, *, backward: bool = False,
    cap_grads: tuple[Tensor, ...] | None = None,
) -> dict[str, Any]:
    """The kernels' mod arguments: the generated functions (identities without), the tuples of the
    tensors they read (q as a placeholder, never read, when there are none) and, for the backward
    kernels, the float32 gradient buffers of the captured tensors (``cap_grads``, one per tensor)."""
    kw: dict[str, Any] = {
        "CAP": score_gen.tensors if score_gen is not None and score_gen.tensors else (q,),
        "MCAP": mask_gen.tensors if mask_gen is not None and mask_gen.tensors else (q,),
        "SCORE_MOD": score_gen.fwd if score_gen is not None else fwd_k.no_score_mod,
        "MASK_MOD": mask_gen.fwd if mask_gen is not None else fwd_k.no_mask_mod,
        "HAS_MOD": score_gen is not None, "HAS_MASK_MOD": mask_gen is not None,
    }  # fmt: skip
    if backward:
        kw["CAP_GRAD"] = cap_grads if cap_grads else (q,)
        bwd = score_gen.bwd if score_gen is not None else None
        kw["SCORE_MOD_BWD"] = bwd if bwd is not None else fwd_k.no_score_mod_bwd
    return kw


def _ids_args(q_ids: Tensor | None, k_ids: Tensor | None, ranges: Tensor | None, q: Tensor) -> list[Tensor]:
    """The kernels' QIds, KIds, Ranges pointers (q: a placeholder, never read, without segments)."""
    if q_ids is None or k_ids is None or ranges is None:
        return [q, q, q]
    return [q_ids, k_ids, ranges]


def _launch_opts(cfg: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in cfg.items() if k.startswith("BLOCK") or k in ("num_warps", "num_stages")}


# ---------------------------------------------------------------------------------------------
# The three computations (plain functions of tensors and scalars)


def _forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, q_ids: Tensor | None,
    k_ids: Tensor | None, causal: bool, left: int, right: int, scale: float, softcap: float, dropout_p: float,
    seed: int, keep_f32: bool = False, score_gen: Generated | None = None, mask_gen: Generated | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    _check_head_dims(D, Dv)
    out = torch.empty((B, Hq, Lq, Dv), dtype=q.dtype, device=q.device)  # (B, Hq, Lq, Dv)
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)  # (B, Hq, Lq)
    out32 = torch.empty((B, Hq, Lq, Dv) if keep_f32 else (0,), dtype=torch.float32, device=q.device)
    flags, scalars, mask_t, bias_t = _common(q, k, mask, bias, q_ids, causal, left, right, scale, softcap, dropout_p,
                                             seed, score_gen)
    flags.update(_mod_args(q, score_gen, mask_gen))
    cfg = _blocks("fwd", D, Dv, q.dtype, q.device)
    # the keys [lo, hi) of each (batch, query block): (B, cdiv(Lq, BLOCK_M), 2) int32
    ranges = _segment_ranges(q_ids, k_ids, cfg["BLOCK_M"]) if q_ids is not None and k_ids is not None else None
    grid = (triton.cdiv(Lq, cfg["BLOCK_M"]) * B * Hq,)
    args = (
        q, k, v, out, lse, out32 if keep_f32 else lse, mask_t, bias_t, *_ids_args(q_ids, k_ids, ranges, q),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        *_strides4(mask), *_strides4(bias),
        Hq, Hq // Hkv, Lq, Lk, D, Dv, _qk_scale(scale, score_gen), *scalars,
    )
    if not trace.active():
        fwd_k.fwd_kernel[grid](*args, Trace=lse, **_launch_opts(cfg), **flags, STORE_F32=keep_f32, TRACE=False)
        return out, lse, out32
    # Recording (attnzero.trace): the same kernel, writing down the key blocks it visits
    record = _trace_buffer(grid[0], Lk, cfg["BLOCK_N"], q.device)
    fwd_k.fwd_kernel[grid](*args, Trace=record, **_launch_opts(cfg), **flags, STORE_F32=keep_f32, TRACE=True)
    bm = cfg["BLOCK_M"]
    for pid, (pid_m, bh, blocks, masked) in enumerate(_trace_rows(record)):
        trace.note(
            "triton.program", kernel="fwd_kernel", pid=pid, q_block=pid_m, batch=bh // Hq, head=bh % Hq,
            rows=(pid_m * bm, min((pid_m + 1) * bm, Lq)), key_blocks=blocks, masked=masked,
            block_m=bm, block_n=cfg["BLOCK_N"], Lq=Lq, Lk=Lk,
        )
    return out, lse, out32


def _trace_buffer(programs: int, Lk: int, block_n: int, device: torch.device) -> Tensor:
    """The record a traced kernel fills: (programs, 2 + cdiv(Lk, block_n)) int32, -1 everywhere
    (program ``pid`` writes its row: two ids, then the part in which it visited each key block)."""
    return torch.full((programs, 2 + triton.cdiv(Lk, block_n)), -1, dtype=torch.int32, device=device)


def _trace_rows(record: Tensor) -> list[tuple[int, int, list[int], list[bool]]]:
    """Each program's row of a traced kernel's record: (first id, second id, the key blocks it
    visited in order, whether each was an edge block — LEADING or TRAILING — with range checks)."""
    rows = []
    for row in record.cpu().tolist():
        blocks = [nb for nb, part in enumerate(row[2:]) if part >= 0]
        masked = [row[2 + nb] != fwd_k.INTERIOR.value for nb in blocks]
        rows.append((row[0], row[1], blocks, masked))
    return rows


def _decode(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, q_ids: Tensor | None,
    k_ids: Tensor | None, causal: bool, left: int, right: int, scale: float, softcap: float, dropout_p: float,
    seed: int, score_gen: Generated | None = None, mask_gen: Generated | None = None,
) -> tuple[Tensor, Tensor]:
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    _check_head_dims(D, Dv)
    G = Hq // Hkv
    flags, scalars, mask_t, bias_t = _common(q, k, mask, bias, q_ids, causal, left, right, scale, softcap, dropout_p,
                                             seed, score_gen)
    flags.update(_mod_args(q, score_gen, mask_gen))
    cfg = _blocks("decode", D, Dv, q.dtype, q.device)
    # one program holds all Lq queries (of G heads): one key range per batch, (B, 1, 2) int32
    ranges = _segment_ranges(q_ids, k_ids, Lq) if q_ids is not None and k_ids is not None else None
    if DECODE_SPLITS is not None:
        S, chunk = dec_k.split_keys(Lk, cfg["BLOCK_N"], DECODE_SPLITS)
    else:
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 2
        S, chunk = dec_k.splits_for(B * Hkv, Lk, cfg["BLOCK_N"], num_sms)
    opart = torch.empty((B, Hq, S, Lq, Dv), dtype=torch.float32, device=q.device)  # (B, Hq, S, Lq, Dv)
    lpart = torch.empty((B, Hq, S, Lq), dtype=torch.float32, device=q.device)  # (B, Hq, S, Lq)
    grid = (S * B * Hkv,)
    args = (
        q, k, v, opart, lpart, mask_t, bias_t, *_ids_args(q_ids, k_ids, ranges, q),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), *_strides4(mask), *_strides4(bias),
        Hq, G, Lq, Lk, D, Dv, S, chunk, _qk_scale(scale, score_gen), *scalars,
    )
    opts = {**_launch_opts(cfg), "BLOCK_M": fwd_k.next_pow2(G * Lq)}
    tracing = trace.active()
    # recording (attnzero.trace): the same kernel, writing down the key blocks it visits
    record = _trace_buffer(grid[0], Lk, cfg["BLOCK_N"], q.device) if tracing else lpart  # (lpart: not read)
    dec_k.split_kernel[grid](*args, Trace=record, **opts, **flags, TRACE=tracing)
    out = torch.empty((B, Hq, Lq, Dv), dtype=q.dtype, device=q.device)  # (B, Hq, Lq, Dv)
    lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)  # (B, Hq, Lq)
    dec_k.merge_kernel[(B * Hq * Lq,)](
        opart, lpart, out, lse, out.stride(0), out.stride(1), out.stride(2), Hq, Lq, Dv, S,
        BLOCK_S=triton.next_power_of_2(S), BLOCK_DV=triton.next_power_of_2(Dv),
    )
    if tracing:
        # one event per (split, batch, kv head) program: its keys, the blocks it visited, and copies of
        # the partial results it wrote for its G query heads, with the merged ones they became
        for pid, (s, bk, blocks, masked) in enumerate(_trace_rows(record)):
            b, hk = bk // Hkv, bk % Hkv
            heads = slice(hk * G, (hk + 1) * G)
            trace.note(
                "decode.split", kernel="split_kernel", pid=pid, split=s, splits=S, batch=b, kv_head=hk,
                heads=list(range(hk * G, (hk + 1) * G)), keys=(s * chunk, min((s + 1) * chunk, Lk)),
                key_blocks=blocks, masked=masked, block_n=cfg["BLOCK_N"], Lk=Lk,
                out_s=opart[b, heads, s].clone(), lse_s=lpart[b, heads, s].clone(),  # (G, Lq, Dv), (G, Lq)
                out=out[b, heads].clone(), lse=lse[b, heads].clone(),  # merged: (G, Lq, Dv), (G, Lq)
            )
    return out, lse


def _backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Tensor | None,
    bias: Tensor | None, q_ids: Tensor | None, k_ids: Tensor | None, causal: bool, left: int, right: int,
    scale: float, softcap: float, dropout_p: float, seed: int, bias_grad: bool, deterministic: bool,
    score_gen: Generated | None = None, mask_gen: Generated | None = None, cap_grads: tuple[Tensor, ...] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, dbias; with a generated score_mod, the gradients of its captured tensors are added
    into ``cap_grads`` (float32, one per tensor of ``score_gen.tensors``) by the dK/dV kernel."""
    q, k, v, out, dout = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(out), _unit_last(dout)
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    _check_head_dims(D, Dv)
    G = Hq // Hkv
    flags, scalars, mask_t, bias_t = _common(q, k, mask, bias, q_ids, causal, left, right, scale, softcap, dropout_p,
                                             seed, score_gen)
    flags.update(_mod_args(q, score_gen, mask_gen, backward=True, cap_grads=cap_grads))
    qk_scale = _qk_scale(scale, score_gen)
    lse = lse.contiguous()

    # 1. Δ_i = Σ_d dO_id O_id                                                  (B, Hq, Lq) float32
    delta = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    BDV = fwd_k.next_pow2(Dv)
    bm = 16 if not q.is_cuda else 64
    o3, do3 = out.reshape(B * Hq, Lq, Dv), dout.reshape(B * Hq, Lq, Dv)  # (B·Hq, Lq, Dv)
    bwd_k.delta_kernel[(triton.cdiv(Lq, bm) * B * Hq,)](
        o3, do3, delta, o3.stride(0), o3.stride(1), do3.stride(0), do3.stride(1), Lq, Dv, BLOCK_M=bm, BLOCK_DV=BDV
    )

    # 2. dK, dV per key block (and dQ by atomics unless deterministic)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # (B, Hkv, Lk, D), contiguous like the fakes
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # (B, Hkv, Lk, Dv)
    atomic = not deterministic
    dq_acc = torch.zeros((B, Hq, Lq, D), dtype=torch.float32, device=q.device) if atomic else q
    dbias_full = (
        torch.zeros((B, Hq, Lq, Lk), dtype=torch.float32, device=q.device) if bias_grad else q
    )  # (B, Hq, Lq, Lk); zeros: skipped blocks have dS = 0
    cfg = _blocks("dkdv", D, Dv, q.dtype, q.device)
    # the queries [lo, hi) that may see each (batch, key block): (B, cdiv(Lk, BLOCK_N), 2) int32
    ranges = _segment_ranges(k_ids, q_ids, cfg["BLOCK_N"]) if q_ids is not None and k_ids is not None else None
    bwd_k.dkdv_kernel[(triton.cdiv(Lk, cfg["BLOCK_N"]) * B * Hkv,)](
        q, k, v, dout, lse, delta, dq_acc, dk, dv, dbias_full, mask_t, bias_t, *_ids_args(q_ids, k_ids, ranges, q),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        dq_acc.stride(0), dq_acc.stride(1), dq_acc.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2), *_strides4(mask), *_strides4(bias),
        Hq, G, Lq, Lk, D, Dv, qk_scale, scale, *scalars,
        **_launch_opts(cfg), **flags, BIAS_GRAD=bias_grad, ATOMIC_DQ=atomic,
    )

    # 3. dQ per query block (deterministic path)
    if atomic:
        dq = dq_acc.to(q.dtype)
    else:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (B, Hq, Lq, D)
        cfg = _blocks("dq", D, Dv, q.dtype, q.device)
        # the keys of each (batch, query block of this kernel's BLOCK_M): (B, cdiv(Lq, BLOCK_M), 2) int32
        ranges = _segment_ranges(q_ids, k_ids, cfg["BLOCK_M"]) if q_ids is not None and k_ids is not None else None
        bwd_k.dq_kernel[(triton.cdiv(Lq, cfg["BLOCK_M"]) * B * Hq,)](
            q, k, v, dout, lse, delta, dq, mask_t, bias_t, *_ids_args(q_ids, k_ids, ranges, q),
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2), *_strides4(mask), *_strides4(bias),
            Hq, G, Lq, Lk, D, Dv, qk_scale, scale, *scalars,
            **_launch_opts(cfg), **flags,
        )

    # 4. The bias gradient: dS summed over the bias's broadcast dims
    if bias_grad:
        assert bias is not None
        dims = [d for d in range(4) if bias.shape[d] == 1]
        dbias = (dbias_full.sum(dim=dims, keepdim=True) if dims else dbias_full).to(bias.dtype)  # bias's shape
    else:
        dbias = q.new_empty(0)
    return dq, dk, dv, dbias


# ---------------------------------------------------------------------------------------------
# torch.library registration. Op arguments: ``mask`` a dense bool tensor or None; ``q_ids`` (B, Lq)
# and ``k_ids`` (B, Lk) int32 segment ranks or None (both or neither); ``left`` / ``right`` ints,
# ``ops.UNBOUNDED`` for an unbounded side; ``softcap`` a float, 0.0 for none.


@torch.library.custom_op("attnzero::triton_fwd", mutates_args=())
def triton_fwd(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, q_ids: Tensor | None,
    k_ids: Tensor | None, causal: bool, left: int, right: int, scale: float, softcap: float, dropout_p: float,
    seed: int, keep_f32: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Forward kernel: (out (B, Hq, Lq, Dv), lse (B, Hq, Lq) float32, out32). ``keep_f32``: out32 is
    the float32 output (B, Hq, Lq, Dv) for the backward, else empty."""
    return _forward(q, k, v, mask, bias, q_ids, k_ids, causal, left, right, scale, softcap, dropout_p, seed, keep_f32)


@triton_fwd.register_fake
def _(q, k, v, mask, bias, q_ids, k_ids, causal, left, right, scale, softcap, dropout_p, seed, keep_f32):  # type: ignore[no-untyped-def]
    B, Hq, Lq, _ = q.shape
    out32 = q.new_empty((B, Hq, Lq, v.shape[3]) if keep_f32 else (0,), dtype=torch.float32)
    return q.new_empty((B, Hq, Lq, v.shape[3])), q.new_empty((B, Hq, Lq), dtype=torch.float32), out32


@torch.library.custom_op("attnzero::triton_decode", mutates_args=())
def triton_decode(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, q_ids: Tensor | None,
    k_ids: Tensor | None, causal: bool, left: int, right: int, scale: float, softcap: float, dropout_p: float,
    seed: int,
) -> tuple[Tensor, Tensor]:
    """Split-KV decode (no backward): same results as ``triton_fwd``."""
    return _decode(q, k, v, mask, bias, q_ids, k_ids, causal, left, right, scale, softcap, dropout_p, seed)


@triton_decode.register_fake
def _(q, k, v, mask, bias, q_ids, k_ids, causal, left, right, scale, softcap, dropout_p, seed):  # type: ignore[no-untyped-def]
    B, Hq, Lq, _ = q.shape
    return q.new_empty((B, Hq, Lq, v.shape[3])), q.new_empty((B, Hq, Lq), dtype=torch.float32)


@torch.library.custom_op("attnzero::triton_bwd", mutates_args=())
def triton_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Tensor | None,
    bias: Tensor | None, q_ids: Tensor | None, k_ids: Tensor | None, causal: bool, left: int, right: int,
    scale: float, softcap: float, dropout_p: float, seed: int, bias_grad: bool, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward kernels: (dq, dk, dv, dbias); dbias has bias's shape, or is empty when not asked for."""
    return _backward(
        dout, q, k, v, out, lse, mask, bias, q_ids, k_ids, causal, left, right, scale, softcap, dropout_p, seed,
        bias_grad, deterministic,
    )


@triton_bwd.register_fake
def _(dout, q, k, v, out, lse, mask, bias, q_ids, k_ids, causal, left, right, scale, softcap, dropout_p, seed,  # type: ignore[no-untyped-def]
      bias_grad, deterministic):
    dbias = bias.new_empty(bias.shape) if bias_grad and bias is not None else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    q, k, v, mask, bias, q_ids, k_ids, causal, left, right, scale, softcap, dropout_p, seed, keep_f32 = inputs
    out, lse, out32 = output
    ctx.save_for_backward(q, k, v, out32 if keep_f32 else out, lse, mask, bias, q_ids, k_ids)  # Δ from the unrounded O
    ctx.args = (causal, left, right, scale, softcap, dropout_p, seed)
    ctx.bias_grad = bias is not None and ctx.needs_input_grad[4]


def _dense_keep(mask: Tensor | None, q_ids: Tensor | None, k_ids: Tensor | None) -> Tensor | None:
    """The keep-mask of a dense mask and/or segment ids as one bool tensor broadcastable to
    (B, Hq, Lq, Lk) — for the formula (double backward), which takes one dense mask."""
    if q_ids is None or k_ids is None:
        return mask
    same = q_ids[:, None, :, None] == k_ids[:, None, None, :]  # (B, 1, Lq, Lk)
    return same if mask is None else same & mask


def _backward_rule(ctx: Any, dout: Tensor, dlse: Tensor, dout32: Tensor) -> tuple[Tensor | None, ...]:
    del dlse, dout32  # by-products; their gradients are not propagated
    q, k, v, out, lse, mask, bias, q_ids, k_ids = ctx.saved_tensors
    nones = (None,) * 10  # q_ids, k_ids, causal, left, right, scale, softcap, dropout_p, seed, keep_f32
    if reference.needs_graph(dout):  # create_graph=True, or a batched dout: autograd through the formula
        causal, left, right, scale, softcap, dropout_p, seed = ctx.args
        wl, wr = _side(left), _side(right)
        needs = (*ctx.needs_input_grad[:3], ctx.bias_grad)
        dq, dk, dv, dbias = reference.backward_with_graph(
            dout, q, k, v, bias, needs, mask=_dense_keep(mask, q_ids, k_ids), causal=causal,
            window=None if wl is None and wr is None else (wl, wr), scale=scale,
            softcap=softcap if softcap > 0.0 else None, dropout_p=dropout_p, dropout_seed=seed,
        )
        return dq, dk, dv, None, dbias, *nones
    deterministic = DETERMINISTIC or torch.are_deterministic_algorithms_enabled()
    dq, dk, dv, dbias = triton_bwd(
        dout, q, k, v, out, lse, mask, bias, q_ids, k_ids, *ctx.args, ctx.bias_grad, deterministic
    )
    return dq, dk, dv, None, (dbias if ctx.bias_grad else None), *nones


torch.library.register_autograd("attnzero::triton_fwd", _backward_rule, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# The backend function


def _args(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | Mask | None, bias: Tensor | None, causal: bool,
    window: tuple[int | None, int | None] | None, scale: float, softcap: float | None = None, dropout_p: float,
    dropout_seed: int,
) -> tuple[Any, ...]:
    """The backend's keyword arguments as the ops take them: ``mask, bias, q_ids, k_ids, causal,
    left, right, scale, softcap, dropout_p, seed``. A ``Mask`` with segments becomes its ids (int32
    ranks, never a dense mask); any other ``Mask`` is materialised (broadcast dims kept at size 1).
    Window sides become ints (``ops.UNBOUNDED`` for None), softcap a float (0.0 for None). Head dims
    beyond the tiles are refused here, before any work."""
    _check_head_dims(q.shape[3], v.shape[3])
    q_ids = k_ids = None
    dense: Tensor | None
    if isinstance(mask, Mask) and mask.segments is not None:
        dense = None
        q_ids, k_ids = _segment_ids(mask.segments, q.shape[0], q.shape[2], k.shape[2], q.device)  # (B, Lq), (B, Lk)
    elif isinstance(mask, Mask):
        dense = mask.to_tensor(q.device)  # (B|1, H|1, Lq|1, Lk|1) bool
    else:
        dense = mask
    left, right = (None, None) if window is None else window
    return (
        dense, bias, q_ids, k_ids, causal, _side_arg(left), _side_arg(right), float(scale),
        0.0 if softcap is None else float(softcap), float(dropout_p), int(dropout_seed),
    )


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | Mask | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    scale: float,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """``(out (B, Hq, Lq, Dv), lse (B, Hq, Lq))`` of softmax(cap(scale · Q Kᵀ) + bias) V by Triton
    kernels, differentiable in q, k and v and bias (the forward kernel op and its autograd rule).

    Same contract as ``reference.attention``: ``mask`` (bool, or an ``az.masks.Mask`` — its segment
    ids when it has them, else materialised here to a dense bool tensor) and ``bias`` broadcastable
    to (B, Hq, Lq, Lk); causal bottom-right; ``window=(left, right)``, sides None or any int;
    ``softcap``: the score becomes ``softcap · tanh(score / softcap)`` before the bias; dropout drops
    exactly ``dropout.keep_mask(dropout_seed, ...)``'s entries, in the forward and the backward.
    Inputs are float16, bfloat16 or float32 on a device this backend runs on, head dims up to 256
    (a ValueError beyond): ``functional.choose`` sends float64 to the flash backend and short
    queries without gradients to ``decode``.
    """
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias))
    bias, shift = _shifted_bias(bias)
    args = _args(
        q, k, v, mask=mask, bias=bias, causal=causal, window=window, scale=scale, softcap=softcap,
        dropout_p=dropout_p, dropout_seed=dropout_seed,
    )
    # 16-bit outputs: keep the float32 output for the backward's Δ = rowsum(dO·O) when training
    keep_f32 = needs_grad and q.dtype != torch.float32
    out, lse, _ = triton_fwd(q, k, v, *args, keep_f32)  # the op's backward sees this lse, before the shift
    return out, (lse if shift is None else lse + shift)


# A row whose bias lies farther than this from 0 everywhere (an additive mask's fully masked row,
# −1e9 or ``finfo.min``) is computed less its bias's row max (``_shifted_bias``).
_ROW_SHIFT_MIN = 32.0


def _shifted_bias(bias: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """``(bias − c, c)`` with ``c`` the bias's finite row max (B|1, H|1, Lq|1) in the rows whose bias
    is far from 0 everywhere (``|c| > _ROW_SHIFT_MIN``, 0 in the others), else ``(bias, None)``.
    The softmax does not change; the lse of the shifted bias is ``c`` smaller, and keeps the bits
    that ``lse ≈ c`` (−1e9, say) cannot: the backward's P = exp(s − lse) needs them. One read-back
    per call with a bias."""
    if bias is None:
        return bias, None
    c = bias.amax(dim=-1).to(torch.float32)  # (B|1, H|1, Lq|1)
    c = torch.where(torch.isfinite(c), c, 0.0)
    if float(c.abs().max()) <= _ROW_SHIFT_MIN:
        return bias, None
    # only rows far from 0 are shifted: 0 is subtracted exactly elsewhere, even from a 16-bit bias
    shift = torch.where(c.abs() > _ROW_SHIFT_MIN, c, 0.0)  # (B|1, H|1, Lq|1)
    return bias - shift.unsqueeze(-1).to(bias.dtype), shift  # (differentiable in bias: the identity)


def forward(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> tuple[Tensor, Tensor]:
    """``attention`` as a plain function (the backend interface's forward): the forward kernel, no
    autograd."""
    with torch.no_grad():
        bias, shift = _shifted_bias(kw.pop("bias", None))
        out, lse, _ = triton_fwd(q, k, v, *_args(q, k, v, bias=bias, **kw), False)
    return out, (lse if shift is None else lse + shift)


def decode(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> tuple[Tensor, Tensor]:
    """The split-KV decode kernel (``attnzero::triton_decode``), the same ``(out, lse)`` as
    ``forward``; no backward (``functional.choose`` takes it only when no input requires grad, for
    the shapes it serves: ``DECODE_MAX_LQ``, ``DECODE_MIN_LK``, ``DECODE_MAX_ROWS``)."""
    bias, shift = _shifted_bias(kw.pop("bias", None))
    out, lse = triton_decode(q, k, v, *_args(q, k, v, bias=bias, **kw))
    return out, (lse if shift is None else lse + shift)


def backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
    mask: Tensor | Mask | None, bias: Tensor | None, causal: bool, window: tuple[int | None, int | None] | None,
    scale: float, softcap: float | None = None, dropout_p: float, dropout_seed: int, bias_grad: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
    """The backend interface's backward: ``(dq, dk, dv, dbias)`` by the backward kernels, from the
    ``out`` and ``lse`` given (a ring's global ones, or those with attention sinks folded in, work:
    P = exp(s − lse) and Δ = rowsum(dO·O) are recomputed from them). Δ comes from the output in its
    own dtype, as in the flash backend (the eager path keeps a float32 copy of a 16-bit output for
    it). dbias None unless ``bias_grad``."""
    deterministic = DETERMINISTIC or torch.are_deterministic_algorithms_enabled()
    bias, shift = _shifted_bias(bias)
    args = _args(
        q, k, v, mask=mask, bias=bias, causal=causal, window=window, scale=scale, softcap=softcap,
        dropout_p=dropout_p, dropout_seed=dropout_seed,
    )
    if shift is not None:
        # the lse of the shifted bias: ``lse − c`` loses its bits where c is huge, so this forward's own
        # is computed again, and what the given lse adds to it (a sink, a ring's keys) added back
        with torch.no_grad():
            own = triton_fwd(q, k, v, *args, False)[1]
        extra = lse - (own + shift)  # 0 for this forward's lse; a row with no key: NaN, not used
        lse = torch.where(own == float("-inf"), lse - shift, own + extra)
    grad_b = bias_grad and bias is not None
    dq, dk, dv, dbias = triton_bwd(dout, q, k, v, out, lse, *args, grad_b, deterministic)
    return dq, dk, dv, (dbias if grad_b else None)


# ---------------------------------------------------------------------------------------------
# score_mod / mask_mod: the kernels with code generated from the user's functions (codegen.py).
# A function cannot be an op's argument, so these calls go through an autograd.Function (as
# flash.py's), whose inputs include the captured tensors so that they get gradients.


def generate(score_mod: Any, device: torch.device, *, grads: bool) -> Generated:
    """The score_mod as Triton code (``codegen.score_mod``): raises ``codegen.NotGenerable`` naming
    what cannot be generated; a captured tensor on another device is refused here."""
    from . import codegen

    gen = codegen.score_mod(score_mod, device, grads=grads)
    for t in gen.tensors:
        if t.device != device:
            raise codegen.NotGenerable(
                f"score_mod: reads a tensor of shape {tuple(t.shape)} on {t.device}, the inputs are on {device}"
            )
    return gen


class _ModAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, options: dict[str, Any], *captured: Tensor
    ) -> tuple[Tensor, Tensor]:
        del captured  # inputs only so that they get gradients (the generated code reads gen.tensors)
        args, gen, keep_f32 = options["args"], options["gen"], options["keep_f32"]
        run: Any = _forward  # (args: the op arguments of ``_args``)
        out, lse, out32 = run(q, k, v, args[0], bias, *args[2:], keep_f32, score_gen=gen)
        ctx.save_for_backward(q, k, v, bias, out32 if keep_f32 else out, lse)
        ctx.options = options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        del dlse  # lse is returned as non-differentiable
        q, k, v, bias, out, lse = ctx.saved_tensors
        options = ctx.options
        args, gen, captured = options["args"], options["gen"], options["captured"]
        needs = ctx.needs_input_grad
        if reference.needs_graph(dout):  # create_graph=True, or a batched dout: autograd through the formula
            return _mod_graph_grads(dout, q, k, v, bias, needs, options)
        bufs = tuple(torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in gen.tensors)
        deterministic = DETERMINISTIC or torch.are_deterministic_algorithms_enabled()
        bias_grad = bias is not None and needs[3]
        run: Any = _backward
        dq, dk, dv, dbias = run(
            dout, q, k, v, out, lse, args[0], bias, *args[2:], bias_grad, deterministic, score_gen=gen,
            cap_grads=bufs,
        )  # fmt: skip
        grads: list[Tensor | None] = [None] * len(captured)
        for buf, j in zip(bufs, gen.grad_of):
            if j is not None and needs[5 + j]:
                grads[j] = buf.to(captured[j].dtype)
        return dq, dk, dv, (dbias if bias_grad else None), None, *grads


def _mod_graph_grads(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, needs: tuple[bool, ...], options: dict[str, Any]
) -> tuple[Tensor | None, ...]:
    """Differentiable gradients (double backward, a batched dout): autograd through the reference's
    formula with the same score_mod, as the kernels' op does for its double backward."""
    ref, captured = options["reference"], options["captured"]
    inputs = [q, k, v, bias, *captured]
    wrt = [t for t, n in zip(inputs[:4], needs[:4]) if t is not None and n]
    wrt += [t for t, n in zip(captured, needs[5:]) if n and t.requires_grad]
    with torch.enable_grad():
        out, _ = reference.attention(q, k, v, bias=bias, **ref)
        got = iter(torch.autograd.grad(out, wrt, dout, create_graph=True, allow_unused=True))
    res: list[Tensor | None] = [next(got) if t is not None and n else None for t, n in zip(inputs[:4], needs[:4])]
    rest = [next(got) if n and t.requires_grad else None for t, n in zip(captured, needs[5:])]
    return (*res, None, *rest)


def attention_with_mod(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    score_mod: Any,
    mask: Tensor | Mask | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    scale: float,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    decode: bool = False,
) -> tuple[Tensor, Tensor]:
    """``attention`` with a ``score_mod`` run by the kernels as generated Triton code (codegen.py):
    differentiable in q, k, v, bias and the tensors the mod captures (``mods.captured_tensors``),
    forward and backward by the Triton kernels. ``decode``: the split-KV kernel (no gradients; what
    ``functional.choose`` would take for these shapes). Raises ``codegen.NotGenerable`` naming what
    cannot be generated, before any work."""
    from .. import mods

    captured = mods.captured_tensors(score_mod)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias, *captured))
    gen = generate(score_mod, q.device, grads=needs_grad and not decode)
    bias, shift = _shifted_bias(bias)
    args = _args(
        q, k, v, mask=mask, bias=bias, causal=causal, window=window, scale=scale, softcap=softcap,
        dropout_p=dropout_p, dropout_seed=dropout_seed,
    )  # fmt: skip
    if decode or not needs_grad:
        with torch.no_grad():
            run: Any = _decode if decode else _forward
            out, lse = run(q, k, v, args[0], bias, *args[2:], score_gen=gen)[:2]
    else:
        ref = {
            "mask": mask, "causal": causal, "window": window, "scale": scale, "softcap": softcap,
            "dropout_p": dropout_p, "dropout_seed": dropout_seed, "score_mod": score_mod,
        }  # fmt: skip
        options = {
            "args": args, "gen": gen, "keep_f32": q.dtype != torch.float32, "captured": captured, "reference": ref,
        }  # fmt: skip
        out, lse = _ModAttention.apply(q, k, v, bias, options, *captured)
    return out, (lse if shift is None else lse + shift)
