"""Block timings as fixed-bucket histograms: cheap to observe, read whole at scrape time."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# seconds: from a fraction of a step to an hour
BLOCK_TIME_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0)


@dataclass
class TimeHistogram:
    """Counts of observations per bucket (upper bounds, the last one +inf), their sum and count."""

    buckets: tuple[float, ...] = BLOCK_TIME_BUCKETS
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, seconds: float) -> None:
        """Add one observation."""
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def snapshot(self) -> dict:
        """{"buckets": [(upper bound, cumulative count)...], "sum", "count"}; the last bound is +inf."""
        cumulative, total = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            total += n
            cumulative.append((bound, total))
        return {"buckets": cumulative, "sum": self.sum, "count": self.count}
