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

One token, ReLU (``skip_inactive``): a predicted row whose ReLU output is 0 adds exactly nothing, so
only the row that decides it is read. Each part first computes the gate dot products (``ffn_gated``;
``ffn_relu``: up and ``h``) of all its rows, then walks its rows again and reads the up and down rows
(``ffn_relu``: the down row) only where the gate is positive (``h`` non-zero); the next row's prefetch
is issued only when that row is active too. With the predictor's ~0.6 precision a 1B ReGLU layer reads
~2.3 instead of 3 rows per selected neuron (measured 1.25x faster f16, 1.20x fp32; see
``benchmarks/README.md``); ``y`` is bit-identical. (The batched form reads the union of t tokens'
rows, where a row rarely is inactive for all of them, and keeps one pass.)

Per row (all schedules), three things keep a core streaming at memory speed (fp16 rows are only
``2 * d_model`` bytes, so per-row overheads weigh twice as much as for fp32):

* the rfactor accumulators live in a ``global``-scope (i.e. stack) buffer: TVM 0.27 lowers a
  ``local``-scope allocation inside the parallel loop to a ``TVMBackendAllocWorkspace`` /
  ``FreeWorkspace`` call pair *per row*; a small constant-size global allocation becomes an
  ``alloca`` that LLVM keeps in registers;
* the final lane-sum is a halving tree of vector adds (``lanes -> lanes/2 -> ... -> 2 -> 1``, one
  more ``rfactor`` per level) instead of a serial chain of ``lanes`` scalar adds;
* every iteration of the streaming loop over a row also prefetches the same cache line(s) of the
  *next* selected row (``idx[j + 1]``, an arbitrary row in the sparse case, which the hardware
  prefetchers cannot guess; at a row boundary they also stop at the 4 KiB page): the next row's
  lines are in flight while this row is consumed.

The target names the host CPU (``mcpu``): plain ``llvm`` would emit SSE-only code. The prefetches and
the inactive-row guard are TIR rewrites after the schedule primitives (``cpu_rewrite.py``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx

from .compute import CHUNK, KernelDesc, dot_extent
from .cpu_rewrite import Prefetch, add_prefetch, guard_inactive_rows
from .spec import KernelSpec, dot_lanes, skips_inactive


@dataclass(frozen=True)
class CpuScheduleParams:
    """Tunables of the CPU schedule (chosen by ``default_params``)."""

    up_lanes: int  # float32 accumulators of one row's dot product (a multiple of the SIMD width)
    down_lanes: int  # vector width along d in the row-axpy
    down_chunk: int  # y elements per parallel task (a multiple of down_lanes, divides d_model)
    prefetch: bool = True  # software-prefetch the next selected row while streaming this one
    skip_inactive: bool = True  # fused relu kinds, one token: rows whose activation is 0 skip their other reads
    weight_vec: int = 0  # vector width of the up lanes' weight loads (0: all up_lanes; quantized: 16, see below)


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
    # 64 float32 lanes = 4 independent AVX-512 accumulators (8 with AVX2): hides the FMA latency.
    # Float16 rows take 32 (one cache line per iteration) in every kind, so that the serving batch's
    # ``gemv`` forms the same sums (spec.dot_lanes). The GEMV A/B was inconclusive (+10 %, +6 %, equal,
    # then -5 % and equal); the fused FFN measured equal (benchmarks/schedules.py ffn; benchmarks/README.md).
    up_lanes = dot_lanes(d, spec.weight_dtype)
    down_lanes = _largest_divisor(d, (64, 32, 16, 8, 4, 2))
    weight_vec = 0
    if spec.quantized:
        # 64 lanes span several blocks (and int4 interleaves two half-blocks in one byte run): they are
        # unrolled into 16-lane vectors, each inside one half-block, so every load is a contiguous 16
        # (int8: 16-byte, int4: 16-byte of nibble pairs, one half each) and the scale one broadcast
        # (d_model is a multiple of the block, >= 32, so 64 | d or 32 | d; dot_extent is a multiple of 16)
        up_lanes = _largest_divisor(dot_extent(spec), (64, 32, 16))
        down_lanes = _largest_divisor(d, (64, 32))
        weight_vec = 16
    sizes = (4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1)
    candidates = [c for c in sizes if c % down_lanes == 0 and d % c == 0]
    enough = [c for c in candidates if d // c >= cores]
    chunk = enough[0] if enough else candidates[-1]
    return CpuScheduleParams(up_lanes=up_lanes, down_lanes=down_lanes, down_chunk=chunk, weight_vec=weight_vec)


def _up_elems(spec: KernelSpec, p: CpuScheduleParams) -> int:
    """Weight elements of a row one iteration of a dot product's streaming loop reads: ``up_lanes`` terms of
    ``dot_extent``, each of ``B / 16`` elements for quantized weights."""
    return p.up_lanes * (spec.block // CHUNK if spec.quantized else 1)


def _lane_loops(p: CpuScheduleParams) -> int:
    """Loops a dot product's lanes take after ``_vectorize_lanes``: 2 when split into vectors, else 1."""
    return 2 if p.weight_vec and p.up_lanes > p.weight_vec else 1


def _vectorize_lanes(sch: s_tir.Schedule, lane: s_tir.LoopRV, vec: int) -> None:
    """Vectorise a dot product's lane loop; with ``vec`` (quantized weights) as ``[lanes / vec]`` unrolled
    ``vec``-wide vectors (see ``default_params``)."""
    extent = int(sch.get(lane).extent)
    if vec and extent > vec:
        outer, lane = sch.split(lane, [None, vec])
        sch.unroll(outer)
    sch.vectorize(lane)


def build_cores() -> int:
    """Physical cores of the build machine (the kernel is built for the host it runs on)."""
    from .loader import physical_cores

    return physical_cores()


MCPU_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


def host_target(mcpu: str | None = None) -> tvm.target.Target:
    """LLVM target for ``mcpu`` (an LLVM CPU name, e.g. ``x86-64-v3`` for kernels that run on any AVX2 x86-64),
    by default this machine's CPU (e.g. ``mcpu=emeraldrapids``: AVX-512, F16C)."""
    if mcpu is not None and not MCPU_RE.match(mcpu):
        raise ValueError(f"not an LLVM CPU name: {mcpu!r}")
    cpu = mcpu or tvm.target.codegen.llvm_get_system_cpu()
    return tvm.target.Target({"kind": "llvm", "mcpu": cpu, "opt-level": 3})


def _loop_var(sch: s_tir.Schedule, loop: s_tir.LoopRV) -> tirx.Var:
    return sch.get(loop).loop_var


def _tree_levels(lanes: int) -> list[int]:
    """Lane counts of the halving lane-sum tree below ``lanes``: 64 -> [32, 16, 8, 4, 2]."""
    levels = []
    n = lanes
    while n % 2 == 0 and n > 2:
        n //= 2
        levels.append(n)
    return levels


def _rfactor_tree(sch: s_tir.Schedule, name: str, lanes: int) -> list[s_tir.SBlockRV]:
    """rfactor block ``name`` into ``lanes`` accumulators, then its lane-sum level by level into a
    halving tree. Returns the new blocks, the main accumulator (reading the weights) first. Must run
    at the root, before any compute_at (rfactor of a moved block hits an InternalError in 0.27)."""
    blk = sch.get_sblock(name)
    _, r_in = sch.split(sch.get_loops(blk)[-1], [None, lanes])
    rfs = [sch.rfactor(r_in, 0)]
    for level in _tree_levels(lanes):
        _, l_in = sch.split(sch.get_loops(blk)[-1], [None, level])
        rfs.append(sch.rfactor(l_in, 0))
    return rfs


def _place_tree_levels(sch: s_tir.Schedule, rfs: list[s_tir.SBlockRV], anchor: s_tir.LoopRV, n_anchor: int) -> None:
    """compute_at the tree levels (consumers first) at ``anchor``: each is ``[lo (2), lane]`` below it,
    the lanes vectorised and the two halves unrolled; stack (``global``) scope, see the module doc."""
    for rf in reversed(rfs[1:]):
        sch.compute_at(rf, anchor)
        lane, lo = sch.get_loops(rf)[n_anchor:]
        sch.reorder(lo, lane)
        sch.vectorize(lane)
        sch.unroll(lo)
        sch.set_scope(rf, 0, "global")


def _schedule_up(sch: s_tir.Schedule, spec: KernelSpec, p: CpuScheduleParams, batched: bool) -> list[Prefetch]:
    """Parallel over rows j; per row (and token) a vectorised rfactor-ed dot product, then ``h``.
    Returns the prefetch plan of the weight streams (see ``cpu_rewrite.add_prefetch``)."""
    names = ("gate", "up") if spec.gated else ("up",)
    trees: dict[str, list[s_tir.SBlockRV]] = {}
    # rfactor first, at the root (rfactor of a block already moved by compute_at hits an InternalError)
    if p.up_lanes > 1:
        for name in names:
            trees[name] = _rfactor_tree(sch, name, p.up_lanes)
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
        if name in trees:
            _place_tree_levels(sch, trees[name], anchor, n_anchor)
            rf = trees[name][0]
            sch.compute_at(rf, anchor)
            # below the anchor: [lane, r_out], or [lane] when d == up_lanes (unit loop dropped)
            lane, *r_out = sch.get_loops(rf)[n_anchor:]
            if r_out:
                sch.reorder(r_out[0], lane)
            _vectorize_lanes(sch, lane, p.weight_vec)
            sch.set_scope(rf, 0, "global")  # stack, not a per-row workspace call (module doc)
            sch.unroll(sch.get_loops(blk)[n_anchor])  # the last lane-sum (2 lanes, or all without a tree)
    sch.parallel(j_loop)
    # init statements are split off only after parallel() (it needs the compact reduction block)
    plan = []
    n_lane = _lane_loops(p)
    for name in trees:
        for level in trees[name][1:]:
            sch.decompose_reduction(level, sch.get_loops(level)[n_anchor])  # [lo, lane]
        below = sch.get_loops(trees[name][0])[n_anchor:]  # [r_out, lane(s)] after the reorder, or [lane(s)]
        if len(below) > n_lane:
            sch.decompose_reduction(trees[name][0], below[0])
            plan.append(Prefetch(f"w_{name}", _loop_var(sch, j_loop), None, _loop_var(sch, below[0]), _up_elems(spec, p), 1))
    return plan


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
    _vectorize_lanes(sch, iv, p.weight_vec)
    sch.decompose_reduction(y_block, rj)


def _skips_inactive(spec: KernelSpec, p: CpuScheduleParams, batched: bool) -> bool:
    """Whether the fused one-token kernel skips the rest of a row whose ReLU output is 0
    (see ``cpu_rewrite.guard_inactive_rows``)."""
    return p.skip_inactive and not batched and skips_inactive(spec.kind, spec.act, spec.gate_bias)


def _rfactor_part_dots(sch: s_tir.Schedule, names: tuple[str, ...], lanes: int,
                       batched: bool) -> dict[str, list[s_tir.SBlockRV]]:
    """rfactor each dot product of ``describe_partitioned`` into its lane-sum tree (at the root, before any
    compute_at: see _schedule_up), block iters ordered so that compute_at puts the lanes innermost."""
    nsp = 3 + (1 if batched else 0)  # spatial iters p, jj, t? after the lane
    trees: dict[str, list[s_tir.SBlockRV]] = {}
    for name in names:
        tree = _rfactor_tree(sch, name, lanes)
        # block iters are [lane, p, jj, t?, r_out] / [lane, p, jj, t?]; compute_at creates loops in
        # iter order, so put the lane last: loops become [t?, r_out, lane] / [t?, lane]; likewise
        # the tree levels: iters [lane, lo, p, jj, t?] -> [p, jj, t?, lo, lane], loops [t?, lo, lane]
        sch.reorder_block_iter_var(tree[0], [*range(1, nsp), nsp, 0])
        for level in tree[1:]:
            sch.reorder_block_iter_var(level, [*range(2, nsp + 1), 1, 0])
        sch.reorder_block_iter_var(sch.get_sblock(name), [*range(1, nsp), 0])
        trees[name] = tree
    return trees


def _order_part_rows(sch: s_tir.Schedule, yp: s_tir.SBlockRV, p: CpuScheduleParams,
                     batched: bool) -> tuple[s_tir.LoopRV, s_tir.LoopRV]:
    """``y_part``'s loops [part, rj, t?, i_out, i_lane], the lanes vectorised; returns (part, rj)."""
    if batched:
        part, tt, i, rj = sch.get_loops(yp)
        sch.reorder(part, rj, tt, i)  # a row pair is read once for all tokens
    else:
        part, i, rj = sch.get_loops(yp)
        sch.reorder(part, rj, i)
    _, iv = sch.split(i, [None, p.down_lanes])
    _vectorize_lanes(sch, iv, p.weight_vec)
    return part, rj


def _place_dot(sch: s_tir.Schedule, spec: KernelSpec, name: str, h_blk: s_tir.SBlockRV,
               part: s_tir.LoopRV, rj: s_tir.LoopRV, skip: bool) -> s_tir.LoopRV:
    """compute_at dot product ``name`` at its row loop; returns that loop (the row loop of the down rows,
    or, skipping inactive rows, the gate's own row loop, ffn_relu: h's)."""
    blk = sch.get_sblock(name)
    if skip and name == "gate":
        sch.compute_at(blk, part)
        return sch.get_loops(blk)[1]  # [part, jj, lane]: the gate's own row loop
    if skip and not spec.gated:
        anchor = sch.get_loops(h_blk)[1]  # h's row loop (before the row loop of the down rows)
        sch.compute_at(blk, anchor)
        return anchor
    sch.compute_at(blk, rj)
    return rj


def _place_part_tree(sch: s_tir.Schedule, name: str, tree: list[s_tir.SBlockRV], anchor: s_tir.LoopRV,
                     vec: int = 0) -> None:
    """The lane-sum tree of dot product ``name`` at its row loop ``anchor``: levels (consumers first) and the
    main accumulator vectorised along the lanes, on the stack."""
    for level in reversed(tree[1:]):  # consumers first
        sch.compute_at(level, anchor)
        lo, lane = sch.get_loops(level)[-2:]
        sch.vectorize(lane)
        sch.unroll(lo)
        sch.set_scope(level, 0, "global")
    sch.compute_at(tree[0], anchor)
    _vectorize_lanes(sch, sch.get_loops(tree[0])[-1], vec)  # the lanes
    sch.set_scope(tree[0], 0, "global")  # stack, not a per-row workspace call (module doc)
    sch.unroll(sch.get_loops(sch.get_sblock(name))[-1])  # the last lane-sum (2 lanes, or all without a tree)


def _place_part_dots(sch: s_tir.Schedule, spec: KernelSpec, names: tuple[str, ...],
                     trees: dict[str, list[s_tir.SBlockRV]], part: s_tir.LoopRV, rj: s_tir.LoopRV,
                     skip: bool, vec: int = 0) -> dict[str, s_tir.LoopRV]:
    """compute_at ``h`` and every dot product (with its tree) in the part; returns each dot's row loop.
    skip: the blocks that decide whether a row is active (gated: gate; ffn_relu: up and h) run first for
    all the part's rows, then the row loop reads the rest of the active rows only (see guard_inactive_rows)."""
    h_blk = sch.get_sblock("h")
    sch.compute_at(h_blk, part if skip and not spec.gated else rj)
    anchors: dict[str, s_tir.LoopRV] = {}
    for name in names:
        anchors[name] = _place_dot(sch, spec, name, h_blk, part, rj, skip)
        if name in trees:
            _place_part_tree(sch, name, trees[name], anchors[name], vec)
    return anchors


def _decompose_part_dots(sch: s_tir.Schedule, trees: dict[str, list[s_tir.SBlockRV]],
                         anchors: dict[str, s_tir.LoopRV], has_r_out: bool,
                         n_lane: int = 1) -> dict[str, tuple[tirx.Var, tirx.Var]]:
    """Split off the trees' init statements (only after parallel(): see _schedule_up); returns the dot
    products' weight streams: buffer -> (its row loop, the loop streaming a row)."""
    streams: dict[str, tuple[tirx.Var, tirx.Var]] = {}
    for name, tree in trees.items():
        for level in tree[1:]:
            sch.decompose_reduction(level, sch.get_loops(level)[-2])
        if has_r_out:
            r_out = sch.get_loops(tree[0])[-1 - n_lane]
            sch.decompose_reduction(tree[0], r_out)
            streams[f"w_{name}"] = (_loop_var(sch, anchors[name]), _loop_var(sch, r_out))
    return streams


def _part_prefetch_plan(spec: KernelSpec, p: CpuScheduleParams, streams: dict[str, tuple[tirx.Var, tirx.Var]],
                        part: tirx.Var, skip: bool) -> list[Prefetch]:
    """The prefetch plan of the partitioned kernel's weight ``streams``: every stream the next selected row
    of its own weights, or, skipping inactive rows, only the rows that are read."""
    lanes = {"w_gate": _up_elems(spec, p), "w_up": _up_elems(spec, p), "w_down_t": p.down_lanes}
    decider = "gate" if spec.gated else "h"  # the buffer whose value says whether a row is active

    def entry(target: str, stream: str, ahead: int, only_active: bool = False) -> Prefetch:
        row_loop, loop = streams[stream]
        return Prefetch(target, row_loop, part, loop, lanes[stream], ahead, decider if only_active else None)

    if not skip:  # every stream prefetches the next selected row of its own weights
        return [entry(w, w, 1) for w in streams]
    if spec.gated:  # gate rows are always read; up and down only for rows whose gate is active
        plan = [entry("w_gate", "w_gate", 1)] if "w_gate" in streams else []
        if "w_up" in streams:
            plan.append(entry("w_down_t", "w_up", 0))  # this (active) row's down row, while its up row streams
        if "w_down_t" in streams:
            plan.append(entry("w_up", "w_down_t", 1, only_active=True))  # the next row's up row, if it is active
        return plan
    # ffn_relu: up rows are always read; down rows only where h is not 0
    plan = [entry("w_up", "w_up", 1)] if "w_up" in streams else []
    if "w_down_t" in streams:
        plan.append(entry("w_down_t", "w_down_t", 1, only_active=True))
    return plan


def _schedule_part_sum(sch: s_tir.Schedule, p: CpuScheduleParams) -> None:
    """``y = sum_p y_part[p]``: vectorised along d, the parts summed innermost but for the lanes."""
    y = sch.get_sblock("y")
    i_y, rp = sch.get_loops(y)[-2:]
    io, iv = sch.split(i_y, [None, p.down_lanes])
    sch.reorder(io, rp, iv)
    sch.vectorize(iv)
    sch.decompose_reduction(y, rp)


def _schedule_partitioned(
    sch: s_tir.Schedule, spec: KernelSpec, p: CpuScheduleParams, batched: bool
) -> tuple[list[Prefetch], tuple[tirx.Var, tirx.Var] | None]:
    """Fused FFN of ``describe_partitioned``: parallel over the parts; in a part, for each row: the
    (vectorised, rfactor-ed) dot product(s) for every token, ``h``, then the row's axpy into the
    part's ``y_part`` (so ``h`` never leaves registers/L1); finally ``y = sum_p y_part[p]``.
    Returns the prefetch plan and, when inactive rows are skipped, the (row, part) loop vars to guard."""
    names = ("gate", "up") if spec.gated else ("up",)
    trees = _rfactor_part_dots(sch, names, p.up_lanes, batched) if p.up_lanes > 1 else {}
    yp = sch.get_sblock("y_part")
    part, rj = _order_part_rows(sch, yp, p, batched)
    skip = _skips_inactive(spec, p, batched)
    anchors = _place_part_dots(sch, spec, names, trees, part, rj, skip, p.weight_vec)
    sch.parallel(part)
    streams = _decompose_part_dots(sch, trees, anchors, dot_extent(spec) // p.up_lanes > 1, _lane_loops(p))  # compute_at drops unit loops
    # the down rows: y_part loops are [part, rj, t?, i_out, i_lane] (quantized: i_lane split in two)
    io_loop = sch.get_loops(yp)[-1 - (2 if p.weight_vec and p.down_lanes > p.weight_vec else 1)]
    if spec.d_model // p.down_lanes > 1:
        streams["w_down_t"] = (_loop_var(sch, rj), _loop_var(sch, io_loop))
    rj_var, part_var = _loop_var(sch, rj), _loop_var(sch, part)
    plan = _part_prefetch_plan(spec, p, streams, part_var, skip)
    sch.decompose_reduction(yp, rj)
    _schedule_part_sum(sch, p)
    return plan, (rj_var, part_var) if skip else None


def _schedule_predict(sch: s_tir.Schedule, spec: KernelSpec) -> None:
    """Kind ``predict``: two parallel regions in one call, each a dense GEMV scheduled like ``_schedule_up``
    (parallel over rows; per row a vectorised rfactor-ed dot product with a halving lane-sum tree), fc1
    over its ``rank`` rows then fc2 over its ``n_rows`` rows; the activation and the threshold test are
    computed per row where its dot product ends (no prefetch: the rows are read in order)."""
    stages = (("up", "h", spec.d_model), ("score", "mask", spec.rank))
    trees = {}
    for dot, _, length in stages:  # every rfactor at the root, before any compute_at (see _schedule_up)
        lanes = dot_lanes(length, spec.weight_dtype)
        if lanes > 1:
            trees[dot] = _rfactor_tree(sch, dot, lanes)
    for dot, out, _ in stages:
        (row,) = sch.get_loops(sch.get_sblock(out))
        blk = sch.get_sblock(dot)
        sch.compute_at(blk, row)
        if dot in trees:
            _place_tree_levels(sch, trees[dot], row, 1)
            rf = trees[dot][0]
            sch.compute_at(rf, row)
            lane, *r_out = sch.get_loops(rf)[1:]  # [lane, r_out], or [lane] when the length is the lane count
            if r_out:
                sch.reorder(r_out[0], lane)
            sch.vectorize(lane)
            sch.set_scope(rf, 0, "global")  # stack, not a per-row workspace call (module doc)
            sch.unroll(sch.get_loops(blk)[1])
        sch.parallel(row)
    for dot in trees:  # init statements only after parallel() (see _schedule_up)
        for rf in trees[dot]:
            below = sch.get_loops(rf)[1:]
            if len(below) == 2:
                sch.decompose_reduction(rf, below[0])


def schedule(desc: KernelDesc, spec: KernelSpec, params: CpuScheduleParams | None = None) -> tvm.IRModule:
    """Apply the CPU schedule to an unscheduled description; returns the scheduled IRModule."""
    p = params or default_params(spec)
    sch = s_tir.Schedule(desc.func)
    if spec.kind == "predict":
        _schedule_predict(sch, spec)
        return sch.mod
    plan: list[Prefetch] = []
    skip = None
    if desc.partitions is not None:
        plan, skip = _schedule_partitioned(sch, spec, p, desc.batched)
    else:
        if spec.has_up:
            plan = _schedule_up(sch, spec, p, desc.batched)
        if spec.has_down:
            _schedule_down(sch, spec, p, desc.batched)
    func = sch.mod["main"]
    if p.prefetch and plan:
        func = add_prefetch(func, plan, desc.partitions)
    if skip is not None:
        func = guard_inactive_rows(func, spec, *skip)
    return tvm.IRModule({"main": func})


def as_named(mod: tvm.IRModule, name: str) -> tirx.PrimFunc:
    """The module's single PrimFunc, renamed (``global_symbol``) so several fit in one library."""
    func = mod["main"]
    return func.with_attr("global_symbol", name)
