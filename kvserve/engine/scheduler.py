"""Iteration-level scheduling: one token budget per step, chunked prefill, preemption."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvserve.engine.request import Request, RequestStatus
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.no_cache import NoCacheManager
from kvserve.kv.swap import SwapSpace


@dataclass
class SchedulerOutput:
    """The requests to run this step and how many new tokens each."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens in the batch."""
        return sum(n for _, n in self.scheduled)


class FcfsOrder:
    """Arrival order: a preempted request goes back to the front, the newest running one is preempted."""

    def add(self, waiting: deque[Request], req: Request) -> None:
        waiting.append(req)

    def requeue(self, waiting: deque[Request], req: Request) -> None:
        waiting.appendleft(req)

    def victim(self, running: list[Request]) -> Request:
        return running.pop()


class PriorityOrder:
    """vLLM's priority policy: lower `priority` first, then arrival; preemption takes the running
    request latest in that order."""

    @staticmethod
    def key(req: Request) -> tuple[int, float]:
        return req.params.priority, req.arrival_time

    def add(self, waiting: deque[Request], req: Request) -> None:
        i = next((i for i, r in enumerate(waiting) if self.key(req) < self.key(r)), len(waiting))
        waiting.insert(i, req)

    requeue = add

    def victim(self, running: list[Request]) -> Request:
        req = max(running, key=self.key)
        running.remove(req)
        return req


ORDERS = {"fcfs": FcfsOrder, "priority": PriorityOrder}


class Scheduler:
    """Continuous batching over a KVCacheManager, or over a NoCacheManager (recompute mode: every step
    runs each running request's whole sequence, chosen once here), in FCFS or priority order."""

    def __init__(self, kv: KVCacheManager | NoCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 swap: SwapSpace | None = None, preemption_mode: str = "recompute", policy: str = "fcfs"):
        self.kv = kv
        self._schedule = self._schedule_cached if kv.holds_kv else self._schedule_recompute
        self.order = ORDERS[policy]()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.swap = swap
        self.preemption_mode = preemption_mode
        self.num_swap_preemptions = 0
        self.seconds_per_token: float | None = None  # measured prefill cost, for preemption "auto"

    def add(self, req: Request) -> None:
        """Queue a new request."""
        self.order.add(self.waiting, req)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch: running requests first, then waiting ones in the policy's order."""
        return self._schedule()

    def _schedule_cached(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = _chunk(req, req.num_computed_tokens, budget) + _lookahead(req, budget)
            if n == 0:  # nothing new to run (a beam waiting for its siblings)
                i += 1
                continue
            fits = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            if not fits and req.spec_token_ids:   # lookahead slots never preempt anyone
                req.spec_token_ids, n = [], 1
                fits = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            while not fits:
                victim = self.order.victim(self.running)
                budget += self._unschedule(out, victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return budget
                i = self.running.index(req)
                fits = self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n)
            out.scheduled.append((req, n))
            budget -= n
            i += 1
        return budget

    @staticmethod
    def _unschedule(out: SchedulerOutput, victim: Request) -> int:
        """Take a preempted request out of this step's batch (the priority order may pick one already
        in it); returns the tokens it gives back to the budget."""
        tokens = sum(n for r, n in out.scheduled if r is victim)
        out.scheduled = [(r, n) for r, n in out.scheduled if r is not victim]
        return tokens

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            self.kv.set_salt(req.request_id, req.params.cache_salt)  # before any of its blocks is hashed
            self.kv.set_retention(req.request_id, req.params.kv_retention, req.num_prompt_tokens)
            if self.swap is not None and self.swap.is_swapped(req.request_id):
                n = _chunk(req, req.num_computed_tokens, budget)
                if not self.swap.swap_in(req.request_id, lambda: self.kv.allocate_slots(
                        req.request_id, req.num_computed_tokens, n)):
                    break  # stays first in line (FCFS) until enough blocks are free
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                if n:
                    out.scheduled.append((req, n))
                budget -= n
                continue
            hits, num_hit = self._prefix_hits(req)
            n = _chunk(req, num_hit, budget)
            if not self.kv.allocate_slots(req.request_id, num_hit, n, hits):
                break
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING:  # first admission, not a resume
                req.num_cached_tokens = num_hit
                self.kv.record_prefix_query(req.num_tokens, num_hit, hits)
                req.metrics.first_scheduled_time = time.monotonic()
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n

    def _prefix_hits(self, req: Request) -> tuple[list[int], int]:
        if req.params.prompt_logprobs is not None:  # every prompt position must produce logits
            self.kv.get_computed_blocks(req.request_id, [])
            return [], 0
        return self.kv.get_computed_blocks(req.request_id, req.token_ids)

    def _preempt(self, req: Request) -> None:
        req.spec_token_ids = []
        if self._prefer_swap(req) and self.swap.swap_out(req.request_id, req.num_computed_tokens):
            self.num_swap_preemptions += 1  # keeps num_computed_tokens: its KV comes back on resume
        else:
            self.kv.free(req.request_id)
            req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.order.requeue(self.waiting, req)

    def _prefer_swap(self, req: Request) -> bool:
        """Swap when forced, or ("auto") when moving the bytes out and back beats recomputing."""
        if self.swap is None or self.preemption_mode == "recompute" or req.num_computed_tokens == 0:
            return False
        if self.preemption_mode == "swap":
            return True
        blocks = self.swap.blocks_to_swap(req.request_id, req.num_computed_tokens)
        if self.seconds_per_token is None:
            return True
        return self.swap.estimate_seconds(blocks) < req.num_computed_tokens * self.seconds_per_token

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """Learn the cost of a computed token from prefill-sized steps (for preemption "auto")."""
        if num_tokens >= 64 and seconds > 0:
            x = seconds / num_tokens
            self.seconds_per_token = x if self.seconds_per_token is None else 0.8 * self.seconds_per_token + 0.2 * x

    def _schedule_recompute(self) -> SchedulerOutput:
        """No cache: admit waiting requests up to max_num_seqs; every running one reruns from token 0."""
        out = SchedulerOutput()
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.metrics.first_scheduled_time = time.monotonic()
            self.running.append(req)
        for req in self.running:
            req.num_computed_tokens = 0  # nothing is cached: the whole sequence runs again
            out.scheduled.append((req, req.num_tokens))
        return out

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark a request finished and release its blocks."""
        req.status = status
        req.metrics.finished_time = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        self.kv.drop_salt(req.request_id)
        if self.swap is not None:
            self.swap.drop(req.request_id)


def _lookahead(req: Request, budget: int) -> int:
    """Slots for a decoding request's proposals (speculative decoding) within what the budget
    leaves after its own token; the proposals beyond them are dropped."""
    if req.spec_token_ids:
        del req.spec_token_ids[max(0, budget - 1):]
    return len(req.spec_token_ids)


def _chunk(req: Request, start: int, budget: int) -> int:
    """Tokens to run from `start`: the rest of the sequence, within the budget and the request's chunk."""
    return min(req.num_tokens - start, budget, req.prefill_chunk or budget)
