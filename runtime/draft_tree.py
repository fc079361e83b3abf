"""Draft trees: several candidate continuations per position, verified in one target pass.

A tree hangs off a sequence's last token (its root, offset 0). Every other node has a parent at
a smaller offset, so a tree listed depth by depth is also listed parents first; a chain is the
tree whose node ``i`` has parent ``i - 1``. The KV cache appends a tree's nodes in offset order
and gives each the position of its depth, and each node attends to the sequence and its own
path (``compiler/cpu_attention.py``), so its logits are those of decoding that path.

Acceptance walks down from the root: at each node the target picks its next token, greedily or
by sampling, and the walk moves to the child holding that token, or stops there with it. The
draft tree proposes its children deterministically (a point mass each), so sampling is exact
with sequential point-mass rejection (SpecInfer's multi-draft rule for drafts that are not
sampled): child ``c`` is accepted with the probability the residual target distribution gives
it, ``p(c) / (1 - p(children tried before))``; if every child is rejected, the token comes from
the target distribution with the tried children removed. Marginally, the token is drawn from the
target's distribution, whichever children the draft offered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np


def tree_paths(parents: Sequence[int]) -> list[list[int]]:
    """Each node's path of offsets from the root (``parents[0]`` is -1, the root's)."""
    paths: list[list[int]] = []
    for node, parent in enumerate(parents):
        if node == 0:
            if parent != -1:
                raise ValueError("a tree's first node is its root (parent -1)")
            paths.append([0])
        elif not 0 <= parent < node:
            raise ValueError(f"node {node}'s parent {parent} is not an earlier node")
        else:
            paths.append([*paths[parent], node])
    return paths


def block_parents(num_drafts: int, parents: Sequence[int] | None = None) -> np.ndarray:
    """The parents of a verify block's nodes: the pending token (the root, -1), then each
    draft's, as a proposal gives them (``None``: a chain, draft j's parent being j - 1)."""
    drafts = np.arange(num_drafts) if parents is None else np.asarray(parents)
    return np.concatenate([[-1], drafts]).astype(np.int64)


def children(parents: Sequence[int]) -> list[list[int]]:
    """Each node's children, in offset order (the draft's order of preference)."""
    out: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            out[parent].append(node)
    return out


@dataclasses.dataclass
class Walk:
    """An accepted path: the nodes kept after the root and the tokens emitted (their tokens,
    then the target's own token from the last node)."""

    path: list[int]
    tokens: list[int]


def greedy_walk(tokens: Sequence[int], parents: Sequence[int], best: Sequence[int]) -> Walk:
    """The longest path whose tokens are each the target's argmax (``best[node]``) at its
    parent, then the argmax after it: what plain greedy decoding emits."""
    kids = children(parents)
    node, path = 0, []
    while True:
        chosen = next((c for c in kids[node] if tokens[c] == best[node]), None)
        if chosen is None:
            return Walk(path, [tokens[n] for n in path] + [int(best[node])])
        path.append(chosen)
        node = chosen


def sampled_walk(
    tokens: Sequence[int],
    parents: Sequence[int],
    probs: Callable[[int], np.ndarray],
    uniform: Callable[[], float],
) -> Walk:
    """Sequential point-mass rejection down the tree (the module's docstring): ``probs(node)``
    is the target's processed distribution at ``node`` (read only for the nodes the walk
    reaches), ``uniform()`` the request's next draw in [0, 1)."""
    kids = children(parents)
    node, path = 0, []
    while True:
        p = np.array(probs(node), dtype=np.float64)
        mass, chosen, last = p.sum(), None, None
        for child in kids[node]:
            q = p[tokens[child]]
            if q > 0:
                last = child
                if uniform() * mass < q:
                    chosen = child
                    break
            mass -= q
            p[tokens[child]] = 0
        if chosen is None and not p.any():  # rounding rejected the one child left with mass
            chosen = last
        if chosen is None:
            return Walk(path, [tokens[n] for n in path] + [_inverse_cdf(p, uniform())])
        path.append(chosen)
        node = chosen


def _inverse_cdf(p: np.ndarray, u: float) -> int:
    """The token at ``u`` of ``p``'s total mass; never one of zero mass."""
    cdf = np.cumsum(p)
    token = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(p) - 1)
    return token if p[token] > 0 else int(np.flatnonzero(p[: token + 1])[-1])
