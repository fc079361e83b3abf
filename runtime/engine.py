"""The continuous-batching engine: each ``step`` runs the plan the scheduler makes
(runtime/scheduler.py: admissions, a prompt chunk, decode or verify rows with their drafts,
preemptions) and commits its results. A chunk that completes a prompt samples its first token
from the same pass as the step's decode or verify rows, so a prompt arriving beside running
streams costs them no pass of its own.

A step reads as schedule -> execute -> commit -> process:
  schedule  ``Scheduler.schedule``: one plan, decided there and nowhere else
  execute   the forward passes and sampling, nothing else: proposer.propose -> drafts;
            target.decode when nothing was drafted (with the plan's prompt chunk, a prefill
            of every row), else evaluate_multi_query over [pending token + drafts] of every
            sequence (ragged) and the compiled verification (runtime/sampler.py) -> accepted
            prefix + one corrected/bonus token per sequence; a draft tree is verified in the
            same pass, each node over its own path, and accepted by walking down it
            (runtime/draft_tree.py)
  commit    keep the accepted tokens' K/V, drop the rest (the proposer rolls back its own;
            a tree's accepted path moves into place); statistics, and what
            the scheduler's policy learns (acceptance, step costs); token ids appended up to
            EOS, a stop token or max_tokens; finished sequences free their pages at once
  process   logprobs, text, stop strings, and the increments the caller streams

With ``async_scheduling`` the execute phase runs on a worker thread (TVM releases the GIL
during its calls): ``step`` commits the step launched last time, schedules and launches the
next one, and only then processes the committed tokens and admits requests for the step after,
so text, stop strings, streaming, admission and the caller's own work overlap the forward
instead of delaying it. Admission ahead counts the tokens of the step in flight, not known yet,
as placeholders at their most (every draft accepted); the admitted requests enter the cache
when the next step is planned, where what did not fit that bound is admitted on exact counts.
Commit and the rest of scheduling see what they see without it; the one difference is a
stop string, found only by processing: its sequence was already launched into the next step,
whose tokens for it are discarded (its KV freed with it), so nothing past the stop reaches a
client. The KV cache is touched only while no step is in flight.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import warnings
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import tvm.runtime

from mlc_spec.errors import UserError

from .draft_tree import block_parents, greedy_walk, sampled_walk
from .logprobs import token_logprobs
from .metrics import SpecStats, Timers
from .model import Model, release_pooled_buffers
from .output_processor import OutputProcessor, SequenceOutput
from .params import EngineConfig, ParamsError, SamplingParams, SpeculativeConfig
from .proposers import Proposer
from .request import Request, RequestOutput, Sequence, Status
from .rows import Rows, take
from .sampler import DraftProbs
from .scheduler import (
    SEQUENCE_PAGE_SLACK,
    PrefillWork,
    Scheduler,
    StepPlan,
    Work,
    pages,
)
from .speculation import CostTable, DraftCosts, StepCosts
from .speculation.warm_up import LARGEST_TIMED, attention_costs, record, sizes, time_passes
from .structured_output import Grammars, unconstrained
from .tokenizer import Tokenizer

__all__ = ["Engine", "EngineConfig"]


@dataclasses.dataclass
class PrefillResult:
    first: list[tuple[Sequence, int, Rows]]  # (sequence, first token, its logits row)


@dataclasses.dataclass
class StepResult:
    num_draft: np.ndarray  # drafts verified per sequence
    accepted: np.ndarray
    kept: list[list[int]]  # per sequence, the accepted drafts (numbered from 1)
    emitted: list[np.ndarray]  # accepted drafts + the target's token, per sequence
    rows: list[Rows]  # the target's logits row each emitted token came from, per sequence
    started: float  # perf_counter when execution began
    ended: float  # ... and when it ended
    draft_seconds: float
    target_seconds: float  # the target's pass and sampling
    first: PrefillResult  # first tokens of the prompts the pass's riding chunk completed


@dataclasses.dataclass
class Emitted:
    """Tokens a step committed to one sequence, waiting to be processed into text."""

    seq: Sequence
    tokens: list[int]
    rows: Rows  # the target's logits row of each token


@dataclasses.dataclass
class InFlight:
    works: list[Work]
    result: Future  # -> list of PrefillResult | StepResult, one per work
    free_pages: int  # when it was launched; the cache itself is the worker's until collected
    most_pages: int  # what its passes may take of them: every chunk token, every draft kept


@dataclasses.dataclass
class Occupancy:
    num_running: int  # admitted requests (prefilling or decoding)
    num_waiting: int  # queued, or preempted and queued again
    free_pages: int
    capacity_pages: int
    prefix_cache_queries: int  # tokens looked up as sequences entered the cache, all along
    prefix_cache_hits: int  # ... and found there


# Measured on an H200 (docs/benchmarks.md, docs/exactness.md): a CUDA artifact's verify rows differ
# from its decode rows of the same tokens (dlight's GEMV against its matmul schedule, and the
# decode against the prefill attention kernels), and from the rows of a shorter verify, so greedy
# speculative output there can differ from plain decoding. The CPU's rows are bit-identical.
CUDA_ROWS_DIFFER = (
    "speculative decoding on CUDA is not lossless yet: verify rows are not bit-identical to "
    "decode rows there, so greedy output can differ from plain decoding (docs/exactness.md)"
)


class Engine:
    def __init__(
        self,
        target: Model,
        tokenizer: Tokenizer,
        config: EngineConfig,
        proposer: Proposer | None = None,
        speculative: SpeculativeConfig | None = None,
    ):
        if (proposer is None) != (speculative is None):
            raise ValueError("a proposer comes with its speculative config, and only with one")
        self.target, self.tokenizer, self.config = target, tokenizer, config
        if speculative is not None:
            per_sequence = config.prefill_chunk_size // config.max_batch_size - 1
            max_k = speculative.max_drafts(per_sequence)
            speculative = dataclasses.replace(speculative, max_speculative_tokens=max_k)
        self.proposer, self.speculative = proposer, speculative
        self.max_k = speculative.max_speculative_tokens if speculative else 0
        self.max_nodes = speculative.nodes(self.max_k) if speculative else 0
        if config.chunk_time_ratio is not None and not config.chunk_time_ratio > 0:
            raise UserError(f"chunk_time_ratio must be above 0, got {config.chunk_time_ratio}")
        if config.max_num_batched_tokens < 1:
            raise UserError(
                f"max_num_batched_tokens must be at least 1, got {config.max_num_batched_tokens}"
            )
        if proposer is not None and target.config["target"] == "cuda":
            warnings.warn(CUDA_ROWS_DIFFER, stacklevel=3)
        if config.max_batch_size * (self.max_nodes + 1) > config.prefill_chunk_size:
            raise UserError(
                f"a verify pass of max_batch_size {config.max_batch_size} x "
                f"({self.max_nodes} drafts + 1) tokens exceeds prefill_chunk_size "
                f"{config.prefill_chunk_size}, the most one forward pass takes"
            )
        self.kv = target.create_kv_cache(
            config.max_batch_size,
            config.max_total_len,
            config.prefill_chunk_size,
            prefix_cache=config.enable_prefix_caching,
        )
        self.capacity_pages = self.kv.available_pages()
        draft_costs = proposer.costs if proposer else DraftCosts(model=False)
        # Method auto: the model-free proposer's costs beside the draft model's.
        others = (proposer.by_method() if proposer else {}).values()
        free = next((p.costs for p in others if p.costs is not draft_costs), None)
        costs = StepCosts(decode=CostTable(), verify=CostTable(), draft=draft_costs, free=free)
        self.scheduler = Scheduler(config, self.kv, proposer, speculative, costs)
        self.eos_ids = set(target.config.get("eos_token_ids") or [])
        self.grammars = Grammars(target.path, target.vocab_size, sorted(self.eos_ids))
        self.outputs = OutputProcessor(tokenizer)
        self.stats = SpecStats()
        self.timers = Timers()
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._requests: dict[str, Request] = {}
        self._worker = (
            ThreadPoolExecutor(1, thread_name_prefix="mlc-spec-step")
            if config.async_scheduling
            else None
        )
        self._in_flight: InFlight | None = None
        self._unprocessed: list[Emitted] = []  # committed while collecting outside ``step``
        self._stopped: list[Sequence] = []  # stopped by a string while a step was in flight
        if speculative is not None and speculative.auto:
            self._warm_up()

    def _warm_up(self) -> None:
        """Measure the costs the policy needs before the first request: the target's decode of
        1..B rows, its verify of 1..B(K+1) tokens of one sequence (``sizes`` of them, up to
        ``LARGEST_TIMED``; see ``StepCosts`` for how other shapes are priced), what attending
        over a longer context adds, and the proposer's passes."""
        rows, width = self.config.max_batch_size, self.max_k + 1
        decodes = [[1] * r for r in sizes(1, rows)]
        verifies = [[n] for n in sizes(1, min(rows * width, LARGEST_TIMED))]
        costs = self.scheduler.costs
        record(costs.decode, map(len, decodes), self._time("decode", decodes))
        record(costs.verify, map(sum, verifies), self._time("evaluate_multi_query", verifies))
        chunk = self.config.prefill_chunk_size
        costs.attention = attention_costs(self.target, self.kv, rows, width, chunk)
        self.proposer.warm_up(rows)

    def _time(self, function: str, passes: list[list[int]]) -> list[float | None]:
        return time_passes(self.target, self.kv, function, passes, self.config.prefill_chunk_size)

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
        if any(not 0 <= t < self.target.vocab_size for t in params.stop_token_ids):
            raise UserError(f"stop_token_ids must be in [0, {self.target.vocab_size})")
        total = len(ids) + params.max_tokens
        if total > self.target.context_length:
            raise UserError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context length {self.target.context_length}"
            )
        most_drafts = self.scheduler.most_nodes(params)
        need = params.n * (pages(total + most_drafts + 1, self.kv.page_size) + SEQUENCE_PAGE_SLACK)
        if need > self.capacity_pages or params.n > self.config.max_batch_size:
            raise UserError(
                f"request needs {need} KV pages for {params.n} x {total} tokens (prompt "
                f"{len(ids)} + max_tokens {params.max_tokens}), but the cache has "
                f"{self.capacity_pages} pages ({self.capacity_pages * self.kv.page_size} tokens) "
                f"and {self.config.max_batch_size} sequence slots; raise max_total_len / "
                "max_batch_size"
            )
        method = params.speculative_method
        if method is not None and method not in self.scheduler.proposers:
            built = ", ".join(self.scheduler.proposers) or "none: no speculation"
            raise ParamsError(
                f"speculative_method {method!r} is not one this engine has (it has {built})"
            )
        grammar = None
        if params.structured_output is not None:
            grammar = self.grammars.compile(params.structured_output)
        request = Request(request_id, prompt, ids, params, arrival)
        request.sequences = [
            Sequence(
                request,
                i,
                next(self._seq_ids),
                SequenceOutput(params.stop, params.logprobs is not None),
            )
            for i in range(params.n)
        ]
        if grammar is not None:
            for seq in request.sequences:
                seq.constraint = self.grammars.constraint(grammar)
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> None:
        """Drop a request and free its pages (finished requests are simply forgotten). A step
        in flight is collected first, since only then is the cache free to change."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if self._in_flight is not None:
            self._unprocessed += self._collect()
        self._unprocessed = [e for e in self._unprocessed if e.seq.request is not request]
        for seq in request.unfinished:
            seq.finish_reason = "abort"
            self.scheduler.free(seq)
        self.scheduler.remove(request)

    def has_unfinished(self) -> bool:
        """Requests to run, a step in flight, or committed tokens not yet reported."""
        return (
            self.scheduler.has_unfinished()
            or self._in_flight is not None
            or bool(self._unprocessed)
        )

    def max_sequence_len(self, n: int = 1) -> int:
        """The longest prompt + output each of ``n`` samples may have: the model's context, or
        less where the KV cache cannot hold that much (the bound ``add_request`` checks)."""
        fit = (
            (self.capacity_pages // n - SEQUENCE_PAGE_SLACK) * self.kv.page_size
            - self.max_nodes
            - 1
        )
        return min(self.target.context_length, fit)

    def occupancy(self) -> Occupancy:
        """Requests running and waiting, KV pages free: what a server reports as load."""
        in_flight = self._in_flight
        return Occupancy(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            self.kv.available_pages() if in_flight is None else in_flight.free_pages,
            self.capacity_pages,
            self.scheduler.prefix_cache_queries,
            self.scheduler.prefix_cache_hits,
        )

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance every request by one step; returns the increments of the requests that
        produced tokens (finished requests are forgotten after they are reported). With
        ``async_scheduling`` the step launched now is collected by the next call, which
        reports its tokens."""
        committed, self._unprocessed = self._unprocessed, []
        if self._in_flight is not None:
            committed += self._collect()
        with self.timers("schedule"):
            works = self.scheduler.schedule().works
        if works and self._worker is not None:
            self._in_flight = InFlight(
                works,
                self._worker.submit(self._execute_all, works),
                self.kv.available_pages(),
                self.scheduler.most_pages(works),
            )
        elif works:
            committed += self._commit_all(works, self._execute_all(works))
        with self.timers("process"):
            outputs = self._process(committed)
        if self._in_flight is not None and all(
            s.finished for w in self._in_flight.works for s in w.seqs
        ):  # every sequence in flight was stopped by a string: nothing in it is wanted
            self._collect()
        if self._in_flight is not None:
            with self.timers("admit ahead"):
                self.scheduler.admit_ahead(self._in_flight.free_pages, self._in_flight.most_pages)
        return outputs

    def _execute_all(self, works: list[Work]) -> list[PrefillResult | StepResult]:
        """The passes of one step (on the worker thread with ``async_scheduling``)."""
        with self.timers("execute"):
            return [
                self._prefill(w) if isinstance(w, PrefillWork) else self._execute(w) for w in works
            ]

    def _commit_all(
        self, works: list[Work], results: list[PrefillResult | StepResult]
    ) -> list[Emitted]:
        with self.timers("commit"):
            committed = []
            for work, result in zip(works, results, strict=True):
                if isinstance(work, PrefillWork):
                    committed += self._commit_prefill(work, result)
                else:
                    committed += self._commit(work, result)
            for seq in self._stopped:  # their KV can change now
                self.scheduler.free(seq)
            self._stopped.clear()
            return committed

    def _collect(self) -> list[Emitted]:
        """Wait for the step in flight and commit it."""
        in_flight, self._in_flight = self._in_flight, None
        with self.timers("wait"):
            results = in_flight.result.result()
        return self._commit_all(in_flight.works, results)

    # ---- execute -----------------------------------------------------------------------
    def _prefill(self, work: PrefillWork) -> PrefillResult:
        """Run a prefill pass; requests whose prompt it completes sample their first tokens,
        each sample of ``n > 1`` from the prompt's KV pages, shared through
        ``fork_sequence``."""
        with self.timers("prefill"):
            if work.restored:
                self.target.evaluate_multi_query(
                    self.kv, [s.seq_id for s, _ in work.restored], [t for _, t in work.restored]
                )
                release_pooled_buffers()
            if not work.fresh:
                return PrefillResult([])
            logits = self.target.prefill(
                self.kv, [s.seq_id for s, _ in work.fresh], [t for _, t in work.fresh]
            )
            release_pooled_buffers()
        return self._first_tokens(work, logits, range(len(work.fresh)))

    def _first_tokens(
        self, work: PrefillWork, logits: tvm.runtime.Tensor, rows: Iterable[int]
    ) -> PrefillResult:
        """The first token of each prompt ``work`` completes, from its last token's row
        ``rows[i]`` of ``logits`` (one per fresh prompt); each sample of ``n > 1`` forks from
        the prompt's KV pages."""
        seqs, picked = [], []
        for row, (parent, _), done in zip(rows, work.fresh, work.completes, strict=True):
            if not done:
                continue
            for seq in parent.request.sequences[1:]:
                self.kv.fork_sequence(parent.seq_id, seq.seq_id)
            seqs += parent.request.sequences
            picked += [row] * len(parent.request.sequences)
        if not seqs:
            return PrefillResult([])
        none = [np.zeros(0, np.int64)] * len(seqs)
        masks = self._grammar_masks(seqs, none, [None] * len(seqs))
        with self.timers("sample"):
            first = take(logits, picked)
            tokens = self.target.sampler.sample_logits(
                first if masks is None else self.target.sampler.mask(first, masks),
                [s.params for s in seqs],
                np.array([s.rng.random() for s in seqs]),
            )
        return PrefillResult(
            [
                (s, int(t), Rows(first, i, i + 1))
                for i, (s, t) in enumerate(zip(seqs, tokens, strict=True))
            ]
        )

    # ---- commit ------------------------------------------------------------------------
    def _commit_prefill(self, work: PrefillWork, result: PrefillResult) -> list[Emitted]:
        self.scheduler.prefilled(work)
        committed = []
        for seq, token, row in result.first:
            if seq.index > 0:  # a sample forked from its prompt's sequence
                seq.in_cache, seq.kv_len = True, seq.request.sequences[0].kv_len
            committed.append(self._append(seq, [token], row))
        return committed

    def _execute(self, plan: StepPlan) -> StepResult:
        seqs, started = plan.seqs, time.perf_counter()
        drafts: list[np.ndarray] = [np.zeros(0, np.int64)] * len(seqs)
        parents: list[np.ndarray | None] = [None] * len(seqs)
        draft_probs = None
        asked = [i for i, k in enumerate(plan.num_draft) if k > 0]
        if asked:
            with self.timers("draft"):
                proposal = self.proposer.propose(
                    [seqs[i] for i in asked], [plan.num_draft[i] for i in asked]
                )
            trees = proposal.parents or [None] * len(asked)
            for i, tokens, tree in zip(asked, proposal.tokens, trees, strict=True):
                if tree is None:
                    drafts[i] = tokens[: plan.num_draft[i]]
                else:  # the proposer grew the tree to the plan's depth
                    drafts[i], parents[i] = tokens, tree
            if proposal.probs is not None:  # rows per sequence of the plan, none unasked
                rows: list[np.ndarray | None] = [np.zeros(0, np.int64)] * len(seqs)
                for j, i in enumerate(asked):
                    rows[i] = proposal.probs.rows[j]
                draft_probs = DraftProbs(proposal.probs.data, rows).first(map(len, drafts))
        masks = self._grammar_masks(seqs, drafts, parents)
        drafted = time.perf_counter()
        num_draft = np.array([len(d) for d in drafts])
        if num_draft.any():
            kept, emitted, logits, first = self._verify(
                seqs, drafts, parents, draft_probs, masks, plan.chunk
            )
        else:
            kept = [[] for _ in seqs]
            emitted, logits, first = self._decode(seqs, plan.chunk, masks)
        accepted = np.array([len(k) for k in kept], np.int64)
        per_seq = np.split(emitted, np.cumsum(accepted + 1)[:-1])
        starts = np.cumsum(num_draft + 1) - (num_draft + 1)  # each sequence's first logits row
        return StepResult(
            num_draft,
            accepted,
            kept,
            per_seq,
            [_rows_of(logits, a, path) for a, path in zip(starts, kept, strict=True)],
            started,
            (ended := time.perf_counter()),
            drafted - started,
            ended - drafted,
            first,
        )

    def _decode(
        self, seqs: list[Sequence], chunk: PrefillWork | None, masks: np.ndarray | None
    ) -> tuple[np.ndarray, tvm.runtime.Tensor, PrefillResult]:
        """The plain step: one token per sequence, no draft forward, no verification;
        ``(tokens, logits, first tokens of the prompts the chunk completes)``, each row sampled
        under its grammar's ``masks`` where given. A prompt ``chunk`` is computed in the same
        pass (``_beside_chunk``)."""
        first = PrefillResult([])
        with self.timers("decode"):
            ids, pending = [s.seq_id for s in seqs], [s.tokens[-1] for s in seqs]
            if chunk is None:
                logits = self.target.decode(self.kv, ids, pending)
            else:
                logits, first = self._beside_chunk(
                    ids, [[t] for t in pending], [None] * len(ids), chunk
                )
        with self.timers("sample"):
            uniforms = np.array([s.rng.random() for s in seqs])
            masked = logits if masks is None else self.target.sampler.mask(logits, masks)
            tokens = self.target.sampler.sample_logits(masked, [s.params for s in seqs], uniforms)
        return tokens, logits, first

    def _beside_chunk(
        self,
        ids: list[int],
        inputs: list,
        trees: list[tuple[int, np.ndarray] | None],
        chunk: PrefillWork,
    ) -> tuple[tvm.runtime.Tensor, PrefillResult]:
        """One target pass over ``inputs`` of sequences ``ids`` and a prompt ``chunk``: logits
        of the sequences' tokens, and of the last token of each prompt the chunk completes,
        whose first token is sampled from it; the chunk's other rows pay no LM head (a row is
        the same in any function, docs/exactness.md). ``(the sequences' logits, the first
        tokens)``."""
        chunks = [t for _, t in chunk.fresh]
        rows = sum(map(len, inputs))
        ends = np.cumsum([rows, *map(len, chunks)])[1:] - 1  # each chunk's last token
        last = [int(end) for end, done in zip(ends, chunk.completes, strict=True) if done]
        logits = self.target.evaluate_multi_query(
            self.kv,
            ids + [s.seq_id for s, _ in chunk.fresh],
            inputs + chunks,
            trees + [None] * len(chunk.fresh),
            scored=[*range(rows), *last],
        )
        release_pooled_buffers()
        if not last:
            return logits, PrefillResult([])
        at = iter(range(rows, rows + len(last)))
        first = self._first_tokens(chunk, logits, [next(at) if c else -1 for c in chunk.completes])
        return take(logits, range(rows)), first

    def _verify(
        self,
        seqs: list[Sequence],
        drafts: list[np.ndarray],
        parents: list[np.ndarray | None],
        draft_probs: DraftProbs | None,
        masks: np.ndarray | None,
        chunk: PrefillWork | None = None,
    ) -> tuple[list[list[int]], np.ndarray, tvm.runtime.Tensor, PrefillResult]:
        """One target pass over every sequence's pending token and drafts, then acceptance:
        ``(accepted drafts per sequence, emitted tokens concatenated, the pass's logits, first
        tokens of the prompts the chunk completes)``. A prompt ``chunk`` is computed in the
        same pass (``_beside_chunk``)."""
        inputs = [[s.tokens[-1], *d] for s, d in zip(seqs, drafts, strict=True)]
        blocks = [block_parents(len(d), p) for d, p in zip(drafts, parents, strict=True)]
        trees = [
            None if p is None else (s.kv_len, block)
            for s, p, block in zip(seqs, parents, blocks, strict=True)
        ]
        first = PrefillResult([])
        with self.timers("verify"):
            ids = [s.seq_id for s in seqs]
            if chunk is None:
                logits = self.target.evaluate_multi_query(self.kv, ids, inputs, trees)
            else:
                logits, first = self._beside_chunk(ids, inputs, trees, chunk)
        with self.timers("sample"):
            scored = logits if masks is None else self.target.sampler.mask(logits, masks)
            if any(p is not None for p in parents):
                return (*self._walk_trees(seqs, inputs, blocks, scored), logits, first)
            num_draft = [len(d) for d in drafts]
            uniforms = [s.rng.random(k + 1) for s, k in zip(seqs, num_draft, strict=True)]
            accepted, emitted = self.target.sampler.verify(
                scored, [s.params for s in seqs], drafts, draft_probs, uniforms
            )
        return [list(range(1, a + 1)) for a in accepted], emitted, logits, first

    # ---- structured output ---------------------------------------------------------------
    def _grammar_masks(
        self,
        seqs: list[Sequence],
        drafts: list[np.ndarray],
        parents: list[np.ndarray | None],
    ) -> np.ndarray | None:
        """The grammar mask of each row of the coming pass (per sequence its pending token's
        row, then its drafts'; ``runtime/structured_output.py``), or None without constrained
        sequences. A model-free chain (point masses) is cut before the first draft the
        grammar rejects (``drafts[i]`` replaced): the target would reject it anyway. A draft
        model's drafts are kept (its cache holds them; a sampled draft's rejection sampling
        needs it), as are a tree's nodes (their parents' rows give them no probability)."""
        if all(s.constraint is None for s in seqs):
            return None
        vocab, rows = self.target.vocab_size, []
        with self.timers("grammar"):
            for i, seq in enumerate(seqs):
                nodes = [seq.tokens[-1], *drafts[i]]
                if seq.constraint is None:
                    rows.append(unconstrained(len(nodes), vocab))
                    continue
                masks = seq.constraint.masks(nodes, block_parents(len(drafts[i]), parents[i]))
                rejected = ~masks.any(axis=1)
                cuttable = len(drafts[i]) and not self._drafted_by_model(seq)
                if parents[i] is None and cuttable and rejected.any():
                    keep = max(1, int(np.argmax(rejected)))  # the first node it rejects
                    drafts[i], masks = drafts[i][: keep - 1], masks[:keep]
                    rejected = rejected[:keep]
                masks[rejected] = -1  # never read: any mask keeps the row's softmax finite
                rows.append(masks)
        return np.concatenate(rows)

    def _drafted_by_model(self, seq: Sequence) -> bool:
        """The draft model proposed ``seq``'s drafts this step (its cache holds them)."""
        return self.scheduler.proposers[seq.draft_method].costs.model

    def _walk_trees(
        self,
        seqs: list[Sequence],
        inputs: list[list[int]],
        parents: list[np.ndarray],
        logits: tvm.runtime.Tensor,
    ) -> tuple[list[list[int]], np.ndarray]:
        """Acceptance of draft trees (a chain among them is the tree of width 1; ``parents``:
        each block's, ``block_parents``): the target's argmaxes walked down each tree when every
        request is greedy, else its processed distributions, read only at the nodes the walk
        reaches."""
        starts = np.cumsum([0, *map(len, inputs)])[:-1]
        walks = []
        if all(s.params.greedy for s in seqs):
            best = self.target.sampler.argmax(logits)
            for tokens, tree, a in zip(inputs, parents, starts, strict=True):
                walks.append(greedy_walk(tokens, tree, best[a : a + len(tokens)]))
        else:
            row_params = [s.params for s, t in zip(seqs, inputs, strict=True) for _ in t]
            probs = self.target.sampler.probs(logits, row_params)
            for seq, tokens, tree, a in zip(seqs, inputs, parents, starts, strict=True):
                walks.append(
                    sampled_walk(
                        tokens,
                        tree,
                        lambda node, a=a: np.asarray(Rows(probs, a + node, a + node + 1))[0],
                        seq.rng.random,
                    )
                )
        return [w.path for w in walks], np.concatenate([w.tokens for w in walks])

    def _commit(self, plan: StepPlan, result: StepResult) -> list[Emitted]:
        """Apply a step's outcome to the sequences it advanced. A sequence stopped by a string
        after this step was launched is skipped: its tokens are discarded and the pages they
        took go with it (``_commit_all`` frees it next)."""
        if not result.num_draft.any():
            self.scheduler.plain_step_ran(plan, result.target_seconds)
        elif plan.chunk is not None:
            self.scheduler.chunk_ran(plan, result.num_draft.tolist(), result.target_seconds)
        committed = [] if plan.chunk is None else self._commit_prefill(plan.chunk, result.first)
        live = [i for i, s in enumerate(plan.seqs) if not s.finished]
        seqs = [plan.seqs[i] for i in live]
        num_draft, accepted = result.num_draft[live], result.accepted[live]
        kept = [result.kept[i] for i in live]
        for seq, k, a, path in zip(seqs, num_draft, accepted, kept, strict=True):
            self.kv.keep(seq.seq_id, seq.kv_len, [0, *path])
            seq.kv_len += int(a) + 1
            seq.stats.record(int(k), int(a))
            self.stats.record(int(k), int(a))
        if self.proposer is not None:
            self.scheduler.verified(plan, live, num_draft.tolist(), kept)
        committed += [
            self._append(seq, [int(t) for t in result.emitted[i]], result.rows[i])
            for i, seq in zip(live, seqs, strict=True)
        ]
        # A pass with a chunk in it is not one the cost tables hold (the policy prices the
        # chunk's tokens from them).
        if self.proposer is not None and plan.chunk is None:
            # Overlapped, the host's work is off the step's time; in series it is on it.
            end = time.perf_counter() if self._worker is None else result.ended
            self.scheduler.record_step(
                plan,
                result.num_draft.tolist(),
                int(result.accepted.sum()) + len(plan.seqs),
                end - result.started,
                result.draft_seconds,
                result.target_seconds,
            )
        return committed

    # ---- tokens, stops, outputs ---------------------------------------------------------
    def _append(self, seq: Sequence, tokens: list[int], rows: Rows) -> Emitted:
        """Append a step's token ids, up to EOS, a stop token or max_tokens (the ones past it
        are dropped with the sequence's KV); ``rows[i]`` is the target's logits row that
        ``tokens[i]`` was sampled or verified from."""
        params, kept = seq.params, 0
        for token in tokens:
            seq.tokens.append(token)
            kept += 1
            if seq.constraint is not None and not seq.constraint.accept(token):
                raise RuntimeError(f"token {token} was emitted against its request's grammar")
            if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
                seq.finish_reason = "stop"
            elif seq.constraint is not None and seq.constraint.terminated:
                seq.finish_reason = "stop"  # the grammar is complete: nothing may follow
            elif seq.tokens_left == 0:
                seq.finish_reason = "length"
            if seq.finished:
                self._finish(seq)
                break
        return Emitted(seq, tokens[:kept], rows[:kept])

    def _finish(self, seq: Sequence) -> None:
        """Free a finished sequence's pages, now or, while a step is in flight, when it is
        collected; a request is done when all its samples are."""
        if self._in_flight is None:
            self.scheduler.free(seq)
        else:
            self._stopped.append(seq)
        if not seq.request.unfinished and seq.request.status == Status.RUNNING:
            self.scheduler.finish(seq.request)

    def _process(self, committed: list[Emitted]) -> list[RequestOutput]:
        """Logprobs, text and stop strings of committed tokens; the increments to report. A
        stop string ends its sequence here: the output processor keeps its output up to the
        stop, and ``tokens`` is left alone (a step in flight may be reading it)."""
        requests = {}
        for emitted in committed:
            seq = emitted.seq
            params = seq.params
            scored = (
                token_logprobs(emitted.rows, emitted.tokens, params.logprobs)
                if params.logprobs is not None
                else None
            )
            if self.outputs.process(seq.output, emitted.tokens, scored, finished=seq.finished):
                was_running, seq.finish_reason = not seq.finished, "stop"
                if was_running:
                    self._finish(seq)
            requests[seq.request.request_id] = seq.request
        return [self._delta(r) for r in requests.values()]

    def _delta(self, request: Request) -> RequestOutput:
        if not request.unfinished:
            self._requests.pop(request.request_id, None)
        return request.output(delta=True)

    # ---- metrics ------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Engine-wide speculation counters, seconds and calls per phase, the prefix cache's
        tokens looked up and found, the speculation policy's decisions with the measurements
        behind them, and what the proposer reports (its caches)."""
        return {
            **self.stats.to_dict(),
            "seconds": dict(self.timers.seconds),
            "calls": dict(self.timers.calls),
            "prefix_cache": {
                "query_tokens": self.scheduler.prefix_cache_queries,
                "hit_tokens": self.scheduler.prefix_cache_hits,
            },
            "speculation": self.scheduler.speculation_metrics(),
            **(self.proposer.metrics() if self.proposer else {}),
        }


def _rows_of(logits: tvm.runtime.Tensor, start: int, kept: list[int]) -> Rows:
    """The logits rows the emitted tokens came from: the pending token's, then each accepted
    draft's (consecutive for a chain; for a tree's path, copied out)."""
    path = [0, *kept]
    if path == list(range(len(path))):
        return Rows(logits, start, start + len(path))
    return Rows(take(logits, [start + node for node in path]), 0, len(path))
