"""A step's logits summarized in one pass on the CPU (rows.cpp), built on first use as a torch op.

`torch.ops.kvserve_rows.row_stats(logits)` gives each row's maximum (NaN where it holds one), the
index of its first maximum, its log-sum-exp and the maximum's log-prob, as float64 [R, 4]: what the
sampler needs of a greedy row (is it valid, its token, its log-prob) and of every row (the
log-sum-exp that turns a logit into a log-prob), where torch took three passes over the vocabulary.
Compiled like the other kernels (kvserve/native.py); `available()` is False where the build fails
(logged once), and the sampler then takes torch's amax, argmax and logsumexp.
"""

from __future__ import annotations

from pathlib import Path

from kvserve import native

SOURCE = Path(__file__).with_name("rows.cpp")

_state: dict = {}


def available() -> bool:
    """True once the op is loaded (built on the first call; False, logged once, where it cannot be)."""
    return native.load_ops(_state, SOURCE, "CPU row statistics kernel unavailable (%s); the sampler uses "
                           "torch's reductions")
