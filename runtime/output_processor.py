"""From a sequence's new token ids to what its client is sent: incremental detokenization,
stop strings, and the streamed (delta) or final (whole) output.

Each call works on the new tokens only, over windows whose length does not grow with the
output, so the cost per token stays flat where decoding the whole output again after every
step grew with it (quadratic in the output's length). It reads nothing of the engine but the
ids and logprobs it is handed, so it can run off the step loop's critical path.

Token-level stops (EOS, ``stop_token_ids``, ``max_tokens``) stay with the engine, which must
know them at once to free the sequence's pages; it tells ``process`` that the chunk it hands
over is the last one (``finished``).

The text streamed equals the decode of the whole output wherever the tokenizer's decoder is
local, as byte-level ones are (GPT-2 style: SmolLM2, Qwen2.5). A byte-fallback decoder
(SentencePiece, Llama 2) writes a whole run of byte tokens as one U+FFFD per byte once any
of it is not valid UTF-8, which text already streamed cannot follow: after such a run the two
differ in those replacement characters (as with vLLM's and Hugging Face's streamers).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from .logprobs import TokenLogprob
from .metrics import SpecStats
from .request import CompletionOutput
from .tokenizer import Tokenizer

INCOMPLETE = "\ufffd"  # what decoding yields for the first bytes of a character cut in two


class SequenceOutput:
    """One sequence's output as the output processor keeps it: the kept token ids and their
    logprobs, the detokenizer's offsets, the released text, the stop-string window, and how
    much of each was already sent. Built by the engine per sequence; ``OutputProcessor``
    advances it and ``completion`` reads it."""

    def __init__(self, stop: Sequence[str] = (), with_logprobs: bool = False):
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self.stop = tuple(stop)
        self.token_ids: list[int] = []  # output ids: none past a stop string
        self.logprobs: list[TokenLogprob] | None = [] if with_logprobs else None
        self.stopped = False  # a stop string ended it
        self.finished = False
        # Detokenizer: the first ``_released`` characters of the decode of
        # token_ids[prefix:] were released; the text of token_ids[:read] ended complete.
        self._prefix = 0
        self._read = 0
        self._released = 0
        # Stop strings: the last (longest stop - 1) characters of decoded text, of which the
        # last ``_held`` are not released yet because a stop string may begin with them.
        self._window_len = max(map(len, self.stop), default=1) - 1
        self._tail = ""
        self._held = 0
        self._text: list[str] = []  # released pieces; their concatenation is the output
        self._sent_pieces = 0
        self._sent_tokens = 0

    @property
    def text(self) -> str:
        """The text released so far; once finished, the whole output up to any stop."""
        return "".join(self._text)

    def completion(
        self, index: int, finish_reason: str | None, stats: SpecStats, delta: bool
    ) -> CompletionOutput:
        """The sequence's output for a client: what was not sent yet (``delta``, for
        streaming; marks it sent) or all of it (for a final result)."""
        text = self._text[self._sent_pieces :] if delta else self._text
        start = self._sent_tokens if delta else 0
        logprobs = self.logprobs[start:] if self.logprobs is not None else None
        out = CompletionOutput(
            index, "".join(text), self.token_ids[start:], finish_reason, stats, logprobs
        )
        if delta:
            self._sent_pieces, self._sent_tokens = len(self._text), len(self.token_ids)
        return out


class OutputProcessor:
    """Advances ``SequenceOutput`` states by the tokens each step accepted."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def process(
        self,
        state: SequenceOutput,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprob] | None = None,
        finished: bool = False,
    ) -> bool:
        """Add the tokens one step accepted (``logprobs[i]`` scores ``token_ids[i]``) and
        release their text; ``finished``: the engine ends the sequence with them. Returns
        True when a stop string ended the sequence: its text is cut where the stop begins,
        and the tokens after the one that completed it are dropped.

        The result does not depend on how the tokens are split into calls: a run of
        speculative tokens gives the output that one token per call would have given.
        """
        if state.finished:
            raise ValueError("the sequence is finished; it takes no more tokens")
        if not len(token_ids):
            raise ValueError("no tokens to add")
        if state.logprobs is not None and (logprobs is None or len(logprobs) != len(token_ids)):
            raise ValueError("this sequence reports logprobs: one is needed per token")
        ids, start = [int(t) for t in token_ids], len(state.token_ids)
        # Stop strings need the token that completes each character; else one decode will do.
        cuts = range(1, len(ids) + 1) if state.stop else [len(ids)]
        pieces, ends = [], []  # new text released up to each cut; characters after it
        for cut in cuts:
            state.token_ids += ids[len(state.token_ids) - start : cut]
            pieces.append(self._detokenize(state, finished and cut == len(ids)))
            ends.append((ends[-1] if ends else 0) + len(pieces[-1]))
        piece = self._release(state, "".join(pieces), ends, finished)
        kept = len(ids) if piece is None else cuts[piece]
        del state.token_ids[start + kept :]
        if state.logprobs is not None:
            state.logprobs += logprobs[:kept]
        state.finished = finished or state.stopped
        return state.stopped

    # ---- incremental detokenization --------------------------------------------------------
    def _detokenize(self, state: SequenceOutput, last: bool) -> str:
        """The text the newest id completes, as vLLM's ``detokenize_incrementally``: decode a
        window of ids that begins with those of the last released piece, and release what
        follows the text already released from it, up to any half character at its end
        (``last``: including it, as decoding the whole output has it). Beginning with ids
        already released, not with the new ones alone, keeps what depends on the neighbours
        (a leading space a decoder strips from the first token, skipped special tokens) as
        the whole output's decode has it. Once a new piece ends complete, the window moves up
        to it, so it stays a few ids long."""
        ids = state.token_ids
        text = self.tokenizer.decode(ids[state._prefix :])
        end = len(text) if last else len(text.rstrip(INCOMPLETE))
        new = text[state._released : end]
        if new and end == len(text) and not last:
            state._prefix, state._read = state._read, len(ids)
            state._released = len(self.tokenizer.decode(ids[state._prefix :]))
        else:
            state._released = max(state._released, end)
        return new

    # ---- stop strings -----------------------------------------------------------------------
    def _release(
        self, state: SequenceOutput, new: str, ends: list[int], finished: bool
    ) -> int | None:
        """Check ``new`` text for stop strings and release what is certain; returns the
        piece of ``new`` (``ends``: where each ends) that completed a stop string, if any.

        Only ``new`` and the ``longest stop - 1`` characters before it are searched: an
        earlier stop would have ended the sequence already. Of several stops, the one that
        completes in the earliest piece (token) wins and the text is cut at its start, as if tokens
        had come one at a time. Text that a stop string may begin with is held back until
        the next tokens settle it: once streamed it could not be taken back, and a stop that
        spans two steps would leak its first part to the client (what vLLM does too).
        """
        window = state._tail + new
        unreleased = len(state._tail) - state._held  # where the window's unsent text starts
        hits = []
        for stop in state.stop:
            start = window.find(stop)
            if start >= 0:
                end = start + len(stop) - len(state._tail)  # in ``new``
                hits.append((bisect.bisect_left(ends, end), start))
        if hits:
            piece, start = min(hits)
            self._append(state, window[unreleased:start])
            state.stopped = True
            return piece
        keep = len(window) if finished else len(window) - _stop_prefix(window, state)
        self._append(state, window[unreleased:keep])
        state._tail = window[max(0, len(window) - state._window_len) :]
        state._held = len(window) - keep
        return None

    @staticmethod
    def _append(state: SequenceOutput, text: str) -> None:
        if text:
            state._text.append(text)


def _stop_prefix(window: str, state: SequenceOutput) -> int:
    """Length of the longest end of ``window`` that some stop string begins with."""
    for length in range(min(len(window), state._window_len), 0, -1):
        end = window[-length:]
        if any(stop.startswith(end) for stop in state.stop):
            return length
    return 0
