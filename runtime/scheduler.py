"""Which requests run: FIFO admission within KV-page and batch limits, preemption of the
newest request when the cache is full (it is re-queued first and recomputed later)."""

from __future__ import annotations

import collections

from .request import Request, Sequence, Status

# Pages a sequence may need beyond ``pages(its tokens)``. After ``fork_sequence`` a sample writes
# its tokens into pages of its own while its parent's last, partly filled prompt page stays shared,
# so each sample can hold one page more than a packed count says.
FORK_PAGE_SLACK = 1
# Pages admission sets aside for each sequence's first step (its pending token and drafts). It is
# a reservation only: every step counts its pages again before it runs (``Engine._plan``).
FIRST_STEP_PAGES = 1
# What a sequence may need beyond ``pages(its tokens)`` from admission to its end.
SEQUENCE_PAGE_SLACK = FORK_PAGE_SLACK + FIRST_STEP_PAGES


def pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Scheduler:
    def __init__(self, max_batch_size: int, page_size: int):
        self.max_batch_size = max_batch_size
        self.page_size = page_size
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order; prefilling ones included

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running_seqs(self) -> int:
        return sum(len(r.unfinished) for r in self.running)

    def admission_pages(self, request: Request) -> int:
        """Pages the request needs to (re)enter the cache and take its first step."""
        seqs = request.unfinished
        if len(seqs[0].tokens) == seqs[0].num_prompt:  # new: one prompt, forked after prefill
            return pages(seqs[0].num_prompt, self.page_size) + SEQUENCE_PAGE_SLACK * len(seqs)
        return sum(pages(len(s.tokens), self.page_size) + FIRST_STEP_PAGES for s in seqs)

    def admit(self, free_pages: int) -> list[Request]:
        """Move waiting requests (FIFO, no overtaking) into the running set while they fit."""
        admitted = []
        while self.waiting:
            request = self.waiting[0]
            need = self.admission_pages(request)
            seqs = len(request.unfinished)
            if need > free_pages or self.num_running_seqs() + seqs > self.max_batch_size:
                break
            free_pages -= need
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            admitted.append(request)
        return admitted

    def step_pages(self, seqs: list[Sequence], new_tokens: list[int]) -> int:
        """Pages needed to append ``new_tokens[i]`` tokens to each sequence's KV."""
        return sum(
            pages(s.kv_len + n, self.page_size) - pages(s.kv_len, self.page_size)
            for s, n in zip(seqs, new_tokens, strict=True)
        )

    def preempt_newest(self) -> Request:
        request = self.running.pop()
        request.status = Status.WAITING
        self.waiting.appendleft(request)
        return request

    def finish(self, request: Request) -> None:
        request.status = Status.FINISHED
        self.running.remove(request)
