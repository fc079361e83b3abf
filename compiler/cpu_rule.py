"""The common frame of this project's ``llvm`` schedule rules (``dlight.cpu`` lacks them)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.script import tirx as T
from tvm.script.ir_builder.tirx import prim_func as build_prim_func
from tvm.target import Target


class CPURule(ScheduleRule):
    """A rule for TIR functions compiled for ``llvm``; ``schedule`` does the rule's own job
    and returns None for a function that is not its to schedule."""

    def is_target_available(self, target: Target) -> bool:
        return target.kind.name == "llvm"

    def apply(self, func, target: Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        return self.schedule(s_tir.Schedule(func), func, target)

    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        raise NotImplementedError


def find_block(sch: s_tir.Schedule, name: str):
    """The block called ``name``, or None where the function has none."""
    try:
        return sch.get_sblock(name)
    except Exception:  # noqa: BLE001 - TVM raises its own error types for a missing block
        return None


# Output elements below which a kernel runs on the calling thread: a thread-pool launch and
# barrier costs microseconds (a scheduler time slice when the machine is busy), the work less.
SERIAL_BELOW_ELEMENTS = 8192


def per_vocabulary(build: Callable[..., tirx.PrimFunc]) -> Callable[..., tirx.PrimFunc]:
    """``build(v, *args)``, a sampler's row kernel, built once per fixed vocabulary size ``v``
    (a symbolic one builds anew): parsing a kernel's TVMScript takes 0.1-0.3 s, and a sampler
    module asks for some of them two or three times."""

    @functools.cache
    def fixed(size: int, dtype: str, *args) -> tirx.PrimFunc:
        return build(tirx.const(size, dtype), *args)

    @functools.wraps(build)
    def kernel(v: tirx.PrimExpr, *args) -> tirx.PrimFunc:
        return fixed(int(v), str(v.ty), *args) if isinstance(v, tirx.IntImm) else build(v, *args)

    return kernel


@T.macro
def each_row(n, row, buffers):
    """``row(*buffers, i)`` for each of ``n`` rows: one row on the calling thread (a pool
    launch would cost more than it saves), several on the thread pool. For the sampler's
    per-row kernels, whose rows are independent and computed alike whatever the batch."""
    if n == 1:
        row(*buffers, 0)
    else:
        for i in T.parallel(n):
            row(*buffers, i)


@contextmanager
def scheduled_prim_func() -> Iterator[None]:
    """A PrimFunc frame, for TVM's IR builder, for a kernel scheduled by hand: the dlight rules
    must leave it alone, and fusing it with a neighbour would hand the fused function back to
    them. Unnamed: the module names each kernel where it is added. ``s_tir``, with the body in a
    root block, as Relax's analyses expect. No ``tirx.noalias``: ``noalias.py`` gives each
    artifact's kernels one setting, and a kernel compiled alone (``scripts/bench_kernel.py``)
    then runs as an int8 artifact's do."""
    with build_prim_func(s_tir=True):
        T.func_attr({"tirx.is_scheduled": True, "op_pattern": 8})
        yield


@contextmanager
def root_block() -> Iterator[None]:
    """The root block of a kernel written with TVM's IR builder, with the empty read and write
    regions that TVM would derive for it where it allocates nothing (the same IR): left out,
    the PrimFunc frame derives them from the whole body, 1.6 s for one of Qwen2.5's int8
    matmuls and most of a model's graph build."""
    with T.sblock("root"):
        T.reads()
        T.writes()
        yield


def float_lanes(target: Target) -> int:
    """float32 lanes of the widest vectors the target's CPU has: 16 with AVX-512, else 8."""
    return 16 if "avx512f" in tvm.target.codegen.llvm_get_cpu_features(target) else 8


def for_each_row(rows, elements, body) -> None:
    """For kernels written with TVM's IR builder: ``body(r)`` for each of ``rows`` rows in a
    root block, on the calling thread below ``SERIAL_BELOW_ELEMENTS`` output ``elements`` and on
    the thread pool from there, the same per-row code either way (as ``serial_when_small`` does
    for scheduled kernels)."""
    with root_block(), T.If(elements < SERIAL_BELOW_ELEMENTS):
        with T.Then(), T.serial(0, rows) as r:
            body(r)
        with T.Else(), T.parallel(0, rows) as r:
            body(r)


def serial_when_small(sch: s_tir.Schedule) -> s_tir.Schedule:
    """Give a kernel whose body is one parallel loop a serial copy of it, taken at run time
    when the output is smaller than ``SERIAL_BELOW_ELEMENTS``: a decode step's norms and
    activations (one row) then skip the thread pool, while prefill keeps its threads."""
    func = sch.mod["main"]
    root = func.body.block
    loop = root.body
    shape = getattr(func.params[-1].ty, "shape", None)  # the output, destination-passing style
    if not isinstance(loop, tirx.For) or loop.kind != tirx.ForKind.PARALLEL or shape is None:
        return sch
    elements = 1
    for extent in shape:
        elements = elements * extent
    serial = tirx.For(
        loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, loop.body,
        loop.thread_binding, loop.annotations, loop.step,
    )  # fmt: skip
    body = tirx.IfThenElse(elements < SERIAL_BELOW_ELEMENTS, serial, loop)
    block = s_tir.SBlock([], [], [], "root", body, alloc_buffers=root.alloc_buffers)
    merged = func.with_body(s_tir.SBlockRealize([], True, block))
    # Both branches hold the same loop and block variables.
    return s_tir.Schedule(s_tir.transform.ConvertSSA()(tvm.IRModule({"main": merged})))


class SerialWhenSmall(CPURule):
    """``rule``'s schedule, with ``serial_when_small``."""

    def __init__(self, rule):
        self.rule = rule

    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        scheduled = self.rule.apply(func, target, False)
        return serial_when_small(scheduled) if isinstance(scheduled, s_tir.Schedule) else None
