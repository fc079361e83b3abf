"""The continuous-batching engine: each ``step`` prefills one chunk of newly admitted (or
preempted) requests and advances every running sequence by one decode or speculative step.
A step whose chunk completes a prompt ends after sampling its first token, so that token is
reported at once; the decode step follows in the next ``step``.

One speculative step, for the whole batch (read top-down):
  proposer.propose -> drafts per sequence (k_i may differ, may be 0)
  target.evaluate_multi_query over [pending token + drafts] of every sequence (ragged)
  rejection_sample -> accepted prefix + one corrected/bonus token per sequence
  popn the rejected tokens in the target cache; the proposer rolls back its own
  append tokens with stop checks; finished sequences free their pages at once
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from mlc_spec.errors import UserError

from .logprobs import token_logprobs
from .metrics import SpecStats, Timers
from .model import Model, chunk_rounds
from .params import SamplingParams
from .proposers import Proposer
from .rejection_sampler import rejection_sample
from .request import CompletionOutput, Request, RequestOutput, Sequence, Status
from .sampling import probs_for, sample_from_probs
from .scheduler import Scheduler, pages
from .tokenizer import Tokenizer


@dataclasses.dataclass
class EngineConfig:
    max_batch_size: int = 8  # sequences decoded together
    max_total_len: int = 8192  # tokens the KV cache holds, all sequences together
    prefill_chunk_size: int = 512  # tokens per prefill forward pass


@dataclasses.dataclass
class Occupancy:
    num_running: int  # admitted requests (prefilling or decoding)
    num_waiting: int  # queued, or preempted and queued again
    free_pages: int
    capacity_pages: int


class Engine:
    def __init__(
        self,
        target: Model,
        tokenizer: Tokenizer,
        config: EngineConfig,
        proposer: Proposer | None = None,
        num_speculative_tokens: int = 0,
    ):
        self.target, self.tokenizer, self.config = target, tokenizer, config
        self.proposer = proposer
        self.k = num_speculative_tokens if proposer else 0
        self.kv = target.create_kv_cache(
            config.max_batch_size, config.max_total_len, config.prefill_chunk_size
        )
        self.capacity_pages = self.kv.available_pages()
        self.scheduler = Scheduler(config.max_batch_size, self.kv.page_size)
        self.eos_ids = set(target.config.get("eos_token_ids") or [])
        self.stats = SpecStats()
        self.timers = Timers()
        self.num_preemptions = 0
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._requests: dict[str, Request] = {}

    # ---- requests -----------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Validate and queue a request; nothing is allocated until it is admitted."""
        arrival = next(self._arrivals)
        request_id = request_id if request_id is not None else str(arrival)
        if request_id in self._requests:
            raise UserError(f"request id {request_id!r} is already in use")
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise UserError("the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.target.vocab_size:
            raise UserError(f"prompt token ids must be in [0, {self.target.vocab_size})")
        total = len(ids) + params.max_tokens
        if total > self.target.context_length:
            raise UserError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context length {self.target.context_length}"
            )
        need = params.n * (pages(total + self.k + 1, self.kv.page_size) + 2)
        if need > self.capacity_pages or params.n > self.config.max_batch_size:
            raise UserError(
                f"request needs {need} KV pages for {params.n} x {total} tokens, but the cache "
                f"has {self.capacity_pages} and {self.config.max_batch_size} sequence slots; "
                "raise max_total_len / max_batch_size"
            )
        request = Request(request_id, prompt, ids, params, arrival)
        request.sequences = [Sequence(request, i, next(self._seq_ids)) for i in range(params.n)]
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> None:
        """Drop a request and free its pages (finished requests are simply forgotten)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.unfinished:
            seq.finish_reason = "abort"
            self._free(seq)
        if request in self.scheduler.waiting:
            self.scheduler.waiting.remove(request)
        elif request.status == Status.RUNNING:
            self.scheduler.finish(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def max_sequence_len(self, n: int = 1) -> int:
        """The longest prompt + output each of ``n`` samples may have: the model's context, or
        less where the KV cache cannot hold that much (the bound ``add_request`` checks)."""
        fit = (self.capacity_pages // n - 2) * self.kv.page_size - self.k - 1
        return min(self.target.context_length, fit)

    def occupancy(self) -> Occupancy:
        """Requests running and waiting, KV pages free: what a server reports as load."""
        return Occupancy(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            self.kv.available_pages(),
            self.capacity_pages,
        )

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance every request by one step; returns the increments of the requests that
        produced tokens (finished requests are forgotten after they are reported)."""
        touched: dict[str, Request] = {}
        for request in self.scheduler.admit(self.kv.available_pages() - self._prefill_reserve()):
            for seq in self._to_feed(request):
                self._enter_cache(seq)
        with self.timers("prefill"):
            started = self._prefill_chunk(touched)
        if not started:  # a first token is reported as soon as it is sampled, decode waits a step
            self._decode(touched)
        return [self._delta(r) for r in touched.values()]

    def _to_feed(self, request: Request) -> list[Sequence]:
        """A new request feeds its prompt once (its samples fork from it); a preempted one
        recomputes each sequence's KV."""
        seqs = request.unfinished
        return [s for s in seqs if s.output_ids] if seqs[0].output_ids else seqs[:1]

    @staticmethod
    def _feed_end(seq: Sequence) -> int:
        return len(seq.tokens) - 1 if seq.output_ids else len(seq.tokens)

    def _prefilling(self) -> list[Sequence]:
        """Admitted sequences whose prompt (or, after preemption, history) is not yet fully in
        the cache."""
        return [
            s
            for r in self.scheduler.running
            for s in r.unfinished
            if s.in_cache and s.kv_len < self._feed_end(s)
        ]

    def _prefill_reserve(self) -> int:
        """Pages still owed to admitted requests whose prefill is not finished."""
        page = self.kv.page_size
        return sum(
            pages(self._feed_end(s), page) - pages(s.kv_len, page) + 2 for s in self._prefilling()
        )

    def _prefill_chunk(self, touched: dict[str, Request]) -> bool:
        """Feed one prefill chunk; True if it sampled the first token of some request."""
        seqs = self._prefilling()
        if not seqs:
            return False
        feeds = [s.tokens[s.kv_len : self._feed_end(s)] for s in seqs]
        rows, chunks = next(chunk_rounds(feeds, self.config.prefill_chunk_size))
        fresh = [(seqs[i], feeds[i][c]) for i, c in zip(rows, chunks, strict=True)]
        restored = [(s, t) for s, t in fresh if s.output_ids]
        fresh = [(s, t) for s, t in fresh if not s.output_ids]
        if restored:  # preempted sequences: recompute their KV, no logits needed
            self.target.evaluate_multi_query(
                self.kv, [s.seq_id for s, _ in restored], [t for _, t in restored]
            )
        logits = (
            self.target.prefill(self.kv, [s.seq_id for s, _ in fresh], [t for _, t in fresh])
            if fresh
            else None
        )
        for s, t in restored + fresh:
            s.kv_len += len(t)
        done = [(i, s) for i, (s, _) in enumerate(fresh) if s.kv_len == s.num_prompt]
        if done:
            self._first_tokens([s.request for _, s in done], logits[[i for i, _ in done]], touched)
        return bool(done)

    def _first_tokens(
        self, requests: list[Request], logits: np.ndarray, touched: dict[str, Request]
    ) -> None:
        """Sample each sample's first token from its prompt's logits; ``n > 1`` samples share
        the prompt's KV pages through ``fork_sequence``."""
        seqs, rows = [], []
        for row, request in enumerate(requests):
            parent = request.sequences[0]
            for seq in request.sequences[1:]:
                self.kv.fork_sequence(parent.seq_id, seq.seq_id)
                seq.in_cache, seq.kv_len = True, parent.kv_len
            seqs += request.sequences
            rows += [row] * len(request.sequences)
        with self.timers("sample"):
            probs = probs_for(logits[rows], [s.params for s in seqs])
            tokens = sample_from_probs(probs, np.array([s.rng.random() for s in seqs]))
        for seq, token, row in zip(seqs, tokens, rows, strict=True):
            self._append(seq, [int(token)], logits[row : row + 1], touched)

    def _decode(self, touched: dict[str, Request]) -> None:
        seqs, ks = self._make_room()
        if not seqs:
            return
        drafts: list[np.ndarray] = [np.zeros(0, np.int64)] * len(seqs)
        draft_probs = None
        asked = [i for i, k in enumerate(ks) if k > 0]
        if asked:
            with self.timers("draft"):
                proposal = self.proposer.propose([seqs[i] for i in asked], [ks[i] for i in asked])
            for i, tokens in zip(asked, proposal.tokens, strict=True):
                drafts[i] = tokens[: ks[i]]
            if proposal.probs is not None:
                draft_probs = np.concatenate(
                    [p[: len(drafts[i])] for i, p in zip(asked, proposal.probs, strict=True)]
                )
        num_draft = np.array([len(d) for d in drafts])
        ids = [s.seq_id for s in seqs]
        with self.timers("verify"):
            if num_draft.any():
                inputs = [[s.tokens[-1], *d] for s, d in zip(seqs, drafts, strict=True)]
                logits = self.target.evaluate_multi_query(self.kv, ids, inputs)
            else:
                logits = self.target.decode(self.kv, ids, [s.tokens[-1] for s in seqs])
        with self.timers("sample"):
            row_params = [
                s.params for s, k in zip(seqs, num_draft, strict=True) for _ in range(k + 1)
            ]
            uniforms = [s.rng.random(k + 1) for s, k in zip(seqs, num_draft, strict=True)]
            accepted, emitted = rejection_sample(
                np.concatenate(drafts),
                num_draft,
                draft_probs,
                probs_for(logits, row_params),
                np.concatenate([u[:-1] for u in uniforms]),
                np.array([u[-1] for u in uniforms]),
            )
        per_seq = np.split(emitted, np.cumsum(accepted + 1)[:-1])
        row_starts = np.cumsum(num_draft + 1) - (num_draft + 1)
        for seq, k, a in zip(seqs, num_draft, accepted, strict=True):
            self.kv.popn(seq.seq_id, int(k - a))
            seq.kv_len += int(a) + 1
            seq.stats.record(int(k), int(a))
            self.stats.record(int(k), int(a))
        if asked:
            self.proposer.on_verified(
                [seqs[i] for i in asked],
                [int(num_draft[i]) for i in asked],
                [int(accepted[i]) for i in asked],
            )
        for seq, tokens, start in zip(seqs, per_seq, row_starts, strict=True):
            rows = logits[start : start + len(tokens)]  # the target's row at each emitted token
            self._append(seq, [int(t) for t in tokens], rows, touched)

    def _make_room(self) -> tuple[list[Sequence], list[int]]:
        """The sequences to advance and their draft counts, preempting the newest requests
        until one step of every remaining sequence fits in the free pages."""
        while True:
            seqs = [s for r in self.scheduler.running for s in r.unfinished if s.prefilled]
            ks = [max(0, min(self._max_draft(s), s.tokens_left - 1)) for s in seqs]
            need = self.scheduler.step_pages(seqs, [k + 1 for k in ks]) + self._prefill_reserve()
            if need <= self.kv.available_pages() or len(self.scheduler.running) <= 1:
                return seqs, ks
            self._preempt(self.scheduler.preempt_newest())

    def _max_draft(self, seq: Sequence) -> int:
        """The engine's draft length, capped by the request's own ``num_speculative_tokens``."""
        asked = seq.params.num_speculative_tokens
        return self.k if asked is None else min(self.k, asked)

    def _preempt(self, request: Request) -> None:
        self.num_preemptions += 1
        for seq in request.unfinished:
            self._free(seq)

    # ---- tokens, stops, outputs ---------------------------------------------------------
    def _append(
        self, seq: Sequence, tokens: list[int], logits: np.ndarray, touched: dict[str, Request]
    ) -> None:
        """Append accepted tokens one by one, honouring EOS, stop tokens, stop strings and
        max_tokens inside the run; tokens past a stop are dropped with the sequence's KV.
        ``logits[i]`` is the target's row that ``tokens[i]`` was sampled or verified from."""
        params = seq.params
        touched[seq.request.request_id] = seq.request
        scored = (
            token_logprobs(logits, tokens, params.logprobs) if params.logprobs is not None else []
        )
        for i, token in enumerate(tokens):
            seq.tokens.append(token)
            if scored:
                seq.logprobs.append(scored[i])
            stop_token = token in params.stop_token_ids or (
                token in self.eos_ids and not params.ignore_eos
            )
            if stop_token or (params.stop and self._hit_stop_string(seq)):
                seq.finish_reason = "stop"
            elif seq.tokens_left == 0:
                seq.finish_reason = "length"
            if seq.finished:
                break
        if not (params.stop and seq.finished):
            seq.text = self.tokenizer.decode(seq.output_ids)
        if seq.finished:
            self._free(seq)
            if not seq.request.unfinished:
                self.scheduler.finish(seq.request)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        text = self.tokenizer.decode(seq.output_ids)
        window = max(len(s) for s in seq.params.stop) + 8
        hits = [
            i for s in seq.params.stop if (i := text.find(s, max(0, len(seq.text) - window))) >= 0
        ]
        seq.text = text[: min(hits)] if hits else text
        return bool(hits)

    def _enter_cache(self, seq: Sequence) -> None:
        self.kv.add_sequence(seq.seq_id)
        seq.in_cache, seq.kv_len = True, 0

    def _free(self, seq: Sequence) -> None:
        if seq.in_cache:
            self.kv.remove_sequence(seq.seq_id)
            seq.in_cache, seq.kv_len = False, 0
        if self.proposer:
            self.proposer.remove(seq)

    def _delta(self, request: Request) -> RequestOutput:
        outputs = []
        for seq in request.sequences:
            text = seq.text if seq.finished else seq.text.rstrip("\ufffd")  # half a character
            outputs.append(
                CompletionOutput(
                    seq.index,
                    text[seq.sent_text :],
                    seq.output_ids[seq.sent_tokens :],
                    seq.finish_reason,
                    seq.stats,
                    seq.logprobs[seq.sent_tokens :] if seq.params.logprobs is not None else None,
                )
            )
            seq.sent_text, seq.sent_tokens = len(text), len(seq.output_ids)
        finished = not request.unfinished
        if finished:
            self._requests.pop(request.request_id, None)
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, outputs, finished
        )
