"""Request: one sequence moving through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvserve.engine.detokenizer import TextBuffer
from kvserve.outputs import Logprob, RequestMetrics
from kvserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        """True for the three finished states."""
        return self.value in ("stop", "length", "abort")


@dataclass
class Request:
    """Token ids, progress through the cache, and sampling state of one sequence."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    group_id: str | None = None           # the user-visible request id (forks share it)
    index: int = 0                        # which of the group's `n` completions
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    kv_policy: object | None = None       # resolved kv.policies.KVPolicy when the request evicts
    prefill_chunk: int | None = None      # most tokens per step when below the step budget (a streaming
                                          # kv_policy in a pool too small for its capacity + a full chunk)
    grammar: object | None = None         # structured outputs: its matcher (structured/grammar.py Grammar)
    bad_words: list[list[int]] = field(default_factory=list)   # params.bad_words as token ids

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)   # prompt + output
        self.output_token_ids: list[int] = []          # output only (kept, not sliced per step)
        self.num_sent_tokens = 0                       # DELTA outputs: tokens and text already reported
        self.num_sent_chars = 0
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0                   # tokens whose K/V are in the cache
        self.spec_token_ids: list[int] = []            # proposed next tokens the coming step verifies
        self.num_cached_tokens = 0                     # prompt tokens served from the prefix cache
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None                  # why the engine failed it, if it did
        self.prefix_fault = False                      # with error: its cached prefix was at fault (evicted)
        self.kv_transfer_params: dict | None = None   # a KV producer's answer, set when it finishes
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, Logprob]] | None = [] if self.params.logprobs is not None else None
        self.prompt_logprobs: list | None = None
        self.output_text = TextBuffer()                # detokenized output, appended piece by piece
        self.metrics = RequestMetrics(self.arrival_time)
        if self.group_id is None:
            self.group_id = self.request_id

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    def step_tokens(self, start: int, n: int) -> list[int]:
        """The `n` tokens a step runs from position `start`: its own, then its proposals."""
        head = self.token_ids[start:start + n]
        return head + self.spec_token_ids[:n - len(head)] if len(head) < n else head

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def text(self) -> str:
        """The output text so far."""
        return self.output_text.text()

    @property
    def is_finished(self) -> bool:
        """True once stopped, out of length, or aborted."""
        return self.status.finished

    def append_token(self, token_id: int, logprob: float, top: dict[int, Logprob] | None) -> None:
        """Record one sampled token."""
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if self.logprobs is not None and top is not None:
            self.logprobs.append(top)
        now = time.monotonic()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now

    def fork(self, request_id: str, index: int = 0, generator: torch.Generator | None = None) -> Request:
        """A copy of this sequence so far under a new id (same group), not yet scheduled."""
        child = Request(request_id, self.prompt_token_ids, self.params, prompt=self.prompt, group_id=self.group_id,
                        index=index, generator=generator, arrival_time=self.arrival_time,
                        kv_policy=self.kv_policy, prefill_chunk=self.prefill_chunk,
                        grammar=self.grammar.fork() if self.grammar is not None else None,
                        bad_words=self.bad_words)
        child.token_ids = list(self.token_ids)
        child.output_token_ids = list(self.output_token_ids)
        child.cumulative_logprob = self.cumulative_logprob
        if self.logprobs is not None:
            child.logprobs = list(self.logprobs)
        child.num_cached_tokens = self.num_cached_tokens
        child.metrics.first_scheduled_time = self.metrics.first_scheduled_time
        return child

    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason, None while running."""
        return self.status.value if self.is_finished else None
