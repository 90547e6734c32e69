"""What generate() returns: RequestOutput, CompletionOutput, Logprob, RequestMetrics."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class Logprob:
    """Log-probability of one token, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    spec_draft_tokens: int = 0       # speculative decoding: tokens proposed and verified
    spec_accepted_tokens: int = 0    # of those, accepted

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Share of proposed tokens accepted (None before any was verified)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Time waiting before first scheduled."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated sequence of a request (there are `n` of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None      # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its `n` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None     # set when the engine failed this request (finish reason 'abort')
    prefix_fault: bool = False   # with error: a cached prefix it read was at fault and is evicted (a retry recomputes it)
    kv_transfer_params: dict | None = None   # a KV producer's answer: where a consumer finds this prompt's KV


class DeltaCollector:
    """Adds up a request's DELTA outputs into the output CUMULATIVE would have given: pieces are kept
    and joined once, so collecting costs the size of what is new at each step."""

    def __init__(self):
        self.last: RequestOutput | None = None
        self.parts: dict[int, tuple[list[str], list[int], list | None]] = {}

    def add(self, out: RequestOutput) -> None:
        for c in out.outputs:
            texts, ids, logprobs = self.parts.setdefault(c.index, ([], [], None if c.logprobs is None else []))
            texts.append(c.text)
            ids.extend(c.token_ids)
            if logprobs is not None and c.logprobs is not None:
                logprobs.extend(c.logprobs)
        self.last = out

    def result(self) -> RequestOutput | None:
        """The whole output so far (None before the first)."""
        if self.last is None:
            return None
        outs = []
        for c in self.last.outputs:
            texts, ids, logprobs = self.parts[c.index]
            outs.append(replace(c, text="".join(texts), token_ids=list(ids), logprobs=logprobs))
        return replace(self.last, outputs=outs)


@dataclass
class BeamSearchSequence:
    """One finished beam."""

    tokens: list[int]            # generated tokens only
    text: str
    cum_logprob: float
    score: float                 # cum_logprob / len(prompt + tokens) ** length_penalty
    finish_reason: str           # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    """The best `beam_width` beams of one prompt, best first."""

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]
