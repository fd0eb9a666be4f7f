"""The compiled CPU kernel (``csrc/attention.cpp``): its build, and the backend functions around it.

Letters: B batch, Hq / Hkv query / key-value heads, Lq / Lk query / key length, D / Dv head dims.

What it computes is flash.py's function — the online softmax of docs/MATH.md and its backward —
for float32, bfloat16 and float16 on CPU (float32 accumulation), in one C++ loop per call over
(batch, key-value head, query block) in one OpenMP region on torch's threads: GQA reading K/V head ``h // G``
without a copy, causal / window (bottom-right), dense bool masks through their strides, an
``az.masks.Mask`` through a table of its blocks (skip / full / partial, ``_mask_table``), a float
bias and its gradient, softcap, dropout with ``dropout.py``'s hash. Sinks are folded outside, as
for every backend (``ops._WithSinks``). ``functional.choose`` decides when it runs
(``unsupported``: float64 and other devices stay on flash.py; a backward whose rows need a shifted
lse runs there too, ``backward``).

The build. On first use ``torch.utils.cpp_extension.load`` compiles the source into
``$ATTNZERO_CACHE/cpu_kernel-<key>`` (else ``$XDG_CACHE_HOME/attnzero``, else ``~/.cache/attnzero``;
the key hashes the source, the flags, torch's and Python's versions), printing one line while it
does; later processes load the built library directly. A lock on a file (``lockf``: it goes with
a process that dies, even killed mid-build) makes processes that start together wait for one
build. Where it cannot be built or loaded — ``ATTNZERO_NO_BUILD=1``, no C++ compiler, a cache
directory that cannot be written, a failing build — ``available()`` is False, one warning says why
and what to do, and attention runs on flash.py (same results within the tolerance rule, slower).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import sys
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import flash, geometry, mods, reference
from .locks import ForkSafeLock
from .masks import COMPARED_MAX, Mask, copies, equal_values, unchanged, version_of

SOURCE = Path(__file__).with_name("csrc") / "attention.cpp"
HEADER = SOURCE.with_name("fast_math.h")  # its float32 tanh (shared with cpu_mods.py's generated code)
# Query rows per block (the G heads of a group are stacked: G·bm rows share each K/V block) and key
# columns per block, chosen per call by ``block_sizes``. Measured on the 2-core EPYC VM of
# docs/benchmarks.md (one thread, against torch's SDPA, forward and backward): 512 keys per block
# (fewer rescales by alpha, longer rows; torch's CPU flash attention takes 512 too); 64 query rows
# under causal / window (a diagonal block computes only the keys its last row keeps — and each group
# of six rows in it only the keys that group keeps — so smaller row blocks waste less: GPT-2's
# causal forward 1.09 → 1.20× torch; with the groups, 64–192 rows time alike at causal L=2048), else
# 256 rows in all (BERT's forward 0.83 → 0.95×). A Mask with block structure keeps 128 × 128: its
# table (``_mask_table``) skips at that grain (documents, padding).
BLOCK_ROWS_BAND, BLOCK_ROWS_FULL, BLOCK_KEYS = 64, 256, 512
MASK_BLOCK = 128
UNBOUNDED = -(2**63)  # a side of the band without a bound (the C++ side's UNBOUNDED)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = ForkSafeLock()
_state: dict[str, Any] = {}  # "ok": bool once tried; "why": the reason when not


def cache_dir() -> Path:
    """Where built kernels are kept: ``$ATTNZERO_CACHE``, else ``$XDG_CACHE_HOME/attnzero``, else
    ``~/.cache/attnzero``."""
    given = os.environ.get("ATTNZERO_CACHE")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnzero"


# The vector widths the kernel can be built for, widest first, and their flags. AVX-512: the row
# math (scale, max, exp, sums) and the register tiles of the products run 16 floats a step (BERT's
# forward 0.91 → 0.95× torch on the EPYC VM with the row math alone), and loops the compiler
# vectorises at that width too (gcc's default for AVX-512 is 256 bits). AVX2 + FMA: 8 floats.
# "default": at::vec's scalar code, and MKL's sgemm for the products.
ISA_FLAGS = {
    "avx512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mfma", "-mf16c", "-mprefer-vector-width=512"],
    "avx2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "default": ["-DCPU_CAPABILITY=DEFAULT"],
}  # fmt: skip


def cpu_widths() -> list[str]:
    """The keys of ``ISA_FLAGS`` this CPU runs, widest first (``/proc/cpuinfo``'s flags)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    widths = []
    if all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c")):
        widths.append("avx512")
    if all(f in flags for f in ("avx2", "fma", "f16c")):
        widths.append("avx2")
    return [*widths, "default"]


def _isa() -> tuple[str, str | None]:
    """The width to build for and, when ``$ATTNZERO_CPU_ISA`` asks for one this CPU cannot run (or
    names none), why not: the widest this CPU runs unless the variable picks a narrower one (to test
    or compare the narrower builds)."""
    widths = cpu_widths()
    asked = os.environ.get("ATTNZERO_CPU_ISA", "")
    if asked == "":
        return widths[0], None
    if asked not in widths:
        return widths[0], f"ATTNZERO_CPU_ISA={asked!r} is not one of this CPU's widths {widths} (unset it, or pick one)"
    return asked, None


def _cpu_flags() -> list[str]:
    """The flags of the vector width the kernel (and cpu_mods' generated code) is built for; they are
    part of the build's key (``_key``)."""
    return ISA_FLAGS[_isa()[0]]


def _build_flags() -> list[str]:
    # -fopenmp at compile time only: the kernel's parallel region is an OpenMP pragma (without the
    # flag it is ignored and every call runs on one thread), and its GOMP_* calls resolve at load to
    # the OpenMP runtime libtorch_cpu links — torch's own thread pool, not a second one.
    return ["-O3", "-fno-math-errno", "-fopenmp", *_cpu_flags()]


def _key(flags: list[str]) -> str:
    parts = [SOURCE.read_text(), HEADER.read_text(), " ".join(flags), torch.__version__, sys.version,
             os.environ.get("CXX", "")]  # fmt: skip
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def _library(build_dir: Path, name: str) -> Path:
    return build_dir / f"{name}.so"


def _load() -> str | None:
    """Build (unless built) and load the kernel; None when loaded, else why not."""
    if os.environ.get("ATTNZERO_NO_BUILD", "") not in ("", "0"):
        return "ATTNZERO_NO_BUILD is set (unset it to build the kernel)"
    if sys.platform != "linux":
        return f"the kernel is built on Linux only, not {sys.platform}"
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx.split()[0]) is None:
        return f"no C++ compiler: {cxx!r} not found (install g++, or point $CXX at one)"
    refused = _isa()[1]
    if refused is not None:
        return refused
    flags = _build_flags()
    key = _key(flags)
    name = f"attnzero_cpu_{key}"
    build_dir = cache_dir() / f"cpu_kernel-{key}"
    done = build_dir / "built"  # written after a build that loaded: the library is whole
    if done.exists():  # built before: load it (no write, so a read-only cache serves too)
        _state["module"] = _import(_library(build_dir, name), name)
        return None
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        probe = build_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
        lock = open(build_dir / "lock.flock", "w")  # locked across the build below
    except OSError as e:
        return f"cannot write the cache directory {build_dir}: {e} (set $ATTNZERO_CACHE to a writable directory)"
    with lock:
        # Processes that start together queue here (the lock goes with a process that dies); the
        # first builds, the others find it built. A record lock, not flock: a process forked while
        # a thread builds (a DataLoader worker) does not inherit it, and waits for it as any other.
        fcntl.lockf(lock, fcntl.LOCK_EX)
        if not done.exists():
            from torch.utils import cpp_extension

            # cpp_extension's own lock file, left by a build killed mid-way (SIGKILL skips its cleanup):
            # its waiters poll for it forever. No other process builds here now (the lock above).
            (build_dir / "lock").unlink(missing_ok=True)

            start = time.monotonic()
            print(
                f"attnzero: building the CPU attention kernel ({SOURCE.name}) into {build_dir}, once; "
                "about a minute",
                file=sys.stderr,
                flush=True,
            )
            _state["module"] = cpp_extension.load(
                name=name, sources=[str(SOURCE)], extra_cflags=flags, build_directory=str(build_dir),
                is_python_module=True, verbose=False,
            )  # fmt: skip
            done.write_text(f"built in {time.monotonic() - start:.0f} s\n")
            return None
    _state["module"] = _import(_library(build_dir, name), name)
    return None


def _import(path: Path, name: str) -> Any:
    """The built library as a Python module (its pybind11 functions forward, backward, keep_mask)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_error(e: Exception) -> str:
    """The line of a failed build's output that names the error (else its last line)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
    named = [line for line in lines if "error" in line.lower() and not line.startswith("ninja")]
    return (named[0] if named else lines[-1])[:300]


def available() -> bool:
    """Whether the kernel is built and loaded (tried once per process; the first failure warns)."""
    if "ok" not in _state:
        with _lock:
            if "ok" not in _state:
                try:
                    why = _load()
                except OSError as e:  # a full disk or quota (a compiler's failure is a RuntimeError)
                    why = f"the build failed writing the cache: {e} (free space, or set $ATTNZERO_CACHE elsewhere)"
                except Exception as e:  # any failure of the build or the load: flash.py instead
                    why = f"the build failed: {_first_error(e)} (fix the compiler, or set ATTNZERO_NO_BUILD=1)"
                _state["why"] = why or ""
                _state["ok"] = why is None
                if why is not None:
                    warnings.warn(
                        f"attnzero: the CPU attention kernel is not available — {why}. Attention on CPU runs "
                        "flash.py's tiled PyTorch path instead (the same results, slower).",
                        RuntimeWarning,
                        stacklevel=3,
                    )
    return bool(_state["ok"])


def why() -> str:
    """Why the kernel is not available ("" when it is)."""
    return "" if available() else str(_state["why"])


def unsupported(q: Tensor) -> str | None:
    """Why the kernel does not take these inputs (None: it does), before asking whether it is built:
    the device and the dtype. (Every bias is taken; a backward whose rows need a shifted lse runs on
    flash.py — ``backward``.)"""
    if q.device.type != "cpu":
        return f"the kernel runs on CPU, not {q.device.type}"
    if q.dtype not in DTYPES:
        return f"the kernel takes float32, bfloat16 and float16, not {q.dtype} (flash.py computes it)"
    return None


# ---------------------------------------------------------------------------------------------
# The arguments as the C++ ops take them


def _band(causal: bool, window: geometry.Window) -> tuple[int, int]:
    left, right = geometry.band(causal, window)
    return (UNBOUNDED if left is None else left), (UNBOUNDED if right is None else right)


# A structured Mask's table and tiles, per (Lq, Lk, bm, bn), kept while the Mask lives and what it
# reads holds the values it held: the tensors it lists (``Mask.tensors``: a keep tensor of
# ``and_(causal, keep)``; copies compared each call: the Mask reads them as they are now) and what
# its mask_mods read (``Mask.mods``, a from_mod's: walked each call, ``mods.fingerprint``, as
# attnzero.flex keeps a BlockMask's Mask — their code, numbers and tensors). A mod the walk cannot
# vouch for, or more than ``COMPARED_MAX`` elements to compare, and the table is built each call. A
# Mask usually serves many calls (every layer, every step), and building its table (a classify per
# block in Python, the mod evaluated on each PARTIAL tile) cost more than the attention itself for
# a from_mod prefix-LM mask at L = 2048.
_Kept = tuple[Tensor, Tensor, list[Tensor], tuple[Any, ...]]  # table, tiles, copies, the mods' keys
_TABLES: weakref.WeakKeyDictionary[Mask, dict[tuple[int, int, int, int], _Kept]] = weakref.WeakKeyDictionary()


def _mask_table(mask: Mask, Lq: int, Lk: int, bm: int, bn: int) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dense, table, tiles)`` for a Mask (a structured one's from ``_TABLES`` after its first call)."""
    if not _structured(mask):
        return _build_mask_table(mask, Lq, Lk, bm, bn)
    walks = [mods.fingerprint(fn) for fn in mask.mods]  # (key, tensors) of each mod, as it is now
    keys = tuple(key for key, _ in walks)
    read = [*mask.tensors, *(t for _, ts in walks for t in ts)]
    if None in keys or sum(t.numel() for t in read) > COMPARED_MAX:  # (nothing to compare with)
        return _build_mask_table(mask, Lq, Lk, bm, bn)
    per_mask = _TABLES.setdefault(mask, {})
    key = (Lq, Lk, bm, bn)
    got = per_mask.get(key)
    if got is None or got[3] != keys or not equal_values(got[2], read):
        _, table, tiles = _build_mask_table(mask, Lq, Lk, bm, bn)
        assert table is not None and tiles is not None
        got = per_mask[key] = (table, tiles, copies(read), keys)
    return None, got[0], got[1]


def _build_mask_table(
    mask: Mask, Lq: int, Lk: int, bm: int, bn: int
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dense, table, tiles)`` for a Mask. Without block structure: its dense bool tensor
    (B|1, H|1, Lq, Lk). With it: per batch of the mask (Bm = 1 or B), query block and key block
    the kind — 0 SKIP, 1 FULL, 2 + t PARTIAL — as int32 (Bm, nqb, nkb), found from
    ``Mask.key_range`` and ``Mask.classify``, and the PARTIAL blocks evaluated (``Mask.block``)
    into tiles, bool (n, Bm, Hm, bm, bn), shared by the batches that need the same block."""
    Bm, Hm = mask.shape[0], mask.shape[1]
    if not _structured(mask):  # no structure: evaluate it all
        return mask.block((0, Lq), (0, Lk)).expand(Bm, Hm, Lq, Lk), None, None
    nqb, nkb = -(-Lq // bm), -(-Lk // bn)
    table = torch.zeros(Bm, nqb, nkb, dtype=torch.int32)
    found: dict[tuple[int, int], int] = {}
    tiles: list[Tensor] = []
    for b in range(Bm):
        for ib in range(nqb):
            rows = (ib * bm, min(Lq, (ib + 1) * bm))
            lo, hi = mask.key_range((b, b + 1), rows)
            lo, hi = max(lo, 0), min(hi, Lk)
            for jb in range(lo // bn, -(-hi // bn) if hi > lo else 0):
                cols = (jb * bn, min(Lk, (jb + 1) * bn))
                kind = mask.classify((b, b + 1), rows, cols)
                if kind is geometry.FULL:
                    table[b, ib, jb] = 1
                elif kind is geometry.PARTIAL:
                    if (ib, jb) not in found:
                        tile = torch.zeros(Bm, Hm, bm, bn, dtype=torch.bool)
                        r, c = rows[1] - rows[0], cols[1] - cols[0]
                        tile[:, :, :r, :c] = mask.block(rows, cols).expand(Bm, Hm, r, c)
                        found[(ib, jb)] = len(tiles)
                        tiles.append(tile)
                    table[b, ib, jb] = 2 + found[(ib, jb)]
    pool = torch.stack(tiles) if tiles else torch.zeros(0, 1, 1, bm, bn, dtype=torch.bool)
    return None, table, pool


def _structured(mask: Mask) -> bool:
    """Whether a Mask knows its blocks (``classify`` / ``key_range`` answer without evaluating it): a
    band, segments, a block table (``from_mod``, a BlockMask) or a combination of such parts."""
    return mask.band is not None or mask._segments is not None or mask.table is not None or mask.parts is not None


def block_sizes(Lq: int, Lk: int, G: int, banded: bool, structured: bool) -> tuple[int, int]:
    """``(bm, bn)``: query rows (per head of a group) and key columns per block (see ``BLOCK_KEYS``),
    at most Lq and Lk (the kernel's scratch is sized by them)."""
    if structured:
        bm, bn = MASK_BLOCK, MASK_BLOCK
    else:
        bm = BLOCK_ROWS_BAND if banded else max(BLOCK_ROWS_BAND, BLOCK_ROWS_FULL // G)  # G·bm rows: ~256
        bn = BLOCK_KEYS
    # min(b, L), then at least 1 (a length may be 0) — as comparisons: every call asks, and each
    # min / max builtin costs ~0.1 µs
    bm, bn = (bm if bm < Lq else Lq), (bn if bn < Lk else Lk)
    return (bm if bm > 1 else 1), (bn if bn > 1 else 1)


def _args(
    q: Tensor, k: Tensor, mask: Tensor | Mask | None, bias: Tensor | None, causal: bool,
    window: geometry.Window, scale: float, softcap: float | None, dropout_p: float, dropout_seed: int,
) -> tuple[Any, ...]:
    """What both ops take after (q, k, v): the tensors ``(dense, bias, table, tiles)``, then the
    options ``(left, right, scale, softcap, dropout_p, seed, bm, bn)`` — one flat tuple (a tiny call
    spends more here than in the kernel: no lists, the shapes read once)."""
    if not available():
        raise RuntimeError(f"attnzero: the CPU kernel is not available: {why()}")
    _, Hq, Lq, _ = q.shape
    _, Hkv, Lk, _ = k.shape
    banded = causal or window is not None
    dense: Tensor | None = None
    table = tiles = None
    G = Hq // Hkv if Hkv else Hq  # query heads per key/value head
    if isinstance(mask, Mask):
        bm, bn = block_sizes(Lq, Lk, G, banded, _structured(mask))
        dense, table, tiles = _mask_table(mask, Lq, Lk, bm, bn)
    else:
        bm, bn = block_sizes(Lq, Lk, G, banded, False)
        dense = mask
    b32 = None if bias is None else bias.detach().to(torch.float32)
    left, right = _band(causal, window) if banded else (UNBOUNDED, UNBOUNDED)
    seed = dropout_seed if dropout_seed < 2**63 else dropout_seed - 2**64  # int64 bits
    cap = 0.0 if softcap is None else float(softcap)
    return dense, b32, table, tiles, left, right, float(scale), cap, float(dropout_p), seed, bm, bn


# ---------------------------------------------------------------------------------------------
# The backend (ops.Backend): plain forward and backward, and the differentiable entry


_NO_MOD_FORWARD = (0, None)  # the C++ functions' score_mod arguments without one
_NO_MOD_BACKWARD = (0, 0, None, None, 0)


def forward(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | Mask | None, bias: Tensor | None, causal: bool,
    window: geometry.Window, scale: float, dropout_p: float, dropout_seed: int, softcap: float | None = None,
    mod: Any = None, out_f32: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(out (B, Hq, Lq, Dv) in q's dtype — a 16-bit call's in float32 with ``out_f32``, before its
    rounding, what a backward takes for D = rowsum(dO · O) (MATH.md, section 4) —, lse (B, Hq, Lq)
    float32)``; fully blocked rows: 0, −inf. ``mod``: a score_mod built by ``cpu_mods.py`` (its
    ``forward_args()``), or None."""
    args = _args(q, k, mask, bias, causal, window, scale, softcap, dropout_p, dropout_seed)
    extra = mod.forward_args() if mod is not None else _NO_MOD_FORWARD
    out, lse = _state["module"].forward(q, k, v, *args, *extra, out_f32)  # (no autograd: plain values)
    return out, lse


def backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, mask: Tensor | Mask | None,
    bias: Tensor | None, causal: bool, window: geometry.Window, scale: float, dropout_p: float, dropout_seed: int,
    bias_grad: bool = True, softcap: float | None = None, mod: Any = None, mod_grad: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dv, dbias)`` from ``out`` (in q's dtype, or float32: ``forward``'s ``out_f32``) and
    ``lse`` (also those of the same queries over more keys: the ring's), recomputing P block by
    block; dbias in bias's shape and dtype, None without a bias or when ``bias_grad`` is False.
    ``mod``: a score_mod built by ``cpu_mods.py``; its captured tensors' gradients are added into
    ``mod_grad`` (float64, a flat copy per thread). Rows whose lse needs a shift (``flash.row_shift``:
    a huge bias on every key a row keeps) are not the kernel's: without a mod the whole backward runs
    on flash.py (``cpu_mods`` sends a mod's there itself)."""
    if mod is None and flash.row_shift(lse, bias, None) is not None:
        return flash.backward(
            dout, q, k, v, out, lse, mask=mask, bias=bias, causal=causal, window=window, scale=scale,
            dropout_p=dropout_p, dropout_seed=dropout_seed, bias_grad=bias_grad, softcap=softcap,
        )  # fmt: skip
    args = _args(q, k, mask, bias, causal, window, scale, softcap, dropout_p, dropout_seed)
    want = bias is not None and bias_grad
    lse32 = lse if lse.dtype == torch.float32 else lse.to(torch.float32)  # (a .to that changes nothing: ~1 µs)
    extra = mod.backward_args(mod_grad) if mod is not None else _NO_MOD_BACKWARD
    dq, dk, dv, dbias = _state["module"].backward(dout, q, k, v, out, lse32, *args, want, *extra)
    return dq, dk, dv, (dbias.to(bias.dtype) if want and bias is not None else None)


def dropout_keep(
    seed: int, p: float, shape: tuple[int, int, int, int], at: tuple[int, int, int], j0: int, n: int
) -> Tensor:
    """The kernel's keep decisions (bool (n,)) for keys ``j0 .. j0 + n`` of batch, head and query
    ``at`` in a problem of ``shape`` (B, H, Lq, Lk): what ``dropout.keep_mask`` gives there."""
    if not available():
        raise RuntimeError(f"attnzero: the CPU kernel is not available: {why()}")
    _, H, Lq, Lk = shape
    signed = seed if seed < 2**63 else seed - 2**64
    return _state["module"].keep_mask(signed, p, H, Lq, Lk, *at, j0, n)  # type: ignore[no-any-return]


class _KernelAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, options: dict[str, Any]
    ) -> tuple[Tensor, Tensor]:
        out, lse = forward(q, k, v, bias=bias, **options, out_f32=True)
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.options, ctx.mask_seen = options, version_of(options["mask"])
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # (no zeros made for the lse's gradient at every backward)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        del dlse  # lse is returned as non-differentiable
        q, k, v, bias, out, lse = ctx.saved_tensors
        unchanged(ctx.mask_seen)  # (autograd's check of saved tensors, for the mask)
        if dout is None:  # no gradient reached the output (grads are not materialised): zeros, as autograd gives
            dout = torch.zeros_like(out)
        if reference.needs_graph(dout):  # create_graph=True, or a batched dout: autograd through the formula
            needs = tuple(ctx.needs_input_grad[:4])
            return (*reference.backward_with_graph(dout, q, k, v, bias, needs, **ctx.options), None)
        want_dbias = ctx.needs_input_grad[3]
        dq, dk, dv, dbias = backward(dout, q, k, v, out, lse, bias=bias, bias_grad=want_dbias, **ctx.options)
        return dq, dk, dv, dbias, None


def attention(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | Mask | None = None, bias: Tensor | None = None,
    causal: bool = False, window: geometry.Window = None, scale: float, dropout_p: float = 0.0,
    dropout_seed: int = 0, need_lse: bool = True, softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The backend entry used by ``functional.py``: ``(out, lse)``, differentiable in q, k, v and
    bias (lse is not). The lse is always computed (``need_lse`` changes nothing here)."""
    grads = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (bias is not None and bias.requires_grad)
    )
    if not grads:
        return forward(
            q, k, v, mask=mask, bias=bias, causal=causal, window=window, scale=scale, dropout_p=dropout_p,
            dropout_seed=dropout_seed, softcap=softcap,
        )  # fmt: skip
    options: dict[str, Any] = {
        "mask": mask, "causal": causal, "window": window, "scale": scale, "dropout_p": dropout_p,
        "dropout_seed": dropout_seed, "softcap": softcap,
    }  # fmt: skip
    out, lse = _KernelAttention.apply(q, k, v, bias, options)
    return out, lse


__all__ = ["attention", "available", "backward", "cache_dir", "forward", "unsupported", "why"]
