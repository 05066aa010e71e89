"""TIR rewrites of a scheduled CPU kernel (``cpu.schedule`` applies them after the schedule primitives):
software prefetch of the next selected row in every weight-streaming loop (``add_prefetch``), and, one token
with ReLU, skipping the rest of a row whose activation is 0 (``guard_inactive_rows``). ``cpu.py``'s module
doc says why and what they gain.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import tvm
from tvm import s_tir, tirx

from .spec import KernelSpec

_LINE_BYTES = 64  # cache line
_PREFETCH_LOCALITY = 2  # llvm.prefetch locality 2 = prefetcht1 (into L2)


class Prefetch(NamedTuple):
    """One entry of a prefetch plan: while ``stream`` streams a row, prefetch the matching lines of a row of
    ``weight`` ``ahead`` rows on (1: the next selected row of the weights being streamed; 0: this row of
    another weight, read next)."""

    weight: str  # buffer name of the weights to prefetch
    row: tirx.Var  # the row loop ``jj``
    part: tirx.Var | None  # the part loop (partitioned form), else None
    stream: tirx.Var  # the loop streaming a row: the prefetches go at the start of its body
    n_elems: int  # elements of a row per iteration of ``stream``
    ahead: int
    only_active: str | None = None  # prefetch only if that row is active by this decider buffer ("gate", "h")


def _prefetch(w: tirx.Buffer, row: tirx.PrimExpr, col: tirx.PrimExpr, n_elems: int) -> list[tirx.Stmt]:
    """Prefetch statements for the cache lines of ``w[row, col : col + n_elems]`` (row start is 64-byte
    aligned when ``d_model * itemsize`` is a multiple of 64; otherwise a line may be fetched twice)."""
    step = max(1, _LINE_BYTES // (tvm.DataType(w.dtype).bits // 8))
    out = []
    for off in range(0, n_elems, step):
        addr = tirx.address_of(tirx.BufferLoad(w, [row, col + off]))
        call = tirx.call_llvm_intrin("void", "llvm.prefetch.p0", addr, 0, _PREFETCH_LOCALITY, 1)
        out.append(tirx.Evaluate(call))
    return out


def _seq(stmts: list[tirx.Stmt]) -> tirx.Stmt:
    """A SeqStmt, or the statement itself when there is one (TIR rejects a SeqStmt of length 1)."""
    return stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts)


def _rewrite_loops(func: tirx.PrimFunc, rewrites: dict[tirx.Var, Callable[[tirx.Stmt], tirx.Stmt]]) -> tirx.PrimFunc:
    """Return ``func`` with the body of the loop over each ``v`` replaced by ``rewrites[v](body)``.

    (TVM 0.27 exposes no TIR mutator to Python, so the path to each loop is rebuilt by hand; the
    scheduled functions only contain SBlockRealize / SBlock / For / SeqStmt / IfThenElse on those paths.)"""
    found: set = set()

    def rw(stmt: tirx.Stmt) -> tirx.Stmt:
        if isinstance(stmt, tirx.For):
            body = rw(stmt.body)
            for var, fn in rewrites.items():
                if stmt.loop_var.same_as(var):
                    body = fn(body)
                    found.add(var)
            if body.same_as(stmt.body):
                return stmt
            return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body, stmt.thread_binding,
                            stmt.annotations, stmt.step)
        if isinstance(stmt, tirx.SeqStmt):
            seq = [rw(s) for s in stmt.seq]
            if all(a.same_as(b) for a, b in zip(seq, stmt.seq)):
                return stmt
            return tirx.SeqStmt(seq)
        if isinstance(stmt, tirx.IfThenElse):
            then = rw(stmt.then_case)
            if then.same_as(stmt.then_case):
                return stmt
            return tirx.IfThenElse(stmt.condition, then, stmt.else_case)
        if isinstance(stmt, s_tir.SBlockRealize):
            block = rw(stmt.block)
            if block.same_as(stmt.block):
                return stmt
            return s_tir.SBlockRealize(stmt.iter_values, stmt.predicate, block)
        if isinstance(stmt, s_tir.SBlock):
            body = rw(stmt.body)
            if body.same_as(stmt.body):
                return stmt
            return s_tir.SBlock(stmt.iter_vars, stmt.reads, stmt.writes, stmt.name_hint, body, stmt.init,
                                stmt.alloc_buffers, stmt.match_buffers, stmt.annotations)
        return stmt

    body = rw(func.body)
    missing = [v for v in rewrites if v not in found]
    if missing:
        raise RuntimeError(f"loops {missing} not found in the scheduled function")
    return func.with_body(body)


def _prepend_to_loops(func: tirx.PrimFunc, inserts: dict[tirx.Var, list[tirx.Stmt]]) -> tirx.PrimFunc:
    """Return ``func`` with ``inserts[v]`` placed at the start of the body of the loop over ``v``."""
    def prepend(stmts: list[tirx.Stmt]) -> Callable[[tirx.Stmt], tirx.Stmt]:
        return lambda body: _seq([*stmts, body])

    return _rewrite_loops(func, {var: prepend(stmts) for var, stmts in inserts.items()})


def _buffers(func: tirx.PrimFunc) -> dict:
    return {buf.name: buf for buf in func.params}  # TVM 0.27: the params are the buffers


def _root_buffer(func: tirx.PrimFunc, name: str) -> tirx.Buffer:
    """The intermediate buffer ``name`` (allocated in the root block of a scheduled function)."""
    root = func.body.block
    for buf in root.alloc_buffers:
        if buf.name == name:
            return buf
    raise RuntimeError(f"buffer {name!r} not found in the scheduled function")


def _block_names(stmt: tirx.Stmt) -> list[str]:
    """Names of the blocks inside ``stmt`` (For / SeqStmt / SBlockRealize nesting)."""
    if isinstance(stmt, tirx.For):
        return _block_names(stmt.body)
    if isinstance(stmt, tirx.SeqStmt):
        return [n for s in stmt.seq for n in _block_names(s)]
    if isinstance(stmt, s_tir.SBlockRealize):
        return [stmt.block.name_hint, *_block_names(stmt.block.body)]
    return []


def _is_active(decider: str, value: tirx.PrimExpr) -> tirx.PrimExpr:
    """Whether a row whose ``gate`` / ``h`` value is ``value`` contributes (a NaN still propagates)."""
    zero = tirx.const(0.0, "float32")
    return tirx.Not(value <= zero) if decider == "gate" else value != zero


def guard_inactive_rows(func: tirx.PrimFunc, spec: KernelSpec, rj: tirx.Var, part: tirx.Var) -> tirx.PrimFunc:
    """Row loop body ``[gate…, up…, h, y_part]`` → ``[gate…, if gate > 0: [up…, h, y_part]]`` (``ffn_gated``),
    ``[up…, h, y_part]`` → ``[up…, h, if h != 0: y_part]`` (``ffn_relu``): a selected row whose ReLU is 0
    (a predicted neuron that does not fire) costs only its gate (up) row, not its up and down rows.
    ``h`` is exactly 0 there, so ``y`` is unchanged bit for bit."""
    if spec.gated:
        cond_buf, first = _root_buffer(func, "gate"), "up"
    else:
        cond_buf, first = _root_buffer(func, "h"), "y_part"
    cond = _is_active(cond_buf.name, tirx.BufferLoad(cond_buf, [part, rj]))

    def guarded(body: tirx.Stmt) -> tirx.Stmt:
        seq = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
        at = next((i for i, st in enumerate(seq) if any(n.startswith(first) for n in _block_names(st))), None)
        if at is None:
            raise RuntimeError(f"skip_inactive: no {first!r} block in the row loop")
        return _seq([*seq[:at], tirx.IfThenElse(cond, _seq(seq[at:]), None)])

    return _rewrite_loops(func, {rj: guarded})


_SCALES = {"w_up": "s_up", "w_gate": "s_gate", "w_down_t": "s_down"}  # = compute.SCALE_NAMES


def _row_prefetch(bufs: dict, w_name: str, row: tirx.PrimExpr, col: tirx.PrimExpr, n_elems: int) -> list[tirx.Stmt]:
    """Prefetches of elements ``col : col + n_elems`` of a row of weight ``w_name``; a quantized weight's
    quants (int4: two elements a byte) and the line of its scales that covers them."""
    w = bufs[w_name]
    scales = bufs.get(_SCALES.get(w_name, ""))
    if scales is None:
        return _prefetch(w, row, col, n_elems)
    per_byte = 2 if w.dtype == "uint8" else 1  # int4: nibble pairs
    block = (int(w.shape[1]) * per_byte) // int(scales.shape[1])  # elements per scale
    stmts = _prefetch(w, row, tirx.floordiv(col, per_byte), max(1, n_elems // per_byte))
    return stmts + _prefetch(scales, row, tirx.floordiv(col, block), 1)


def add_prefetch(func: tirx.PrimFunc, plan: list[Prefetch], partitions: int | None) -> tirx.PrimFunc:
    """Insert, at the start of each streaming loop of the plan, prefetches of the lines of a selected row
    at the loop's offset (see :class:`Prefetch`). The row is ``idx[min(j + ahead, k - 1)]`` with ``j = jj``
    or ``p * S + jj`` (the partitioned row numbering of ``compute.describe_partitioned``); the clamp keeps
    the ``idx`` load in bounds. Quantized weights: their quants' lines and their scales' line."""
    bufs = _buffers(func)
    idx = bufs["idx"]
    k = idx.shape[0]
    inserts: dict[tirx.Var, list[tirx.Stmt]] = {}
    for w_name, jj, part, stream, n_elems, ahead, only_active in plan:
        w = bufs[w_name]
        per_byte = 2 if w_name in _SCALES and _SCALES[w_name] in bufs and w.dtype == "uint8" else 1
        if n_elems * (tvm.DataType(w.dtype).bits // 8) // per_byte < _LINE_BYTES // 2:
            continue  # narrow vectors (odd d_model): a prefetch per few elements would cost more than it saves
        size = tirx.floordiv(k + (partitions or 1) - 1, partitions or 1)  # rows per part
        j = jj if part is None else part * size + jj
        row = tirx.BufferLoad(idx, [tirx.min(j + ahead, k - 1)])
        stmts = _row_prefetch(bufs, w_name, row, stream * n_elems, n_elems)
        if only_active is not None:  # only if that row is active (its decider value is known already)
            value = tirx.BufferLoad(_root_buffer(func, only_active), [part, tirx.min(jj + ahead, size - 1)])
            stmts = [tirx.IfThenElse(_is_active(only_active, value), _seq(stmts), None)]
        inserts.setdefault(stream, []).extend(stmts)
    return _prepend_to_loops(func, inserts)
