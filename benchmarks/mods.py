"""What programmable attention costs (issue 23's numbers), CPU float32, B = 1, H = 8, L = 2048, D = 64,
each a ratio of medians in one interleaved run, printed as markdown tables for docs/benchmarks.md:

* ``cost``: a cheap score_mod (ALiBi from slopes, a relative-bias table lookup, tanh softcap written
  as a mod) against the same call without it (``auto``: the compiled kernel, the mod as generated
  C++), forward and forward + backward — beside the built-in that computes the same (``bias=alibi``,
  ``softcap=``), the mod on flash.py (where the kernel cannot take it), and the mod with attention
  sinks (kernel and flash.py; before, the reference's formula, also timed);
* ``masks``: masks from a mask_mod (``az.masks.from_mod``): prefix-LM against the causal call,
  documents from a mod against ``az.masks.document``;
* ``training``: what a user who trains would pick instead — torch's SDPA with the equivalent dense
  bias or mask (built in the step, from the same learnable slopes / table) — forward + backward
  time and the extra peak memory of one step (each in a fresh process);
* ``flex``: inference against ``torch.compile(flex_attention)``, a row per attention-gym mask and
  score mod implemented here (it compiles for a minute or two).

    .venv/bin/python benchmarks/mods.py [--only cost masks training flex] [--repeats 5] [--length 2048]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from harness import ms, table

import attnzero as az
from attnzero import functional
from attnzero.bench import machine, time_interleaved

Run = Callable[[], Any]
B, H, D = 1, 8, 64


def _mods(L: int) -> dict[str, Any]:
    """The mods every section uses, on fixed tensors (slopes, a relative table)."""
    slopes = az.masks.alibi_slopes(H)
    rel = torch.randn(H, 2 * L - 1) * 0.1

    def alibi(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s - slopes[h] * (i - j).abs()

    def relative(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s + rel[h, i - j + L - 1]

    def capped(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return 30.0 * torch.tanh(s / 30.0)

    sinks = torch.randn(H)  # gpt-oss's attention sinks, one logit per head
    return {"slopes": slopes, "rel": rel, "alibi": alibi, "relative": relative, "capped": capped, "sinks": sinks}


def _on_flash(fn: Run) -> Run:
    """``fn`` with the compiled kernel declined (flash.py runs the mod)."""

    def run() -> Any:
        real = functional._takes_kernel
        functional._takes_kernel = lambda q: False  # type: ignore[assignment]
        try:
            return fn()
        finally:
            functional._takes_kernel = real

    return run


def cost(L: int, repeats: int) -> Iterator[str]:
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    m = _mods(L)
    alibi_bias = az.masks.alibi(H, L)  # (1, H, L, L): what the built-in needs materialised

    def fwd(**kw: Any) -> Run:
        return lambda: az.attention(q, k, v, causal=True, **kw)

    def fwd_bwd(**kw: Any) -> Run:
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        return lambda: az.attention(*xs, causal=True, **kw).sum().backward()  # type: ignore[union-attr]

    yield f"score_mod cost, causal, B{B} H{H} L{L} D{D} float32 (× the plain call's time; above 1: slower)"
    yield ""
    cells = []
    for label, make in (("forward", fwd), ("forward + backward", fwd_bwd)):
        runs = {
            "plain (kernel)": make(),
            "ALiBi mod (kernel, generated C++)": make(score_mod=m["alibi"]),
            "relative-bias table mod (kernel)": make(score_mod=m["relative"]),
            "tanh softcap mod (kernel)": make(score_mod=m["capped"]),
            "ALiBi as a dense bias (kernel)": make(bias=alibi_bias),
            "softcap built-in (kernel)": make(softcap=30.0),
            "ALiBi mod on flash.py": _on_flash(make(score_mod=m["alibi"])),
            "ALiBi mod with sinks (kernel)": make(score_mod=m["alibi"], sinks=m["sinks"]),
            "ALiBi mod with sinks on flash.py": _on_flash(make(score_mod=m["alibi"], sinks=m["sinks"])),
            "ALiBi mod with sinks, the reference's formula": make(score_mod=m["alibi"], sinks=m["sinks"],
                                                                  backend="reference"),
        }
        t = time_interleaved(runs, repeats)
        base = t["plain (kernel)"]
        cells += [[label, name, ms(sec), f"{sec / base:.2f}"] for name, sec in t.items()]
    yield from table(["pass", "case", "ms", "× plain"], iter(cells))


def masks(L: int, repeats: int) -> Iterator[str]:
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    prefix = L // 4

    def prefix_lm(b, h, i, j):  # type: ignore[no-untyped-def]
        return (j < prefix) | (j <= i)

    docs_ids = torch.arange(L) // (L // 8)

    def documents(b, h, i, j):  # type: ignore[no-untyped-def]
        return docs_ids[i] == docs_ids[j]

    from_prefix = az.masks.from_mod(prefix_lm, 1, 1, L, L)
    qp, kp, vp = (t[:, :, :prefix].contiguous() for t in (q, k, v))
    from_docs = az.masks.from_mod(documents, 1, 1, L, L)
    docs = az.masks.document(docs_ids[None])
    dense_prefix = from_prefix.to_tensor()
    t = time_interleaved(
        {
            "causal": lambda: az.attention(q, k, v, causal=True),
            "prefix-LM from_mod": lambda: az.attention(q, k, v, mask=from_prefix),
            "prefix-LM dense": lambda: az.attention(q, k, v, mask=dense_prefix),
            "documents built-in": lambda: az.attention(q, k, v, mask=docs),
            "documents from_mod": lambda: az.attention(q, k, v, mask=from_docs),
            "torch SDPA, prefix-LM dense": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_prefix),
            # the prefix-LM's kept blocks beyond causal's: the prefix square's upper half (full − causal on it)
            "prefix square, full": lambda: az.attention(qp, kp, vp),
            "prefix square, causal": lambda: az.attention(qp, kp, vp, causal=True),
        },
        repeats,
    )
    kept = t["causal"] + t["prefix square, full"] - t["prefix square, causal"]
    share = prefix * prefix / 2 / (L * L / 2)
    yield f"masks from mods, forward, B{B} H{H} L{L} D{D} (the prefix adds {share:.0%} of causal's pairs)"
    yield ""
    cells = [[name, ms(sec), f"{sec / t['causal']:.2f}"] for name, sec in t.items()]
    cells.append(["prefix-LM from_mod ÷ its kept blocks (causal + the prefix square's upper half)", "",
                  f"{t['prefix-LM from_mod'] / kept:.2f}"])  # fmt: skip
    cells.append(["documents from_mod ÷ built-in", "", f"{t['documents from_mod'] / t['documents built-in']:.2f}"])
    yield from table(["case", "ms", "× causal"], iter(cells))


# ---------------------------------------------------------------------------------------------
# Training against torch's SDPA with the equivalent dense bias / mask


def _training_case(name: str, L: int) -> Run:
    """One training step's attention (forward + backward) of case ``name`` at length L, with
    learnable slopes / table where the case has them."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    slopes = az.masks.alibi_slopes(H).requires_grad_()
    rel = (torch.randn(H, 2 * L - 1) * 0.1).requires_grad_()
    dist = (torch.arange(L).view(-1, 1) - torch.arange(L).view(1, -1)).abs()  # (L, L) |i - j|
    offs = torch.arange(L).view(-1, 1) - torch.arange(L).view(1, -1) + L - 1  # (L, L) i - j + L - 1
    prefix = L // 4
    prefix_mask = az.masks.from_mod(lambda b, h, i, j: (j < prefix) | (j <= i), 1, 1, L, L)
    dense_prefix = prefix_mask.to_tensor()

    def alibi(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s - slopes[h] * (i - j).abs()

    def relative(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s + rel[h, i - j + L - 1]

    causal_keep = torch.ones(L, L, dtype=torch.bool).tril()
    neg = torch.tensor(float("-inf"))
    steps: dict[str, Run] = {
        "alibi/attnzero": lambda: az.attention(q, k, v, causal=True, score_mod=alibi),
        # torch: the bias from the learnable slopes, causal folded in (SDPA takes a mask or is_causal, not both)
        "alibi/torch": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.where(causal_keep, -slopes.view(1, H, 1, 1) * dist, neg)
        ),
        "relative/attnzero": lambda: az.attention(q, k, v, causal=True, score_mod=relative),
        "relative/torch": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.where(causal_keep, rel[:, offs].unsqueeze(0), neg)
        ),
        "prefix/attnzero": lambda: az.attention(q, k, v, mask=prefix_mask),
        "prefix/torch": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense_prefix),
    }
    step = steps[name]

    def run() -> None:
        for t in (q, k, v, slopes, rel):
            t.grad = None
        out = step()
        out.sum().backward()

    return run


def _memory(name: str, L: int) -> float:
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[3]); import mods; from attnzero.bench import extra_peak_mb; "
        "print(extra_peak_mb(mods._training_case(sys.argv[1], int(sys.argv[2])), "
        "warmup=mods._training_case(sys.argv[1], 256)))"
    )
    here = str(Path(__file__).parent)
    res = subprocess.run([sys.executable, "-c", code, name, str(L), here], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"memory of {name}: {res.stderr[-2000:]}")
    return float(res.stdout.strip().splitlines()[-1])


def training(L: int, repeats: int) -> Iterator[str]:
    yield (
        f"training (forward + backward, learnable slopes / table), B{B} H{H} L{L} D{D} float32: attnzero against "
        "torch SDPA with the equivalent dense bias or mask; extra peak memory of one step, fresh process each"
    )
    yield ""

    def cells() -> Iterator[list[str]]:
        for case in ("alibi", "relative", "prefix"):
            t = time_interleaved(
                {"attnzero": _training_case(f"{case}/attnzero", L), "torch": _training_case(f"{case}/torch", L)},
                repeats,
            )
            mem = {impl: _memory(f"{case}/{impl}", L) for impl in ("attnzero", "torch")}
            yield [case, ms(t["attnzero"]), ms(t["torch"]), f"{t['attnzero'] / t['torch']:.2f}",
                   f"{mem['attnzero']:.0f}", f"{mem['torch']:.0f}"]  # fmt: skip

    yield from table(["case", "attnzero ms", "torch ms", "attnzero ÷ torch", "attnzero MB", "torch MB"], cells())


# ---------------------------------------------------------------------------------------------
# Inference against compiled FlexAttention, attention-gym's mods


def _gym(L: int) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """attention-gym's masks and score mods as (attnzero's keyword arguments, Flex's: the mod
    functions, made into a block mask by the caller)."""
    m = _mods(L)
    slopes = m["slopes"]
    prefix, window, dilation = L // 4, 256, 2
    ids = torch.arange(L) // (L // 8)
    side = int(L**0.5)  # NATTEN: the sequence as a side × side image, a 2-D neighbourhood of radius 3

    def causal(b, h, i, j):  # type: ignore[no-untyped-def]
        return j <= i

    def sliding(b, h, i, j):  # type: ignore[no-untyped-def]
        return (j <= i) & (i - j <= window)

    def prefix_lm(b, h, i, j):  # type: ignore[no-untyped-def]
        return (j < prefix) | (j <= i)

    def document(b, h, i, j):  # type: ignore[no-untyped-def]
        return (ids[i] == ids[j]) & (j <= i)

    def dilated(b, h, i, j):  # type: ignore[no-untyped-def]
        return (j <= i) & (i - j <= window * dilation) & ((i - j) % dilation == 0)

    def natten(b, h, i, j):  # type: ignore[no-untyped-def]
        return ((i // side - j // side).abs() <= 3) & ((i % side - j % side).abs() <= 3)

    def rel_pos(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s + (i - j) * 0.01

    def alibi(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return s + slopes[h] * (j - i)

    def mask(fn: Any) -> dict[str, Any]:
        return {"mask": az.masks.from_mod(fn, 1, 1, L, L)}

    return {
        "causal": ({"causal": True}, {"mask_mod": causal}),
        "sliding window 256": ({"window": window}, {"mask_mod": sliding}),
        "prefix-LM (L/4)": (mask(prefix_lm), {"mask_mod": prefix_lm}),
        "8 documents, causal": (mask(document), {"mask_mod": document}),
        "dilated sliding window": (mask(dilated), {"mask_mod": dilated}),
        "NATTEN 2-D, radius 3": (mask(natten), {"mask_mod": natten}),
        "ALiBi, causal": ({"causal": True, "score_mod": alibi}, {"mask_mod": causal, "score_mod": alibi}),
        "relative position, causal": ({"causal": True, "score_mod": rel_pos},
                                      {"mask_mod": causal, "score_mod": rel_pos}),
        "tanh softcap 30, causal": ({"causal": True, "score_mod": m["capped"]},
                                    {"mask_mod": causal, "score_mod": m["capped"]}),
        "relative-bias table, causal": ({"causal": True, "score_mod": m["relative"]},
                                        {"mask_mod": causal, "score_mod": m["relative"]}),
    }  # fmt: skip


def flex(L: int, repeats: int) -> Iterator[str]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.cache_size_limit = 1024  # every row recompiles: stay compiled (see flex_table.py)
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    compiled = torch.compile(flex_attention)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    yield f"vs torch.compile(flex_attention), attention-gym's mods, forward, inference, B{B} H{H} L{L} D{D} float32"
    yield ""

    def cells() -> Iterator[list[str]]:
        for name, (ours, theirs) in _gym(L).items():
            bm = create_block_mask(theirs["mask_mod"], None, None, L, L, device="cpu")
            mine: Run = lambda o=ours: az.attention(q, k, v, **o)  # noqa: E731
            other: Run = lambda t=theirs, bm=bm: compiled(q, k, v, score_mod=t.get("score_mod"), block_mask=bm)  # noqa: E731
            with torch.no_grad():
                try:
                    want = other()
                except Exception as e:  # torch's compiled Flex fails on some mods on CPU: say so
                    yield [name, ms(time_interleaved({"a": mine}, repeats)["a"]), f"fails: {type(e).__name__}", ""]
                    continue
                err = float((mine() - want).abs().max())
                if not err < 1e-3:
                    raise AssertionError(f"{name}: attnzero and Flex differ by {err:.3g}")
                t = time_interleaved({"attnzero": mine, "flex": other}, repeats)
            yield [name, ms(t["attnzero"]), ms(t["flex"]), f"{t['attnzero'] / t['flex']:.2f}"]

    yield from table(["case", "attnzero ms", "Flex ms", "attnzero ÷ Flex"], cells())


SECTIONS = {"cost": cost, "masks": masks, "training": training, "flex": flex}


def main() -> None:
    ap = argparse.ArgumentParser(description="What programmable attention costs, as markdown tables.")
    ap.add_argument("--only", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--length", type=int, default=2048)
    args = ap.parse_args()
    print(f"machine: {json.dumps(machine())}")
    for name in args.only:
        print()
        for line in SECTIONS[name](args.length, args.repeats):
            print(line, flush=True)


if __name__ == "__main__":
    main()
