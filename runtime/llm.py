"""The embedding API: ``LLM(model=..., draft_model=..., speculative=...)`` with ``generate``,
``stream`` and ``chat`` (names as in vLLM)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mlc_spec.errors import UserError

from .engine import Engine
from .model import Model
from .params import EngineConfig, SamplingParams, SpeculativeConfig
from .proposers import build_proposer
from .request import Request, RequestOutput
from .tokenizer import Tokenizer

Prompt = str | Sequence[int]


class LLM:
    def __init__(
        self,
        model: str | Path,
        draft_model: str | Path | None = None,
        speculative: SpeculativeConfig | dict[str, Any] | None = None,
        max_batch_size: int = 8,
        max_total_len: int = 8192,
        prefill_chunk_size: int = 512,
        max_num_batched_tokens: int = 64,
        chunk_time_ratio: float | None = EngineConfig.chunk_time_ratio,
        async_scheduling: bool = False,
        enable_prefix_caching: bool = True,
        chat_template: str | Path | None = None,
        tool_call_parser: str | None = None,
    ):
        self.speculative = SpeculativeConfig.parse(speculative, draft_model is not None)
        self.model = Model(model)
        self.tokenizer = Tokenizer(model, chat_template, tool_call_parser)
        config = EngineConfig(
            max_batch_size,
            max_total_len,
            prefill_chunk_size,
            max_num_batched_tokens=max_num_batched_tokens,
            chunk_time_ratio=chunk_time_ratio,
            async_scheduling=async_scheduling,
            enable_prefix_caching=enable_prefix_caching,
        )
        proposer = build_proposer(self.speculative, draft_model, self.model, self.tokenizer, config)
        self.engine = Engine(self.model, self.tokenizer, config, proposer, self.speculative)

    # ---- public API ---------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (text or token ids) to completion; outputs in the order given."""
        requests = self._add(prompts, params)
        for _ in self._run(requests):
            pass
        return [r.output(delta=False) for r in requests]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield each request's new text and token ids as soon as a step produces them."""
        yield from self._run(self._add(prompts, params))

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, formatted by the chat template,
        which renders ``tools`` (OpenAI's function tools) where its model can call them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, tools) for c in conversations]
        return self.generate(prompts, params)

    def default_sampling_params(self, **given: Any) -> SamplingParams:
        """``SamplingParams(**given)``, with the sampling settings the model's publisher
        recommends (carried in the artifact) for the fields not given (vLLM's
        ``get_default_sampling_params``). Requests without params get these."""
        return SamplingParams(**{**self.sampling_defaults, **given})

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The artifact's recommended ``temperature`` / ``top_p`` / ``top_k`` ({} if none)."""
        return dict(self.model.config.get("sampling_defaults") or {})

    def metrics(self) -> dict[str, Any]:
        """Engine-wide speculation counters, seconds per phase, and the speculation policy's
        decisions with the measurements behind them."""
        return self.engine.metrics()

    # ---- plumbing -----------------------------------------------------------------------
    def _add(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[Request]:
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = params if params is not None else self.default_sampling_params()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if len(per_prompt) != len(prompts):
            raise UserError(f"{len(prompts)} prompts but {len(per_prompt)} sampling params")
        requests = []
        try:
            for prompt, p in zip(prompts, per_prompt, strict=True):
                text = prompt if isinstance(prompt, str) else None
                ids = self.tokenizer.encode(prompt) if text is not None else list(prompt)
                requests.append(self.engine.add_request(ids, p, prompt=text))
        except BaseException:
            self._abort(requests)
            raise
        return requests

    def _run(self, requests: list[Request]) -> Iterator[RequestOutput]:
        """Step until these requests finish; on any error or early exit, abort them so no
        KV-cache sequence is left behind."""
        mine = {r.request_id for r in requests}
        try:
            while any(r.unfinished for r in requests):
                for out in self.engine.step():
                    if out.request_id in mine:
                        yield out
        finally:
            self._abort(requests)

    def _abort(self, requests: list[Request]) -> None:
        for r in requests:
            self.engine.abort(r.request_id)
