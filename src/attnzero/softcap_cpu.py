"""Softcap's tanh on CPU in one fused pass: ``softcap.c``, built with the system's C compiler on
first use and loaded with ctypes.

Why: flash's softcapped score block is ``cap · tanh(x) + edge + shift`` (then ``exp2`` in the
backward). In torch that is three or four passes, and torch's CPU ``tanh`` is MKL's, which runs a
slow path on CPUs that are not Intel's (9× an ``exp2`` on the AMD EPYC VM of docs/benchmarks.md).
The C kernel does the whole line in one pass with glibc's vector ``tanhf`` and ``exp2f`` (libmvec,
glibc 2.35 or later; at most a few ulp, the same on every vendor's CPU).

Where it cannot be had — no C compiler, not Linux on x86-64 with AVX2 or AVX-512, an older glibc,
a build that fails its check against ``math.tanh``, or ``ATTNZERO_NO_BUILD=1`` in the environment
(no compiler is ever run) — ``available()`` is False and flash takes its tanh in torch. Nothing
here is needed for correctness; the tests hold every way to the float64 golden.

The built library is kept in ``$ATTNZERO_CACHE`` (else ``$XDG_CACHE_HOME/attnzero``, else
``~/.cache/attnzero``), named by a hash of the source, the compiler command and this CPU's flags,
so a change to any of them builds anew."""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("softcap.c")
# -march=native: the vector width this CPU has (the cache key holds its flags; $ATTNZERO_MARCH
# overrides it, e.g. x86-64-v3 builds the AVX2 variant on an AVX-512 CPU); libmvec: the vector
# tanhf / exp2f
_FLAGS = ["-O2", "-shared", "-fPIC", "-Wall"]
_LIBS = ["-lmvec", "-lm"]

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded function or None once tried; "why": why not


def cpuinfo(field: str) -> str:
    """One field of /proc/cpuinfo for the first CPU ("vendor_id": ``GenuineIntel``, ``AuthenticAMD``;
    "flags": the features -march=native depends on); "" where it does not say."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cache_dir() -> Path:
    """Where the built library is kept (see the module docstring)."""
    given = os.environ.get("ATTNZERO_CACHE")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnzero"


def _build(cc: str) -> Path:
    """The library for this source, compiler and CPU: built into the cache unless already there."""
    march = os.environ.get("ATTNZERO_MARCH") or "native"
    command = [*shlex.split(cc), *_FLAGS, f"-march={march}", str(SOURCE), "-o", "OUT", *_LIBS]
    version = subprocess.run([*shlex.split(cc), "--version"], capture_output=True, text=True, timeout=60, check=False)
    parts = [SOURCE.read_text(), " ".join(command), version.stdout, cpuinfo("flags"), platform.machine()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    target = cache_dir() / f"softcap-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # built beside the target under a unique name, then renamed: two processes never see half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command[command.index("OUT")] = tmp
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise OSError(f"{cc} failed: {done.stderr.strip()[:500]}")
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users of a shared cache out
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _checked(lib: ctypes.CDLL) -> bool:
    """Whether the built kernel gives tanh, cap · tanh + addends and exp2 of them on values that
    span its edges (0, ±tiny, ±1, past ±9 where tanh rounds to ±1, ±inf, NaN) and a row with a
    ragged tail, within 4 ulp of math's."""
    xs = [0.0, -0.0, 1e-30, -1e-30, 1e-4, -0.3, 0.55, 1.0, -2.5, 8.9, -9.1, 20.0, 1e30, -math.inf, math.inf]
    f32, cpu = torch.float32, torch.device("cpu")  # whatever torch's defaults are
    x = torch.tensor(xs * 3, dtype=f32, device=cpu).view(1, 1, -1)  # 45 values: two full vectors and a tail
    want = [math.tanh(v) for v in x.flatten().tolist()]
    t = torch.empty_like(x)  # x's dtype and device
    a = torch.full((1,), 0.5, dtype=f32, device=cpu)
    if _call(lib, x, 3.0, t_out=t, a=a, exp2=1) != 0:
        return False
    got_t, got = t.flatten().tolist(), x.flatten().tolist()
    for w, g_t, g in zip(want, got_t, got):
        if abs(g_t - w) > 4 * 2**-24 * max(abs(w), 2**-126):
            return False
        y = 2.0 ** (3.0 * w + 0.5)
        if abs(g - y) > 8 * 2**-24 * y:
            return False
    nan = torch.tensor([[[math.nan]]], dtype=f32, device=cpu)
    return _call(lib, nan, 1.0) == 0 and math.isnan(nan.item())


def _load() -> ctypes.CDLL | None:
    """The library, or None (and the reason in ``why()``)."""
    if os.environ.get("ATTNZERO_NO_BUILD", "") not in ("", "0"):
        _state["why"] = "ATTNZERO_NO_BUILD is set"
        return None
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        _state["why"] = f"not Linux on x86-64 ({sys.platform}, {platform.machine()})"
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")  # $CC may carry arguments
    if not cc:
        _state["why"] = "no C compiler (cc, gcc or $CC)"
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
        lib.az_softcap.restype = ctypes.c_int
        lib.az_softcap.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_float,
                                   ctypes.c_int, ctypes.c_void_p, *[ctypes.c_int64] * 3,
                                   ctypes.c_void_p, *[ctypes.c_int64] * 3]  # fmt: skip
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        _state["why"] = f"the build failed: {e}"
        return None
    if int(lib.az_lanes()) not in (8, 16):
        _state["why"] = f"the built kernel has {lib.az_lanes()} lanes, not 8 or 16"
        return None
    if not _checked(lib):
        _state["why"] = "the built kernel disagrees with math.tanh"
        return None
    return lib


def _lib() -> ctypes.CDLL | None:
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _load()
    return _state["lib"]  # type: ignore[return-value]


def available() -> bool:
    """Whether the fused kernel is here (built, loaded and checked; tried once per process)."""
    return _lib() is not None


def lanes() -> int:
    """The floats one vector of the built kernel holds: 16 (AVX-512) or 8 (AVX2); 0 when not available."""
    lib = _lib()
    return 0 if lib is None else int(lib.az_lanes())


def why() -> str:
    """Why the kernel is not available ("" when it is)."""
    return "" if available() else str(_state.get("why", ""))


def _addend(x: Tensor | None, shape: torch.Size) -> tuple[Tensor | None, list[int]]:
    """An addend broadcast to ``shape`` (3-D) as the kernel reads it: contiguous first, so the
    expanded strides are 0 (broadcast) or its own, innermost 0 or 1; a dim of size 1 in ``shape``
    reads only index 0, so its stride is 0 too (a contiguous (c, 1) may carry any stride there)."""
    if x is None:
        return None, [0, 0, 0]
    x = x.contiguous()
    return x, [0 if n == 1 else st for n, st in zip(shape, x.expand(shape).stride())]


def _call(lib: ctypes.CDLL, s: Tensor, cap: float, t_out: Tensor | None = None, a: Tensor | None = None,
          b: Tensor | None = None, exp2: int = 0) -> int:  # fmt: skip
    shape = s.shape  # (n0, n1, n2)
    a, sa = _addend(a, shape)
    b, sb = _addend(b, shape)
    return int(lib.az_softcap(
        s.data_ptr(), None if t_out is None else t_out.data_ptr(), *shape, cap, exp2,
        None if a is None else a.data_ptr(), *sa, None if b is None else b.data_ptr(), *sb,
    ))  # fmt: skip


def softcap_(
    s: Tensor, cap: float, *, t_out: Tensor | None = None, a: Tensor | None = None, b: Tensor | None = None,
    exp2: bool = False,
    dtanh: bool = False,
) -> Tensor:
    """In place on ``s`` (float32, CPU, contiguous, 3-D): ``t = tanh(s)``, ``t_out = t`` (same shape,
    contiguous), ``s = cap · t + a + b`` (each broadcast to s), then ``s = exp2(s)`` when ``exp2``,
    and ``t_out = s · (1 − t²)`` instead when ``dtanh`` too (the backward's factor through the cap).
    Only where ``available()``. The call releases the GIL while it runs."""
    lib = _lib()
    assert lib is not None and s.dtype == torch.float32 and s.is_contiguous() and s.dim() == 3
    assert t_out is None or (t_out.shape == s.shape and t_out.is_contiguous() and t_out.dtype == torch.float32)
    assert all(x is None or (x.dtype == torch.float32 and x.device.type == "cpu") for x in (a, b))
    assert exp2 or not dtanh
    # (_addend makes every stride fit: a refusal would be a bug here)
    if _call(lib, s, cap, t_out, a, b, 2 if dtanh else int(exp2)) != 0:
        raise RuntimeError("softcap kernel: an addend's innermost stride is not 0 or 1")
    return s
