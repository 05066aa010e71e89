"""How fast could this artifact's decode step be with its kernels? The step against its kernels alone.

    python benchmarks/replay.py ART [--compile] [--prompt-len 64] [--steps 8] [--rounds 7]

Records every TVM kernel call of ``--steps`` real decode steps (q/k/v, o, the predictors, the sparse FFN
parts, lm_head; with their real inputs and active-row lists), then, in each of ``--rounds`` interleaved
rounds, times the same decode steps run by the session and the recorded kernel calls replayed back to
back from Python with nothing between them: no glue (norms, rotary, attention, residual adds), no op
dispatch, no mask-to-row-list conversion. The replay is the floor that runtime work (fusing the glue,
fewer or cheaper calls) can reach with these kernels; step minus replay is what everything else costs.
Each kernel's weights are read from DRAM in the replay as in the step (a step's weights are far larger
than the caches). Medians; the copy bandwidth is measured in the same rounds. Not a test.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: see picompile/__init__.py

import argparse
import statistics
import time
from typing import Any

import torch

import picompile
from picompile.tools.traffic import copy_bandwidth
from picompile.errors import PicompileError
from picompile.kernels.loader import call_args
from picompile.runtime import Session
from picompile.tools.kernel_calls import Log, group, recording


def weight_bytes(kernel: Any, args: tuple[Any, ...]) -> int:
    """Weight bytes one call reads: the selected rows of each weight matrix it takes, quantized ones with their
    scales (bias and x aside)."""
    named = dict(zip(call_args(kernel.spec), args))
    if kernel.spec.kind == "predict":  # every row of fc1 and fc2
        return sum(named[n].numel() * named[n].element_size() for n in ("fc1", "fc2"))
    if kernel.spec.kind == "input_sparse":  # the rows of w_t [d_in, d_out] whose input channel the mask reads
        w_t = named["w_t"]
        return int(named["mask"].count_nonzero()) * w_t.shape[1] * w_t.element_size()
    k = int(named["idx"].numel())  # the other kinds read the selected rows of each w_* they take
    return sum(k * t.shape[1] * t.element_size() for n, t in named.items()
               if n.startswith(("w_", "s_")) and t is not None)


def measure(session: Session, prompt_len: int = 64, steps: int = 8, rounds: int = 7) -> dict[str, Any]:
    """Record ``steps`` greedy decode steps' kernel calls, then time in interleaved rounds: the steps, the
    calls replayed back to back, and the steps with each call timed. Seconds per step, medians."""
    log = Log()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, session.vocab_size, (prompt_len,), generator=gen).tolist()
    # a compiled step whose kernel calls are C++ ops (runtime/native.py) calls them past KERNEL_TABLE: its
    # calls are recorded from the eager step on the same weights (the same calls), and cannot be timed
    # one by one inside it
    native = int(getattr(getattr(session, "step_fn", None), "native_calls", 0) or 0) > 0
    recorded = (Session(session.root, session.manifest, session.graph, session.tokenizer, native=False)
                if native else session)
    decs = {id(s): s.decoder() for s in (session, recorded)}  # as generate runs (the KV cache in place)
    first = int(decs[id(session)].feed(prompt)[-1].argmax())
    if native:
        decs[id(recorded)].feed(prompt)

    def decode(of: Session = session) -> None:
        dec = decs[id(of)]
        dec.truncate(prompt_len)  # the same steps every time
        tok = first
        for _ in range(steps):
            tok = int(dec.feed([tok])[-1].argmax())

    replay_groups: dict[str, list[float]] = {}

    def replay(by_group: bool = False) -> None:
        if not by_group:
            for kern, a in log.calls:
                kern.unchecked(*a)
            return
        spent: dict[str, float] = {}
        for kern, a in log.calls:
            t0 = time.perf_counter()
            kern.unchecked(*a)
            spent[group(kern)] = spent.get(group(kern), 0.0) + time.perf_counter() - t0
        for g, sec in spent.items():
            replay_groups.setdefault(g, []).append(sec / steps)

    step_groups: dict[str, list[float]] = {}

    with recording(log):
        decode()  # warm-up (and the compile, for a compiled session)
        decode(recorded)
        log.on = True
        decode(recorded)
        log.on = False
        if not log.calls:
            raise SystemExit("no TVM kernel ran in a decode step: the artifact was built without kernels "
                             "(pipeline 'reference' or 'dense')")
        src, dst = torch.ones(64 << 20), torch.empty(64 << 20)  # 256 MiB, far beyond the caches
        times: dict[str, list[float]] = {"step": [], "replay": [], **({} if native else {"in_step": []})}
        bw: list[float] = []
        for i in range(rounds):
            for what in (list(times) if i % 2 == 0 else list(times)[::-1]):
                if what == "in_step":  # a step with each kernel call timed: the kernels' share inside it
                    log.timing, log.seconds, log.by_group = True, 0.0, {}
                    decode()
                    log.timing = False
                    times["in_step"].append(log.seconds / steps)
                    for g, sec in log.by_group.items():
                        step_groups.setdefault(g, []).append(sec / steps)
                    replay(by_group=True)  # the calls again, back to back, each timed
                    continue
                t0 = time.perf_counter()
                decode() if what == "step" else replay()
                times[what].append((time.perf_counter() - t0) / steps)
            if native:  # the calls back to back, each timed (done with the in-step timing otherwise)
                replay(by_group=True)
            bw.append(copy_bandwidth(src, dst))
    groups: dict[str, dict[str, float]] = {}
    for kern, a in log.calls:
        g = groups.setdefault(group(kern), {"calls": 0.0, "bytes": 0.0})
        g["calls"] += 1 / steps
        g["bytes"] += weight_bytes(kern, a) / steps
    for g, row in groups.items():
        row["in_step_s"] = statistics.median(step_groups[g]) if g in step_groups else None
        row["replay_s"] = statistics.median(replay_groups[g])
    return {
        "calls_per_step": len(log.calls) / steps,
        "bytes_per_step": sum(row["bytes"] for row in groups.values()),
        "groups": groups,
        "calls": log.calls,
        "rounds": times,
        **{f"{k}_s": statistics.median(v) for k, v in times.items()},
        "copy_gbps": statistics.median(bw) / 1e9,
        "native": native,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--compile", action="store_true", help="load(compile=True): the step through torch.compile")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8, help="decode steps recorded and timed per round")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    try:
        session = picompile.load(args.artifact, compile=args.compile)
    except PicompileError as err:
        raise SystemExit(f"error: {err}") from None
    if session.torch_weight_reads:  # e.g. float32 linear layers of an artifact built before lower-tvm took them
        print(f"note: in {args.artifact}'s decode step torch itself reads {len(session.torch_weight_reads)} weight "
              "matrices (not TVM kernels), so they count under 'everything else' below")
    r = measure(session, args.prompt_len, args.steps, args.rounds)
    step, rep, nbytes, gbps = r["step_s"], r["replay_s"], r["bytes_per_step"], r["copy_gbps"]
    inside = r.get("in_step_s")  # None: the step's kernel calls are C++ ops, not timed one by one
    print(f"{args.artifact}: {r['calls_per_step']:.0f} kernel calls per step, {nbytes / 1e9:.3f} GB of weights per step"
          f"{' (compiled step)' if args.compile else ''}{' (its kernel calls are C++ ops)' if r['native'] else ''}")
    print(f"  decode step          {step * 1e3:7.1f} ms   {1 / step:6.2f} tok/s   {nbytes / step / 1e9:5.1f} GB/s")
    print(f"  its kernels alone    {rep * 1e3:7.1f} ms   {1 / rep:6.2f} tok/s   {nbytes / rep / 1e9:5.1f} GB/s"
          "   (replayed back to back)")
    if inside is not None:
        print(f"  the kernels in it    {inside * 1e3:7.1f} ms   (timed call by call inside a step: "
              f"{(inside - rep) * 1e3:+.1f} ms against back to back)")
    kern = inside if inside is not None else rep
    print(f"  everything else      {(step - kern) * 1e3:7.1f} ms   (glue, dispatch, mask handling: "
          f"{100 * (step - kern) / step:.0f} % of the step{'' if inside is not None else '; against the replay'})")
    print(f"  copy bandwidth       {gbps:7.1f} GB/s (read + write; bound {gbps * 1e9 / nbytes:.2f} tok/s)")
    print(f"  {'kernel (kind rows x d)':<26} {'calls':>6} {'MB':>8} {'in step ms':>11} {'GB/s':>6} {'replayed ms':>12} {'GB/s':>6}")
    for g, row in sorted(r["groups"].items(), key=lambda kv: -kv[1]["replay_s"]):
        ins = row["in_step_s"]
        cells = f"{ins * 1e3:11.2f} {row['bytes'] / ins / 1e9:6.1f}" if ins is not None else f"{'-':>11} {'-':>6}"
        print(f"  {g:<26} {row['calls']:6.0f} {row['bytes'] / 1e6:8.1f} {cells} "
              f"{row['replay_s'] * 1e3:12.2f} {row['bytes'] / row['replay_s'] / 1e9:6.1f}")
    print(f"  rounds (ms, {' / '.join(r['rounds'])}): "
          + ", ".join("/".join(f"{v * 1e3:.1f}" for v in vals) for vals in zip(*r["rounds"].values())))


if __name__ == "__main__":
    main()
