"""How much of a sequence's text the model-free proposer drafts, where a draft model drafts
beside it (method ``auto``).

A draft model first reads what the sequence made while it did not draft, and the policy spreads
that catch-up over the tokens it will draft for (``Candidate.served``). Alone, that is the rest of
the reply. Beside suffix decoding it is only the text suffix decoding leaves it: on the editing
workload suffix decoding drafted ~90% of the tokens, and a draft model that caught up on a
~220-token prompt to draft the rest drafted a few steps before suffix decoding took over again
(Qwen 1.5B/0.5B int8 at batch 1: 5 catch-ups, 2.0 s for 23 tokens, where a plain step makes a
token in 44 ms; method auto ran at 0.92x suffix decoding alone).

The share is the tokens a sequence emitted in steps where the model-free proposer drafted for it,
over all it emitted, faded per step (a reply moves between text it copies and text it writes)
against the engine-wide share as a prior.
"""

from __future__ import annotations

from .acceptance import ENGINE_DECAY, SEQUENCE_DECAY

# The engine-wide share counts as this many tokens against a sequence's own.
PRIOR_TOKENS = 8.0


class Coverage:
    def __init__(self) -> None:
        self.covered = 0.0  # tokens emitted in steps the model-free proposer drafted, fading
        self.emitted = 0.0  # all tokens emitted, fading
        self._own: dict[int, list[float]] = {}  # seq_id -> [covered, emitted], fading

    def engine_share(self) -> float:
        return self.covered / self.emitted if self.emitted else 0.0

    def share(self, seq_id: int) -> float:
        """The share of ``seq_id``'s next tokens the model-free proposer is expected to draft."""
        covered, emitted = self._own.get(seq_id, (0.0, 0.0))
        return (covered + PRIOR_TOKENS * self.engine_share()) / (emitted + PRIOR_TOKENS)

    def observe(self, seq_id: int, emitted: int, covered: bool) -> None:
        """A step of ``seq_id`` emitted ``emitted`` tokens, drafted by the model-free proposer
        where ``covered``."""
        self.covered = self.covered * ENGINE_DECAY + covered * emitted
        self.emitted = self.emitted * ENGINE_DECAY + emitted
        own = self._own.setdefault(seq_id, [0.0, 0.0])
        own[0] = own[0] * SEQUENCE_DECAY + covered * emitted
        own[1] = own[1] * SEQUENCE_DECAY + emitted

    def forget(self, seq_id: int) -> None:
        self._own.pop(seq_id, None)
