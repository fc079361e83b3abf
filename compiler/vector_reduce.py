"""Reductions of TIR vectors for the hand-written CPU kernels: short dependency chains, no libm."""

from __future__ import annotations

from collections.abc import Callable

from tvm import tirx
from tvm.script import tirx as T


def tree(combine: Callable, values: list):
    """A balanced reduction tree: short dependency chains."""
    while len(values) > 1:
        pairs = [combine(a, b) for a, b in zip(values[0::2], values[1::2], strict=False)]
        values = pairs + ([values[-1]] if len(values) % 2 else [])
    return values[0]


def horizontal(combine: Callable, vector, lanes: int):
    """The lanes of ``vector`` combined into a scalar, halving the vector each step."""
    while lanes > 1:
        lanes //= 2
        vector = T.Bind(vector)
        low = tirx.Shuffle([vector], list(range(lanes)))
        high = tirx.Shuffle([vector], list(range(lanes, 2 * lanes)))
        vector = combine(low, high)
    return vector
