"""The public functions: validate once, then hand trusted inputs to one backend.

Letters used in shapes: B batch, Hq query heads, Hkv key/value heads (Hq % Hkv == 0), Lq query
length, Lk key length, D head dim of q and k, Dv head dim of v.

A backend is a function with one signature::

    backend(q, k, v, *, mask, bias, causal, window, scale, dropout_p, dropout_seed)
        -> (out (B, Hq, Lq, Dv), lse (B, Hq, Lq))

where ``mask`` is a 4-D bool tensor or an ``az.masks.Mask`` (True = may attend), ``bias`` a 4-D
float tensor (both broadcastable to (B, Hq, Lq, Lk)), ``window`` a ``(left, right)`` pair, ``scale``
a float and ``dropout_seed`` the seed of ``dropout.keep_mask`` — with a plain forward and backward
beside it (``ops.Backend``).

Three things are settled here, once, so that every backend behaves the same (and a fourth beside
it: torch's conventions in the drop-in, ``sdpa.py``, which hands its call to ``run``):

* which implementation runs (``choose``): "auto", float64 on ``backend="triton"`` (the flash
  backend computes it), the triton backend's split-KV decode kernel (only without gradients) and
  whether the device can run it — for ``attention`` and the drop-in, and for the ring
  (``distributed.py``), which calls the chosen backend's forward and backward;
* autocast: inside ``torch.autocast`` the inputs are cast as autocast casts those of torch's
  ``scaled_dot_product_attention``, and the backend then runs with autocast off (``autocast.py``);
* zero sizes, and ``torch.compile`` / ``torch.export``: the call goes through the backend's custom
  ops (``ops.py``), which answer zero-size problems and keep the backend's Python out of the traced
  graph; other eager calls go to the backend directly.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function_variadic

from . import autocast, batching, checks, cpu_kernel, dropout, geometry, lse_grad, mods, ops, reference
from .checks import ArgumentError, ArgumentTypeError
from .masks import Mask

log = logging.getLogger("attnzero")
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None

Backend = Callable[..., tuple[Tensor, Tensor | None]]
BackendName = Literal["auto", "reference", "flash", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "flash", "triton")


def _backend(name: str) -> Backend:
    """The eager, differentiable function of an implementation that ``choose`` returned (imported
    on first use)."""
    return ops.backend(name).attention


def _check_triton(device: torch.device) -> None:
    """backend="triton" can run here: triton is installed (else a clear ImportError) and the tensors
    are on CUDA, or on CPU under TRITON_INTERPRET=1."""
    from .kernels import triton_backend  # ImportError: "... needs the `triton` package: pip install triton ..."

    reason = triton_backend.unsupported_device_reason(device)
    if reason is not None:
        raise ArgumentError(f"backend: {reason}")


def _auto(q: Tensor, v: Tensor) -> str:
    """The fastest correct backend for these inputs (see docs/benchmarks.md for the measurements).
    Whether gradients are needed does not change it: ``choose`` then takes the triton backend's
    split-KV decode path only when no input requires grad."""
    # flash, on any device (the tiled online softmax in plain PyTorch).
    name = "flash"
    if q.is_cuda and q.dtype != torch.float64 and _TRITON_INSTALLED and _fits_triton(q, v):
        name = "triton"  # the Triton kernels (kernels/), for every size on CUDA up to their head dims
    if not torch.compiler.is_compiling() and log.isEnabledFor(logging.DEBUG):  # a compiled graph has no logger calls
        log.debug("backend='auto' chose %r for q %s, v %s on %s", name, tuple(q.shape), tuple(v.shape), q.device)
    return name


# The largest head dim of the Triton kernels' tiles (kernels/triton_backend.py's TILES).
TRITON_MAX_HEAD_DIM = 256


def _fits_triton(q: Tensor, v: Tensor) -> bool:
    """Whether the head dims of q/k (D) and v (Dv) fit the Triton kernels' tiles."""
    return checks.known(q.shape[-1] <= TRITON_MAX_HEAD_DIM) and checks.known(v.shape[-1] <= TRITON_MAX_HEAD_DIM)


def _takes_decode(q: Tensor, k: Tensor) -> bool:
    """Whether the triton backend's split-KV decode kernel serves these shapes: few queries (G·Lq
    rows per key/value head, at most ``DECODE_MAX_ROWS``) against many keys. Decided only where the
    sizes are known (a symbolic size that depends on data takes the forward kernel)."""
    from .kernels import triton_backend as tb

    Hq, Lq, Hkv, Lk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    return (
        checks.known(Lq <= tb.DECODE_MAX_LQ)
        and checks.known(Lk >= tb.DECODE_MIN_LK)
        and checks.known(Hq * Lq <= tb.DECODE_MAX_ROWS * Hkv)  # G·Lq <= DECODE_MAX_ROWS, G = Hq / Hkv
    )


def _kernel_built() -> bool:
    """Whether the compiled CPU kernel is here (built on first use; a constant for dynamo)."""
    return cpu_kernel.available()


# torch.compiler.assume_constant_result(_kernel_built), which only sets this mark: calling it here
# would import torch._dynamo (seconds) and triton with attnzero — before a test run can choose
# Triton's interpreter.
_kernel_built._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _takes_kernel(q: Tensor) -> bool:
    """Whether "flash" runs as the compiled CPU kernel (``cpu_kernel.py``): CPU, float32 / bfloat16 /
    float16 (``cpu_kernel.unsupported``), with any bias, and the kernel built (else flash.py, after
    one warning that says why)."""
    return cpu_kernel.unsupported(q) is None and _kernel_built()


def choose(name: str, q: Tensor, k: Tensor, *, needs_grad: bool, v: Tensor | None = None) -> str:
    """The implementation that runs (one of ``ops.NAMES``) for backend ``name`` — the one place where
    it is decided, for ``attention`` and the ring alike:

    * "auto" → the fastest correct backend for the inputs and device (``_auto``);
    * "triton" → checked to run on q's device and to fit its tiles (head dims up to
      ``TRITON_MAX_HEAD_DIM``; a clear ImportError / ValueError otherwise); then float64 →
      "flash" (float64 is not a GPU-kernel dtype: the plain-PyTorch tiled backend computes it in
      float64 on the same device, with gradients), and the split-KV decode kernel
      ("triton_decode") when no input requires grad and the shapes suit it (``_takes_decode``);
    * "flash" on CPU → the compiled kernel ("cpu_kernel") where it takes the inputs and is built
      (``_takes_kernel``); flash.py otherwise (float64, no compiler, ``ATTNZERO_NO_BUILD=1``, ...).
    """
    values = k if v is None else v
    if name == "auto":
        name = _auto(q, values)
    if name == "triton":
        _check_triton(q.device)
        if not _fits_triton(q, values):
            raise ArgumentError(
                f"backend: 'triton' tiles take head dims up to {TRITON_MAX_HEAD_DIM}, got D = {q.shape[-1]} and "
                f"Dv = {values.shape[-1]}; use backend='flash' (or 'auto', which takes it for larger heads)"
            )
        if q.dtype == torch.float64:
            name = "flash"
        elif not needs_grad and _takes_decode(q, k):
            name = "triton_decode"
    if name == "flash" and _takes_kernel(q):
        name = "cpu_kernel"
    return name


def _needs_grad(*xs: Tensor | None) -> bool:
    """Whether autograd will ask for a gradient of any of ``xs``."""
    if not torch.is_grad_enabled():
        return False
    for x in xs:  # (a loop, not any() over a generator: this runs on every call)
        if x is not None and x.requires_grad:
            return True
    return False


# ---------------------------------------------------------------------------------------------
# The public functions


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | Mask | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    backend: BackendName = "auto",
    return_lse: bool = False,
    score_mod: mods.ScoreMod | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention ``softmax(scale · Q Kᵀ + bias) V`` over kept pairs.

    Args:
        q: (B, Hq, Lq, D). k: (B, Hkv, Lk, D). v: (B, Hkv, Lk, Dv). Query head ``h`` reads
            key/value head ``h // (Hq // Hkv)`` (GQA / MQA). Any size may be 0.
        mask: keep-mask broadcastable to (B, Hq, Lq, Lk): True / non-zero = may attend. A tensor of
            any dtype, or a builder from ``az.masks``.
        bias: float tensor broadcastable to (B, Hq, Lq, Lk), added to the scaled scores.
        causal: bottom-right aligned — query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq``.
        window: ``(left, right)`` or ``w`` = ``(w, 0)``: query ``i`` at ``p = i + Lk - Lq`` sees
            ``p - left <= j <= p + right``; None on a side = unbounded.
        scale: defaults to ``1 / sqrt(D)``.
        softcap: a float > 0: each score ``s = scale · q · k`` becomes ``softcap · tanh(s / softcap)``
            before the bias (Gemma 2's logit soft-capping).
        sinks: float logits (Hq,) or (B, Hq, Lq) of a virtual key of value 0 in every row's softmax
            (gpt-oss's attention sinks): ``p_ij = exp(s_ij) / (exp(sink) + Σ_j exp(s_ij))``. The lse
            includes it; a row with no kept key gives output 0 and lse = sink. May require grad.
        dropout_p: drop probabilities with this chance (and rescale by 1 / (1 - p)); the dropped
            entries follow torch's RNG state.
        backend: "reference", "flash", "triton" or "auto".
        return_lse: also return the natural-log log-sum-exp of the scores, (B, Hq, Lq); differentiable
            in q, k, bias, sinks and a score_mod's tensors on every backend (``lse_grad.py``; under
            ``torch.compile`` the backend's op adds the lse's share in its backward); under
            ``torch.func`` a call whose lse may take a gradient runs the reference.
        score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to
            each scaled score ``scale · q · k`` before ``softcap`` and ``bias`` (a kept pair's score
            is ``bias + cap(score_mod(scale · q · k, ...))``); ``h`` is the query head, ``q_idx`` /
            ``kv_idx`` the 0-based positions; −inf blocks the pair. Called as Flex calls it (vmapped
            over 0-d int32 indices, ``mods.py``); tensors it captures get gradients. Every backend runs
            it: the CPU kernel and the Triton kernels as code generated from it (``cpu_mods.py``,
            ``kernels/codegen.py``; one that cannot be generated runs on flash.py's tiles, and
            ``backend="triton"`` refuses it naming the operation), flash.py and the reference as it is.

    Returns:
        out (B, Hq, Lq, Dv) in q's dtype, or ``(out, lse)``. A query row with no kept key gives
        output 0, lse −inf and zero gradients — never NaN. Zero sizes: B, Hq or Lq = 0 give empty
        results; Lk = 0 makes every row fully blocked; D = 0 makes every score 0 (+ bias).

    Under ``torch.autocast`` the float32 tensors are cast as autocast casts torch's
    ``scaled_dot_product_attention``'s, and the result has that dtype on every backend.
    """
    if _dispatches(q, k, v, mask, bias, sinks):  # a __torch_function__ subclass: as torch's functions
        return handle_torch_function(  # type: ignore[no-any-return]
            attention, (q, k, v, mask, bias, sinks), q, k, v, mask=mask, bias=bias, causal=causal, window=window,
            scale=scale, softcap=softcap, sinks=sinks, dropout_p=dropout_p, backend=backend, return_lse=return_lse,
            score_mod=score_mod,
        )  # fmt: skip
    if not autocast.active():  # the common call: nothing to cast, nothing to turn off (asked once: µs count here)
        return run(
            q, k, v, mask=mask, bias=bias, causal=causal, window=window, scale=scale, softcap=softcap, sinks=sinks,
            dropout_p=dropout_p, backend=backend, return_lse=return_lse, score_mod=score_mod,
        )  # fmt: skip
    q, k, v, bias = autocast.cast(q, k, v, bias)
    with autocast.as_given(q):
        return run(
            q, k, v, mask=mask, bias=bias, causal=causal, window=window, scale=scale, softcap=softcap, sinks=sinks,
            dropout_p=dropout_p, backend=backend, return_lse=return_lse, score_mod=score_mod,
        )  # fmt: skip


def run(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    causal: Any = False,
    window: Any = None,
    scale: Any = None,
    softcap: Any = None,
    sinks: Any = None,
    dropout_p: Any = 0.0,
    backend: Any = "auto",
    return_lse: Any = False,
    score_mod: Any = None,
    qkv_checked: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``attention`` after autocast: validate, then run one backend — directly in eager mode, or
    through its custom ops (``ops.py``) when compiling or for zero sizes. ``qkv_checked``: q, k and
    v were checked by the caller (the drop-in, in torch's words; a tiny call pays for every check)."""
    if qkv_checked:
        B, Hq, Lq, _ = q.shape
        Lk = k.shape[2]
    else:
        if v is None:  # checks.qkv treats v=None as "no values" (attention_weights)
            raise ArgumentTypeError("v: expected a torch.Tensor, got NoneType")
        B, Hq, _, Lq, Lk = checks.qkv(q, k, v, empty_ok=True)
    full = (B, Hq, Lq, Lk)
    # (an optional argument left at None has nothing to check: asked here, where a check costs a call)
    keep = None if mask is None else checks.mask(_no_causal_bias("mask", mask), full, q.device)
    add = None if bias is None else checks.bias(_no_causal_bias("bias", bias), full, q.device)
    is_causal = checks.flag("causal", causal)
    win = None if window is None else checks.window(window, Lq, Lk)
    sc = checks.scale(scale, q.shape[-1])
    cap = None if softcap is None else checks.softcap(softcap)
    sink = None if sinks is None else checks.sinks(sinks, B, Hq, Lq, q.device)
    p = checks.dropout_p(dropout_p)
    name = checks.choice("backend", backend, BACKENDS)
    want_lse = checks.flag("return_lse", return_lse)
    # pinned: the backward reads what this forward read, not what a loop has rebound since (mods.pin)
    fn = None if score_mod is None else mods.pin(mods.check_callable("score_mod", score_mod))
    if checks.is_zero(Lk):
        fn = None  # no pair to modify: every row is blocked, as without it (ops.py answers it)
    elif fn is not None and (checks.surely(B == 0) or checks.surely(Hq == 0) or checks.surely(Lq == 0)):
        fn = None  # no row: nothing to modify either
    keep, is_causal, win = _fold_band(keep, is_causal, win, Lq, Lk)

    def with_grad(lse: Tensor) -> Tensor:
        """A backend's lse, differentiable as the reference's is (``lse_grad.py``): eager calls."""
        return lse_grad.attach(lse, q, k, bias=add, sinks=sink, mask=keep, causal=is_causal, window=win, scale=sc,
                               softcap=cap, score_mod=fn)  # fmt: skip

    lse: Tensor | None
    if fn is not None:
        # A score_mod runs as Triton code generated from it (kernels/codegen.py) on backend="triton", and
        # on "auto" for CUDA inputs when it can be generated; else on flash.py's tiles (eager, a backward
        # of its own that gives the captured tensors their gradients) or on the reference's formula —
        # which "auto" takes where a tiled backend's Python cannot run: traced by dynamo (an op's schema
        # cannot hold a function), under torch.func, and for empty problems. On CPU ("auto", "flash")
        # the compiled kernel runs it as generated C++ where it can be (cpu_mods.py), else flash.py.
        # A mod that cannot be generated is refused by backend="triton", naming the operation — never
        # run elsewhere.
        empty = 0 in (q.numel(), k.numel(), v.numel())
        # (traced, or tensors without data of their own: the mod is not walked — dynamo would trace it)
        special = torch.compiler.is_compiling() or empty or _without_data(q, k, v, keep, add, sink)
        captured = () if special else mods.captured_tensors(fn)  # a table seen through torch.func / a dual counts
        special = special or batching.wrapped(q, k, v, keep, add, sink, *captured)
        special = special or batching.dual(q, k, v, add, sink, *captured)  # forward-mode AD
        # (attention sinks with a mod: each backend's Function folds them into its result and backward)
        if name == "triton" and special and not empty:
            raise ArgumentError(
                "score_mod: backend='triton' runs a score_mod eagerly only (not under torch.compile, torch.func or "
                "forward-mode AD); use backend='auto'"
            )
        if name == "triton" and not empty and q.dtype != torch.float64:
            _check_triton(q.device)
            if not _fits_triton(q, v):
                raise ArgumentError(
                    f"backend: 'triton' tiles take head dims up to {TRITON_MAX_HEAD_DIM}, got D = {q.shape[-1]} and "
                    f"Dv = {v.shape[-1]}; use backend='flash' (or 'auto', which takes it for larger heads)"
                )
            ran = _triton_with_mod(q, k, v, keep, add, is_causal, win, sc, cap, p, fn, sink, strict=True)
            assert ran is not None  # (strict: raises instead)
            return (ran[0], with_grad(ran[1])) if want_lse else ran[0]
        if name == "auto" and not special and _auto(q, v) == "triton":
            got = _triton_with_mod(q, k, v, keep, add, is_causal, win, sc, cap, p, fn, sink, strict=False)
            if got is not None:
                return (got[0], with_grad(got[1])) if want_lse else got[0]
        seed = _seed(q.device) if p > 0.0 else 0
        if name in ("auto", "flash") and not special and _takes_kernel(q):
            # The compiled CPU kernel with the mod as C++ generated from it (cpu_mods.py); None: it
            # cannot be generated or built, and flash.py runs it below.
            from . import cpu_mods

            assert not isinstance(seed, Tensor)  # (eager: an int)
            got = cpu_mods.attention(
                q, k, v, score_mod=fn, mask=keep, bias=add, causal=is_causal, window=win, scale=sc, softcap=cap,
                dropout_p=p, dropout_seed=seed, sink=sink,
            )  # fmt: skip
            if got is not None:
                return (got[0], with_grad(got[1])) if want_lse else got[0]
        if name == "triton":
            name = "reference" if empty else "flash"  # float64 (as without a mod: flash computes it) or empty
        if name in ("auto", "flash"):
            name = "reference" if special else "flash"
        run = reference.attention if name == "reference" else _flash_with_mod
        out, lse = run(
            q, k, v, mask=keep, bias=add, causal=is_causal, window=win, scale=sc, softcap=cap, sinks=sink,
            dropout_p=p, dropout_seed=seed, score_mod=fn,
        )  # fmt: skip
        return (out, lse if name == "reference" else with_grad(lse)) if want_lse else out

    name = choose(name, q, k, needs_grad=_needs_grad(q, k, v, add, sink), v=v)
    # tensors without data of their own are traced as a compiled call is: through the custom ops
    compiling = torch.compiler.is_compiling() or _without_data(q, k, v, keep, add, sink)
    transformed = not compiling and batching.wrapped(q, k, v, keep, add, sink)
    if (transformed and batching.forward_mode()) or batching.dual(q, k, v, add, sink):
        # jvp / jacfwd / forward_ad's duals: no fused kernel has a JVP; the formula has every op's (batching.py)
        name = "reference"
    lse_with_grad = want_lse and _needs_grad(q, k, v, add, sink)
    if lse_with_grad and transformed and name != "reference":
        name = "reference"  # an lse that may take a gradient under torch.func: the formula's (batching.py's has none)
    if compiling and name == "reference" and want_lse and 0 not in (q.numel(), k.numel(), v.numel()):
        # traced as the formula's ops (as a score_mod's call is), so that its lse keeps its gradient
        seed = _seed(q.device) if p > 0.0 else 0
        out, lse = reference.attention(
            q, k, v, mask=keep, bias=add, causal=is_causal, window=win, scale=sc, softcap=cap, sinks=sink,
            dropout_p=p, dropout_seed=seed,
        )  # fmt: skip
    elif transformed and name != "reference":
        # Under torch.func (vmap, grad, ...): the backend through a Function that functorch can batch
        # and differentiate (batching.py); the reference's formula is taken as it is.
        seed = batching.draw_seed(q.device) if p > 0.0 else 0
        out, lse = batching.attention(
            name, q, k, v, mask=keep, bias=add, causal=is_causal, window=win, scale=sc, softcap=cap, sinks=sink,
            dropout_p=p, dropout_seed=seed,
        )  # fmt: skip
    elif compiling or 0 in (q.numel(), k.numel(), v.numel()):
        # One opaque op per call: dynamo never traces a backend's Python, and zero sizes (some only
        # known when a compiled program runs) are answered there. The seed stays a tensor.
        dense = keep.to_tensor(q.device) if isinstance(keep, Mask) else keep  # (B|1, Hq|1, Lq|1, Lk|1)
        seed_t = dropout.seed_tensor(q.device) if p > 0.0 else torch.zeros((), dtype=torch.int64)
        out, lse = ops.attention(
            name, q, k, v, mask=dense, bias=add, causal=is_causal, window=win, scale=sc, softcap=cap, sinks=sink,
            dropout_p=p, dropout_seed=seed_t, lse_grad=lse_with_grad,
            keep_out=torch.is_grad_enabled() and _needs_grad(q, k, v, add, sink),
        )  # fmt: skip
    else:
        seed = dropout.draw_seed(q.device) if p > 0.0 else 0
        out, lse = _backend(name)(
            q, k, v, mask=keep, bias=add, causal=is_causal, window=win, scale=sc, softcap=cap, sinks=sink,
            dropout_p=p, dropout_seed=seed, need_lse=want_lse,
        )  # fmt: skip
        if want_lse and name != "reference" and lse is not None:
            lse = with_grad(lse)
    if want_lse:
        assert lse is not None  # asked for: every backend gives it
        return out, lse
    return out


def _no_causal_bias(name: str, x: Any) -> Any:
    """``x``, unless it is torch's ``CausalBias`` (the drop-in's ``attn_mask`` reads one): a tensor
    whose data is not its pattern, which a mask or bias slot would take as it is."""
    if autocast.is_causal_bias(x):
        raise ArgumentTypeError(
            f"{name}: expected a tensor or an az.masks Mask, got torch's CausalBias; pass causal=True (its "
            "lower-right variant) or mask=az.masks.causal(Lq, Lk, align='top_left') (upper-left)"
        )
    return x


_NO_TORCH_FUNCTION = torch._C._disabled_torch_function_impl


def _dispatches(*ts: Any) -> bool:
    """Whether a call with ``ts`` takes ``__torch_function__``'s protocol: one of them is of a Tensor
    subclass that takes it (a Parameter's or a FakeTensor's is turned off; a function mode alone does
    not count: it traces the ops inside — torch.export's), and the call is neither inside the
    protocol (turned off there) nor traced by dynamo (it traces the subclass's ops as they come)."""
    for t in ts:  # (every call asks: None and plain tensors are passed over first — a getattr that misses costs)
        if t is None:
            continue
        c = type(t)
        if c is not Tensor and getattr(c, "__torch_function__", _NO_TORCH_FUNCTION) is not _NO_TORCH_FUNCTION:
            return has_torch_function_variadic(*ts) and not torch.compiler.is_compiling()
    return False


_PLAIN_DISPATCH = Tensor.__torch_dispatch__


def _without_data(q: Tensor, k: Tensor, v: Tensor, *rest: Any) -> bool:
    """Whether a call computes on no memory a backend can read: meta tensors (q's device is every
    input's), fake tensors (shape inference, ``FakeTensorMode``, ``make_fx``), a ``__torch_dispatch__``
    subclass (DTensor, a logging tensor) as q, k, v or in ``rest`` (the mask, bias, sinks), or any
    torch dispatch mode (``FlopCounterMode``). Such a call goes through the custom ops (``ops.py``),
    as a compiled one does: each of these dispatches them, and their fake implementations give the
    shapes. (Asked by every eager call: plain tensors and None answer at the first test.)"""
    if torch._C._len_torch_dispatch_stack() or q.is_meta:
        return True
    for x in (q, k, v, *rest):
        if x is None or type(x) is Tensor:
            continue
        if isinstance(x, Tensor) and type(x).__torch_dispatch__ is not _PLAIN_DISPATCH:
            return True
    return False


def _seed(device: torch.device) -> int | Tensor:
    """Dropout's seed for a call run here: an int, or traced by dynamo a 0-d tensor (an int would be a
    read-back, a graph break: dropout.keep_mask takes the tensor)."""
    return dropout.seed_tensor(device) if torch.compiler.is_compiling() else dropout.draw_seed(device)


def _triton_with_mod(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor | Mask | None, add: Tensor | None, causal: bool,
    win: tuple[int | None, int | None] | None, sc: float, cap: float | None, p: float, fn: mods.ScoreMod,
    sink: Tensor | None, *, strict: bool,
) -> tuple[Tensor, Tensor] | None:
    """The Triton kernels with the score_mod as generated code (``kernels/codegen.py``), the split-KV
    kernel where ``choose`` would take it (no gradient, few queries, many keys). A mod that cannot be
    generated: with ``strict`` (backend="triton") an error naming the operation; else None ("auto"
    then runs it on flash.py)."""
    from .kernels import codegen, triton_backend

    needs = _needs_grad(q, k, v, add, sink, *mods.captured_tensors(fn))
    decode = not needs and _takes_decode(q, k)
    seed = dropout.draw_seed(q.device) if p > 0.0 else 0
    try:
        return triton_backend.attention_with_mod(
            q, k, v, score_mod=fn, mask=keep, bias=add, causal=causal, window=win, scale=sc, softcap=cap,
            dropout_p=p, dropout_seed=seed, decode=decode, sink=sink,
        )  # fmt: skip
    except codegen.NotGenerable as e:
        if strict:
            raise ArgumentError(f"{e}; use backend='flash' (it runs any score_mod) or 'auto'") from e
        return None


def _flash_with_mod(q: Tensor, k: Tensor, v: Tensor, *, sinks: Tensor | None, **kw: Any) -> tuple[Tensor, Tensor]:
    """flash.py with a score_mod (and its attention sinks, folded in flash.py's Function)."""
    from . import flash

    out, lse = flash.attention(q, k, v, sink=sinks, **kw)
    assert lse is not None
    return out, lse


def attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | Mask | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    score_mod: mods.ScoreMod | None = None,
) -> Tensor:
    """The attention probabilities (B, Hq, Lq, Lk) in q's dtype, for inspection and plots.
    Same arguments as :func:`attention`; fully blocked rows are 0. With ``sinks`` a row's weights
    sum to less than 1 (the sink's share goes nowhere). Materialises Lq × Lk."""
    q, k, bias = autocast.cast(q, k, bias)
    with autocast.as_given(q):
        B, Hq, _, Lq, Lk = checks.qkv(q, k, None, empty_ok=True)
        full = (B, Hq, Lq, Lk)
        keep = checks.mask(mask, full, q.device)
        add = checks.bias(bias, full, q.device)
        is_causal = checks.flag("causal", causal)
        win = checks.window(window, Lq, Lk)
        sc = checks.scale(scale, q.shape[-1])
        cap = checks.softcap(softcap)
        sink = checks.sinks(sinks, B, Hq, Lq, q.device)
        fn = mods.check_callable("score_mod", score_mod)
        if checks.is_zero(B * Hq * Lq * Lk):  # no weights at all; D = 0 needs nothing special (scores 0)
            return _empty(full, q, k, add, sink)
        p, _ = reference.probabilities(
            q, k, mask=keep, bias=add, causal=is_causal, window=win, scale=sc, softcap=cap, sinks=sink,
            score_mod=fn,
        )  # fmt: skip
        return p.to(q.dtype)


def _fold_band(
    keep: Tensor | Mask | None, causal: bool, window: tuple[int | None, int | None] | None, Lq: int, Lk: int
) -> tuple[Tensor | Mask | None, bool, tuple[int | None, int | None] | None]:
    """A ``Mask``'s causal / window part (its ``band``) joined with the ``causal`` / ``window``
    arguments: ``(the rest of the mask or None, causal, window)``. Every backend then skips the
    blocks the band blocks and masks its edges as it does for ``causal=True`` — a causal ``Mask``
    costs what ``causal=True`` costs. Bands are intervals of ``d = j − i``; the window of the result
    may have negative sides (torch's top-left causal with Lk > Lq), which the backends take."""
    if not isinstance(keep, Mask):
        return keep, causal, window
    keep = keep.at(Lq, Lk)  # a mask broadcast along a length has no band there
    if keep.band is None:
        return keep, causal, window
    off = Lk - Lq  # bottom-right: query i sits at key position i + off
    left, right = geometry.band(causal, window)  # the arguments' band around p = i + off
    lo, hi = keep.band
    if left is not None:
        lo = off - left if lo is None else max(lo, off - left)
    if right is not None:
        hi = off + right if hi is None else min(hi, off + right)
    rest = keep.without_band()
    if lo is None and hi == off:
        return rest, True, None
    if lo is None and hi is None:
        return rest, False, None
    return rest, False, (None if lo is None else off - lo, None if hi is None else hi - off)


def _empty(shape: tuple[int, ...], *inputs: Tensor | None) -> Tensor:
    """An empty result of ``shape`` in the first input's dtype, on the autograd graph of the inputs
    (their gradients: zeros)."""
    first = inputs[0]
    assert first is not None
    tie = sum((x.sum() for x in inputs if x is not None), torch.zeros((), dtype=first.dtype, device=first.device))
    return first.new_zeros(shape) + 0.0 * tie  # an empty tensor: the scalar's value never shows


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    backend: BackendName = "auto",
    return_lse: bool = False,
    score_mod: mods.ScoreMod | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over packed sequences without padding (FlashAttention's varlen layout).

    Args:
        q: (Tq, Hq, D), k: (Tk, Hkv, D), v: (Tk, Hkv, Dv): N sequences back to back.
        cu_seqlens_q, cu_seqlens_k: integer (N + 1,) cumulative lengths, starting at 0,
            non-decreasing, ending at Tq / Tk: sequence ``n`` holds queries
            ``cu_seqlens_q[n]:cu_seqlens_q[n + 1]`` and keys ``cu_seqlens_k[n]:cu_seqlens_k[n + 1]``.
        max_seqlen_q, max_seqlen_k: optional; if given, at least the longest sequence (checked).
        causal, window: bottom-right aligned per sequence.
        sinks: (Hq,) or (Hq, Tq) (one per query).
        score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score`` as in
            :func:`attention`, written for one sequence: ``b`` is the sequence's index ``n`` and
            ``q_idx`` / ``kv_idx`` are 0-based positions WITHIN sequence ``n`` (not in the packed
            row; no bottom-right shift) — what torch's Flex handed a mod for jagged nested tensors.
            Pairs of two sequences are blocked before it matters. Tensors it captures get gradients.
        The rest as in :func:`attention`.

    Returns:
        out (Tq, Hq, Dv), or ``(out, lse (Hq, Tq))``. Equal to :func:`attention` on each sequence
        alone (with a score_mod: one that sees ``b = n``); the cost is that of the sequences
        (Σ Lq_n · Lk_n), not of the packed length squared. An empty sequence gives nothing; a
        sequence with queries but no keys gives 0. Under ``torch.compile`` the call runs eagerly
        (one graph break; new cu_seqlens do not recompile). Where queries and keys are packed alike
        it is one call over the packed row with the documents as a mask, so a NaN or infinity in one
        sequence's q, k, v or output gradient can reach another's result through a block both share
        (0 · NaN, as in a dense masked softmax); with finite values each sequence is on its own.
        Under ``torch.export`` nothing is read: one call over the packed row with a dense mask
        computed in the program (``_exported_varlen``; O(Tq · Tk) memory).
    """
    if torch.compiler.is_exporting():
        return _exported_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, window=window, scale=scale, softcap=softcap,
            sinks=sinks, dropout_p=dropout_p, backend=backend, return_lse=return_lse, score_mod=score_mod,
        )  # fmt: skip
    return _attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
        window=window, scale=scale, softcap=softcap, sinks=sinks, dropout_p=dropout_p, backend=backend,
        return_lse=return_lse, score_mod=score_mod,
    )  # fmt: skip


def _packed(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None) -> None:
    """attention_varlen's checks of the packed tensors (shapes only)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        checks.tensor(name, x, empty_ok=True)
        if x.ndim != 3:
            raise ArgumentError(f"{name}: expected 3 dims (T, H, D), got {tuple(x.shape)}")
    if v.shape[0] != k.shape[0]:
        raise ArgumentError(f"v: {v.shape[0]} packed keys do not match k's {k.shape[0]}")
    Hq, Tq = q.shape[1], q.shape[0]
    if sinks is not None:
        checks.tensor("sinks", sinks, empty_ok=True)
        if tuple(sinks.shape) not in ((Hq,), (Hq, Tq)):
            raise ArgumentError(
                f"sinks: expected shape (Hq,) = ({Hq},) or (Hq, Tq) = ({Hq}, {Tq}), got {tuple(sinks.shape)}"
            )


# torch.compile runs a varlen call as one eager call (a single graph break): its sequences are
# read back as Python ints (the blocks between sequences are chosen from them), and traced they
# became constants of the graph — a recompile for every new cu_seqlens and a graph break at every
# read-back (twenty graphs for one call). The model around it still compiles.
@torch.compiler.disable
def _attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    causal: bool,
    window: int | tuple[int | None, int | None] | None,
    scale: float | None,
    softcap: float | None,
    sinks: Tensor | None,
    dropout_p: float,
    backend: BackendName,
    return_lse: bool,
    score_mod: mods.ScoreMod | None,
) -> Tensor | tuple[Tensor, Tensor]:
    _packed(q, k, v, sinks)
    Tq, Tk = q.shape[0], k.shape[0]
    cu_q = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, Tq, q.device)
    cu_k = _cu_seqlens("cu_seqlens_k", cu_seqlens_k, Tk, q.device)
    if len(cu_q) != len(cu_k):
        raise ArgumentError(
            f"cu_seqlens_k: expected as many sequences as cu_seqlens_q ({len(cu_q) - 1}), got {len(cu_k) - 1}"
        )
    lens_q = [b - a for a, b in itertools.pairwise(cu_q)]
    lens_k = [b - a for a, b in itertools.pairwise(cu_k)]
    for name, given, lens in (("max_seqlen_q", max_seqlen_q, lens_q), ("max_seqlen_k", max_seqlen_k, lens_k)):
        if given is None:
            continue
        if isinstance(given, bool) or not isinstance(given, int):
            raise ArgumentTypeError(f"{name}: expected None or an int, got {given!r}")
        if given < max(lens, default=0):
            raise ArgumentError(f"{name}: expected at least the longest sequence, {max(lens)}, got {given}")
    fn = mods.check_callable("score_mod", score_mod)
    fn = None if fn is None else mods.pin(fn)  # its closure as now, under the per-sequence wrapper
    options: dict[str, Any] = {
        "causal": causal, "window": window, "scale": scale, "softcap": softcap, "dropout_p": dropout_p,
        "backend": backend, "return_lse": True,
    }  # fmt: skip

    def four(x: Tensor, a: int, b: int) -> Tensor:
        return x[a:b].transpose(0, 1).unsqueeze(0)  # (T, H, E) → (1, H, b − a, E)

    def sinks_of(a: int, b: int) -> Tensor | None:
        if sinks is None or sinks.ndim == 1:
            return sinks
        return sinks[:, a:b].unsqueeze(0)  # (Hq, Tq) → (1, Hq, b − a)

    if cu_q == cu_k and len(cu_q) > 2 and cu_q[-1] > 0:
        # Queries and keys packed alike: one call over the packed row, with the documents as a mask
        # whose segments let every backend skip the blocks between sequences. Per sequence, causal /
        # window around the bottom-right position is the same band as on the whole row (each
        # sequence has as many queries as keys), so they pass as they are.
        from .masks import document

        docs = document(cu_seqlens=cu_q)
        if fn is not None:
            options["score_mod"] = _within_sequences(fn, cu_q, q.device)
        res = attention(four(q, 0, Tq), four(k, 0, Tk), four(v, 0, Tk), mask=docs, sinks=sinks_of(0, Tq), **options)
        assert isinstance(res, tuple)
        out4, lse3 = res  # (1, Hq, Tq, Dv), (1, Hq, Tq)
        out, lse = out4[0].transpose(0, 1), lse3[0]  # (Tq, Hq, Dv), (Hq, Tq)
    else:
        # Otherwise each sequence on its own (its own bottom-right alignment), and the results
        # back to back.
        outs, lses = [], []
        pairs = list(zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k))) or [((0, 0), (0, 0))]  # N = 0: one empty
        for n, ((a, b), (c, d)) in enumerate(pairs):
            if fn is not None:
                options["score_mod"] = _as_sequence(fn, n)
            res = attention(four(q, a, b), four(k, c, d), four(v, c, d), sinks=sinks_of(a, b), **options)
            assert isinstance(res, tuple)
            outs.append(res[0][0].transpose(0, 1))  # (Lq_n, Hq, Dv)
            lses.append(res[1][0])  # (Hq, Lq_n)
        out, lse = torch.cat(outs, dim=0), torch.cat(lses, dim=1)
    return (out, lse) if checks.flag("return_lse", return_lse) else out


def _exported_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *, causal: bool,
    window: int | tuple[int | None, int | None] | None, scale: float | None, softcap: float | None,
    sinks: Tensor | None, dropout_p: float, backend: BackendName, return_lse: bool, score_mod: mods.ScoreMod | None,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """attention_varlen under torch.export, where cu_seqlens cannot be read: one call over the
    packed row, its mask computed in the program — token ``t``'s sequence ``n`` (by
    ``searchsorted``), its position within it and the sequence's lengths; pairs of one sequence
    kept by causal / window around that sequence's bottom-right position. The values of cu_seqlens
    are not checked (max_seqlen neither): cu_seqlens must hold what attention_varlen says."""
    _packed(q, k, v, sinks)
    Tq, Tk = q.shape[0], k.shape[0]
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _cu_tensor(name, x, q.device, 2)  # (N = 0 has no sequence to place a token in)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ArgumentError(
            f"cu_seqlens_k: expected as many sequences as cu_seqlens_q ({cu_seqlens_q.shape[0] - 1}), "
            f"got {cu_seqlens_k.shape[0] - 1}"
        )
    N = cu_seqlens_q.shape[0] - 1

    def tokens(cu: Tensor, T: int) -> tuple[Tensor, Tensor, Tensor]:
        # int64: a window side up to 2⁶² is added to these positions (geometry.kept)
        cu = cu.to(torch.int64)  # (N + 1,)
        t = torch.arange(T, dtype=torch.int64, device=q.device)  # (T,)
        n = torch.searchsorted(cu[1:], t, right=True).clamp(max=N - 1)  # (T,) each token's sequence
        return n, t - cu[n], cu[1:] - cu[:-1]  # its sequence, position within it; (N,) lengths

    n_q, pos_q, len_q = tokens(cu_seqlens_q, Tq)
    n_k, pos_k, len_k = tokens(cu_seqlens_k, Tk)
    i, j, n = pos_q.view(Tq, 1), pos_k.view(1, Tk), n_q.view(Tq, 1)  # (Tq, 1), (1, Tk), (Tq, 1)
    keep = n == n_k.view(1, Tk)  # (Tq, Tk): one sequence
    sides = checks.window(window, Tq, Tk)  # (a side past every key of the row: unbounded)
    by_position = geometry.kept(i, j, len_q[n], len_k[n], causal, sides)  # its bottom-right band
    if isinstance(by_position, Tensor):
        keep = keep & by_position
    fn = mods.check_callable("score_mod", score_mod)
    if fn is not None:
        seq_q, local_q, local_k = (x.to(mods.INDEX_DTYPE) for x in (n_q, pos_q, pos_k))

        def within(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return fn(score, seq_q[q_idx], h, local_q[q_idx], local_k[kv_idx])  # b is 0: the one packed row

    res = attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),  # (1, H, T, E)
        mask=keep.view(1, 1, Tq, Tk), scale=scale, softcap=softcap,
        sinks=sinks if sinks is None or sinks.ndim == 1 else sinks.unsqueeze(0),  # (Hq,) or (1, Hq, Tq)
        dropout_p=dropout_p, backend=backend, return_lse=True, score_mod=None if fn is None else within,
    )  # fmt: skip
    assert isinstance(res, tuple)
    out, lse = res[0][0].transpose(0, 1), res[1][0]  # (Tq, Hq, Dv), (Hq, Tq)
    return (out, lse) if checks.flag("return_lse", return_lse) else out


def _as_sequence(fn: mods.ScoreMod, n: int) -> mods.ScoreMod:
    """``fn`` on one sequence of a varlen call, run alone as batch 0: it sees ``b = n``."""

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return fn(score, b + n, h, q_idx, kv_idx)

    return score_mod


def _within_sequences(fn: mods.ScoreMod, cu: list[int], device: torch.device) -> mods.ScoreMod:
    """``fn`` on the packed row of sequences ``cu`` (queries and keys packed alike): a packed
    position ``t`` of sequence ``n`` is handed to it as ``b = n`` and position ``t − cu[n]``."""
    lengths = torch.tensor([b - a for a, b in itertools.pairwise(cu)])  # (N,)
    starts = torch.tensor(cu[:-1], dtype=mods.INDEX_DTYPE)  # (N,)
    seq = torch.repeat_interleave(torch.arange(len(lengths), dtype=mods.INDEX_DTYPE), lengths)  # (T,) each one's n
    local = torch.arange(cu[-1], dtype=mods.INDEX_DTYPE) - starts[seq]  # (T,) its position within sequence n
    seq, local = seq.to(device), local.to(device)

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return fn(score, seq[q_idx], h, local[q_idx], local[kv_idx])  # b is 0: the one packed row

    return score_mod


def _cu_tensor(name: str, x: Any, device: torch.device, least: int) -> Tensor:
    """The cumulative lengths' type, dtype, shape and device, checked without reading them: a 1-D
    integer tensor of at least ``least`` entries (N + 1,) on q's device."""
    if not isinstance(x, Tensor):
        raise ArgumentTypeError(f"{name}: expected a torch.Tensor of any integer dtype, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise ArgumentTypeError(f"{name}: expected any integer dtype (int32, int64, …), got {x.dtype}")
    if x.ndim != 1 or not checks.surely(x.shape[0] >= least):  # (shape[0], not len: N may be dynamic)
        at_least = f" with N >= {least - 1}" if least > 1 else ""
        raise ArgumentError(f"{name}: expected shape (N + 1,){at_least}, got {tuple(x.shape)}")
    if x.device != device:
        raise ArgumentError(f"{name}: device {x.device} does not match q's {device}")
    return x


def _cu_seqlens(name: str, x: Any, total: int, device: torch.device) -> list[int]:
    """The cumulative lengths as a list of ints, checked: a 1-D integer tensor (N + 1,), N >= 0,
    starting at 0, non-decreasing, ending at ``total``, on q's device."""
    cu = [int(c) for c in _cu_tensor(name, x, device, 1).tolist()]
    if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in itertools.pairwise(cu)):
        raise ArgumentError(f"{name}: expected non-decreasing values from 0 to {total}, got {cu}")
    return cu
