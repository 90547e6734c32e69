"""Engine counters and latency samples; LLM.get_metrics and the Prometheus exporter read these."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MAX_SAMPLES = 10_000  # latency samples kept (the most recent), so a long-running server stays bounded


def _samples() -> deque:
    return deque(maxlen=MAX_SAMPLES)


@dataclass
class EngineStats:
    """Cumulative counters and the most recent per-request latency samples (seconds)."""

    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0   # prompt positions run through the model (prefill, recompute)
    generation_tokens: int = 0
    num_steps: int = 0
    request_success: dict[str, int] = field(default_factory=dict)  # by finish reason
    ttft: deque = field(default_factory=_samples)
    tpot: deque = field(default_factory=_samples)
    e2e: deque = field(default_factory=_samples)
    queue_time: deque = field(default_factory=_samples)

    def record_finished(self, reason: str, ttft: float | None, tpot: float | None,
                        e2e: float, queue: float | None) -> None:
        """Count one finished sequence and keep its latencies."""
        self.request_success[reason] = self.request_success.get(reason, 0) + 1
        self.e2e.append(e2e)
        for values, x in ((self.ttft, ttft), (self.tpot, tpot), (self.queue_time, queue)):
            if x is not None:
                values.append(x)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation, None when empty."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
