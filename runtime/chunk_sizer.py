"""How many prompt tokens a chunk riding in the decoding rows' step may take, so that the step
costs at most an allowance more than their plain step: learnt from the steps it rode in, as a
controller, not from a cost model.

What a chunk adds is not proportional to its tokens. SmolLM2 int8 beside 8 streams on 2 cores
(their plain step ~14 ms), measured added ms for 1 / 2 / 4 / 8 / 16 prompt tokens:

- after 0 tokens of context: 2.2 / 2.5 / 3.1 / 4.7 / 8.9;
- after 2,000: 6.4 / 9.2 / 13.1 / 20.0 / 28.9.

The pass pays once for having more rows than the decoding ones (the int8 matmuls take up to 8
rows in one pass over a weight vector's decoded codes on AVX-512, so a ninth decodes every code
again) and once for reading the prompt's context from memory; each token then pays its share of
the weights' work and its attention over that context from cache. A least-squares fit of those
terms could not tell them apart from the steps it sized itself: chunks of one or two tokens
book the context's read to each token just as well, so the fit kept them there. The controller
instead grows a chunk that fitted by at least a token a step, up to double, in proportion to
the room left, and shrinks one that did not in proportion to its overrun, down to half.
"""

from __future__ import annotations

# Tokens of the first chunk, before any was measured (the whole token budget, 56 tokens, made one
# step 3.5x its streams' gap).
FIRST_CHUNK = 8
# The most a chunk grows from one step to the next.
MAX_GROWTH = 2.0
# The most it shrinks: a step slowed by something else than its chunk (SmolLM2 beside 3
# streams, once in 73 chunks: 152 ms added against 5.6 ms allowed) cut the next chunk to a
# token, and the prompt then came in 1, 2, 4, 8 tokens a step.
MAX_SHRINK = 0.5


class ChunkSizer:
    """The next chunk's size from what the last ones added to their steps."""

    def __init__(self):
        self._size = float(FIRST_CHUNK)

    def size(self) -> int:
        return max(1, int(self._size))

    def ran(self, tokens: int, added: float, allowance: float) -> None:
        """A chunk of ``tokens`` added ``added`` seconds to a step allowed ``allowance`` more.
        A chunk cut short by its prompt's end or the token budget grows the size only past
        itself."""
        if added <= allowance:
            room = MAX_GROWTH if added <= 0 else min(MAX_GROWTH, allowance / added)
            self._size = max(self._size, tokens + 1, tokens * room)
        else:
            self._size = max(1.0, min(self._size, tokens * max(MAX_SHRINK, allowance / added)))
