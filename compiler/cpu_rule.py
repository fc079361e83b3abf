"""The common frame of this project's ``llvm`` schedule rules (``dlight.cpu`` lacks them)."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
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
