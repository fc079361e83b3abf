"""The planner: each step, ``Scheduler.schedule`` decides what runs and returns it as one plan,
a ``SchedulerOutput`` (vLLM v1's): the requests admitted and the prefix-cache hits they found,
the requests preempted for pages, the next prompt chunk, and the rows of the decode or verify
step with each one's draft count. The engine executes the plan's passes and commits their
results; it decides nothing.

The scheduler owns what the decisions rest on: the queues, the KV cache's pages (sequences
enter the cache from their longest cached prefix here, and leave it here), and the speculation
policy's state (acceptance estimates, measured step costs, the decision log).

A plan reads top-down:
  admit     FIFO, no overtaking, while pages (less those owed to prompts still prefilling)
            and batch slots allow; admitted requests enter the cache
  prefill   the next chunk of pending prompt (or preempted history) tokens: a whole pass with
            nothing decoding, else what ``max_num_batched_tokens`` leaves the decoding rows
  step      the newest requests are preempted while a step at every row's draft cap does not
            fit, then the policy chooses each row's drafts, pricing the chunk in; the step
            carries the chunk in its own pass, so the weights are read once for both, and a
            chunk that completes its prompt samples the prompt's first token there
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Iterable

from .chunk_sizer import ChunkSizer
from .kv_cache import PagedKVCache
from .metrics import SpeculationLog, StepRecord
from .model import chunk_rounds
from .params import EngineConfig, SamplingParams, SpeculativeConfig
from .proposers import Proposer
from .request import Request, Sequence, Status
from .speculation import (
    AcceptanceEstimator,
    Attended,
    Backoff,
    Candidate,
    Coverage,
    Decision,
    GoodputPolicy,
    RunningMean,
    StepCosts,
    StepShape,
    refreshes_plain,
)

# Weight of a step's rows in the running mean of the batch's size (``_joining``): ~20 steps, so
# the steps between a reply's end and its successor's first decode barely move it.
BATCH_ROWS_WEIGHT = 0.05
# Pages a sequence may need beyond ``pages(its tokens)``. After ``fork_sequence`` a sample writes
# its tokens into pages of its own while its parent's last, partly filled prompt page stays shared,
# so each sample can hold one page more than a packed count says.
FORK_PAGE_SLACK = 1
# Pages admission sets aside for each sequence's first step (its pending token and drafts). It is
# a reservation only: every step counts its pages again before it runs (``Scheduler._plan_step``).
FIRST_STEP_PAGES = 1
# What a sequence may need beyond ``pages(its tokens)`` from admission to its end.
SEQUENCE_PAGE_SLACK = FORK_PAGE_SLACK + FIRST_STEP_PAGES
# Every this many steps in a row that carry a chunk, one goes without: a chunk's cost is what its
# step took beyond the plain step of its decoding rows, and only plain steps measure that, at the
# rows' growing contexts. Without them the plain step stayed at its last measurement while 8
# SmolLM2 streams' contexts grew by hundreds of tokens; their added attention was booked to the
# chunk, the chunk shrank to a token, and a 2,000-token prompt waited 30 s for its first token.
PLAIN_EVERY = 16


def pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@dataclasses.dataclass
class PrefillWork:
    """One prefill pass: preempted sequences recomputing their KV (no logits needed), and
    prompt chunks; ``completes[i]``: ``fresh[i]``'s chunk ends its prompt, so its request
    samples its first token(s) from the pass."""

    restored: list[tuple[Sequence, list[int]]]
    fresh: list[tuple[Sequence, list[int]]]
    completes: list[bool]
    # Seconds the chunk may add to the decoding rows' plain step it rides in (None: no bound).
    allowance: float | None = None

    @property
    def seqs(self) -> list[Sequence]:
        return [s for s, _ in self.restored + self.fresh]

    def tokens(self) -> int:
        """Tokens the pass computes."""
        return sum(len(t) for _, t in self.restored + self.fresh)

    def in_cache(self) -> PrefillWork | None:
        """Without the sequences preempted since it was planned (``None`` if that is all)."""
        fresh = [(f, c) for f, c in zip(self.fresh, self.completes, strict=True) if f[0].in_cache]
        restored = [(s, t) for s, t in self.restored if s.in_cache]
        if not (fresh or restored):
            return None
        return PrefillWork(restored, [f for f, _ in fresh], [c for _, c in fresh], self.allowance)


@dataclasses.dataclass
class StepPlan:
    """The decode or verify rows of a step."""

    seqs: list[Sequence]
    num_draft: list[int]  # drafts asked of the proposer per sequence
    acceptance: list[float]  # the estimates the policy chose with (empty without a proposer)
    predicted_seconds: float | None
    expected_tokens: float  # what the policy expects the step to emit, by those estimates
    # A prompt chunk computed in this step's decode pass (a plain step only): one forward
    # reads the weights once for both.
    chunk: PrefillWork | None = None
    contexts: list[int] = dataclasses.field(default_factory=list)  # KV tokens per sequence
    methods: list[str] = dataclasses.field(default_factory=list)  # proposer per sequence
    # Its pass follows a prefill pass of its own (in this plan or the last). A prefill's
    # activations evict the weights that a run of decode steps keeps in a large cache: the
    # Qwen 1.5B's first 4-row decode after a 420-token prefill took 77-122 ms against 50-60 ms
    # (480 MB L3), so its time says nothing of its shape's price.
    cold: bool = False

    def attended(self, num_draft: list[int]) -> Attended:
        """What the target pass with ``num_draft`` drafts per sequence attends over."""
        return Attended.of(self.contexts, num_draft)


Work = PrefillWork | StepPlan


@dataclasses.dataclass
class SchedulerOutput:
    """One step's plan. ``works`` are its passes, in order."""

    admitted: list[Request]  # entered the cache for this step
    cached_tokens: int  # of their tokens, found in the prefix cache
    preempted: list[Request]  # back to the queue's front; their pages freed
    prefill: PrefillWork | None  # a prefill pass of its own
    step: StepPlan | None  # decode / verify rows, with the chunk when it rides along

    @property
    def works(self) -> list[Work]:
        return [w for w in (self.prefill, self.step) if w is not None and w.seqs]


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: PagedKVCache,
        proposer: Proposer | None,
        speculative: SpeculativeConfig | None,
        costs: StepCosts,
    ):
        self.config, self.kv = config, kv
        self.proposer, self.speculative = proposer, speculative
        self.max_batch_size, self.page_size = config.max_batch_size, kv.page_size
        self.max_k = speculative.max_speculative_tokens if speculative else 0
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order; prefilling ones included
        self._admitted_ahead: list[Request] = []  # enter the cache at the next ``schedule``
        # The speculation policy and what it learns from, per proposer (``auto`` has two).
        self.proposers = proposer.by_method() if proposer else {}
        self.acceptance = {
            m: AcceptanceEstimator(steady=p.costs.model) for m, p in self.proposers.items()
        }
        self.costs = costs
        # Where a draft model drafts beside a model-free proposer: how much text that one covers.
        self.coverage = Coverage()
        self._beside_free = {m: self._free_beside_model(m) for m in self.proposers}
        self.policy = GoodputPolicy()
        self.backoff = Backoff()
        self.plain_refreshes = 0  # plain steps taken to measure a stale plain price
        self.batch_rows = RunningMean()  # rows of recent decode steps
        self.speculation_log = SpeculationLog()
        # The chunk budget in time, from what chunks added to plain steps (which it reads by
        # rows from ``costs.decode``).
        self.chunk_sizer = ChunkSizer()
        self._chunks_in_a_row = 0  # plain steps that carried a chunk since one went without
        self._prefilled_alone = False  # the last plan had a prefill pass of its own
        # Counters a server reports.
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache as sequences enter
        self.prefix_cache_hits = 0  # ... and found there

    # ---- queues -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        request.status = Status.FINISHED
        self.running.remove(request)

    def remove(self, request: Request) -> None:
        """An aborted request leaves the queues; its sequences were freed."""
        if request in self.waiting:
            self.waiting.remove(request)
        elif request.status == Status.RUNNING:
            self.finish(request)

    # ---- the plan -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Admit what fits (after the requests admitted ahead enter the cache), then the step's
        passes: the next prefill chunk, and the decode or verify step of the sequences past
        their prompts, if any, which carries the chunk in its pass. While sequences decode,
        the chunk takes what ``max_num_batched_tokens`` leaves them, so a long prompt holds up
        no stream for more than a small chunk's time. A chunk that ended its prompt in a pass
        of its own made the decoding rows wait a pass (a prompt that arrived beside them each
        cost them a step: SmolLM2 int8 with automatic speculation at 4 rows, 61 such passes in
        2,250 steps on ShareGPT)."""
        hits = self.prefix_cache_hits
        ahead, self._admitted_ahead = self._admitted_ahead, []
        admitted = self._enter([r for r in ahead if r.status == Status.RUNNING])  # not aborted
        admitted += self._enter(self._admit(self.kv.available_pages() - self._prefill_reserve()))
        cached = self.prefix_cache_hits - hits
        prefill, step, preempted = self._plan_prefill(*self._chunk_budget()), None, []
        if prefill is None or not any(prefill.completes) or self._decoding():
            rides = prefill is not None and not prefill.restored
            step, preempted = self._plan_step(prefill.tokens() if rides else 0)
            if prefill is not None:  # the step may have preempted a prompt's request
                prefill = prefill.in_cache()
        if step is not None and step.seqs and prefill is not None and not prefill.restored:
            if not any(step.num_draft) and self._plain_is_stale():
                prefill = None  # this step measures its rows' plain step; the prompt waits
            else:
                step.chunk, prefill = prefill, None  # the chunk rides in the step's pass
        if step is not None:
            step.cold = self._prefilled_alone or prefill is not None
        self._prefilled_alone = prefill is not None
        return SchedulerOutput(admitted, cached, preempted, prefill, step)

    def _plain_is_stale(self) -> bool:
        """Whether ``PLAIN_EVERY`` steps in a row carried a chunk bounded in time."""
        return self.config.chunk_time_ratio is not None and self._chunks_in_a_row >= PLAIN_EVERY

    def admit_ahead(self, free_pages: int, most_pages: int) -> None:
        """While a step runs, admit the requests that fit even if it takes ``most_pages`` of
        the ``free_pages`` it was launched with; they enter the cache at the next plan."""
        self._admitted_ahead += self._admit(free_pages - most_pages - self._prefill_reserve())

    def most_pages(self, works: list[Work]) -> int:
        """Pages the passes of ``works`` may take: every chunk token, every draft accepted."""
        most = 0
        for work in works:
            if isinstance(work, PrefillWork):
                new = [len(t) for _, t in work.restored + work.fresh]
            else:
                new = [self.nodes(k) + 1 for k in work.num_draft]
                if work.chunk is not None:
                    most += self.step_pages(work.chunk.seqs, [len(t) for _, t in work.chunk.fresh])
            most += self.step_pages(work.seqs, new)
        return most

    def step_pages(self, seqs: list[Sequence], new_tokens: list[int]) -> int:
        """Pages needed to append ``new_tokens[i]`` tokens to each sequence's KV."""
        return sum(
            pages(s.kv_len + n, self.page_size) - pages(s.kv_len, self.page_size)
            for s, n in zip(seqs, new_tokens, strict=True)
        )

    # ---- admission ----------------------------------------------------------------------
    def _admit(self, free_pages: int) -> list[Request]:
        """Move waiting requests (FIFO, no overtaking) into the running set while they fit."""
        admitted = []
        while self.waiting:
            request = self.waiting[0]
            need = self._admission_pages(request)
            seqs = len(request.unfinished)
            if need > free_pages or self._num_running_seqs() + seqs > self.max_batch_size:
                break
            free_pages -= need
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            admitted.append(request)
        return admitted

    def _num_running_seqs(self) -> int:
        return sum(len(r.unfinished) for r in self.running)

    def _admission_pages(self, request: Request) -> int:
        """Pages the request needs to (re)enter the cache and take its first step."""
        seqs = request.unfinished
        if len(seqs[0].tokens) == seqs[0].num_prompt:  # new: one prompt, forked after prefill
            return pages(seqs[0].num_prompt, self.page_size) + SEQUENCE_PAGE_SLACK * len(seqs)
        return sum(pages(len(s.tokens), self.page_size) + FIRST_STEP_PAGES for s in seqs)

    @staticmethod
    def _to_feed(request: Request) -> list[Sequence]:
        """A new request feeds its prompt once (its samples fork from it); a preempted one
        recomputes each sequence's KV."""
        seqs = request.unfinished
        return [s for s in seqs if s.num_output] if seqs[0].num_output else seqs[:1]

    def _enter(self, requests: list[Request]) -> list[Request]:
        for request in requests:
            for seq in self._to_feed(request):
                self._enter_cache(seq)
        return requests

    def _enter_cache(self, seq: Sequence) -> None:
        """Into the KV cache, starting from the longest cached prefix of what it feeds."""
        feed = seq.tokens[: feed_end(seq)]
        seq.kv_len = self.kv.add_sequence_with_prefix(seq.seq_id, feed)
        seq.in_cache = True
        self.prefix_cache_queries += len(feed)
        self.prefix_cache_hits += seq.kv_len
        if not seq.num_output:
            seq.request.num_cached_tokens = seq.kv_len

    def free(self, seq: Sequence) -> None:
        """Out of the KV cache, its whole pages kept as a cached prefix; the proposer's and the
        policy's state for it go too once it is finished."""
        if seq.in_cache:
            self.kv.cache_prefix(seq.seq_id, seq.tokens[: seq.kv_len])
            self.kv.remove_sequence(seq.seq_id)
            seq.in_cache, seq.kv_len = False, 0
        if self.proposer:
            self.proposer.remove(seq)
        if seq.finished:
            for estimator in self.acceptance.values():
                estimator.forget(seq.seq_id)
            self.coverage.forget(seq.seq_id)

    # ---- prefill ------------------------------------------------------------------------
    def _prefilling(self) -> list[Sequence]:
        """Admitted sequences whose prompt (or, after preemption, history) is not yet fully in
        the cache."""
        return [
            s for r in self.running for s in r.unfinished if s.in_cache and s.kv_len < feed_end(s)
        ]

    def _prefill_reserve(self) -> int:
        """Pages still owed to admitted requests whose prefill is not finished."""
        page = self.page_size
        return sum(
            pages(feed_end(s), page) - pages(s.kv_len, page) + SEQUENCE_PAGE_SLACK
            for s in self._prefilling()
        )

    def _chunk_budget(self) -> tuple[int, float | None]:
        """Prompt tokens this step's prefill pass may take: a whole pass's worth with nothing
        decoding, else the step's token budget less a token per decoding sequence (their drafts
        are chosen later; the budget bounds the prefill, not the verify pass), at least a page
        so prompts always advance; and what ``chunk_sizer`` says fits in ``chunk_time_ratio``
        times the decoding rows' plain step (at their contexts) per waiting prompt, the
        allowance (seconds) returned beside the tokens. The time bound is for prompts longer
        than a prefill pass: a shorter one, spread thinner, adds no less to the streams' time
        in all while its row idles longer and its first token comes later (beside 7 SmolLM2
        int8 streams, a 500-token prompt took 62 steps of ~1.8x gaps and 0.54 s bounded, 9
        steps of ~4.7x and 0.21 s not; beside 3, ShareGPT's 50-250-token chats came in 11-17
        tokens a step, and automatic n-gram speculation ran at 0.94x no speculation, 0.97x
        without the bound on them)."""
        decoding = self._decoding()
        if not decoding:
            return self.config.prefill_chunk_size, None
        budget = self.config.max_num_batched_tokens - len(decoding)
        budget = min(self.config.prefill_chunk_size, max(self.page_size, budget))
        ratio, whole = self.config.chunk_time_ratio, self.config.prefill_chunk_size
        prefilling = self._prefilling()
        if ratio is None or all(feed_end(s) <= whole for s in prefilling):
            return budget, None
        plain = self.costs.plain([s.kv_len for s in decoding])
        if plain is None:
            return budget, None
        # Each waiting prompt may add the ratio's time: a prompt at a time would cap the batch.
        # At 8 tokens a step a 150-token prompt takes ~19 steps, so a closed loop of 16
        # clients with 128-token answers kept ~7 rows decoding (SmolLM2 int8: 0.85x the
        # throughput of a token budget alone, and TTFT 2.8x); one prompt waiting is as before.
        allowance = len(prefilling) * ratio * plain
        return min(budget, self.chunk_sizer.size()), allowance

    def _plan_prefill(self, budget: int, allowance: float | None) -> PrefillWork | None:
        """The next prefill pass: up to ``budget`` pending prompt (or history) tokens, first
        come first served; ``allowance``: what it may add to a plain step it rides in."""
        seqs = self._prefilling()
        if not seqs:
            return None
        feeds = [s.tokens[s.kv_len : feed_end(s)] for s in seqs]
        rows, chunks = next(chunk_rounds(feeds, budget))
        chunked = [(seqs[i], feeds[i][c]) for i, c in zip(rows, chunks, strict=True)]
        fresh = [(s, t) for s, t in chunked if not s.num_output]
        return PrefillWork(
            [(s, t) for s, t in chunked if s.num_output],
            fresh,
            [s.kv_len + len(t) == s.num_prompt for s, t in fresh],
            allowance,
        )

    def plain_step_ran(self, plan: StepPlan, seconds: float) -> None:
        """A step that drafted nothing, before its commit: its pass's time by rows (the policy's
        decode table, with or without a proposer), or, with a chunk in it, what the chunk added
        to that; nothing from a ``cold`` step."""
        rows = len(plan.seqs)
        if plan.chunk is None:
            if not plan.cold:
                self.costs.observe_target(rows, rows, seconds, Attended.of(plan.contexts))
                self._chunks_in_a_row = 0
            return
        self._chunks_in_a_row += 1
        self.chunk_ran(plan, [0] * rows, seconds)

    def chunk_ran(self, plan: StepPlan, num_draft: list[int], seconds: float) -> None:
        """A pass that carried ``plan``'s chunk beside ``num_draft`` drafts per row: the chunk
        sizer learns what the chunk added to that pass as priced (a cold step teaches it
        nothing). Learned from plain steps alone, the sizer stayed at ``FIRST_CHUNK`` while the
        Qwen draft drafted in nearly every step, and prompts arriving one by one at 4 streams
        came in 8 tokens a step: the batch averaged 2.3 rows and the server ran at 0.83x no
        speculation (ShareGPT)."""
        rows, allowance = len(plan.seqs), plan.chunk.allowance
        without = self.costs.target(rows, rows + sum(num_draft))
        if without is not None and allowance is not None and not plan.cold:
            without += self.costs.attention.seconds(plan.attended(num_draft))
            self.chunk_sizer.ran(plan.chunk.tokens(), seconds - without, allowance)

    def prefilled(self, work: PrefillWork) -> None:
        """A prefill pass ran: its sequences' KV grew, and each finished prompt (or history)
        is shared with prompts arriving meanwhile."""
        for seq, tokens in work.restored + work.fresh:
            seq.kv_len += len(tokens)
            if seq.kv_len == feed_end(seq):
                self.kv.cache_prefix(seq.seq_id, seq.tokens[: seq.kv_len])

    # ---- the decode / verify step -------------------------------------------------------
    def _decoding(self) -> list[Sequence]:
        """Running sequences past their prompt: the rows of a decode step."""
        return [s for r in self.running for s in r.unfinished if s.prefilled]

    def _plan_step(self, chunk: int) -> tuple[StepPlan, list[Request]]:
        """The sequences to advance and their draft counts, and the requests preempted for
        them. The newest requests are preempted until a step at every sequence's draft cap fits
        in the free pages; then the policy chooses each count up to its cap, or up to what the
        proposer has (prompt lookup may find fewer drafts, or none), unless the batch rests
        after a decline (``Backoff``).

        ``chunk``: prompt tokens that ride in this step's pass, plain or verifying, which the
        policy prices with the step's other tokens. Automatic requests used to draft nothing
        while a chunk waited (a draft then cost the chunk a pass of its own); with prompts
        arriving every few replies, a chunk rode in nearly half of a 4-stream batch's steps,
        and free drafts were held back in all of them."""
        preempted = []
        while True:
            seqs = self._decoding()
            caps = [self._draft_cap(s) for s in seqs]
            need = self.step_pages(seqs, [self.nodes(c) + 1 for c in caps])
            need += self._prefill_reserve()
            if need <= self.kv.available_pages() or len(self.running) <= 1:
                break
            preempted.append(self._preempt_newest())
        contexts = [s.kv_len for s in seqs]
        plain = StepPlan(seqs, [0] * len(seqs), [], None, len(seqs), contexts=contexts)
        if not seqs or self.proposer is None:
            return plain, preempted
        self.batch_rows.observe(len(seqs), BATCH_ROWS_WEIGHT)
        automatic = [self.pinned_k(s.params) is None for s in seqs]
        ids = [s.seq_id for s in seqs]
        unweighed = any(automatic) and self.backoff.resting(ids)
        caps = [0 if a and unweighed else c for a, c in zip(automatic, caps, strict=True)]
        if not any(caps):
            # Nothing for the policy to choose: speculation is off for every sequence, or the
            # batch rests (``Backoff``) and every sequence is automatic (as under load in the
            # server, where choosing among nothing cost 0.3 ms a step, ~3% of SmolLM2's 8-row
            # step). Planned as without a proposer, unpriced: pricing it and reading every
            # sequence's estimate made a resting step's plan cost 2.5x one without speculation
            # (0.055 ms against 0.022, SmolLM2 int8 at 4 rows; its step ~3.2 ms).
            return plain, preempted
        start = time.perf_counter()
        options = [
            {m: self._candidate(seq, m, cap, auto) for m in self._methods(seq)}
            for seq, cap, auto in zip(seqs, caps, automatic, strict=True)
        ]
        joining = self._joining(len(seqs))
        decision, methods = self.policy.choose_methods(options, self.costs, joining, chunk)
        drafted = any(k for k, a in zip(decision.num_draft, automatic, strict=True) if a)
        if any(automatic) and not unweighed:
            self.backoff.weighed(
                ids, drafted, time.perf_counter() - start, decision.predicted_seconds
            )
        if drafted and all(automatic) and refreshes_plain(decision, self.costs, len(seqs)):
            decision = self._plain(contexts)
            self.plain_refreshes += 1
        for seq, method in zip(seqs, methods, strict=True):
            seq.draft_method = method
        plan = StepPlan(
            seqs,
            decision.num_draft,
            [o[m].acceptance for o, m in zip(options, methods, strict=True)],
            decision.predicted_seconds,
            decision.expected_tokens,
            contexts=contexts,
            methods=methods,
        )
        return plan, preempted

    def _joining(self, rows: int) -> int:
        """Sequences expected to join a batch of ``rows`` soon: those whose prompts wait or are
        in prefill, or as many as the batch has lately held beyond ``rows`` (a closed loop
        refills a batch each time a reply ends, often after the policy has weighed a step),
        within the batch's room."""
        room = self.max_batch_size - rows
        if room <= 0:
            return 0
        # Each waiting request brings a sequence at least: the first ``room`` can fill the room.
        waiting = itertools.islice(self.waiting, room)
        pending = len(self._prefilling()) + sum(len(r.unfinished) for r in waiting)
        lately = round(self.batch_rows.value or rows) - rows
        return max(0, min(max(pending, lately), room))

    def _plain(self, contexts: list[int]) -> Decision:
        """No drafts for sequences holding ``contexts`` tokens, with the step's predicted time."""
        step = self.costs.predict(StepShape(len(contexts), attended=Attended.of(contexts)))
        return Decision([0] * len(contexts), step, float(len(contexts)))

    def _methods(self, seq: Sequence) -> list[str]:
        """The proposers the policy may choose for ``seq``: the one its request pins, or all."""
        pinned = seq.params.speculative_method
        return [pinned] if pinned is not None else list(self.proposers)

    def _estimate(self, seq: Sequence, method: str) -> float:
        """With the proposer's own chance from its latest lookup (``available``), if any."""
        chance = self.proposers[method].chance(seq)
        return self.acceptance[method].estimate(seq.seq_id, chance)

    def _is_free(self, method: str) -> bool:
        return self.proposers[method].costs is self.costs.free

    def _free_beside_model(self, method: str) -> bool:
        """Whether ``method`` is a draft model beside a model-free proposer, whose catch-ups
        serve only the text that one leaves it."""
        return not self._is_free(method) and any(map(self._is_free, self.proposers))

    def _candidate(self, seq: Sequence, method: str, cap: int, automatic: bool) -> Candidate:
        """``seq`` drafting with ``method``'s proposer, up to what it has to offer."""
        proposer = self.proposers[method]
        most = proposer.available(seq, cap) if cap else 0
        beside = self._beside_free[method] and seq.params.speculative_method is None
        return Candidate(
            cap=most,
            pinned=None if automatic else most,
            acceptance=self._estimate(seq, method),
            catch_up=proposer.catch_up(seq) if most else 0,
            tokens_left=seq.tokens_left,
            context=seq.kv_len,
            free=self._is_free(method),
            calibration=self.acceptance[method].calibration(),
            width=proposer.width,
            served=1.0 - self.coverage.share(seq.seq_id) if beside else 1.0,
        )

    def _preempt_newest(self) -> Request:
        """The newest request goes back to the queue's front; its pages are freed (its whole
        pages stay cached, so it usually finds them again)."""
        request = self.running.pop()
        request.status = Status.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        for seq in request.unfinished:
            self.free(seq)
        return request

    def pinned_k(self, params: SamplingParams) -> int | None:
        """The k a request runs with (its own, else the engine's), capped by the engine's
        maximum; ``None`` when the policy chooses."""
        k = params.num_speculative_tokens
        if k is None:
            k = self.speculative.num_speculative_tokens if self.speculative else 0
        return None if k == "auto" else min(k, self.max_k)

    def most_drafts(self, params: SamplingParams) -> int:
        pinned = self.pinned_k(params)
        return self.max_k if pinned is None else pinned

    def nodes(self, k: int) -> int:
        """Drafts a step of ``k`` verifies (a tree's depth k has more)."""
        return self.speculative.nodes(k) if self.speculative else k

    def most_nodes(self, params: SamplingParams) -> int:
        """Drafts a request's step may append to the cache before verification."""
        return self.nodes(self.most_drafts(params))

    def _draft_cap(self, seq: Sequence) -> int:
        """Most drafts ``seq`` may take this step: no more than it has tokens left for."""
        return max(0, min(self.most_drafts(seq.params), seq.tokens_left - 1))

    # ---- what the policy learns from a step ---------------------------------------------
    def verified(
        self, plan: StepPlan, rows: Iterable[int], num_draft: list[int], kept: list[list[int]]
    ) -> None:
        """Acceptance of plan rows ``rows`` (those still running), ``num_draft[j]`` verified
        and those at ``kept[j]`` accepted for the j-th of them."""
        rows = list(rows)
        seqs = [plan.seqs[i] for i in rows]
        asked = [j for j, k in enumerate(num_draft) if k > 0]
        if asked:
            self.proposer.on_verified(
                [seqs[j] for j in asked],
                [num_draft[j] for j in asked],
                [kept[j] for j in asked],
            )
        accepted = [len(path) for path in kept]
        for estimator in self.acceptance.values():
            estimator.fade([s.seq_id for s in seqs])
        track_coverage = any(self._beside_free.values())
        for seq, k, a, i in zip(seqs, num_draft, accepted, rows, strict=True):
            if k:  # a tree's acceptance is by depth, as its chance to be emitted is priced
                width = self.proposers[plan.methods[i]].width
                self.acceptance[plan.methods[i]].observe(
                    seq.seq_id, -(-k // width), a, plan.acceptance[i]
                )
            if track_coverage:
                covered = bool(k) and self._is_free(plan.methods[i])
                self.coverage.observe(seq.seq_id, a + 1, covered)
            seq.stats.record_choice(plan.num_draft[i])

    def record_step(
        self,
        plan: StepPlan,
        num_draft: list[int],
        emitted: int,
        seconds: float,
        draft_seconds: float,
        target_seconds: float,
    ) -> None:
        """Feed a step's measured times to the cost model (unless the step is ``cold``) and the
        decision log."""
        rows, drafted = len(plan.seqs), sum(num_draft)
        if drafted and not plan.cold:  # a plain step's pass was observed by ``plain_step_ran``
            attended = plan.attended(num_draft)
            self.costs.observe_target(rows, rows + drafted, target_seconds, attended)
        self.costs.per_row.observe((seconds - draft_seconds - target_seconds) / rows)
        if plan.predicted_seconds is not None and seconds > 0:
            self.costs.realized.observe(
                bool(drafted), plan.expected_tokens, emitted, plan.predicted_seconds, seconds
            )
        names = [
            s.request.request_id if s.params.n == 1 else f"{s.request.request_id}/{s.index}"
            for s in plan.seqs
        ]
        self.speculation_log.record(
            StepRecord(
                names,
                list(plan.num_draft),
                plan.acceptance,
                plan.predicted_seconds,
                seconds,
                plan.expected_tokens,
                emitted,
                plan.methods,
            )
        )

    def speculation_metrics(self) -> dict | None:
        """What the policy chose and why: per-step decisions with predicted and measured step
        times, the acceptance estimates and the measured cost tables (``None`` without
        speculation)."""
        if self.proposer is None:
            return None
        first = next(iter(self.acceptance.values()))
        return {
            **self.speculation_log.to_dict(),
            "acceptance_prior": first.prior(),
            "acceptance_per_position": first.per_position(),
            "acceptance_by_method": {
                m: {"prior": e.prior(), "per_position": e.per_position()}
                for m, e in self.acceptance.items()
            },
            "model_free_share": self.coverage.engine_share(),
            "rested_steps": self.backoff.rested_steps,
            "plain_refreshes": self.plain_refreshes,
            "costs": self.costs.to_dict(),
        }


def feed_end(seq: Sequence) -> int:
    """Tokens of ``seq`` whose KV a (re)entry computes: the prompt, or after preemption all
    but the pending token (the next step feeds it)."""
    return len(seq.tokens) - 1 if seq.num_output else len(seq.tokens)
