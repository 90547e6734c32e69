"""The engine's speculation: proposals for the running requests before each step, the verdict on
them after it, and the counts (vLLM's spec_decode metric names).

Verification is exact for greedy and sampled requests alike: every row of a request's step is
sampled as if the drafts before it had been accepted; the drafts are accepted while each equals the
token its row drew, and the first row that drew another token gives that token (the row after the
last accepted draft gives the bonus token). Each emitted token is thus drawn from the target's own
distribution given the tokens before it (for a proposal fixed before the step, this is rejection
sampling with a one-point draft distribution: accept with probability p(draft), else draw from p
without the draft)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.spec.config import SpeculativeConfig


@dataclass
class SpecStats:
    """Counters of verified proposals (vLLM's spec_decode_* names)."""

    num_drafts: int = 0                    # steps that verified at least one proposed token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # accepted at draft position i

    def count(self, num_drafted: int, num_accepted: int) -> None:
        """One request's verdict."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos.extend([0] * (num_drafted - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def metrics(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos)}


def num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts equal the tokens their rows drew (sampled[i] was drawn at the row
    before drafts[i])."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return n


class Speculator:
    """Proposes with `proposer` (ngram.py, suffix.py or draft.py: propose(reqs, ks) -> up to ks[i] tokens
    each, finished(req)), at most `num_speculative_tokens` a request, fewer where the request's
    recent proposals were rejected; none while more than `disable_by_batch_size` sequences run, for
    requests that cannot take them (a grammar, the end of max_tokens or max_model_len), and for a
    while after a request's proposals were all rejected (1, 2, 4 ... up to MAX_PAUSE steps for each
    such verdict in a row): a step that verifies costs more than a plain decode step."""

    MAX_PAUSE = 16

    enabled = True

    def __init__(self, spec: SpeculativeConfig, proposer, max_model_len: int):
        self.spec = spec
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.k: dict[str, int] = {}   # request id -> proposals it gets next
        self.pause: dict[str, list[int]] = {}   # request id -> [steps left without proposals, next pause]
        self.stats = SpecStats()

    def propose(self, running: list) -> None:
        """Give each running request in decode its proposals for the next step (req.spec_token_ids)."""
        limit = self.spec.disable_by_batch_size
        if limit is not None and len(running) > limit:
            for req in running:
                req.spec_token_ids = []
            return
        for req in running:
            req.spec_token_ids = []
        rooms = [(req, self._room(req)) for req in running]
        rooms = [(req, k) for req, k in rooms if k > 0]
        if rooms:
            proposals = self.proposer.propose([r for r, _ in rooms], [k for _, k in rooms])
            for (req, k), drafts in zip(rooms, proposals):
                req.spec_token_ids = list(drafts[:k])

    def _room(self, req) -> int:
        """Proposals `req` can take: its allowance, within max_tokens and max_model_len (a step
        emits up to one token more than it verifies), none in prefill or under a grammar."""
        if req.grammar is not None or req.is_finished or req.num_computed_tokens != req.num_tokens - 1:
            return 0
        pause = self.pause.get(req.request_id)
        if pause is not None and pause[0] > 0:
            pause[0] -= 1
            return 0
        left = min(req.params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        return min(self.k.get(req.request_id, self.spec.num_speculative_tokens), left - 1)

    def verdict(self, req, sampled: list[int]) -> int:
        """Accepted drafts of `req` given the tokens its rows drew; adapts its allowance: one more
        after all were accepted, else one more than were accepted."""
        drafts = req.spec_token_ids
        n = num_accepted(drafts, sampled)
        self.stats.count(len(drafts), n)
        req.metrics.spec_draft_tokens += len(drafts)
        req.metrics.spec_accepted_tokens += n
        top = self.spec.num_speculative_tokens
        self.k[req.request_id] = min(top, n + 1) if n < len(drafts) else min(top, len(drafts) + 1)
        self._back_off(req.request_id, n)
        return n

    def _back_off(self, rid: str, accepted: int) -> None:
        """Pause a request's proposals after a verdict that accepted none, longer each time in a row."""
        if accepted:
            self.pause.pop(rid, None)
            return
        nxt = self.pause.get(rid, (0, 1))[1]
        self.pause[rid] = [nxt, min(2 * nxt, self.MAX_PAUSE)]

    def finished(self, req) -> None:
        """Forget a request that ended."""
        self.k.pop(req.request_id, None)
        self.pause.pop(req.request_id, None)
        self.proposer.finished(req)

    def metrics(self) -> dict:
        return self.stats.metrics()


class NoSpeculation:
    """The engine without speculative_config: no proposals, nothing counted."""

    enabled = False

    def propose(self, running: list) -> None:
        pass

    def finished(self, req) -> None:
        pass

    def metrics(self) -> dict:
        return {}
