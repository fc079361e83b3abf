"""A request and its sequences (one per parallel sample): the state the engine advances.

Invariant of a running sequence: the target's KV cache holds every token but the last one
(``kv_len == len(tokens) - 1``); the last token is pending, fed by the next step.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

import numpy as np

from .logprobs import TokenLogprob
from .metrics import SpecStats
from .params import SamplingParams

if TYPE_CHECKING:
    from .output_processor import SequenceOutput
    from .structured_output import Constraint


class Status(enum.Enum):
    WAITING = "waiting"  # not in the KV cache (new, or preempted)
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: Request, index: int, seq_id: int, output: SequenceOutput):
        self.request = request
        self.index = index
        self.seq_id = seq_id
        self.tokens: list[int] = list(request.prompt_token_ids)
        self.kv_len = 0
        self.in_cache = False
        self.finish_reason: str | None = None
        self.output = output  # text, logprobs and what was streamed: the output processor's
        self.stats = SpecStats()
        seed = request.params.seed
        # A negative seed (OpenAI allows any int64) stands for its two's complement.
        entropy = None if seed is None else [seed % 2**64, index]
        # Target sampling and acceptance draw from one stream, the draft from another, so a
        # seed gives the same output whatever else shares the batch.
        self.rng = np.random.default_rng(entropy)
        self.draft_rng = np.random.default_rng(None if entropy is None else [*entropy, 1])
        # The request's grammar, following this sample's committed tokens (structured output).
        self.constraint: Constraint | None = None
        # The proposer drafting for it in the step being planned, run and committed.
        self.draft_method: str | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilled(self) -> bool:
        """Past its prompt: has output, and its KV holds everything but the pending token."""
        return len(self.tokens) > self.num_prompt and self.kv_len == len(self.tokens) - 1

    @property
    def tokens_left(self) -> int:
        return self.params.max_tokens - self.num_output


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    status: Status = Status.WAITING
    sequences: list[Sequence] = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0  # of its prompt, found in the prefix cache when it entered

    @property
    def unfinished(self) -> list[Sequence]:
        return [s for s in self.sequences if not s.finished]

    def output(self, delta: bool) -> RequestOutput:
        """Its outputs: what the last step added (``delta``), or everything so far."""
        outputs = [
            s.output.completion(s.index, s.finish_reason, s.stats, delta=delta)
            for s in self.sequences
        ]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            not self.unfinished,
            self.num_cached_tokens,
        )


@dataclasses.dataclass
class CompletionOutput:
    """One sample of a request (vLLM's name and fields)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    spec_stats: SpecStats
    logprobs: list[TokenLogprob] | None = None  # per token in token_ids, when asked for


@dataclasses.dataclass
class RequestOutput:
    """A request's outputs so far; in streaming, ``text``/``token_ids`` are the increments."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
