"""Make each VM object once per call: shapes, tensor views and reshapes repeat layer after layer.

After ``VMShapeLower`` a batch-1 SmolLM2 decode ran ~4,450 VM instructions for its 485 kernel
calls: every kernel's output got a fresh ``make_shape`` (a heap-allocated shape object) and a
fresh ``alloc_tensor`` view into its statically planned storage, every reshape chain made each
intermediate view, and ``KillAfterLastUse`` dropped each of them again, along with every weight
taken out of the parameter tuple. That bookkeeping took about an eighth of the decode step
(docs/kernels.md). Objects that an earlier instruction already made with the same
arguments are the same value here:

- a shape's dimensions live in the shape heap, whose slots are written once per call;
- a view at the same storage, offset, shape and type is the same bytes, and the static planner
  never gives two live tensors the same bytes, so no kernel sees a new alias;
- a reshape of a reshape is a reshape of its root.

So the pass keeps the first of each, rewrites later uses to it, drops pure bindings nobody
reads, and re-places each kill after the last use of what it kills, no kill for a parameter
tuple's items (the caller's tuple holds them, so killing frees nothing). The kernels and their
arguments' bytes are unchanged, so every row is bit for bit what it was. Functions with control
flow are left as they are.
"""

from __future__ import annotations

import tvm
from tvm import relax as rx

_KILL = tvm.ir.Op.get("relax.vm.kill_object")
_ALLOC_TENSOR = tvm.ir.Op.get("relax.vm.alloc_tensor")
_MAKE_SHAPE = "vm.builtin.make_shape"
_RESHAPE = "vm.builtin.reshape"


def _builtin(value: rx.Expr) -> str | None:
    if isinstance(value, rx.Call) and isinstance(value.op, rx.ExternFunc):
        return value.op.global_symbol
    return None


def _vars(expr: rx.Expr) -> list[rx.Var]:
    """The variables ``expr`` reads. Calls, tuples and their items by a walk of its own, since
    ``post_order_visit`` also walks each variable's struct info: an item of the parameter tuple
    took ~1,500 visits (its fields' shapes), 2 s of SmolLM2's compile per function."""
    if isinstance(expr, rx.Var):
        return [expr]
    if isinstance(expr, rx.Call):
        return [*_vars(expr.op), *(var for arg in expr.args for var in _vars(arg))]
    if isinstance(expr, rx.Tuple):
        return [var for field in expr.fields for var in _vars(field)]
    if isinstance(expr, rx.TupleGetItem):
        return _vars(expr.tuple_value)
    found: list[rx.Var] = []
    rx.analysis.post_order_visit(expr, lambda e: found.append(e) if isinstance(e, rx.Var) else None)
    return found


@rx.expr_functor.mutator
class _Substitute(rx.PyExprMutator):
    def __init__(self, alias: dict[rx.Var, rx.Var]):
        super().__init__()
        self.alias = alias

    def visit_var_(self, var: rx.Var) -> rx.Expr:
        return self.alias.get(var, var)


def _argument_key(arg: rx.Expr):
    """A variable by identity (names repeat), a constant by value; None for anything else."""
    if isinstance(arg, rx.Var):
        return arg
    if isinstance(arg, (tvm.tirx.IntImm, tvm.ir.expr.GenericConst, tvm.ir.expr.StringImm)):
        return ("constant", str(arg))  # an integer with its type, a dtype, a memory scope
    return None


def _reusable_key(value: rx.Expr) -> tuple | None:
    """Equal keys make equal objects: the shape heap's slots, a storage's bytes, a view's root."""
    if _builtin(value) in (_MAKE_SHAPE, _RESHAPE):
        kind = _builtin(value)
    elif isinstance(value, rx.Call) and value.op == _ALLOC_TENSOR:
        kind = "alloc_tensor"
    else:
        return None
    key = tuple(_argument_key(arg) for arg in value.args)
    return None if None in key else (kind, *key)


def _is_pure(value: rx.Expr) -> bool:
    return _builtin(value) in (_MAKE_SHAPE, _RESHAPE) or isinstance(value, rx.Tuple)


def dedup_function(func: rx.Function) -> rx.Function:
    """``func`` with each VM object made once; unchanged if it has control flow."""
    body = func.body
    if not isinstance(body, rx.SeqExpr):
        return func
    bindings = [binding for block in body.blocks for binding in block.bindings]
    if any(
        not isinstance(b, rx.VarBinding) or isinstance(b.value, (rx.If, rx.SeqExpr))
        for b in bindings
    ):
        return func
    alias: dict[rx.Var, rx.Var] = {}
    kept, killed = _reuse(bindings, alias)
    result = _Substitute(alias).visit_expr(body.body)
    kept = _read_only(kept, result)
    params = set(func.params)
    never_killed = params | set(_vars(result))
    never_killed |= {  # the caller's tuple holds a parameter's items: killing frees nothing
        var
        for var, value in kept
        if isinstance(value, rx.TupleGetItem) and value.tuple_value in params
    }
    out = _kill_after_last_use(kept, [var for var in killed if var not in never_killed])
    return rx.Function(
        func.params,
        rx.SeqExpr([rx.BindingBlock(out)], result),
        func.ret_ty,
        func.is_pure,
        func.attrs,
        func.span,
    )


def _reuse(
    bindings: list[rx.VarBinding], alias: dict[rx.Var, rx.Var]
) -> tuple[list[tuple[rx.Var, rx.Expr]], list[rx.Var]]:
    """The bindings left once each object repeats its first maker (``alias`` maps the dropped
    variables to it) and reshape chains start at their root, without the kills; what was
    killed."""
    substitute = _Substitute(alias)
    first: dict[tuple, rx.Var] = {}
    reshape_root: dict[rx.Var, rx.Expr] = {}
    kept: list[tuple[rx.Var, rx.Expr]] = []
    killed: list[rx.Var] = []
    for binding in bindings:
        var, value = binding.var, binding.value
        if isinstance(value, rx.Call) and value.op == _KILL:
            killed.append(value.args[0])
            continue
        if any(used in alias for used in _vars(value)):
            value = substitute.visit_expr(value)
        if _builtin(value) == _RESHAPE:
            source = value.args[0]
            if source in reshape_root:
                value = rx.Call(
                    value.op, [reshape_root[source], *value.args[1:]], value.attrs, value.ty_args
                )
            reshape_root[var] = value.args[0]
        key = _reusable_key(value)
        if key is not None and key in first:
            alias[var] = first[key]
            continue
        if key is not None:
            first[key] = var
        kept.append((var, value))
    return kept, list(dict.fromkeys(killed))


def _read_only(kept: list[tuple[rx.Var, rx.Expr]], result: rx.Expr) -> list[tuple[rx.Var, rx.Expr]]:
    """Without the pure bindings that nothing reads (a reshape's former intermediates, the
    tuples of a call's outputs), until none is left."""
    while True:
        read = set(_vars(result))
        for _, value in kept:
            read.update(_vars(value))
        unread = {var for var, value in kept if var not in read and _is_pure(value)}
        if not unread:
            return kept
        kept = [(var, value) for var, value in kept if var not in unread]


def _kill_after_last_use(
    kept: list[tuple[rx.Var, rx.Expr]], killed: list[rx.Var]
) -> list[rx.VarBinding]:
    """The bindings, each of ``killed`` dropped right after the last one that reads it."""
    last_use: dict[rx.Var, int] = {}
    for index, (var, value) in enumerate(kept):
        last_use.setdefault(var, index)
        for used in _vars(value):
            last_use[used] = index
    kills_after: dict[int, list[rx.Var]] = {}
    for var in killed:
        if var in last_use:  # not a binding dropped as unread or repeated
            kills_after.setdefault(last_use[var], []).append(var)
    out = []
    for index, (var, value) in enumerate(kept):
        out.append(rx.VarBinding(var, value))
        for dead in kills_after.get(index, ()):
            out.append(rx.VarBinding(rx.Var("_", rx.ObjectType()), rx.Call(_KILL, [dead])))
    return out


@tvm.transform.module_pass(opt_level=0, name="DedupVMObjects")
class DedupVMObjects:
    """Runs after ``VMShapeLower`` on every Relax function (``dedup_function``)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gv, func in list(mod.functions_items()):
            if isinstance(func, rx.Function):
                mod[gv] = dedup_function(func)
        return mod
