"""When to weigh a batch's drafts again after the policy declined them.

Weighing costs host time per row and step: each automatic sequence's candidates with their
lookups, then the policy's search (SmolLM2 int8, 16 streams on HumanEval: ~0.35 ms of a ~21 ms
step). Under load, where a verified token costs about what a decoded one does, the answer is
"none" step after step, and automatic speculation ran 1-3% behind no speculation for asking.
So after a step where the policy chose no draft, and the weighing took more than
``MIN_SHARE`` of the step, the batch steps plain for ``rest`` steps before it is weighed
again, ``rest`` doubling with each such decline up to ``MOST_REST``. A step that drafts asks
every step again, and so does a batch with a sequence new to it, whose acceptance is the
optimistic prior's. Estimates still fade while the batch rests, so the next weighing sees the
evidence it would have seen.

Where weighing is cheap against the step (a larger model's longer steps) it stays every step:
a rest would save little there, and it skips the steps whose lookups would have found drafts
worth taking.
"""

from __future__ import annotations

from collections.abc import Iterable

# Most plain steps between two weighings: a sequence whose drafts started to pay waits at most
# this long for them.
MOST_REST = 8
# The share of a step that weighing must cost for a decline to rest the batch.
MIN_SHARE = 0.01


class Backoff:
    def __init__(self) -> None:
        self.rest = 0  # plain steps after the latest decline
        self._left = 0  # of those, still to come
        self._batch: frozenset[int] = frozenset()  # the sequences that decline was for
        self.rested_steps = 0  # steps planned plain without weighing

    def resting(self, seq_ids: Iterable[int]) -> bool:
        """Whether this step of ``seq_ids`` goes plain without weighing its drafts."""
        if self._left <= 0 or not self._batch.issuperset(seq_ids):
            self._left = 0
            return False
        self._left -= 1
        self.rested_steps += 1
        return True

    def weighed(
        self, seq_ids: Iterable[int], drafted: bool, seconds: float, step: float | None
    ) -> None:
        """The policy weighed a step of ``seq_ids`` in ``seconds`` and chose drafts for their
        automatic sequences or not (``drafted``); ``step``: the predicted plain step."""
        if drafted or step is None or seconds <= MIN_SHARE * step:
            self.rest = self._left = 0
            return
        self.rest = min(2 * self.rest or 1, MOST_REST)
        self._left = self.rest
        self._batch = frozenset(seq_ids)
