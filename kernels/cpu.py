"""CPU (LLVM) schedules for the kernel descriptions of ``compute.py``.

Up/gate part (``[k]`` dot products over d): parallel over the active rows ``j`` (one whole row per
iteration, a contiguous stream of ``d_model`` weights); the d-reduction is ``rfactor``-ed into
``lanes`` float32 accumulators so it vectorises (fp16 weights are widened to fp32 in registers).
``k`` is never split (splitting a symbolic k and ``compute_at`` of an rfactor block crashes TVM 0.27).

Down part (row-axpy ``y = sum_j h[j] * w_down_t[idx[j]]``): parallel over column chunks of ``y``;
each thread keeps its chunk of ``y`` in L1 and streams the matching segment of every selected row,
vectorised along d. Threads never write the same ``y`` element, so no atomics or reduction buffer.

Fused FFN kinds use ``compute.describe_partitioned`` instead: one parallel region over
``cores`` contiguous parts of the active rows; each part computes its rows' ``h`` and accumulates
their down-projection rows into a private ``y_part`` (no barrier between up and down, whole rows
streamed), and ``y`` sums the parts. The separate-phase schedules above serve ``up``/``down`` kinds.

The target names the host CPU (``mcpu``): plain ``llvm`` would emit SSE-only code.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx

from .compute import KernelDesc
from .spec import KernelSpec


@dataclass(frozen=True)
class CpuScheduleParams:
    """Tunables of the CPU schedule (chosen by ``default_params``)."""

    up_lanes: int  # float32 accumulators of one row's dot product (a multiple of the SIMD width)
    down_lanes: int  # vector width along d in the row-axpy
    down_chunk: int  # y elements per parallel task (a multiple of down_lanes, divides d_model)


def _largest_divisor(d: int, candidates: tuple[int, ...]) -> int:
    for c in candidates:
        if d % c == 0:
            return c
    return 1


def default_params(spec: KernelSpec, cores: int | None = None) -> CpuScheduleParams:
    """Vector widths and the y-chunk size: one chunk per core, as long as possible (a long contiguous
    segment of every selected row per task streams best), at most 4096 elements."""
    d = spec.d_model
    cores = cores or build_cores()
    # 64 float32 lanes = 4 independent AVX-512 accumulators (8 with AVX2): hides the FMA latency
    up_lanes = _largest_divisor(d, (64, 32, 16, 8, 4, 2))
    down_lanes = _largest_divisor(d, (64, 32, 16, 8, 4, 2))
    sizes = (4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1)
    candidates = [c for c in sizes if c % down_lanes == 0 and d % c == 0]
    enough = [c for c in candidates if d // c >= cores]
    chunk = enough[0] if enough else candidates[-1]
    return CpuScheduleParams(up_lanes=up_lanes, down_lanes=down_lanes, down_chunk=chunk)


def build_cores() -> int:
    """Physical cores of the build machine (the kernel is built for the host it runs on)."""
    from .loader import physical_cores

    return physical_cores()


def host_target() -> tvm.target.Target:
    """LLVM target for this machine's CPU (e.g. ``mcpu=emeraldrapids``: AVX-512, F16C)."""
    cpu = tvm.target.codegen.llvm_get_system_cpu()
    return tvm.target.Target({"kind": "llvm", "mcpu": cpu, "opt-level": 3})


def _schedule_up(sch: s_tir.Schedule, spec: KernelSpec, p: CpuScheduleParams, batched: bool) -> None:
    """Parallel over rows j; per row (and token) a vectorised rfactor-ed dot product, then ``h``."""
    names = ("gate", "up") if spec.gated else ("up",)
    # rfactor first, at the root (rfactor of a block already moved by compute_at hits an InternalError)
    if p.up_lanes > 1:
        for name in names:
            blk = sch.get_sblock(name)
            _, r_in = sch.split(sch.get_loops(blk)[-1], [None, p.up_lanes])
            sch.rfactor(r_in, 0)
    h_block = sch.get_sblock("h")
    h_loops = sch.get_loops(h_block)
    if batched:
        t_loop, j_loop = h_loops
        sch.reorder(j_loop, t_loop)  # a row is reused from cache by every token
        anchor = t_loop
    else:
        (j_loop,) = h_loops
        anchor = j_loop
    n_anchor = len(sch.get_loops(h_block))
    for name in names:
        blk = sch.get_sblock(name)
        sch.compute_at(blk, anchor)
        if p.up_lanes > 1:
            rf = sch.get_sblock(f"{name}_rf")
            sch.compute_at(rf, anchor)
            # below the anchor: [lane, r_out], or [lane] when d == up_lanes (unit loop dropped)
            lane, *r_out = sch.get_loops(rf)[n_anchor:]
            if r_out:
                sch.reorder(r_out[0], lane)
            sch.vectorize(lane)
            sch.set_scope(rf, 0, "local")
            sch.unroll(sch.get_loops(blk)[n_anchor])  # the final lane-sum
    sch.parallel(j_loop)
    # init statements are split off only after parallel() (it needs the compact reduction block)
    if p.up_lanes > 1:
        for name in names:
            rf = sch.get_sblock(f"{name}_rf")
            below = sch.get_loops(rf)[n_anchor:]  # [r_out, lane] after the reorder, or [lane]
            if len(below) == 2:
                sch.decompose_reduction(rf, below[0])


def _schedule_down(sch: s_tir.Schedule, spec: KernelSpec, p: CpuScheduleParams, batched: bool) -> None:
    """Parallel over d-chunks of y; in a chunk: for each selected row (for each token) an axpy."""
    y_block = sch.get_sblock("y")
    loops = sch.get_loops(y_block)
    if batched:
        t_loop, i_loop, rj = loops
    else:
        i_loop, rj = loops
        t_loop = None
    io, im, iv = sch.split(i_loop, [None, p.down_chunk // p.down_lanes, p.down_lanes])
    order = [io, rj] + ([t_loop] if t_loop is not None else []) + [im, iv]
    sch.reorder(*order)
    sch.parallel(io)
    sch.vectorize(iv)
    sch.decompose_reduction(y_block, rj)


def _schedule_partitioned(sch: s_tir.Schedule, spec: KernelSpec, p: CpuScheduleParams, batched: bool) -> None:
    """Fused FFN of ``describe_partitioned``: parallel over the parts; in a part, for each row: the
    (vectorised, rfactor-ed) dot product(s) for every token, ``h``, then the row's axpy into the
    part's ``y_part`` (so ``h`` never leaves registers/L1); finally ``y = sum_p y_part[p]``."""
    names = ("gate", "up") if spec.gated else ("up",)
    n_tok = 1 if batched else 0
    has_r_out = spec.d_model // p.up_lanes > 1  # compute_at drops unit loops
    rfs: dict[str, s_tir.SBlockRV] = {}
    if p.up_lanes > 1:  # rfactor at the root, before any compute_at (see _schedule_up)
        for name in names:
            blk = sch.get_sblock(name)
            _, r_in = sch.split(sch.get_loops(blk)[-1], [None, p.up_lanes])
            rf = sch.rfactor(r_in, 0)
            # block iters are [lane, p, jj, t?, r_out] / [lane, p, jj, t?]; compute_at creates loops in
            # iter order, so put the lane last: loops become [t?, r_out, lane] / [t?, lane]
            nsp = 3 + n_tok
            sch.reorder_block_iter_var(rf, [*range(1, nsp), nsp, 0])
            sch.reorder_block_iter_var(blk, [*range(1, nsp), 0])
            rfs[name] = rf
    yp = sch.get_sblock("y_part")
    if batched:
        part, tt, i, rj = sch.get_loops(yp)
        sch.reorder(part, rj, tt, i)  # a row pair is read once for all tokens
    else:
        part, i, rj = sch.get_loops(yp)
        sch.reorder(part, rj, i)
    _, iv = sch.split(i, [None, p.down_lanes])
    sch.vectorize(iv)
    sch.compute_at(sch.get_sblock("h"), rj)
    for name in names:
        blk = sch.get_sblock(name)
        sch.compute_at(blk, rj)
        if name in rfs:
            rf = rfs[name]
            sch.compute_at(rf, rj)
            sch.vectorize(sch.get_loops(rf)[-1])  # the lanes
            sch.set_scope(rf, 0, "local")
            sch.unroll(sch.get_loops(blk)[-1])  # the final lane-sum
    sch.parallel(part)
    if has_r_out:
        for rf in rfs.values():  # init statements only after parallel() (see _schedule_up)
            sch.decompose_reduction(rf, sch.get_loops(rf)[-2])  # at r_out
    sch.decompose_reduction(yp, rj)
    y = sch.get_sblock("y")
    loops = sch.get_loops(y)
    i_y, rp = loops[-2:]
    io, iv = sch.split(i_y, [None, p.down_lanes])
    sch.reorder(io, rp, iv)
    sch.vectorize(iv)
    sch.decompose_reduction(y, rp)


def schedule(desc: KernelDesc, spec: KernelSpec, params: CpuScheduleParams | None = None) -> tvm.IRModule:
    """Apply the CPU schedule to an unscheduled description; returns the scheduled IRModule."""
    p = params or default_params(spec)
    sch = s_tir.Schedule(desc.func)
    if desc.partitions is not None:
        _schedule_partitioned(sch, spec, p, desc.batched)
        return sch.mod
    if spec.has_up:
        _schedule_up(sch, spec, p, desc.batched)
    if spec.has_down:
        _schedule_down(sch, spec, p, desc.batched)
    return sch.mod


def as_named(mod: tvm.IRModule, name: str) -> tirx.PrimFunc:
    """The module's single PrimFunc, renamed (``global_symbol``) so several fit in one library."""
    func = mod["main"]
    return func.with_attr("global_symbol", name)
