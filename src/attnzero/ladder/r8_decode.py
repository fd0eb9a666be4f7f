"""Rung 8 — decoding: the KV cache, and split-KV with the log-sum-exp merge.

A decoder produces one token at a time; its keys and values never change once computed, so they go
into ``az.KVCache`` and each step attends its single new query to everything stored. The loop
below gives, row by row, exactly the causal attention of the whole sequence (checked in float64
against rung 5's flash backend).

One query against thousands of keys leaves a GPU idle: one program per (batch, kv head) is too few.
The split-KV kernels (``kernels/decode.py``) cut the keys into S splits, run one program per split
(``split_kernel``), each writing a partial ``(O_s, lse_s)`` normalised over its own keys, and merge
them (``merge_kernel``): ``lse = log Σ_s exp(lse_s)``, ``O = Σ_s exp(lse_s − lse) O_s``. While an
``attnzero.trace`` recording is open the launcher notes one "decode.split" event per program with
its key range, the key blocks it visited and copies of the partials it wrote; the picture and the
plain-PyTorch merge below are computed from those recorded partials.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import attnzero as az

from .. import testing, trace
from .common import Printer, Result, attend, figure, median_time
from .r7_triton import RERUN, not_run, rerun_interpreted, triton_backend

TITLE = "Decoding: the KV cache, and split-KV with the lse merge"


def decode_loop(q: Tensor, k: Tensor, v: Tensor, prompt: int) -> Tensor:
    """Causal attention of a whole sequence computed as a decoder does: the prompt at once, then one
    token per step, each step's keys and values appended to a KV cache. q (B, Hq, N, D), k and v
    (B, Hkv, N, D) are every token's projections (a prompt of 0: every token one by one); returns
    the outputs (B, Hq, N, D)."""
    B, Hkv, N, D = k.shape
    cache = az.KVCache(B, max_len=N, num_kv_heads=Hkv, head_dim=D, dtype=k.dtype)
    outs = []
    if prompt > 0:  # prefill: the prompt's keys and values go in, its queries attend causally among themselves
        k_all, v_all = cache.update(k[:, :, :prompt], v[:, :, :prompt])  # (B, Hkv, prompt, D) views
        outs.append(attend(q[:, :, :prompt], k_all, v_all, causal=True, backend="flash"))  # (B, Hq, prompt, D)
    for t in range(prompt, N):
        # one new token: append its key/value, then its one query sees every stored key
        k_all, v_all = cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1])  # (B, Hkv, t + 1, D)
        outs.append(attend(q[:, :, t : t + 1], k_all, v_all, causal=True, backend="flash"))  # (B, Hq, 1, D)
    return torch.cat(outs, dim=2)  # (B, Hq, N, D)


def merge_splits(out_s: Tensor, lse_s: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The split-KV merge in plain PyTorch: partial outputs ``out_s`` (S, ..., Dv) and their
    log-sum-exps ``lse_s`` (S, ...), each over its own keys → ``(O, lse, weights)`` over all keys.
    A split that saw no key has lse_s = -inf and weight 0; a row no split saw, O = 0 and lse = -inf."""
    lse = torch.logsumexp(lse_s, dim=0)  # lse = log Σ_s exp(lse_s): (...)
    safe = lse.masked_fill(lse == float("-inf"), 0.0)  # never exp(-inf - (-inf)): a row without keys
    weights = torch.exp(lse_s - safe)  # w_s = exp(lse_s − lse), Σ_s w_s = 1 (0 without keys): (S, ...)
    out = (weights.unsqueeze(-1) * out_s).sum(dim=0)  # O = Σ_s w_s O_s: (..., Dv)
    return out, lse, weights


def recorded_partials(events: list[trace.Event], batch: int, kv_head: int) -> dict[str, Any]:
    """The partials of one (batch, kv head) as the kernel wrote them (from the "decode.split"
    events), stacked by split: out_s (S, G, Lq, Dv), lse_s (S, G, Lq), the merged out and lse the
    merge kernel produced, and each split's keys and visited key blocks."""
    evs = sorted((e for e in events if e["batch"] == batch and e["kv_head"] == kv_head), key=lambda e: e["split"])
    return {  # tensors on the CPU
        "out_s": torch.stack([e["out_s"] for e in evs]).cpu(),  # (S, G, Lq, Dv): each split's partial output
        "lse_s": torch.stack([e["lse_s"] for e in evs]).cpu(),  # (S, G, Lq): each split's lse over its keys
        "out": evs[0]["out"].cpu(),  # (G, Lq, Dv): what merge_kernel wrote (the same in every event)
        "lse": evs[0]["lse"].cpu(),  # (G, Lq)
        "keys": [e["keys"] for e in evs],  # [(lo, hi)] per split
        "key_blocks": [e["key_blocks"] for e in evs],  # [[nb, ...]] per split: the blocks it visited
        "block_n": evs[0]["block_n"],
        "heads": evs[0]["heads"],  # the G query heads of this kv head
    }


def run(out: Path | None, *, small: bool = False, say: Printer) -> Result:
    tb, why = triton_backend()  # step 2 runs the Triton decode kernels (interpreted without a GPU)
    if tb is None:
        return rerun_interpreted(8, TITLE, out, small, say) if why == RERUN else not_run(8, TITLE, why, say)
    B, Hq, Hkv, D = 1, 4, 2, 16
    N, steps, splits = (100, 6, 4) if small else (300, 12, 4)
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(B, h, N, D, generator=gen, dtype=torch.float64) for h in (Hq, Hkv, Hkv))

    # 1. The KV cache: a prompt, then one token per step
    say(f"sequence of N={N} tokens: q (B={B}, Hq={Hq}, N, D={D}), k, v (B, Hkv={Hkv}, N, D), float64")
    say(f"1. KV cache: prefill {N - steps} tokens, then {steps} steps of one token")
    looped = decode_loop(q, k, v, N - steps)
    full = attend(q, k, v, causal=True, backend="flash")  # rung 5 on the whole sequence
    err_cache = testing.max_error(looped, full)
    cache_bound = testing.floor(torch.float64, testing.magnitude(full))
    cache_ok = err_cache <= cache_bound
    say(f"   max |decode loop - causal attention of the whole sequence| = {err_cache:.2e} "
        f"(bound {cache_bound:.0e}) {'OK' if cache_ok else 'FAILED'}")

    # 2. Split-KV: the last step's query against the whole cache, by the Triton decode kernels
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q1, k32, v32 = (t.to(torch.float32).to(device) for t in (q[:, :, -1:], k, v))  # float32: (B, Hq, 1, D), ...
    kw: dict[str, Any] = {"mask": None, "bias": None, "causal": True, "window": None, "scale": 1 / math.sqrt(D),
                          "dropout_p": 0.0, "dropout_seed": 0}
    say(f"2. split-KV: the last query (B, Hq, 1, D) against the {N} cached keys, float32, "
        f"{splits} splits asked (triton_backend.decode_splits)")
    with tb.decode_splits(splits), trace.recording() as rec:
        got, _ = tb.decode(q1, k32, v32, **kw)  # split_kernel + merge_kernel
    events = rec.of("decode.split")
    golden = full[:, :, -1:]  # the last row of rung 5's causal attention, float64
    ref32 = attend(*(t.cpu() for t in (q1, k32, v32)), causal=True, backend="reference")
    verdict = testing.verdict(got.cpu(), ref32, golden)
    S = events[0]["splits"]
    rec0 = recorded_partials(events, 0, 0)
    say(f"   {len(events)} programs = {S} splits × {B * Hkv} (batch, kv head) pairs, each holding its "
        f"{Hq // Hkv} query heads' rows")
    for s, ((lo, hi), blocks) in enumerate(zip(rec0["keys"], rec0["key_blocks"])):
        w = merge_splits(rec0["out_s"], rec0["lse_s"])[2][s, :, 0]  # (G,)
        say(f"   split {s}: keys [{lo:3d}, {hi:3d}), key blocks {blocks[0]}..{blocks[-1]} visited; "
            f"lse_s = {', '.join(f'{x:.3f}' for x in rec0['lse_s'][s, :, 0].tolist())}; "
            f"weight exp(lse_s - lse) = {', '.join(f'{x:.3f}' for x in w.tolist())}")
    # the merge again, in PyTorch, from the partials the kernel wrote
    merge_err = 0.0
    for b in range(B):
        for hk in range(Hkv):
            r = recorded_partials(events, b, hk)
            o, lse, _ = merge_splits(r["out_s"], r["lse_s"])
            merge_err = max(merge_err, testing.max_error(o, got[b, r["heads"]].cpu()),
                            testing.max_error(lse, r["lse"]))
    # a few float32 roundings of the larger of what is compared: the outputs (~1) or the lse (~log Lk)
    lse_size = testing.magnitude(torch.stack([e["lse"].cpu() for e in events]))
    merge_bound = 4 * torch.finfo(torch.float32).eps * max(testing.magnitude(golden), lse_size)
    merge_ok = merge_err <= merge_bound
    say(f"   PyTorch merge of the recorded partials vs the kernel's merged output: {merge_err:.2e} "
        f"(bound {merge_bound:.0e}) {'OK' if merge_ok else 'FAILED'}")
    say(f"   max |split-KV - causal attention's last row| = {verdict.error:.2e} (float32 vs float64)")

    # 3. A decode step's time at a fixed shape: the flash backend against the reference
    Lk, Dt, Hqt, Hkvt = (1024, 64, 8, 2) if small else (4096, 64, 8, 2)
    qt = torch.randn(1, Hqt, 1, Dt)
    kt, vt = torch.randn(1, Hkvt, Lk, Dt), torch.randn(1, Hkvt, Lk, Dt)
    t_flash = median_time(lambda: attend(qt, kt, vt, backend="flash"), repeats=7, warmup=2)
    t_ref = median_time(lambda: attend(qt, kt, vt, backend="reference"), repeats=7, warmup=2)
    t_kernel = median_time(lambda: tb.decode(q1, k32, v32, **kw), repeats=3, warmup=1)
    say(f"3. one decode step, q (1, {Hqt}, 1, {Dt}) against {Lk} keys ({Hkvt} kv heads), float32 on the CPU: "
        f"flash {t_flash * 1e3:.2f} ms, reference {t_ref * 1e3:.2f} ms")
    where = "compiled, on the GPU" if torch.cuda.is_available() else "Triton's interpreter: a note, not a speed"
    say(f"   the split-KV kernels at the shape of step 2: {t_kernel * 1e3:.1f} ms ({where})")

    pictures = []
    if out is not None:
        pictures.append(_draw(out / "r8-splits.png", rec0, N))
    error = verdict.error if cache_ok and merge_ok else float("inf")  # any failed step fails the rung
    return Result(
        rung=8, title=TITLE,
        check="split-KV decode (float32) over the KV cache vs causal attention, rung 5 (float64)",
        error=error, tol=verdict.bound,
        numbers={"cache_error": err_cache, "merge_error": merge_err, "splits": S, "split_error": verdict.error,
                 "time_flash_step_s": t_flash, "time_reference_step_s": t_ref, "time_kernel_s": t_kernel},
        pictures=pictures,
    )


def _draw(path: Path, rec: dict[str, Any], N: int) -> Path:
    """Left: the keys of each split and the key blocks its program visited. Right: each query
    head's merge weights exp(lse_s − lse), stacked (they sum to 1). All from the recorded partials of
    batch 0, kv head 0."""
    import matplotlib.pyplot as plt

    _, _, weights = merge_splits(rec["out_s"], rec["lse_s"])  # (S, G, Lq)
    S, G = weights.shape[0], weights.shape[1]
    bn = rec["block_n"]
    cmap = plt.get_cmap("tab10")
    with figure(path, size=(11.0, 3.8), ncols=2) as (_, axes):
        ax = axes[0, 0]
        for s, ((lo, hi), blocks) in enumerate(zip(rec["keys"], rec["key_blocks"])):
            ax.barh(s, hi - lo, left=lo, height=0.6, color=cmap(s), alpha=0.35)
            for nb in blocks:  # the blocks the program actually visited
                ax.barh(s, min(bn, N - nb * bn), left=nb * bn, height=0.3, color=cmap(s), edgecolor="black",
                        linewidth=0.5)
            ax.text((lo + hi) / 2, s + 0.38, f"[{lo}, {hi})", ha="center", va="bottom", fontsize=8)
        ax.set_xlim(0, N)
        ax.set_ylim(S - 0.4, -0.6)
        ax.set_yticks(range(S))
        ax.set_xlabel("key position")
        ax.set_ylabel("split (program)")
        ax.set_title(f"split_kernel: {S} splits of the {N} cached keys\n(bars: key blocks of {bn} visited)",
                     fontsize=9)
        ax = axes[0, 1]
        bottom = torch.zeros(G)
        for s in range(S):
            w = weights[s, :, 0]  # (G,) the last query's weight of split s, per query head
            ax.bar(range(G), w.tolist(), bottom=bottom.tolist(), color=cmap(s), label=f"split {s}")
            bottom += w
        ax.set_xticks(range(G))
        ax.set_xticklabels([f"head {h}" for h in rec["heads"]])
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("exp(lse_s − lse)")
        ax.set_title("merge_kernel's weights, from the recorded (O_s, lse_s)", fontsize=9)
        ax.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.3, 1.0))
    return path
