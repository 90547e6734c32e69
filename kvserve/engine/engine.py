"""LLMEngine: requests in, tokens out, one scheduler step at a time."""

from __future__ import annotations

import itertools
import logging
import os
import time

import torch

from kvserve.config import DTYPES, EngineConfig
from kvserve.engine.detokenizer import IncrementalDetokenizer, find_stop
from kvserve.engine.eviction import Evictor, extend_positions, request_policy
from kvserve.engine.memory import PoolPlan, check_fits, gib, measure_activation_peak, plan_pool
from kvserve.engine.metrics import EngineStats
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.offload import build_swap, build_tiers, offload_metrics
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampler import Sampler, SamplingError, SamplingInput, prompt_logprobs
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.eviction import KeepAll
from kvserve.kv.formats import KVCacheFormat, build_kv_format, split_budget
from kvserve.kv.hashing import namespace_hash
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.policies import parse_policy
from kvserve.kv.spec import group_layers
from kvserve.kv.storage import KVStorage
from kvserve.model.layers import fuse_projections
from kvserve.model.loader import gguf_linear_types, load_weights, resolve_model_path
from kvserve.model.quant import cast_unquantized, quantize_model, weight_bytes
from kvserve.model.registry import build_model
from kvserve.model.tokenizer import Tokenizer
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams, check_cache_salt

log = logging.getLogger("kvserve")

PromptType = str | list[int] | dict
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class LLMEngine:
    """Synchronous engine: add requests, call step() until none are left."""

    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        t0 = time.perf_counter()
        self.model_path = resolve_model_path(config.model)
        auto = config.weights == "auto" and config.dtype == "auto"
        self.weight_format, why = config.weight_format(gguf_linear_types(self.model_path) if auto else None)
        self.model_config, weights = load_weights(self.model_path, self._load_dtype())
        self.tokenizer = _load_tokenizer(self.model_path)
        self.model = self._build_model(weights)
        self.load_seconds = time.perf_counter() - t0
        log.info("weights: %s, activations and KV %s (%s); %.1f MiB of weights", self.weight_format,
                 str(self.dtype).removeprefix("torch."), why, weight_bytes(self.model) / 2**20)
        self.max_model_len = self._max_model_len()
        extend_positions(self.model, self.max_model_len)
        self.stats = EngineStats()
        self.sampler = Sampler(self._eos_ids(), self.model_config.vocab_size, config.seed)
        self._init_cache()
        self.groups: dict[str, list[Request]] = {}
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()

    # ---- set-up --------------------------------------------------------------------
    def _build_model(self, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
        model = build_model(self.model_config)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and self.model_config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        if not self._quantized():
            model = model.to(device=self.device, dtype=self.dtype).eval()
            fuse_projections(model)
            return model
        model = model.to(device=self.device).eval()
        fuse_projections(model)
        quantize_model(model, self.weight_format)
        cast_unquantized(model, self.dtype)
        return model

    def _quantized(self) -> bool:
        """True when the linear weights are stored in another format than the activations."""
        return DTYPES.get(self.weight_format) != self.dtype

    def _load_dtype(self) -> torch.dtype:
        """Weights are quantized from float32 (not from an already rounded copy)."""
        return torch.float32 if self._quantized() else self.dtype

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        n = self.config.max_model_len or limit
        if n > limit and not self.config.kv_policy:
            raise ValueError(f"max_model_len={n} exceeds the model's context length {limit}")
        if n > limit:  # a kv_policy stream may run past it (sinks/window re-index positions: docs/EVICTION.md)
            log.warning("max_model_len=%d exceeds the model's context length %d (allowed with kv_policy)", n, limit)
        return n

    def _eos_ids(self) -> list[int]:
        ids = list(self.model_config.eos_token_ids)
        tok_eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if tok_eos is not None and tok_eos not in ids:
            ids.append(tok_eos)
        return ids

    def _init_cache(self) -> None:
        cfg = self.config
        self.kv_policy = parse_policy(cfg.kv_policy) if cfg.kv_policy else None  # engine-wide default
        self.kv_groups = group_layers(self.model.kv_specs(), size=1 if self.kv_policy is not None else None)
        self.kv_format = self._kv_format()      # kv/formats.py: how K/V are stored, what a token costs
        self.kv_bytes_per_token = self.kv_format.bytes_per_token
        self.page_bytes_per_token = self.kv_format.page_bytes_per_token
        self.kv_residual_rows = 0
        self.kv, self.storage, self.pool_plan = None, None, None
        if cfg.kv_cache_mode != "none":
            self.pool_plan = self._plan_pool()
            self.kv = KVCacheManager(
                self.pool_plan.num_blocks, self.pool_plan.block_size, self._namespace(),
                enable_prefix_caching=cfg.enable_prefix_caching and cfg.kv_cache_mode == "paged",
                groups=self.kv_groups, hash_algo=cfg.prefix_caching_hash_algo, pin_fraction=cfg.kv_pin_fraction)
            self.storage = KVStorage(self.kv_groups, self.pool_plan.num_blocks, self.pool_plan.block_size,
                                     self.dtype, self.device, self.kv_format, self.kv_residual_rows)
            self.storage.block_is_free = lambda b: self.kv.pool.blocks[b].ref_cnt == 0
            self.kv.residual_rows = self.kv_residual_rows or None  # the scheduler admits this many filling blocks
        self.runner = ModelRunner(self.model, self.kv, self.storage, self.device, cfg.max_num_seqs,
                                  self.max_model_len)
        # The KV manager's eviction strategy: keep everything, or engine/eviction.py's Evictor under
        # a kv_policy (it needs one layer per KV group)
        self.evictor = self.kv.eviction if self.kv is not None else KeepAll()
        if self.kv_policy is not None and self.kv is not None:
            self.evictor = Evictor(self.kv, self.storage, self.model, self.kv_groups)
            self.evictor.check(self.kv_policy)
        self.runner.use_eviction(self.evictor)
        self.swap = build_swap(cfg, self.storage, self.kv)   # host swap pool (swap_space GiB)
        self.tiers = build_tiers(self)                        # prefix store below the device (kv_tiers)
        max_batch = cfg.max_num_batched_tokens if self.kv is not None else self.max_model_len
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, max_batch, self.swap, cfg.preemption_mode)
        self._log_pool()

    def _plan_pool(self) -> PoolPlan:
        cfg = self.config
        # contiguous layout = one max_model_len "block" per sequence, reserved up front
        block_size = self.max_model_len if cfg.kv_cache_mode == "contiguous" else cfg.block_size
        held = weight_bytes(self.model)
        activation = 0
        if cfg.kv_cache_memory is None and (cfg.gpu_memory_utilization is not None or self.device.type == "cuda"):
            activation = measure_activation_peak(self.device, self._warmup)
        plan = plan_pool(cfg.kv_cache_memory, cfg.gpu_memory_utilization, self.device,
                         held, activation, block_size, self.page_bytes_per_token)
        if self.kv_format.has_residual:  # KIVI: full-precision rows for still-filling blocks, from the budget
            plan.num_blocks, self.kv_residual_rows = self._split_residual(plan.budget_bytes, block_size)
        self.pool_plan = plan  # the prefill chunk of a streaming kv_policy is sized from it
        check_fits(plan, self._blocks_per_sequence(block_size), self.max_model_len, self._bound_note())
        return plan

    def _split_residual(self, budget: int, block_size: int) -> tuple[int, int]:
        """(blocks, residual rows) of a KIVI pool; one sequence needs two rows per KV group (the block
        a prefill chunk completes and the one it leaves filling)."""
        groups = len(self.kv_groups)
        blocks, rows = split_budget(max(0, budget), block_size, self.page_bytes_per_token,
                                    self.kv_format.residual_bytes_per_token, self.config.max_num_seqs * groups,
                                    min_rows=2 * groups)
        if rows < 2 * groups:
            raise ValueError(f"KV cache too small for {self.kv_format.description}: {max(0, budget) / 2**20:.1f} MiB "
                             f"cannot hold the {2 * groups} full-precision residual rows one sequence needs plus "
                             "its blocks. Raise kv_cache_memory / gpu_memory_utilization.")
        return blocks, rows

    def _kv_format(self) -> KVCacheFormat:
        """The KV storage format from the config (calibrating per-head precision if asked)."""
        cfg = self.config
        block_size = self.max_model_len if cfg.kv_cache_mode == "contiguous" else cfg.block_size
        high = None
        if cfg.kv_cache_head_precision and cfg.kv_cache_mode != "none":
            from kvserve.engine.kv_calibration import choose_high_precision_heads
            high = choose_high_precision_heads(self, self.kv_groups, cfg)
        return build_kv_format(self.kv_groups, self.dtype, block_size, cfg.kv_cache_dtype, cfg.kv_cache_dtype_k,
                               cfg.kv_cache_dtype_v, cfg.kv_cache_dtype_skip_layers, cfg.kv_cache_rotation,
                               high, cfg.kv_cache_head_precision_dtype)

    def _kv_len_bound(self) -> int:
        """Most tokens one layer holds for one sequence: max_model_len, or less under a bounding kv_policy."""
        p = self.kv_policy
        if p is None or not p.evicts or not p.is_resolved:
            return self.max_model_len
        n = self.max_model_len
        return min(n, p.cache_bound(n, n, self._prefill_chunk(p)))

    def _blocks_per_sequence(self, block_size: int, kv_len: int | None = None) -> int:
        """Blocks one sequence holding `kv_len` tokens per layer (default: the most one max_model_len
        sequence holds) needs, over all KV groups."""
        kv_len = kv_len or self._kv_len_bound()
        total = 0
        for g in self.kv_groups:
            n = -(-kv_len // block_size)
            if g.spec.kind == "sliding":
                n = min(n, -(-g.spec.window // block_size) + 1)
            total += n
        return total + (1 if any(g.spec.kind == "sliding" for g in self.kv_groups) else 0)

    def _prefill_chunk(self, policy) -> int:
        """Most prompt tokens a request under `policy` runs per step: max_num_batched_tokens, or fewer for
        a streaming policy whose capacity plus one chunk would not fit the pool (it evicts between chunks)."""
        chunk, plan = self.config.max_num_batched_tokens, self.pool_plan
        if plan is None or policy is None or not policy.streaming or not policy.is_resolved:
            return chunk

        def fits(c: int) -> bool:
            return self._blocks_per_sequence(plan.block_size, policy.capacity + c) <= plan.num_blocks
        if fits(chunk):
            return chunk
        if not fits(1):  # not even one token: the start-up / admission check refuses
            return 1
        lo, hi = 1, chunk  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def _bound_note(self) -> str:
        """What one sequence holds at most, for the start-up error."""
        p = self.kv_policy
        if p is None or not p.streaming or not p.is_resolved:
            return ""
        return f"kv_policy {p.spec()!r} holds {p.capacity} tokens per layer plus one prefill chunk (at least 1)"

    @torch.inference_mode()
    def _warmup(self) -> None:
        """One no-cache forward of max_num_batched_tokens tokens to measure activation memory."""
        from kvserve.attention import AttentionMetadata, PrefillSpan
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(prefills=[PrefillSpan(0, n, n)])
        hidden = self.model(ids, torch.arange(n, device=self.device), meta)
        self.model.compute_logits(hidden[-256:])
        for layer in self.model.model.layers:
            layer.self_attn.kv_rows = 0

    def _namespace(self) -> bytes:
        mc = self.model_config
        return namespace_hash(mc.name, mc.architecture, self.dtype, self.config.block_size,
                              mc.num_layers, mc.num_kv_heads, mc.head_dim, self.kv_format.description,
                              *([f"weights={self.weight_format}"] if self._quantized() else []),
                              algo=self.config.prefix_caching_hash_algo)

    def _log_pool(self) -> None:
        if self.pool_plan is None:
            log.info("KV cache: none (every step recomputes the whole sequence)")
            return
        p = self.pool_plan
        per_seq = self._blocks_per_sequence(p.block_size)
        log.info("KV cache (%s): %d blocks x %d tokens = %d tokens (%s, format %s, %d B/token, %d KV group(s)) "
                 "from %s; max concurrency at max_model_len=%d: %.1fx", self.config.kv_cache_mode, p.num_blocks,
                 p.block_size, p.num_tokens // len(self.kv_groups), gib(p.nbytes), self.kv_format.description,
                 self.kv_bytes_per_token, len(self.kv_groups), p.source, self.max_model_len, p.num_blocks / per_seq)
        if self.kv_residual_rows:
            log.info("KV cache residual: %d full-precision rows of %d tokens for still-filling blocks (%s)",
                     self.kv_residual_rows, p.block_size, gib(self.storage.residual_nbytes))
        for note in self.kv_format.notes:
            log.info("KV cache format: %s", note)

    # ---- requests ------------------------------------------------------------------
    def make_request(self, prompt: PromptType, params: SamplingParams | None = None,
                     request_id: str | None = None) -> Request:
        """Validate a prompt and its parameters; no engine state changes."""
        params = _with_prompt_salt(params or SamplingParams(), prompt)
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty: give at least one token of text or token ids")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.model_config.vocab_size})")
        policy = request_policy(self.evictor, self.kv_policy, params, len(ids))
        chunk = self._prefill_chunk(policy)
        params = self._fit_max_tokens(params, len(ids), policy, chunk)
        rid = request_id or str(next(self._ids))
        if rid in self.groups:
            raise ValueError(f"request_id {rid!r} is already in use")
        req = Request(rid, ids, params, prompt=text, generator=self._generator(params.seed), kv_policy=policy)
        if chunk < self.config.max_num_batched_tokens:
            req.prefill_chunk = chunk
        return req

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; returns its id. Raises ValueError for input that can never run."""
        req = self.make_request(prompt, params, request_id)
        self.groups[req.request_id] = [req]
        self.detoks[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens)
        self.stats.prompt_tokens += req.num_prompt_tokens
        if req.kv_policy is not None:
            self.evictor.add(req, req.kv_policy)
        self.scheduler.add(req)
        return req.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now, free its blocks and forget it; returns its final output."""
        if request_id not in self.groups:
            return None
        for req in self.groups[request_id]:
            if not req.is_finished:
                self._finish(req, RequestStatus.FINISHED_ABORTED)
        return self._output(request_id)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None and prompt:
                raise ValueError("this model directory has no tokenizer: pass prompts as token id lists")
            return prompt, self.tokenizer.encode(prompt) if prompt else []
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _fit_max_tokens(self, params: SamplingParams, prompt_len: int, policy=None,
                        chunk: int | None = None) -> SamplingParams:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(f"prompt has {prompt_len} tokens but max_model_len is {self.max_model_len}: "
                             "shorten the prompt or raise max_model_len")
        chunk = chunk or self.config.max_num_batched_tokens
        top = policy.position_bound(prompt_len, chunk) if policy is not None else None
        if params.max_tokens is None:
            params = _replace(params, max_tokens=room)
        elif params.max_tokens > room and (top is None or top > self.max_model_len):
            # a re-indexed stream whose positions stay below max_model_len may run past it
            hint = f", or raise max_model_len to {top} (a {policy.spec()} stream then runs past it)" if top else ""
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len={self.max_model_len}: lower max_tokens to at most {room}{hint}")
        if self.kv is not None:
            kv_len = prompt_len + params.max_tokens
            if policy is not None:  # admitted against the policy's bound, not the full length
                kv_len = policy.cache_bound(prompt_len, kv_len, chunk)
            need = self.kv.max_blocks_for_tokens(kv_len)
            if need > self.kv.num_blocks:
                raise ValueError(f"request needs {need} KV blocks but the whole pool has {self.kv.num_blocks}: "
                                 "lower max_tokens or raise kv_cache_memory")
        return params

    def _generator(self, seed: int | None, offset: int = 0) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed((seed + offset) % 2**63)

    # ---- the step ------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return outputs of requests that moved."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        self.stats.num_steps += 1
        pl_reqs = [r for r, _ in sched.scheduled if r.params.prompt_logprobs is not None and r.num_output_tokens == 0]
        t0 = time.perf_counter()
        inp, logits, prompt_logits = self.runner.execute(sched.scheduled, pl_reqs)
        self.scheduler.observe_step(sched.num_tokens, time.perf_counter() - t0)
        for req, n in sched.scheduled:
            done = req.num_computed_tokens
            self.stats.prompt_tokens_computed += max(0, min(done + n, req.num_prompt_tokens) - done)
            req.num_computed_tokens += n
            if self.kv is not None:
                self.kv.cache_blocks(req.request_id, req.token_ids, req.num_computed_tokens)
        if self.tiers is not None:
            self.tiers.write_through()  # copies of the blocks just registered go to the writer threads
        self._collect_prompt_logprobs(prompt_logits, pl_reqs)
        touched = {r.group_id for r, _ in sched.scheduled}
        self._sample(logits, inp.sampling_reqs)
        self.evictor.after_step(sched.scheduled)
        return [self._output(gid) for gid in touched if gid in self.groups and self._reports(gid)]

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        inputs = [SamplingInput(r.params, r.prompt_token_ids, r.output_token_ids, r.generator,
                                self._num_samples(r)) for r in reqs]
        try:
            results = self.sampler(logits, inputs)
        except SamplingError as exc:  # nothing was drawn: fail those requests, sample the rest
            for i in exc.rows:
                self._fail(reqs[i], _sampling_failure(reqs[i].params))
            keep = [i for i, r in enumerate(reqs) if not r.is_finished]
            if keep:
                self._sample(logits[keep], [reqs[i] for i in keep])
            return
        for req, res in zip(reqs, results):
            top = res.top_logprobs or [None] * len(res.token_ids)
            if len(res.token_ids) > 1:
                self._fork(req, res.token_ids[1:], res.logprobs[1:], top[1:])
            self._append(req, res.token_ids[0], res.logprobs[0], top[0])

    def _num_samples(self, req: Request) -> int:
        return req.params.n if req.index == 0 and req.num_output_tokens == 0 else 1

    def _fork(self, parent: Request, tokens, logprobs, tops) -> None:
        """Children share the parent's blocks; the partly filled last block is copied on write."""
        for i, (tok, lp, top) in enumerate(zip(tokens, logprobs, tops), start=1):
            child = Request(f"{parent.request_id}#{i}", parent.prompt_token_ids, parent.params,
                            prompt=parent.prompt, group_id=parent.group_id, index=i,
                            generator=self._generator(parent.params.seed, i), arrival_time=parent.arrival_time)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.prefill_chunk = parent.prefill_chunk
            child.status = RequestStatus.RUNNING
            child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
            self.evictor.fork(parent, child)  # evicts the parent first: children share its compressed cache
            if self.kv is not None:
                self.kv.fork(parent.request_id, child.request_id)
            self.scheduler.running.append(child)
            self.groups[parent.group_id].append(child)
            self.detoks[child.request_id] = IncrementalDetokenizer(self.tokenizer, parent.params.skip_special_tokens)
            self._append(child, tok, lp, top)

    def _append(self, req: Request, token: int, logprob: float, top) -> None:
        req.append_token(token, logprob, top)
        self.stats.generation_tokens += 1
        p = req.params
        delta = self.detoks[req.request_id].add(token)
        req.text += delta
        stop = find_stop(req.text, len(delta), p.stop, p.include_stop_str_in_output)
        n_out = req.num_output_tokens
        if stop is not None:
            req.text, req.stop_reason = stop
            self._finish(req, RequestStatus.FINISHED_STOPPED)
        elif n_out >= p.min_tokens and ((token in self.sampler.eos_token_ids and not p.ignore_eos)
                                        or token in p.stop_token_ids):
            req.stop_reason = token if token in p.stop_token_ids else None
            self._finish(req, RequestStatus.FINISHED_STOPPED)
        elif n_out >= p.max_tokens:  # make_request fits max_tokens to max_model_len (streams may run past)
            self._finish(req, RequestStatus.FINISHED_LENGTH)

    def _fail(self, req: Request, error: str) -> None:
        """End the whole group of `req` with an error (finish reason 'abort'), freeing its blocks."""
        for r in self.groups.get(req.group_id, [req]):
            r.error = error
            if not r.is_finished:
                self._finish(r, RequestStatus.FINISHED_ABORTED)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.finish(req, status)
        self.evictor.drop(req.request_id)
        m = req.metrics
        n = req.num_output_tokens
        tpot = None
        if n > 1 and m.first_token_time is not None:
            tpot = (m.last_token_time - m.first_token_time) / (n - 1)
        self.stats.record_finished(status.value, m.ttft, tpot, m.finished_time - m.arrival_time, m.queue_time)

    def _collect_prompt_logprobs(self, prompt_logits: dict, reqs: list[Request]) -> None:
        for req in reqs:
            rows = prompt_logits.get(req.request_id)
            if rows is None:
                continue
            req._prompt_rows = getattr(req, "_prompt_rows", []) + [rows]
            if req.num_computed_tokens >= req.num_prompt_tokens:
                allrows = torch.cat(req._prompt_rows) if req._prompt_rows else rows
                req.prompt_logprobs = prompt_logprobs(
                    allrows, req.prompt_token_ids, req.params.prompt_logprobs)
                del req._prompt_rows

    # ---- outputs -------------------------------------------------------------------
    def _finished(self, group_id: str) -> bool:
        members = self.groups[group_id]
        head = members[0]
        return all(r.is_finished for r in members) and (
            len(members) == head.params.n or head.status == RequestStatus.FINISHED_ABORTED)

    def _reports(self, group_id: str) -> bool:
        """False for a FINAL_ONLY request still running: its step makes no output."""
        kind = self.groups[group_id][0].params.output_kind
        return kind != RequestOutputKind.FINAL_ONLY or self._finished(group_id)

    def _output(self, group_id: str) -> RequestOutput:
        members = self.groups[group_id]
        head = members[0]
        outs = [_completion(r) for r in members]
        finished = self._finished(group_id)
        out = RequestOutput(group_id, head.prompt, head.prompt_token_ids, outs, finished,
                            head.num_cached_tokens, head.prompt_logprobs, head.metrics, head.error)
        if finished:
            self._drop(group_id)
        return out

    def _drop(self, group_id: str) -> None:
        for r in self.groups.pop(group_id, []):
            self.detoks.pop(r.request_id, None)

    def get_metrics(self) -> dict:
        """Blocks, KV usage, prefix cache, preemptions, tokens and latencies."""
        from kvserve.engine.metrics import percentile
        s = self.stats
        m = {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": s.prompt_tokens,
            "generation_tokens": s.generation_tokens,
            "num_steps": s.num_steps,
            "request_success": dict(s.request_success),
            "kv_projection_rows": self.model.kv_rows,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_cache_dtype": self.kv_format.description,
        }
        for name, values in (("ttft", s.ttft), ("tpot", s.tpot), ("e2e", s.e2e), ("queue_time", s.queue_time)):
            m[f"{name}_mean"] = sum(values) / len(values) if values else None
            m[f"{name}_p50"] = percentile(values, 50)
            m[f"{name}_p99"] = percentile(values, 99)
        m.update(self._kv_metrics())
        m.update(offload_metrics(self))
        m.update(self.evictor.metrics())
        return m

    def _kv_metrics(self) -> dict:
        if self.kv is None:
            return {"num_blocks_total": 0, "num_blocks_free": 0, "num_blocks_used": 0, "num_blocks_cached": 0,
                    "kv_cache_usage": 0.0, "kv_cache_bytes": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                    "prompt_tokens_cached": 0}
        pool = self.kv.pool
        return {
            "num_blocks_total": pool.num_usable,
            "num_blocks_free": pool.num_free,
            "num_blocks_used": pool.num_usable - pool.num_free,
            "num_blocks_cached": pool.num_cached,
            "num_blocks_cached_free": pool.num_cached_free,
            "kv_cache_usage": self.kv.usage(),
            "kv_cache_bytes": self.storage.nbytes,
            "kv_cache_residual_bytes": self.storage.residual_nbytes,
            "block_size": self.kv.block_size,
            "prefix_cache_queries": self.kv.stats.queries,
            "prefix_cache_hits": self.kv.stats.hits,
            "prompt_tokens_cached": self.kv.stats.hits,
            "kv_block_lifetime_seconds": pool.lifetime.snapshot(),
            "kv_block_reuse_gap_seconds": pool.reuse_gap.snapshot(),
            **pool.pin_metrics(),
        }

    def reset_prefix_cache(self, offload: bool = False) -> int:
        """Forget all cached free blocks (`offload`: write them to the KV tiers first); returns how many."""
        if offload and self.tiers is not None:
            self.tiers.flush()  # write-through tiers got them when they were registered
        return self.kv.reset_prefix_cache(offload) if self.kv is not None else 0

    def close(self) -> None:
        """Write pending KV tier writes down and stop the writer threads (the engine stays usable)."""
        if self.tiers is not None:
            self.tiers.close()


def _load_tokenizer(path: str) -> Tokenizer | None:
    """The model's tokenizer; None for a HF directory that ships none (token-id prompts only)."""
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        log.warning("no tokenizer files in %s: prompts must be token ids and outputs have no text", path)
        return None
    return Tokenizer.load(path)


def _sampling_failure(p: SamplingParams) -> str:
    return (f"no token could be drawn: the logits were NaN or infinite after this request's sampling "
            f"parameters were applied (temperature={p.temperature}, repetition_penalty="
            f"{p.repetition_penalty}, top_p={p.top_p}, min_p={p.min_p}); other requests were not "
            "affected. Retry; if it persists, report it with these parameters")


def _with_prompt_salt(params: SamplingParams, prompt: PromptType) -> SamplingParams:
    """`params` with the `cache_salt` of a dict prompt (vLLM's place for it), if it has one."""
    if not isinstance(prompt, dict) or prompt.get("cache_salt") is None:
        return params
    salt = prompt["cache_salt"]
    check_cache_salt(salt)
    if params.cache_salt is not None and params.cache_salt != salt:
        raise ValueError("cache_salt is given twice with different values (in the prompt dict and in "
                         "SamplingParams): give it once")
    return _replace(params, cache_salt=salt)


def _replace(params: SamplingParams, **changes) -> SamplingParams:
    import dataclasses
    return dataclasses.replace(params, **changes)


def _completion(req: Request) -> CompletionOutput:
    """One completion as the request's output kind asks: everything so far (CUMULATIVE, FINAL_ONLY)
    or what is new since its last output (DELTA: no copy of what was already reported)."""
    if req.params.output_kind != RequestOutputKind.DELTA:
        return CompletionOutput(req.index, req.text, list(req.output_token_ids), req.cumulative_logprob,
                                req.logprobs, req.finish_reason(), req.stop_reason)
    t, c = req.num_sent_tokens, req.num_sent_chars
    req.num_sent_tokens, req.num_sent_chars = req.num_output_tokens, max(c, len(req.text))
    logprobs = req.logprobs[t:] if req.logprobs is not None else None
    return CompletionOutput(req.index, req.text[c:], req.output_token_ids[t:], req.cumulative_logprob,
                            logprobs, req.finish_reason(), req.stop_reason)
