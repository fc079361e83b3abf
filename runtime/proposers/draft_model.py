"""A small draft model proposing k tokens per step from its own paged KV cache."""

from __future__ import annotations

import time

import numpy as np
import tvm.runtime

from .. import rows
from ..draft_tree import block_parents
from ..model import Model
from ..request import Sequence
from ..sampler import DraftProbs
from ..speculation import DraftCosts
from ..speculation.warm_up import (
    CATCH_UP_STRIDE,
    LARGEST_CATCH_UP,
    record,
    sizes,
    spread,
    time_passes,
)
from ..structured_output import unconstrained
from .base import Proposal, Proposer


class DraftModelProposer(Proposer):
    """Each step first feeds the draft what it has not seen -- the whole prompt the first time
    (or after the sequence skipped speculation for a while), else the pending token, plus after a
    bonus token the last draft token whose KV the draft never computed (backfill) -- in one ragged
    prefill, then decodes k-1 more tokens, batched.

    Drafts are sampled with each request's own temperature/top-k/top-p, the same processing the
    target's distribution gets, as lossless rejection sampling requires; their distributions
    stay on the device for the verification. Greedy drafts of greedy requests are argmaxes, a
    point mass each: no distributions at all. A request with a grammar (structured output)
    gets its drafts from the draft's rows masked by the grammar's state after the drafts before
    (``runtime/structured_output.py``), so they are grammatical, and a sampled draft's recorded
    distribution is the masked one it was drawn from.

    With ``tree_width`` > 1 the draft grows a tree instead (``runtime/draft_tree.py``): from the
    pending token, each depth expands every node of the last depth into its ``width`` most
    probable tokens and keeps the ``width`` children of highest path probability, one
    batched pass per depth over the kept nodes (EAGLE-2's dynamic tree). The children are
    chosen, not sampled, so every request verifies them as point masses.
    """

    method = "draft"

    def __init__(
        self,
        model: Model,
        max_batch_size: int,
        max_total_len: int,
        prefill_chunk_size: int,
        prefix_cache: bool = False,
        tree_width: int = 1,
    ):
        self.model, self.chunk_size, self.width = model, prefill_chunk_size, tree_width
        self.kv = model.create_kv_cache(
            max_batch_size, max_total_len, prefill_chunk_size, prefix_cache=prefix_cache
        )
        self.costs = DraftCosts(model=True)
        self._known: set[int] = set()
        self._trees: dict[int, int] = {}  # a tree's root position, per sequence growing one

    def catch_up(self, seq: Sequence) -> int:
        seen = self.kv.sequence_length(seq.seq_id) if seq.seq_id in self._known else 0
        return len(seq.tokens) - seen

    def warm_up(self, max_rows: int) -> None:
        """First passes of 1..2 x max_rows tokens (a pending token, maybe a backfill, per row),
        one sequence's catch-ups up to ``LARGEST_CATCH_UP`` tokens (or a prefill chunk), and
        further passes of 1..max_rows rows (``sizes`` of each). The catch-ups are measured, not
        extrapolated from the steady passes: a small pass costs far more per token, and the
        policy weighs a catch-up against what drafting gains over the rest of a reply."""
        firsts = [spread(n, 2) for n in sizes(1, 2 * max_rows)]
        largest = min(self.chunk_size, LARGEST_CATCH_UP)
        firsts += [[n] for n in range(CATCH_UP_STRIDE, largest + 1, CATCH_UP_STRIDE)]
        record(self.costs.first, map(sum, firsts), self._time("prefill", firsts))
        nexts = [[1] * rows for rows in sizes(1, max_rows)]
        record(self.costs.next, map(len, nexts), self._time("decode", nexts))

    def _time(self, function: str, passes: list[list[int]]) -> list[float | None]:
        return time_passes(self.model, self.kv, function, passes, self.chunk_size)

    def _catch_up(self, seqs: list[Sequence]) -> tuple[tvm.runtime.Tensor, int]:
        """Feed each sequence what the draft has not seen: the logits after each one's last
        token, and how many tokens were fed."""
        for seq in seqs:
            if seq.seq_id not in self._known:  # from the prefix cache's pages where it can
                self.kv.add_sequence_with_prefix(seq.seq_id, seq.tokens)
                self._known.add(seq.seq_id)
        ids = [s.seq_id for s in seqs]
        feeds = [s.tokens[self.kv.sequence_length(s.seq_id) :] for s in seqs]
        logits = self.model.prefill_chunked(self.kv, ids, feeds, self.chunk_size)
        return logits, sum(map(len, feeds))

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        if self.width > 1:
            return self.propose_tree(seqs, num_tokens, self.width)
        start = time.perf_counter()
        ids = [s.seq_id for s in seqs]
        logits, caught_up = self._catch_up(seqs)
        sampler, greedy = self.model.sampler, all(s.params.greedy for s in seqs)
        tokens: list[list[int]] = [[] for _ in seqs]
        prob_rows: list[list[int]] = [[] for _ in seqs]
        probs = None if greedy else rows.empty(sum(num_tokens), logits)
        active, filled = list(range(len(seqs))), 0
        while True:
            u = np.array([seqs[i].draft_rng.random() for i in active])
            trees = [
                ([seqs[i].tokens[-1], *tokens[i]], block_parents(len(tokens[i])), [len(tokens[i])])
                for i in active
            ]
            logits = self._masked(logits, [seqs[i] for i in active], trees)
            if greedy:
                sampled = sampler.argmax(logits)
            else:
                p = sampler.probs(logits, [seqs[i].params for i in active])
                sampled = sampler.sample(p, u)
                rows.put(p, probs, filled)
            for row, (i, tok) in enumerate(zip(active, sampled, strict=True)):
                tokens[i].append(int(tok))
                prob_rows[i].append(filled + row)
            filled += len(active)
            now = time.perf_counter()
            if len(tokens[active[0]]) == 1:
                self.costs.first.observe(caught_up, now - start)
            else:
                self.costs.next.observe(len(active), now - start)
            active = [i for i in active if len(tokens[i]) < num_tokens[i]]
            if not active:
                break
            start = now
            logits = self.model.decode(
                self.kv, [ids[i] for i in active], [tokens[i][-1] for i in active]
            )
        return Proposal(
            tokens=[np.array(t, dtype=np.int64) for t in tokens],
            probs=None if greedy else DraftProbs(probs, [np.array(r) for r in prob_rows]),
        )

    def propose_tree(self, seqs: list[Sequence], depths: list[int], width: int) -> Proposal:
        """A tree per sequence of depth ``depths[i]``, ``width`` nodes a depth (the class
        docstring)."""
        start = time.perf_counter()
        ids = [s.seq_id for s in seqs]
        logits, caught_up = self._catch_up(seqs)
        b = len(seqs)
        tokens: list[list[int]] = [[s.tokens[-1]] for s in seqs]  # offset 0: the pending token
        parents: list[list[int]] = [[-1] for _ in seqs]
        score: list[list[float]] = [[0.0] for _ in seqs]  # log probability of each path
        frontier: list[list[int]] = [[0] for _ in seqs]
        for seq in seqs:
            self._trees[seq.seq_id] = self.kv.sequence_length(seq.seq_id) - 1
        active, depth = list(range(b)), 0
        while True:
            trees = [(tokens[i], parents[i], frontier[i]) for i in active]
            masked = self._masked(logits, [seqs[i] for i in active], trees)
            top, probs = self.model.sampler.top_tokens(masked)
            row = 0
            for i in active:
                candidates = []
                for node in frontier[i]:
                    for token, p in zip(top[row, :width], probs[row, :width], strict=True):
                        if p > 0:
                            candidates.append((score[i][node] + np.log(p), node, int(token)))
                    row += 1
                candidates.sort(key=lambda c: -c[0])  # stable: the earlier node first on ties
                frontier[i] = []
                for path_score, node, token in candidates[:width]:
                    frontier[i].append(len(tokens[i]))
                    tokens[i].append(token)
                    parents[i].append(node)
                    score[i].append(path_score)
            now = time.perf_counter()
            if depth == 0:
                self.costs.first.observe(caught_up, now - start)
            else:
                self.costs.next.observe(sum(len(frontier[i]) for i in active), now - start)
            depth += 1
            active = [i for i in active if depth < depths[i] and frontier[i]]
            if not active:
                break
            start = now
            logits = self.model.evaluate_multi_query(
                self.kv,
                [ids[i] for i in active],
                [[tokens[i][n] for n in frontier[i]] for i in active],
                [(self._trees[ids[i]], np.array(parents[i])) for i in active],
            )
        return Proposal(
            tokens=[np.array(t[1:], dtype=np.int64) for t in tokens],
            probs=None,
            parents=[np.array(p[1:], dtype=np.int64) for p in parents],
        )

    def _masked(
        self,
        logits: tvm.runtime.Tensor,
        seqs: list[Sequence],
        trees: list[tuple[list[int], Sequence[int], list[int]]],
    ) -> tvm.runtime.Tensor:
        """``logits`` (per sequence, a row per node it drafts from) masked by each sequence's
        grammar: ``trees[i]`` is sequence i's drafts so far as a tree (tokens from its pending
        token on, parents) and the nodes whose rows these are, each masked with the grammar's
        state after its path."""
        if all(s.constraint is None for s in seqs):
            return logits
        vocab, masks = self.model.vocab_size, []
        for seq, (tokens, parents, nodes) in zip(seqs, trees, strict=True):
            if seq.constraint is None:
                masks.append(unconstrained(len(nodes), vocab))
                continue
            rows = seq.constraint.masks(tokens, parents)[nodes]
            rows[~rows.any(axis=1)] = -1  # a path the grammar ended: anything may be drafted
            masks.append(rows)
        return self.model.sampler.mask(logits, np.concatenate(masks))

    def on_verified(self, seqs: list[Sequence], proposed: list[int], kept: list[list[int]]) -> None:
        for seq, k, path in zip(seqs, proposed, kept, strict=True):
            root = self._trees.pop(seq.seq_id, None)
            if root is not None:  # the cache holds the tree's nodes but its last depth's
                fed = self.kv.sequence_length(seq.seq_id) - root - 1
                self.kv.keep(seq.seq_id, root, [0, *(n for n in path if n <= fed)])
            elif k:  # the cache holds drafts 1..k-1 (the k-th was never fed): keep accepted ones
                a = len(path)
                self.kv.popn(seq.seq_id, (k - 1) - min(a, k - 1))

    def remove(self, seq: Sequence) -> None:
        if seq.seq_id in self._known:
            # Its cache holds the sequence's tokens (rejected drafts were popped), and past
            # them at most drafts that were never verified: those are left out.
            self.kv.cache_prefix(seq.seq_id, seq.tokens)
            self.kv.remove_sequence(seq.seq_id)
            self._known.discard(seq.seq_id)
            self._trees.pop(seq.seq_id, None)


class DraftTreeProposer(Proposer):
    """The draft model's trees beside its chains, for the automatic policy to choose between
    per sequence and step (method ``draft_tree``): the same model, cache and costs as the
    chains' ``DraftModelProposer``, growing trees of ``width`` nodes a depth."""

    method = "draft_tree"

    def __init__(self, draft: DraftModelProposer, width: int):
        self.draft, self.width, self.costs = draft, width, draft.costs

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        return self.draft.propose_tree(seqs, num_tokens, self.width)

    def on_verified(self, seqs: list[Sequence], proposed: list[int], kept: list[list[int]]) -> None:
        self.draft.on_verified(seqs, proposed, kept)

    def remove(self, seq: Sequence) -> None:
        self.draft.remove(seq)

    def catch_up(self, seq: Sequence) -> int:
        return self.draft.catch_up(seq)

    def warm_up(self, max_rows: int) -> None:
        """Nothing of its own: the chains' proposer measures the model's passes."""
