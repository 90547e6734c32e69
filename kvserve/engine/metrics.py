"""Engine counters and latency samples; LLM.get_metrics and the Prometheus exporter read these."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Cumulative counters and per-request latency samples (seconds)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    request_success: dict[str, int] = field(default_factory=dict)  # by finish reason
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    queue_time: list[float] = field(default_factory=list)

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
