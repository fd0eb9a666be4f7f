"""Ring attention across real processes: gloo on 127.0.0.1, 2 and 3 ranks, forward and gradients
equal to single-process attention on the whole sequence; faults end in errors, never in hangs.

Launching processes is the slow part, so each world size is ONE group of processes that runs every
case (and then the fault scenarios) and saves its results; the tests below read those results and
apply DESIGN.md's tolerance rule (attnzero.testing) against ``backend="reference"`` in float64.

This file is also the worker script: ``python tests/test_distributed.py <job dir> <rank>``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import kernel_built

ROOT = Path(__file__).resolve().parents[1]
GROUP_TIMEOUT_S = 120  # default group: generous, the machine is shared
FAULT_TIMEOUT_S = 5  # the group the fault scenarios run on: how long a rank waits for a peer
LAUNCH_TIMEOUT_S = 240  # the whole group of processes; beyond that the test fails (a hang)

# (dtype, layout, causal, B, Hq, Hkv, L per rank, D, Dv, memory layout of the inputs)
CASES: list[tuple[str, str, bool, int, int, int, int, int, int, str]] = [
    ("float64", "contiguous", False, 2, 4, 2, 5, 8, 8, "contiguous"),
    ("float64", "contiguous", True, 1, 3, 1, 7, 16, 12, "contiguous"),  # MQA, Dv != D
    ("float64", "contiguous", True, 1, 2, 2, 1, 8, 8, "contiguous"),  # one position per rank
    ("float64", "zigzag", False, 1, 2, 2, 6, 8, 8, "transpose"),
    ("float64", "zigzag", True, 2, 4, 2, 10, 8, 16, "contiguous"),  # GQA
    ("float64", "zigzag", True, 1, 1, 1, 2, 4, 4, "contiguous"),  # chunks of one position
    ("float32", "contiguous", False, 1, 4, 1, 9, 16, 16, "transpose"),
    ("float32", "contiguous", True, 2, 2, 2, 6, 32, 8, "contiguous"),
    ("float32", "zigzag", False, 1, 6, 3, 8, 8, 8, "contiguous"),
    ("float32", "zigzag", True, 1, 4, 2, 14, 40, 40, "transpose"),
    ("bfloat16", "zigzag", True, 1, 4, 2, 12, 16, 16, "contiguous"),  # 16-bit: float32 merges and sums
    ("float64", "contiguous", True, 0, 2, 1, 4, 8, 8, "contiguous"),  # zero sizes (DESIGN.md): B = 0,
    ("float64", "zigzag", True, 1, 2, 1, 0, 8, 8, "contiguous"),  # L = 0,
    ("float32", "contiguous", False, 1, 2, 2, 3, 0, 8, "contiguous"),  # D = 0 (uniform weights),
    ("float32", "zigzag", True, 1, 2, 2, 4, 8, 0, "contiguous"),  # Dv = 0,
    ("float32", "contiguous", True, 1, 0, 0, 4, 8, 8, "contiguous"),  # no heads,
    ("float64", "contiguous", True, 1, 2, 2, 3, 0, 8, "contiguous"),  # and flash.py's D = 0
    ("float64", "zigzag", False, 1, 2, 1, 4, 8, 0, "contiguous"),  # and Dv = 0
]


def _empty(c: tuple[Any, ...]) -> bool:
    """B, Hq, L or Dv = 0: an empty output, nothing to compute or exchange."""
    return 0 in (c[3], c[4], c[6], c[8])


def case_id(c: tuple[Any, ...]) -> str:
    dtype, layout, causal, B, Hq, Hkv, L, D, Dv, mem = c
    return f"{dtype}-{layout}-{'causal' if causal else 'full'}-B{B}H{Hq}:{Hkv}L{L}D{D}:{Dv}-{mem}"


# Every case runs with the backend that functional.choose picks ("auto": the reference or flash
# backend on the CPU) and with the choice patched to say "flash" / "triton" (functional._auto
# replaced in the worker): the ring must run what the one choice says, float64 routing included.
CHOICES = ["auto", "flash", "triton"]
TRITON_OK = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
)


def result_key(c: tuple[Any, ...], choice: str) -> str:
    return f"{case_id(c)}@{choice}"


def expected_backend(c: tuple[Any, ...], choice: str, world: int) -> str:
    """What functional.choose says for one rank's inputs of case ``c`` (requires grad)."""
    from attnzero import functional

    dtype, _, _, B, Hq, Hkv, L, D, _, _ = c
    q = torch.empty(B, Hq, L, D, dtype=getattr(torch, dtype))
    k = torch.empty(B, Hkv, L, D, dtype=getattr(torch, dtype))
    if choice == "auto":
        return functional.choose("auto", q, k, needs_grad=True)
    if dtype == "float64":
        return "flash"  # functional routes triton to flash, and flash stays flash.py
    if choice == "flash" and kernel_built():
        return "cpu_kernel"  # flash on CPU is the compiled kernel where it is built
    return choice


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on 127.0.0.1 whatever the hostname says
    return env


# ---------------------------------------------------------------------------------------------
# The parent side: launch a group, collect results


def launch(world: int, tmp: Path) -> dict[int, dict[str, Any]]:
    """Run this file as ``world`` worker processes; returns each rank's saved results."""
    torch.manual_seed((1000 + world) ^ int(os.environ.get("ATTNZERO_TEST_SEED", "0")))  # as conftest.py
    inputs = []
    for c in CASES:
        dtype, _, _, B, Hq, Hkv, L, D, Dv, _ = c
        n = L * world
        x = getattr(torch, dtype)
        # Rounded to dtype once, so the golden sees exactly what the ranks see.
        q, k, v = (torch.randn(B, H, n, d).to(x).double() for H, d in ((Hq, D), (Hkv, D), (Hkv, Dv)))
        dout = torch.randn(B, Hq, n, Dv).to(x).double()
        inputs.append({"id": case_id(c), "case": list(c), "q": q, "k": k, "v": v, "dout": dout})
    choices = [c for c in CHOICES if c != "triton" or TRITON_OK]
    torch.save({"world": world, "port": _free_port(), "cases": inputs, "choices": choices}, tmp / "job.pt")
    results = {}
    for r, (code, log) in enumerate(run_ranks(__file__, tmp, world)):
        path = tmp / f"rank{r}.pt"
        assert path.exists(), f"rank {r} of {world} saved no results (exit {code}):\n{log[-4000:]}"
        results[r] = torch.load(path, weights_only=False)
        results[r]["exit"] = code
    return results


def run_ranks(script: str, tmp: Path, world: int) -> list[tuple[int, str]]:
    """Run ``python script tmp rank`` for every rank (the job waits in ``tmp``); returns each rank's
    exit status and output. A group that has not finished within LAUNCH_TIMEOUT_S is killed (a hang)."""
    cmd = [sys.executable, script, str(tmp)]
    procs = [
        subprocess.Popen([*cmd, str(r)], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    logs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise AssertionError(f"the {world}-process group did not finish in {LAUNCH_TIMEOUT_S} s (a hang)") from None
        logs.append(out)
    return [(p.returncode, log) for p, log in zip(procs, logs)]


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def group(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict]:
    world = int(request.param)
    tmp = tmp_path_factory.mktemp(f"ring{world}")
    start = time.monotonic()
    results = launch(world, tmp)
    print(f"\n{world}-process group ran in {time.monotonic() - start:.1f} s")
    for r, res in results.items():
        print(f"  rank {r}: peer raised -> {res['fault']['type']} after {res['fault']['seconds']} s; ", end="")
        print(f"peer died -> {res['death']['type']} after {res['death']['seconds']} s" if "death" in res else "died")
    return world, results


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_single_process(group: tuple[int, dict], case: tuple[Any, ...], choice: str) -> None:
    from conftest import absent, run_attention

    from attnzero.testing import assert_close_to_golden

    world, results = group
    if choice == "triton" and not TRITON_OK:
        absent("backend='triton' needs `pip install triton` and CUDA or TRITON_INTERPRET=1")
    res = results[0]["cases"][result_key(case, choice)]
    assert "error" not in res, res.get("error")
    # The ring ran the backend of the one choice (functional.choose), on every rank (none: an empty output).
    for r in range(world):
        used = results[r]["cases"][result_key(case, choice)]["traffic"]["backends"]
        assert used == ([] if _empty(case) else [expected_backend(case, choice, world)]), (r, used)
    job = torch.load(res["job"], weights_only=False)["cases"]
    inp = next(c for c in job if c["id"] == case_id(case))
    dtype, causal = getattr(torch, case[0]), case[2]
    q, k, v, dout = inp["q"], inp["k"], inp["v"], inp["dout"]
    gold = run_attention("reference", torch.float64, q, k, v, dout, causal=causal)
    ref = gold if dtype == torch.float64 else run_attention("reference", dtype, q, k, v, dout, causal=causal)
    assert res["out"].dtype == dtype and res["out"].shape == gold.out.shape
    assert_close_to_golden(res["out"], ref.out, gold.out, name="out")
    for n in ("q", "k", "v"):
        assert res[f"d{n}"].dtype == dtype
        assert_close_to_golden(res[f"d{n}"], ref.grads[n], gold.grads[n], kind="grad", name=f"d{n}")
    # Every rank computed the same gathered result (they gather one another's slices).
    for r in range(1, world):
        assert torch.equal(results[r]["cases"][result_key(case, choice)]["out"], res["out"])


def test_only_point_to_point_carries_keys_and_values(group: tuple[int, dict]) -> None:
    """K/V and dK/dV move by batch_isend_irecv, one block at a time; the only collective is the
    agreement on shapes (a few integers). Forward: W-1 exchanges of (k, v); backward: W-1 of (k, v)
    and W of (dk, dv), each op one local-sized tensor."""
    world, results = group
    for r in range(world):
        for c, choice in ((c, choice) for c in CASES for choice in CHOICES if choice != "triton" or TRITON_OK):
            cid, res = case_id(c), results[r]["cases"][result_key(c, choice)]
            log = res["traffic"]
            assert [name for name, _ in log["collective"]] == ["all_gather"], (cid, log["collective"])
            assert log["collective"][0][1] < 32, (cid, log["collective"])
            if _empty(c):  # an empty output: nothing moves
                assert log["p2p"] == [], (cid, log["p2p"])
                continue
            sends = [n for op, n in log["p2p"] if op == "isend"]
            recvs = [n for op, n in log["p2p"] if op == "irecv"]
            assert len(sends) == len(recvs) == 2 * (world - 1) + 2 * (world - 1) + 2 * world, (cid, log["p2p"])
            assert max(sends) <= res["kv_numel"], (cid, log["p2p"])


def test_transfers_are_posted_before_the_computation_they_overlap(group: tuple[int, dict]) -> None:
    """Each step posts the exchange of the next block, then computes with the block it holds. With
    causal=False every step computes one block, so the order of events is fixed."""
    world, results = group
    forward = ["post", "forward"] * (world - 1) + ["forward"]
    backward = [e for s in range(world) for e in (["post"] if s < world - 1 else []) + ["backward", "post"]]
    for r in range(world):
        for c, choice in ((c, choice) for c in CASES for choice in CHOICES if choice != "triton" or TRITON_OK):
            order = results[r]["cases"][result_key(c, choice)]["traffic"]["order"]
            if _empty(c):
                assert order == [], (case_id(c), order)
            elif not c[2]:
                assert order == forward + backward, (case_id(c), order)
            else:  # causal: some blocks are skipped, never the first exchange
                assert order[0] == "post" and order.count("post") == len(forward + backward) - 2 * world, order


def test_shard_gather_round_trip(group: tuple[int, dict]) -> None:
    world, results = group
    for r in range(world):
        assert results[r]["round_trip"] == {"contiguous": True, "zigzag": True}
        assert results[r]["zigzag_chunks"] == [r, 2 * world - 1 - r]


def test_mismatched_shapes_raise_on_every_rank(group: tuple[int, dict]) -> None:
    world, results = group
    for r in range(world):
        err = results[r]["mismatch"]
        assert err["type"] == "ValueError", err
        assert "expected the same L on every rank" in err["message"] and f"rank {world - 1}: " in err["message"]
        assert results[r]["after_mismatch_ok"], "the group should still work after a rejected call"


def test_peer_that_raises_makes_the_others_fail(group: tuple[int, dict]) -> None:
    """The last rank raises inside the backward and stays alive; the others must raise a clear
    RuntimeError once the fault group's timeout has passed (a hang would fail the launch)."""
    world, results = group
    faulty = world - 1
    assert results[faulty]["fault"]["type"] == "InjectedFault"
    for r in range(world - 1):
        err = results[r]["fault"]
        assert err["type"] == "RuntimeError", err
        assert f"ring_attention: rank {r} of {world}" in err["message"], err["message"]
        assert "timeout" in err["message"]


def test_peer_that_dies_makes_the_others_fail(group: tuple[int, dict]) -> None:
    """The last rank's process exits inside the backward; every other rank raises a clear
    RuntimeError (at once where the dead rank's sockets close, else after the timeout)."""
    world, results = group
    assert results[world - 1]["exit"] == 17, "the dying rank should have exited with status 17"
    for r in range(world - 1):
        assert results[r]["exit"] == 0
        err = results[r]["death"]
        assert err["type"] == "RuntimeError", err
        assert f"ring_attention: rank {r} of {world}" in err["message"], err["message"]


# ---------------------------------------------------------------------------------------------
# Validation (no process group needed for argument errors, one process for the rest)


def test_validation_messages() -> None:
    import attnzero as az

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        az.distributed.ring_attention(q, q, q)
    with pytest.raises(ValueError, match=r"k: expected .* \(length 4\), got length 3"):
        az.distributed.ring_attention(q, q[:, :, :3], q[:, :, :3])
    with pytest.raises(ValueError, match="layout: expected one of 'contiguous', 'zigzag', got 'ring'"):
        az.distributed.ring_attention(q, q, q, layout="ring")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="even length, got 3"):
        az.distributed.ring_attention(q[:, :, :3], q[:, :, :3], q[:, :, :3], layout="zigzag")
    with pytest.raises(TypeError, match="causal: expected a bool"):
        az.distributed.ring_attention(q, q, q, causal=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k: expected a number of key/value heads"):
        az.distributed.ring_attention(q, q[:, :1].expand(1, 3, 4, 8), q[:, :1].expand(1, 3, 4, 8))


def test_single_process_group(tmp_path: Path) -> None:
    """A ring of one (W = 1) is plain attention; shard/gather are identities; bad shard lengths
    are reported."""
    import torch.distributed as dist

    import attnzero as az

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        q = torch.randn(2, 4, 9, 8, dtype=torch.float64)  # GQA: 4 query heads, 2 key/value heads
        k, v = torch.randn(2, 2, 9, 8, dtype=torch.float64), torch.randn(2, 2, 9, 8, dtype=torch.float64)
        for t in (q, k, v):
            t.requires_grad_(True)
        out = az.distributed.ring_attention(q, k, v, causal=True)
        want = az.attention(q, k, v, causal=True, backend="reference")
        torch.testing.assert_close(out, want)
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), g)
        exp = torch.autograd.grad(want, (q, k, v), g)
        for a, b in zip(got, exp):
            torch.testing.assert_close(a, b)
        # No second derivative through the ring: refused when taken, not a gradient with the penalty's
        # share silently missing; one that does not pass through it (a later layer's) runs.
        out = az.distributed.ring_attention(q, k, v, causal=True)
        (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
        with pytest.raises(RuntimeError, match="ring_attention: no second derivative through it"):
            torch.autograd.grad(dq.square().sum(), q)
        w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
        y = az.distributed.ring_attention(q, k, v, causal=True) @ w  # (2, 4, 9, 8) @ (8, 8)
        (dq,) = torch.autograd.grad(y.square().sum(), q, create_graph=True)  # dO depends on w
        with pytest.raises(RuntimeError, match="ring_attention: no second derivative through it"):
            torch.autograd.grad(dq.square().sum(), w, allow_unused=True)
        penalties = []
        for fn in (az.distributed.ring_attention, az.attention):
            layer = lambda x, fn=fn: fn(x, k, v, causal=True)  # noqa: E731
            y = torch.utils.checkpoint.checkpoint(layer, q, use_reentrant=False) @ w
            _, dw = torch.autograd.grad(y.square().sum(), (q, w), create_graph=True)  # (the ring's backward runs)
            penalties.append(torch.autograd.grad(dw.square().sum(), (q, w)))
        for a, b in zip(*penalties):
            torch.testing.assert_close(a, b)
        even = q[:, :, :8]
        assert az.distributed.gather(az.distributed.shard(even, layout="zigzag"), layout="zigzag").equal(even)
        with pytest.raises(ValueError, match=r"x: expected a length .* divisible by 2 .*got 9"):
            az.distributed.shard(q, layout="zigzag")
        with pytest.raises(TypeError, match=r"group: expected None or a torch\.distributed ProcessGroup"):
            az.distributed.ring_attention(q, k, v, group="world")
    finally:
        dist.destroy_process_group()


def test_ring_runs_the_backend_of_the_one_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In one process (W = 1): each ring call asks functional.choose once, as az.attention would
    ("auto"), and runs that backend's forward and backward — flash on the CPU, for a tiny slice and
    a longer one; a patched choice (the reference) is honoured."""
    import torch.distributed as dist

    import attnzero as az
    from attnzero import functional, ops

    chosen: list[str] = []
    used: list[str] = []
    real_choose = functional.choose

    def choose(name: str, q: torch.Tensor, k: torch.Tensor, *, needs_grad: bool, v: Any = None) -> str:
        assert v is not None, "the ring should pass v, as attention does (Dv takes part in the choice)"
        chosen.append(real_choose(name, q, k, needs_grad=needs_grad, v=v))
        return chosen[-1]

    def spy(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            used.append(name)
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(functional, "choose", choose)
    for name, be in list(ops.BACKENDS.items()):
        wrapped = be._replace(forward=spy(name, be.forward), backward=spy(name, be.backward))
        monkeypatch.setitem(ops.BACKENDS, name, wrapped)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for L, want in ((9, "flash"), (200, "flash")):
            q, k, v = (torch.randn(1, 2, L, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
            chosen.clear()
            used.clear()
            out = az.distributed.ring_attention(q, k, v, causal=True)
            g = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            assert chosen == [want] and set(used) == {want}, (L, chosen, used)
            ref = az.attention(q, k, v, causal=True, backend="reference")
            torch.testing.assert_close(out, ref)
            for a, b in zip(g, torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))):
                torch.testing.assert_close(a, b)
        monkeypatch.setattr(functional, "choose", lambda name, q, k, *, needs_grad, v=None: "reference")
        used.clear()
        q = torch.randn(1, 2, 9, 8, dtype=torch.float64, requires_grad=True)
        az.distributed.ring_attention(q, q, q, causal=True).sum().backward()
        assert set(used) == {"reference"}
    finally:
        dist.destroy_process_group()


def test_example_runs_under_torchrun() -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.fail(f"torchrun is missing next to {sys.executable} (it comes with torch)")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           str(ROOT / "examples" / "ring_attention.py"), "--length", "512", "--heads", "2"]  # fmt: skip
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "matches one process" in done.stdout


# ---------------------------------------------------------------------------------------------
# The worker side


class InjectedFault(Exception):
    pass


def _error(e: BaseException) -> dict[str, str]:
    return {"type": type(e).__name__, "message": str(e)}


class Traffic:
    """Records what torch.distributed carries while active: for each collective the number of
    elements it sends, for each point-to-point op its direction and number of elements."""

    COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce", "reduce_scatter",
                   "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "scatter", "gather")  # fmt: skip

    def __init__(self) -> None:
        self.log: dict[str, list[Any]] = {"collective": [], "p2p": [], "order": [], "backends": []}
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> Traffic:
        import torch.distributed as dist

        def spy(name: str, real: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                sent = args[1] if name == "all_gather" else args[0]
                numel = sum(t.numel() for t in sent) if isinstance(sent, list) else sent.numel()
                self.log["collective"].append((name, numel))
                return real(*args, **kwargs)

            return call

        def batch(ops: list[Any]) -> Any:
            self.log["p2p"] += [(op.op.__name__, op.tensor.numel()) for op in ops]
            self.log["order"].append("post")
            return self.saved["batch_isend_irecv"](ops)

        from attnzero import ops

        def compute(step: str, backend: str, real: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                self.log["order"].append(step)
                if backend not in self.log["backends"]:
                    self.log["backends"].append(backend)
                return real(*args, **kwargs)

            return call

        self.backends = dict(ops.BACKENDS)
        for name, be in self.backends.items():
            ops.BACKENDS[name] = be._replace(
                forward=compute("forward", name, be.forward), backward=compute("backward", name, be.backward)
            )

        for name in (*self.COLLECTIVES, "batch_isend_irecv", "send", "recv", "isend", "irecv"):
            self.saved[name] = getattr(dist, name)
            if name in self.COLLECTIVES:
                setattr(dist, name, spy(name, self.saved[name]))
        dist.batch_isend_irecv = batch
        for name in ("send", "recv"):  # the ring uses batch_isend_irecv only
            setattr(dist, name, spy(name, self.saved[name]))
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        from attnzero import ops

        for name, real in self.saved.items():
            setattr(dist, name, real)
        ops.BACKENDS.update(self.backends)


def worker(tmp: Path, rank: int) -> None:
    import torch.distributed as dist

    import attnzero as az
    from attnzero import functional, ops

    torch.set_num_threads(1)
    job = torch.load(tmp / "job.pt", weights_only=False)
    world = job["world"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank, world_size=world,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )  # fmt: skip
    D = az.distributed
    saved: dict[str, Any] = {"cases": {}}

    # 1. Every case and choice: shard the whole-sequence inputs, run the ring forward and backward,
    #    gather. A choice other than "auto" patches what functional._auto answers.
    real_auto = functional._auto
    for inp, choice in ((inp, choice) for inp in job["cases"] for choice in job["choices"]):
        functional._auto = real_auto if choice == "auto" else (lambda q, k, choice=choice: choice)  # type: ignore[misc]
        dtype_name, layout, causal, *_, mem = inp["case"]
        dtype = getattr(torch, dtype_name)

        def local(x: torch.Tensor, layout: str = layout, mem: str = mem, dtype: torch.dtype = dtype) -> torch.Tensor:
            part = D.shard(x.to(dtype), layout=layout)  # (B, H, L, d)
            if mem == "transpose":  # stored as (B, L, H, d), viewed as (B, H, L, d)
                part = part.transpose(1, 2).contiguous().transpose(1, 2)
            return part.detach().requires_grad_(True)

        q, k, v = local(inp["q"]), local(inp["k"]), local(inp["v"])
        dout = D.shard(inp["dout"].to(dtype), layout=layout)
        try:
            with Traffic() as traffic:
                out = D.ring_attention(q, k, v, causal=causal, layout=layout)
                out.backward(dout)
            assert q.grad is not None and k.grad is not None and v.grad is not None
            saved["cases"][f"{inp['id']}@{choice}"] = {
                "job": str(tmp / "job.pt"),
                "out": D.gather(out.detach(), layout=layout),
                "dq": D.gather(q.grad, layout=layout),
                "dk": D.gather(k.grad, layout=layout),
                "dv": D.gather(v.grad, layout=layout),
                "traffic": traffic.log,
                "kv_numel": max(k.numel(), v.numel()),
            }
        except Exception as e:  # recorded, and the test of this case shows it
            saved["cases"][f"{inp['id']}@{choice}"] = {"error": repr(e)}
    functional._auto = real_auto

    # 2. shard / gather are inverses; zigzag puts chunks r and 2W-1-r on rank r.
    pos = torch.arange(2 * world * 3).view(1, 1, -1, 1).expand(2, 1, -1, 2)  # (2, 1, 6W, 2)
    saved["round_trip"] = {
        lay: bool(D.gather(D.shard(pos, layout=lay), layout=lay).equal(pos)) for lay in ("contiguous", "zigzag")
    }
    saved["zigzag_chunks"] = (D.shard(pos, layout="zigzag")[0, 0, ::3, 0] // 3).tolist()

    # 3. Shapes that differ across ranks: every rank raises ValueError, and the group survives.
    L = 4 if rank < world - 1 else 5
    x = torch.randn(1, 2, L, 8)
    try:
        D.ring_attention(x, x, x)
        saved["mismatch"] = {"type": "none", "message": ""}
    except Exception as e:
        saved["mismatch"] = _error(e)
    y = torch.randn(1, 2, 4, 8)
    saved["after_mismatch_ok"] = bool(torch.isfinite(D.ring_attention(y, y, y, causal=True)).all())

    # 4. A fault: on a group with a short timeout, the last rank raises inside the backward and
    #    stays alive (its process would otherwise close its sockets, which ends the wait at once).
    # Both fault groups are made now, while the ranks are in step (making one connects within its timeout).
    dist.barrier()
    fault_group = dist.new_group(timeout=timedelta(seconds=FAULT_TIMEOUT_S), backend="gloo")
    death_group = dist.new_group(timeout=timedelta(seconds=FAULT_TIMEOUT_S), backend="gloo")
    if rank == world - 1:

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise InjectedFault("this rank fails in the middle of the backward")

        for name, be in ops.BACKENDS.items():  # whichever backend the ring was given
            ops.BACKENDS[name] = be._replace(backward=broken)
    z = torch.randn(1, 2, 6, 8, requires_grad=True)
    start = time.monotonic()
    try:
        D.ring_attention(z, z, z, causal=True, group=fault_group, layout="zigzag").sum().backward()
        saved["fault"] = {"type": "none", "message": ""}
    except Exception as e:
        saved["fault"] = _error(e)
    saved["fault"]["seconds"] = f"{time.monotonic() - start:.1f}"

    # 5. A rank that dies: the last rank's process exits in the middle of the backward (having
    #    saved its results first); the others must raise, whether its sockets close or not.
    dist.barrier()  # on the default group: every rank has finished scenario 4
    if rank == world - 1:
        torch.save(saved, tmp / f"rank{rank}.pt")

        def dying(*args: Any, **kwargs: Any) -> Any:
            os._exit(17)

        for name, be in ops.BACKENDS.items():
            ops.BACKENDS[name] = be._replace(backward=dying)
    start = time.monotonic()
    try:
        D.ring_attention(z, z, z, causal=True, group=death_group).sum().backward()
        saved["death"] = {"type": "none", "message": ""}
    except Exception as e:
        saved["death"] = _error(e)
    saved["death"]["seconds"] = f"{time.monotonic() - start:.1f}"
    torch.save(saved, tmp / f"rank{rank}.pt")
    # Stay alive (as a rank stuck elsewhere would) until every other rank has saved its results.
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while time.monotonic() < deadline and not all((tmp / f"rank{r}.pt").exists() for r in range(world)):
        time.sleep(0.1)
    print(json.dumps({"rank": rank, "fault": saved["fault"], "death": saved["death"]}), flush=True)
    os._exit(0)  # the fault group is broken: skip the shutdown handshake


if __name__ == "__main__":
    worker(Path(sys.argv[1]), int(sys.argv[2]))
