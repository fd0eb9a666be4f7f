"""Building the CPU kernel is part of the product (``attnzero.cpu_kernel``): in fresh processes with
a temporary cache, the first use prints one line and builds once even when 8 processes start
together, and every way it cannot be had — ``ATTNZERO_NO_BUILD=1``, no compiler, a compiler that
fails, a read-only or full cache directory — gives flash.py's results with exactly one warning that
says why and what to do, never a crash.

The cases that cannot build are quick (they stop before or at the compiler). Three really compile,
about a minute each: ``test_eight_processes_build_once``, every process of which checks its results
against the reference, and the builds for narrower vector widths than this CPU's
(``ATTNZERO_CPU_ISA``: AVX2, scalar), each of which runs test_cpu_kernel.py."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import kernel_off

import attnzero
from attnzero import cpu_kernel

SRC = str(Path(attnzero.__file__).resolve().parent.parent)

# A fresh process: two float32 calls (forward and backward) and what they ran on
CHILD = r"""
import json, sys, warnings
warnings.simplefilter("always")
caught = []
warnings.showwarning = lambda message, *a, **k: caught.append(str(message))
import torch
import attnzero as az
from attnzero import cpu_kernel, functional
torch.manual_seed(0)
q, k, v = (torch.randn(2, 4, 70, 16, requires_grad=True) for _ in range(3))
errs = []
for _ in range(2):
    out = az.attention(q, k, v, causal=True)
    g = torch.autograd.grad(out.sum(), (q, k, v))
    x = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    want = az.attention(*x, causal=True, backend="reference")
    g_want = torch.autograd.grad(want.sum(), x)
    diffs = [(out.double() - want)] + [a.double() - b for a, b in zip(g, g_want)]
    errs.append(max(float(d.abs().max()) for d in diffs))
print(json.dumps({"chosen": functional.choose("flash", q, k, needs_grad=True), "err": max(errs),
                  "warnings": [w for w in caught if "CPU attention kernel" in w]}))
"""


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {key: val for key, val in os.environ.items() if key not in ("ATTNZERO_NO_BUILD", "CXX")}
    env.update({"ATTNZERO_CACHE": str(cache), "PYTHONPATH": SRC + os.pathsep + env.get("PYTHONPATH", ""),
                "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"})  # fmt: skip
    env.update(extra)
    return env


def _run(env: dict[str, str], preexec: Any = None, timeout: float = 600) -> tuple[dict[str, Any], str]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _falls_back(result: dict[str, Any], stderr: str, reason: str, tried: bool = False) -> None:
    """flash.py ran, with the reference's results, after one warning that says why (and, where a
    build was tried, after its one line)."""
    assert result["chosen"] == "flash"
    assert result["err"] < 1e-4
    assert len(result["warnings"]) == 1, result["warnings"]
    assert reason in result["warnings"][0], result["warnings"][0]
    assert "flash.py" in result["warnings"][0]
    assert stderr.count("building the CPU attention kernel") == (1 if tried else 0), stderr


def test_no_build(tmp_path: Path) -> None:
    result, err = _run(_env(tmp_path, ATTNZERO_NO_BUILD="1"))
    _falls_back(result, err, "ATTNZERO_NO_BUILD")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_no_compiler(tmp_path: Path) -> None:
    result, err = _run(_env(tmp_path, CXX=str(tmp_path / "no-such-c++")))
    _falls_back(result, err, "no C++ compiler")


def test_a_failing_compiler(tmp_path: Path) -> None:
    """A compiler that runs and fails: the build fails, flash.py runs."""
    cxx = tmp_path / "broken-c++"
    cxx.write_text("#!/bin/sh\necho 'broken-c++: internal error' >&2\nexit 1\n")
    cxx.chmod(0o755)
    result, err = _run(_env(tmp_path / "cache", CXX=str(cxx)))
    _falls_back(result, err, "the build failed", tried=True)
    assert "broken-c++" in result["warnings"][0] or "Error building" in result["warnings"][0]


# What a build killed mid-way (SIGKILL: the OOM killer, a scheduler's time limit) leaves behind:
# cpp_extension's lock file in the build directory, which its waiters poll for as long as it exists
LEFTOVER = r"""
from attnzero import cpu_kernel
d = cpu_kernel.cache_dir() / f"cpu_kernel-{cpu_kernel._key(cpu_kernel._build_flags())}"
d.mkdir(parents=True)
(d / "lock").write_text("")
"""


def test_a_build_killed_before_leaves_no_wait(tmp_path: Path) -> None:
    """The next process builds (attnzero's own lock says no other process is building), instead of
    waiting forever on the lock file the killed build left: here its build fails at once (a broken
    compiler) and flash.py runs, with the one warning."""
    cxx = tmp_path / "broken-c++"
    cxx.write_text("#!/bin/sh\necho 'broken-c++: internal error' >&2\nexit 1\n")
    cxx.chmod(0o755)
    env = _env(tmp_path / "cache", CXX=str(cxx))
    subprocess.run([sys.executable, "-c", LEFTOVER], env=env, check=True, timeout=120)
    result, err = _run(env, timeout=120)
    _falls_back(result, err, "the build failed", tried=True)


# A process forked while a thread of its parent builds (a DataLoader worker): the build stands in as a
# 3 s wait that fails (no compiler runs); the child must take its turn at the lock, not wait forever
FORKED = r"""
import os, signal, threading, time
import torch.utils.cpp_extension as ce
from attnzero import cpu_kernel
def slow(*a, **k):
    time.sleep(3)
    raise RuntimeError("a build that fails")
ce.load = slow
threading.Thread(target=cpu_kernel.available, daemon=True).start()
time.sleep(0.5)
pid = os.fork()
if pid == 0:
    signal.signal(signal.SIGALRM, lambda *a: os._exit(3))
    signal.alarm(30)
    cpu_kernel.available()
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
"""


def test_a_process_forked_during_a_build_takes_its_turn(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", FORKED], env=_env(tmp_path), capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0 and "child exit 0" in done.stdout, (done.stdout, done.stderr[-2000:])


def test_a_read_only_cache(tmp_path: Path) -> None:
    if os.geteuid() == 0:  # root writes through any mode bits: a read-only file system instead
        cache = Path("/sys/attnzero-cache")
        if not Path("/sys").is_dir() or _writable("/sys"):
            pytest.skip("no read-only directory to point the cache at as root")
    else:
        cache = tmp_path / "ro"
        cache.mkdir()
        cache.chmod(0o555)
    result, err = _run(_env(cache))
    _falls_back(result, err, "cannot write the cache directory")


def _writable(path: str) -> bool:
    try:
        os.mkdir(os.path.join(path, "attnzero-probe"))
    except OSError:
        return False
    os.rmdir(os.path.join(path, "attnzero-probe"))
    return True


def _small_files() -> None:
    """A full disk, as the build sees it: no file can grow by a byte (EFBIG, not a signal), so the
    build fails at its first write (cpp_extension's build.ninja), before compiling anything."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


def test_a_full_cache(tmp_path: Path) -> None:
    result, err = _run(_env(tmp_path), preexec=_small_files)
    _falls_back(result, err, "the build failed", tried=True)
    print(result["warnings"][0])


@pytest.mark.slow
@pytest.mark.skipif(kernel_off(), reason="ATTNZERO_NO_BUILD=1: this run tests flash.py without the kernel")
def test_eight_processes_build_once(tmp_path: Path) -> None:
    """8 processes on an empty cache at once: one builds (and prints the one line), the others
    wait for it and load the same library; all run the kernel, with the reference's results, and
    none warns. Then a ninth process finds it built: no line, no build."""
    env = _env(tmp_path)
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for _ in range(8)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    results = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    lines = [line for _, e in outs for line in e.splitlines() if "building the CPU attention kernel" in line]
    assert len(lines) == 1, lines
    assert str(tmp_path) in lines[0] and "about" in lines[0]
    assert [len(list(p.iterdir())) for p in tmp_path.iterdir()] and len(list(tmp_path.iterdir())) == 1
    for r in results:
        assert r["chosen"] == "cpu_kernel" and r["err"] < 1e-4 and r["warnings"] == []
    again, err = _run(env)
    assert again["chosen"] == "cpu_kernel" and "building" not in err and again["warnings"] == []


@pytest.mark.parametrize("width", ["avx2", "default"])
def test_narrower_builds_pass_the_kernel_tests(tmp_path: Path, width: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel built for a narrower vector width than this CPU's (``ATTNZERO_CPU_ISA``): AVX2's
    register tiles are 4 rows × 24 columns instead of AVX-512's 6 × 64, and the scalar build
    multiplies with sgemm. Each is built from scratch into a temporary cache and must pass
    test_cpu_kernel.py (the golden, every argument, forward and backward) in a process of its own."""
    if width not in cpu_kernel.cpu_widths():
        pytest.skip(f"this CPU cannot run {width} code")
    monkeypatch.setenv("ATTNZERO_CPU_ISA", width)
    built = tmp_path / f"cpu_kernel-{cpu_kernel._key(cpu_kernel._build_flags())}"
    env = _env(tmp_path, ATTNZERO_CPU_ISA=width, OMP_NUM_THREADS="2")
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-x",
         str(Path(__file__).with_name("test_cpu_kernel.py"))],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-500:]
    assert (built / "built").exists(), sorted(p.name for p in tmp_path.iterdir())


def test_a_width_this_cpu_lacks_is_refused(tmp_path: Path) -> None:
    """``ATTNZERO_CPU_ISA`` naming no width of this CPU: no build, one warning, flash.py's results."""
    result, err = _run(_env(tmp_path, ATTNZERO_CPU_ISA="avx1024"))
    _falls_back(result, err, "ATTNZERO_CPU_ISA='avx1024' is not one of this CPU's widths")
