"""A draft model (vLLM's `draft_model` method): a smaller model with the target's tokenizer, run by
kvserve itself with its own KV pool, proposes greedy continuations.

Each target request has a mirror (same request id) whose draft KV holds the target's accepted
tokens. At `propose`, one batched draft step runs what each mirror is missing of them (the catch-up,
a multi-token chunk per request through the normal ModelRunner.execute path), then k - 1 batched
one-token steps give k proposals per request, the argmax of the draft's logits. The proposals are
points, so the Speculator's verdict stays exact. The K/V of proposals stays in the draft's blocks:
at the next `propose` the mirror keeps what the target accepted and rolls back the rest
(KVCacheManager.trim)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from kvserve.engine.builder import CachePlanner, LoadedModel, load_model
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.request import RequestStatus
from kvserve.model.loader import MODEL_ALIASES
from kvserve.startup import phase

log = logging.getLogger("kvserve")


class Mirror:
    """The draft's copy of one target request: its tokens (the accepted ones, then this round's
    proposals) and how many of them the draft's KV holds. The runner reads it as a Request."""

    def __init__(self, req):
        self.req = req
        self.request_id = req.request_id
        self.token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_synced = 0             # leading tokens known to equal the target's accepted ones
        self.spec_token_ids: list[int] = []   # always empty: the draft verifies nothing
        self.proposed: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def step_tokens(self, start: int, n: int) -> list[int]:
        """The `n` tokens a step runs from position `start`."""
        return self.token_ids[start:start + n]

    def sync(self, token_ids: list[int]) -> int:
        """Take the target's accepted tokens; returns how many leading tokens of the draft's KV
        still hold them (proposals the target rejected roll back), never all of them: the last
        token runs again for the first proposal's logits."""
        i, end = self.num_synced, min(self.num_tokens, len(token_ids))
        while i < end and self.token_ids[i] == token_ids[i]:
            i += 1
        del self.token_ids[i:]
        self.token_ids.extend(token_ids[i:])
        self.num_synced = len(token_ids)
        self.num_computed_tokens = min(self.num_computed_tokens, i, len(token_ids) - 1)
        self.proposed = []
        return self.num_computed_tokens


class DraftProposer:
    """Proposes with a draft model over its own KV manager, storage and ModelRunner; `token_budget`
    bounds the tokens of one catch-up step."""

    def __init__(self, loaded: LoadedModel, planner: CachePlanner, kv, storage, runner: ModelRunner,
                 token_budget: int):
        self.loaded, self.planner = loaded, planner
        self.kv, self.storage, self.runner = kv, storage, runner
        self.token_budget = token_budget
        self.mirrors: dict[str, Mirror] = {}
        self.num_short = 0   # times a request got no proposals because the draft's pool was short

    @classmethod
    def build(cls, config, target: LoadedModel, target_planner: CachePlanner) -> DraftProposer:
        """Load the draft of `config.speculative_config` on the target's device and dtype and give it
        a KV pool of the bytes the target's planner set aside (`target_planner.draft_kv`); ValueError
        for a draft that cannot propose for this target."""
        spec = config.speculative_config
        check_draft_path(spec.model)
        device = target_planner.device
        budget, source = target_planner.draft_kv
        draft_config = _draft_config(config, spec.model, target.max_model_len, budget)
        with phase("draft model"):
            loaded = _load(draft_config, device, target.dtype)
            check_same_vocabulary(target, loaded)
            planner = CachePlanner(draft_config, loaded, device)
            try:
                kv, storage = planner.build()
            except ValueError as exc:
                raise ValueError(f"speculative_config draft model's KV pool ({source}): {exc} For the draft, "
                                 "raise speculative_config draft_kv_cache_memory (or kv_cache_memory, which "
                                 "holds both pools).") from None
            # attention_backend, not config.attention(): proposals never change a verified token,
            # so the draft needs no batch-invariant attention
            runner = ModelRunner(loaded.model, kv, storage, device, config.max_num_seqs, target.max_model_len,
                                 config.attention_backend)
        proposer = cls(loaded, planner, kv, storage, runner, config.max_num_batched_tokens)
        proposer.log(source)
        return proposer

    def log(self, source: str) -> None:
        """The start-up line: the draft model, its weight format and its KV pool."""
        p, lm, fmt = self.planner.plan, self.loaded, self.planner.format.description
        dtype = str(lm.dtype).removeprefix("torch.")
        log.info("draft model: %s (%s, weights %s, activations %s); its KV pool: %d blocks x %d tokens = %d "
                 "tokens (%.1f MiB, format %s, %d KV group(s)) from %s", lm.config.name, lm.path, lm.weight_format,
                 dtype, p.num_blocks, p.block_size, p.num_tokens // len(self.planner.groups), p.nbytes / 2**20,
                 dtype if fmt == "auto" else fmt, len(self.planner.groups), source)

    # ---- the proposer interface --------------------------------------------------------------
    def propose(self, reqs: list, ks: list[int]) -> list[list[int]]:
        """Up to ks[i] greedy draft tokens after reqs[i]'s tokens; none for a request the draft's
        pool has no room for."""
        self._drop_idle()
        mirrors = [self._sync(req) for req in reqs]
        ready = [(m, k) for m, k in zip(mirrors, ks) if k > 0 and self._reserve(m, k)]
        if ready:
            self._catch_up([m for m, _ in ready])
            for _ in range(max(k for _, k in ready) - 1):
                self._step([(m, 1) for m, k in ready if len(m.proposed) < k])
        return [list(m.proposed) for m in mirrors]

    def finished(self, req) -> None:
        """Free the mirror of a request that ended."""
        if self.mirrors.pop(req.request_id, None) is not None:
            self.kv.free(req.request_id)

    # ---- the steps ----------------------------------------------------------------------------
    def _sync(self, req) -> Mirror:
        """`req`'s mirror, its tokens now the target's accepted ones and its KV trimmed to those it holds."""
        m = self.mirrors.get(req.request_id)
        if m is None:
            m = self.mirrors[req.request_id] = Mirror(req)
        keep = m.sync(req.token_ids)
        if self.kv.has_request(m.request_id):
            self.kv.trim(m.request_id, keep)
        return m

    def _reserve(self, m: Mirror, k: int) -> bool:
        """Slots for the mirror's missing tokens and k - 1 proposals, taken at once (a sliding window
        frees nothing a rollback needs); when the pool is short the mirror gives its blocks back."""
        if self.kv.allocate_slots(m.request_id, m.num_computed_tokens, m.num_tokens - m.num_computed_tokens + k - 1):
            return True
        self.num_short += 1
        self._free(m)
        return False

    def _catch_up(self, mirrors: list[Mirror]) -> None:
        """Run each mirror's missing tokens (chunks within the token budget); the step that runs a
        mirror's last token gives its first proposal."""
        pending = mirrors
        while pending:
            batch, budget = [], self.token_budget
            for m in pending:
                if budget == 0:
                    break
                n = min(m.num_synced - m.num_computed_tokens, budget)
                batch.append((m, n))
                budget -= n
            self._step(batch)
            pending = [m for m in pending if m.num_computed_tokens < m.num_synced]

    def _step(self, batch: list[tuple[Mirror, int]]) -> None:
        """One draft step; each mirror whose last token ran gains the argmax of its logits."""
        inp, logits, _ = self.runner.execute(batch)
        for m, n in batch:
            m.num_computed_tokens += n
        for m, token in zip(inp.sampling_reqs, logits.argmax(dim=-1).tolist()):
            m.token_ids.append(token)
            m.proposed.append(token)

    def _drop_idle(self) -> None:
        """Free the mirrors of preempted requests: the draft's pool holds running requests only."""
        for m in [m for m in self.mirrors.values() if m.req.status != RequestStatus.RUNNING]:
            self._free(m)

    def _free(self, m: Mirror) -> None:
        self.kv.free(m.request_id)
        del self.mirrors[m.request_id]


def check_draft_path(model: str) -> None:
    """ValueError when the draft model's file or folder does not exist."""
    if model not in MODEL_ALIASES and not Path(model).expanduser().exists():
        raise ValueError(f"speculative_config model {model!r} (the draft model) does not exist: give the path of "
                         "a GGUF file or HF model directory with the target's tokenizer")


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """ValueError when the draft's token ids do not mean the target's: another vocabulary size, or
    (both shipping one) another tokenizer."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative_config draft model {draft.path} has a vocabulary of {draft.config.vocab_size} "
                         f"tokens, the target {target.config.vocab_size}: a draft must share the target's tokenizer; "
                         "pick a smaller model of the target's family")
    if draft.tokenizer is None or target.tokenizer is None:
        return
    if draft.tokenizer.hf_tokenizer.get_vocab() != target.tokenizer.hf_tokenizer.get_vocab():
        raise ValueError(f"speculative_config draft model {draft.path} has another tokenizer than the target (same "
                         "vocabulary size, different tokens): a draft must share the target's tokenizer; pick a "
                         "smaller model of the target's family")


def _draft_config(config, model: str, max_model_len: int, kv_bytes: int):
    """The target's options for the draft: its model, its KV pool, and none of the target's cache
    extras (prefix caching, tiers, events, swap, per-layer formats); eager."""
    return dataclasses.replace(
        config, model=model, max_model_len=max_model_len, kv_cache_memory=kv_bytes, gpu_memory_utilization=None,
        kv_cache_mode="paged", enable_prefix_caching=False, kv_cache_dtype_skip_layers=(),
        kv_cache_head_precision=None, kv_tiers=None, kv_tier_key=None, kv_tier_key_file=None, kv_events=None,
        kv_events_replay=None, swap_space=0.0, preemption_mode="recompute", kv_pin_fraction=0.0, kv_policy=None,
        speculative_config=None, enforce_eager=True)


def _load(config, device, dtype) -> LoadedModel:
    """The draft model; its load errors name it as the draft."""
    try:
        return load_model(config, device, dtype)
    except ValueError as exc:
        raise ValueError(f"speculative_config draft model {config.model}: {exc}") from None
