"""softcap's fused C kernel (``attnzero.softcap_cpu``, ``softcap.c``) on its own: its tanh against
float64 on dense grids of floats and at the edges (±0, tiny, the polynomial's boundary 1, saturation,
±inf, NaN), its addends and exp2 against torch, lanes that do not depend on their neighbours,
threads, and the build: cache, a failed compiler, ATTNZERO_NO_BUILD. flash's results through it are
held to the golden by test_softcap_sinks.py (every route)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import absent, flash_py, qkv

import attnzero as az
from attnzero import flash, softcap_cpu

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _kernel() -> None:
    if not softcap_cpu.available():
        absent(f"the softcap kernel is not available: {softcap_cpu.why()}")


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error in units of 2^-24 of |want| (float32's relative rounding; 2^-149 at least)."""
    unit = (want.abs() * 2.0**-24).clamp_min(2.0**-149)
    return float(((got.double() - want) / unit).abs().max())


def _tanh(x: torch.Tensor) -> torch.Tensor:
    """The kernel's t for x (any shape, float32), with cap 1 and nothing added."""
    s = x.reshape(1, 1, -1).clone()
    t = torch.empty_like(s)
    softcap_cpu.softcap_(s, 1.0, t_out=t)
    torch.testing.assert_close(s, t, rtol=0, atol=0, equal_nan=True)  # cap 1, no addend: s = t
    return t.view(x.shape)


def _floats(lo: float, hi: float, step: int) -> torch.Tensor:
    """Every ``step``-th float32 in [lo, hi] (positive), by their bit patterns, and their negatives."""
    a, b = (torch.tensor([v], dtype=torch.float32).view(torch.int32).item() for v in (lo, hi))
    pos = torch.arange(a, b + 1, step, dtype=torch.int32).view(torch.float32)
    return torch.cat([pos, -pos])


@pytest.mark.parametrize(
    ("lo", "hi", "step"),
    [(2.0**-126, 2.0**-10, 4099), (2.0**-10, 0.25, 97), (0.25, 1.0, 31), (0.999, 1.001, 1), (1.0, 10.0, 61),
     (10.0, 1e30, 40009)],
    ids=["tiny", "small", "middle", "poly-edge", "large", "saturated"],
)  # fmt: skip
def test_tanh_within_two_ulps_on_dense_grids(lo: float, hi: float, step: int) -> None:
    """Millions of floats per range (every float around the polynomial's boundary at 1): the
    polynomial (|x| <= 1) and libmvec (beyond) both within 2 ulp of float64's tanh."""
    x = _floats(lo, hi, step)
    assert x.numel() > 20_000
    assert _ulps(_tanh(x), torch.tanh(x.double())) <= 2.0


def test_tanh_edges() -> None:
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([0.0, -0.0, 2.0**-149, -(2.0**-149), 1.0, -1.0, 9.0, 20.0, -20.0, 3e38, inf, -inf, nan])
    t = _tanh(x)
    want = torch.tanh(x.double())
    assert torch.isnan(t[-1])
    assert torch.equal(t[:-1].double(), want[:-1].float().double())  # exact here, ±1 and ±0 included
    assert torch.equal(torch.signbit(t[:2]), torch.tensor([False, True]))  # tanh(−0) = −0


def test_a_lane_does_not_depend_on_its_neighbours() -> None:
    """A value gets the same bits whether the rest of its vector is small (the polynomial alone),
    large (libmvec alone) or mixed (both, blended): results do not depend on the layout."""
    small = torch.linspace(-1.0, 1.0, 64)
    alone = _tanh(small)
    mixed = small.clone()
    mixed[1::2] = 3.0  # every other lane takes libmvec
    assert torch.equal(_tanh(mixed)[0::2], alone[0::2])
    big = torch.linspace(1.1, 8.0, 64)
    mixed_big = big.clone()
    mixed_big[1::2] = 0.1
    assert torch.equal(_tanh(mixed_big)[0::2], _tanh(big)[0::2])


@pytest.mark.parametrize("n2", [1, 15, 16, 17, 33, 256])
@pytest.mark.parametrize("exp2", [0, 1, 2], ids=["scores", "exp2", "exp2-dtanh"])
def test_addends_exp2_and_dtanh_match_torch(n2: int, exp2: int) -> None:
    """``s = cap · tanh(x) + a + b``, its exp2, and ``p · (1 − t²)``, against the same formula in
    float64, with a per-row shift (innermost stride 0), an edge tile with −inf (stride 1, broadcast
    over the batch), ragged row tails, and a shift that takes some exponents below −150 (0) and
    into the subnormals."""
    n0, n1, cap = 3, 5, 30.0 * 1.4426950408889634
    x = torch.randn(n0, n1, n2) / 2
    a = torch.randn(n0, n1, 1) * 4
    a[0, 0] = -180.0  # every exponent of that row below −150: exp2 is 0
    a[0, 1] = -110.0  # exponents around −126 to −150: subnormal results
    b = torch.zeros(n1, n2).masked_fill_(torch.rand(n1, n2) < 0.3, float("-inf"))
    s, t = x.clone(), torch.empty_like(x)
    softcap_cpu.softcap_(s, cap, t_out=t, a=a, b=b, exp2=exp2 > 0, dtanh=exp2 == 2)
    t64 = torch.tanh(x.double())
    y64 = cap * t64 + a.double() + b.double()
    if exp2 == 0:
        assert _ulps(t, t64) <= 2.0
        assert torch.equal(torch.isinf(s), torch.isinf(y64))
        fin = torch.isfinite(y64)
        assert float((s.double() - y64)[fin].abs().max()) <= 4 * 2.0**-24 * (cap + 8)
        return
    want = torch.exp2(y64)
    assert torch.equal(s == 0, want.float() == 0)  # blocked pairs and underflow: exactly 0
    # relative error of p: the exponent's rounding (|y| up to ~200 · 2^-24) and exp2's own
    tol = (200 * 2.0**-24 * 0.7 + 4 * 2.0**-24) * want + 2.0**-149
    assert bool(((s.double() - want).abs() <= tol).all())
    if exp2 == 2:
        w = want * (1 - t64**2)
        assert bool(((t.double() - w).abs() <= 2 * tol + 4 * 2.0**-24 * w).all())


def test_addends_in_any_layout_are_read_as_broadcast() -> None:
    """A non-contiguous addend (a transposed shift, an expanded view) gives what its contiguous copy
    gives."""
    x = torch.randn(2, 7, 19)
    shift_t = torch.randn(2, 19, 1).transpose(1, 2)  # (2, 1, 19): broadcast down the columns
    edge = torch.randn(19, 7).t()  # (7, 19), non-contiguous
    s1, s2 = x.clone(), x.clone()
    softcap_cpu.softcap_(s1, 2.0, a=shift_t, b=edge)
    softcap_cpu.softcap_(s2, 2.0, a=shift_t.contiguous(), b=edge.contiguous())
    assert torch.equal(s1, s2)
    torch.testing.assert_close(s1, 2.0 * torch.tanh(x) + shift_t + edge)


def test_a_column_addend_with_one_column_and_an_infinite_p() -> None:
    """A contiguous (c, 1) addend may carry any stride in its size-1 dim (``torch.zeros(1, c).t()``):
    read as broadcast all the same. And ``p · (1 − t²)`` with p = inf is inf where |t| < 1, as
    ``tanh_backward`` would give, not NaN."""
    x = torch.randn(2, 5, 1)
    edge = torch.randn(1, 5).t()  # (5, 1), strides (1, 5)
    s = x.clone()
    softcap_cpu.softcap_(s, 2.0, b=edge)
    torch.testing.assert_close(s, 2.0 * torch.tanh(x) + edge)
    s, w = torch.full((1, 1, 3), 0.5), torch.empty(1, 1, 3)
    softcap_cpu.softcap_(s, 1.0, t_out=w, a=torch.full((1, 1, 1), 200.0), exp2=True, dtanh=True)  # 2^200.46 = inf
    assert torch.isinf(s).all() and torch.isinf(w).all()


def test_threads_get_what_one_thread_gets() -> None:
    """The call releases the GIL: two threads at once, each on its own block, give the serial bits."""
    xs = [torch.randn(4, 64, 200) for _ in range(8)]
    want = []
    for x in xs:
        s = x.clone()
        softcap_cpu.softcap_(s, 3.0, exp2=True)
        want.append(s)
    got = [x.clone() for x in xs]

    def work(i: int) -> None:
        for j in range(i, len(got), 2):
            softcap_cpu.softcap_(got[j], 3.0, exp2=True)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_flash_fuses_exp2_and_the_cap_factor_where_nothing_follows() -> None:
    """The backward takes ``p`` and ``p · (1 − t²)`` from the kernel when no bias or evaluated mask
    follows the cap, and the plain route (t kept, ``tanh_backward``) otherwise: both against the
    golden in test_softcap_sinks.py; here, that each is taken."""
    seen: list[bool] = []
    real = softcap_cpu.softcap_

    def spy(s: torch.Tensor, cap: float, **kw: object) -> torch.Tensor:
        seen.append(bool(kw.get("dtanh")))
        return real(s, cap, **kw)  # type: ignore[arg-type]

    q, k, v = (t.float().requires_grad_() for t in qkv(1, 2, 1, 300, 300, 16))
    bias = torch.randn(1, 2, 300, 300)
    with pytest.MonkeyPatch.context() as mp, flash_py(), flash.block_sizes(tanh="kernel", softmax=False):
        mp.setattr(softcap_cpu, "softcap_", spy)
        az.attention(q, k, v, causal=True, softcap=5.0, backend="flash").sum().backward()
        assert any(seen), "no fused call"
        seen.clear()
        az.attention(q, k, v, bias=bias, softcap=5.0, backend="flash").sum().backward()
        assert seen and not any(seen), "fused with a bias"


def test_inference_mode_and_threads_through_flash() -> None:
    """The kernel route under inference_mode and on two worker threads equals one thread's bits."""
    q, k, v = (t.float() for t in qkv(1, 4, 2, 300, 300, 32))
    with flash.block_sizes(tanh="kernel", threads=1, softmax=False):
        want = az.attention(q, k, v, causal=True, softcap=7.0, backend="flash")
    with torch.inference_mode(), flash.block_sizes(tanh="kernel", threads=2, softmax=False):
        got = az.attention(q, k, v, causal=True, softcap=7.0, backend="flash")
    assert torch.equal(got, want)


def test_the_avx2_build_passes_the_same_tests(tmp_path: Path) -> None:
    """Where this CPU has AVX-512, the AVX2 variant (8 lanes) is built too and runs this file's
    kernel tests in a subprocess: a user's AVX2-only machine takes that path."""
    if softcap_cpu.lanes() != 16:
        pytest.skip("this CPU's build is the AVX2 one already: the tests above ran it")
    env = {**os.environ, "ATTNZERO_MARCH": "x86-64-v3", "ATTNZERO_CACHE": str(tmp_path)}
    env["PYTHONPATH"] = str(ROOT / "src")
    check = [sys.executable, "-c", "from attnzero import softcap_cpu; print(softcap_cpu.lanes())"]
    assert subprocess.run(check, capture_output=True, text=True, env=env, check=False).stdout.strip() == "8"
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not build and not avx2"]
    done = subprocess.run(tests, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:]


def test_autocast_through_the_kernel_is_the_kernel_on_cast_inputs() -> None:
    """Under CPU autocast (bfloat16) a softcapped flash call, tiled and single-step, forward and
    backward, takes the kernel on its float32 accumulator and equals the call on inputs cast by
    hand, bit for bit."""
    bf16 = torch.bfloat16
    for L, sizes in ((150, {"rows": 32, "cols": 32}), (40, {})):
        q, k, v = (t.float().requires_grad_() for t in qkv(1, 4, 2, L, L, 16))
        with flash.block_sizes(tanh="kernel", **sizes):  # type: ignore[arg-type]
            with torch.autocast("cpu", dtype=bf16):
                out = az.attention(q, k, v, causal=True, softcap=4.0, backend="flash")
            out.float().sum().backward()
            grads = [t.grad for t in (q, k, v)]
            qb, kb, vb = (t.detach().to(bf16).requires_grad_() for t in (q, k, v))
            want = az.attention(qb, kb, vb, causal=True, softcap=4.0, backend="flash")
            want.float().sum().backward()
        assert out.dtype == bf16 and torch.equal(out, want)
        for g, w in zip(grads, (qb.grad, kb.grad, vb.grad)):
            assert g is not None and w is not None and torch.equal(g, w.float())


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env},
    )  # fmt: skip


_REPORT = """
import torch, attnzero as az
from attnzero import softcap_cpu, flash, functional
functional._takes_kernel = lambda q, bias: False  # flash.py itself (not the compiled CPU kernel)
q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))
with flash.block_sizes(rows=16, cols=16):
    out = az.attention(q, k, v, causal=True, softcap=3.0, backend="flash")
ref = az.attention(q.double(), k.double(), v.double(), causal=True, softcap=3.0, backend="reference")
err = (out.double() - ref).abs().max().item()
print(softcap_cpu.available(), repr(softcap_cpu.why()), err < 1e-5)
"""


def test_the_build_is_cached_and_every_failure_falls_back(tmp_path: Path) -> None:
    """In a fresh cache the first process builds the library and a second loads it; a compiler that
    fails, or ATTNZERO_NO_BUILD, leaves the kernel unavailable with the reason, and flash correct."""
    cache = str(tmp_path / "cache")
    first = _python(_REPORT, ATTNZERO_CACHE=cache)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split()[0] == "True" and first.stdout.split()[-1] == "True"
    built = list(Path(cache).glob("softcap-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    second = _python(_REPORT, ATTNZERO_CACHE=cache)  # loads it: not built again
    assert second.stdout.split()[0] == "True" and built[0].stat().st_mtime_ns == stamp
    assert list(Path(cache).glob("*")) == built  # no temporary file left behind
    broken = _python(_REPORT, ATTNZERO_CACHE=str(tmp_path / "other"), CC="/bin/false")
    assert broken.returncode == 0, broken.stderr
    assert broken.stdout.startswith("False 'the build failed") and broken.stdout.split()[-1] == "True"
    # $CC with arguments; torch's default dtype float64 does not fail the load's own check
    args = _python("import torch; torch.set_default_dtype(torch.float64)\n" + _REPORT, CC="gcc -Wextra",
                   ATTNZERO_CACHE=str(tmp_path / "args"))  # fmt: skip
    assert args.stdout.split()[0] == "True", args.stdout + args.stderr
    off = _python(_REPORT, ATTNZERO_NO_BUILD="1", ATTNZERO_CACHE=str(tmp_path / "off"))
    assert off.stdout.startswith("False 'ATTNZERO_NO_BUILD is set'") and off.stdout.split()[-1] == "True"
    assert not (tmp_path / "off").exists()
