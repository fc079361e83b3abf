"""A small draft model proposing k tokens per step from its own paged KV cache."""

from __future__ import annotations

import numpy as np

from ..kv_cache import PagedKVCache
from ..model import Model
from ..request import Sequence
from ..sampling import probs_for, sample_from_probs
from .base import Proposal, Proposer


class DraftModelProposer(Proposer):
    """Each step first feeds the draft what it has not seen -- the whole prompt the first time,
    else the pending token, plus after a bonus token the last draft token whose KV the draft
    never computed (backfill) -- in one ragged prefill, then decodes k-1 more tokens, batched.

    Drafts are sampled with each request's own temperature/top-k/top-p, the same processing the
    target's distribution gets, as lossless rejection sampling requires.
    """

    def __init__(self, model: Model, kv: PagedKVCache, chunk_size: int):
        self.model, self.kv, self.chunk_size = model, kv, chunk_size
        self._known: set[int] = set()

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        for seq in seqs:
            if seq.seq_id not in self._known:
                self.kv.add_sequence(seq.seq_id)
                self._known.add(seq.seq_id)
        ids = [s.seq_id for s in seqs]
        logits = self.model.prefill_chunked(
            self.kv,
            ids,
            [s.tokens[self.kv.sequence_length(s.seq_id) :] for s in seqs],
            self.chunk_size,
        )
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[np.ndarray]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        while True:
            p = probs_for(logits, [seqs[i].params for i in active])
            u = np.array([seqs[i].draft_rng.random() for i in active])
            for row, (i, tok) in enumerate(zip(active, sample_from_probs(p, u), strict=True)):
                tokens[i].append(int(tok))
                probs[i].append(p[row])
            active = [i for i in active if len(tokens[i]) < num_tokens[i]]
            if not active:
                break
            logits = self.model.decode(
                self.kv, [ids[i] for i in active], [tokens[i][-1] for i in active]
            )
        return Proposal(
            tokens=[np.array(t, dtype=np.int64) for t in tokens],
            probs=[np.stack(p) for p in probs],
        )

    def on_verified(self, seqs: list[Sequence], proposed: list[int], accepted: list[int]) -> None:
        # The draft cache holds drafts 1..k-1 (the k-th was never fed); keep the accepted ones.
        for seq, k, a in zip(seqs, proposed, accepted, strict=True):
            if k:
                self.kv.popn(seq.seq_id, (k - 1) - min(a, k - 1))

    def remove(self, seq: Sequence) -> None:
        if seq.seq_id in self._known:
            self.kv.remove_sequence(seq.seq_id)
            self._known.discard(seq.seq_id)
