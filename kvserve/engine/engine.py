"""LLMEngine: requests in, tokens out, one scheduler step at a time.

The engine coordinates: the Scheduler picks what runs, the ModelRunner runs it, the Sampler picks
tokens, and the OutputProcessor appends them, checks stops and builds outputs. What the engine is
built from (model, tokenizer, KV cache sizing) lives in builder.py."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.config import EngineConfig
from kvserve.engine.builder import CachePlanner, load_model, memory_release
from kvserve.engine.compile import startup_compile
from kvserve.engine.eviction import request_policy
from kvserve.engine.metrics import EngineStats, percentile
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.offload import build_swap, offload_metrics
from kvserve.engine.options import engine_options
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.poison import PoisonedPrefixes
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampler import Sampler, SamplingError, SamplingInput
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.spec import build_draft, build_speculator
from kvserve.kv.connector import build_connector
from kvserve.kv.events import build_publisher
from kvserve.kv.tiers import make_tier
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams, check_cache_salt, remote_decode, remote_prefill
from kvserve.startup import phase
from kvserve.structured.outputs import StructuredOutputs

log = logging.getLogger("kvserve")

PromptType = str | list[int] | dict
SampleFn = Callable[[torch.Tensor, list[Request]], None]


@dataclass
class ModelStep:
    """One model run: what was scheduled, and the requests that sample now with their logits rows."""

    scheduled: list[tuple[Request, int]]
    requests: list[Request]
    logits: torch.Tensor


class LLMEngine:
    """Synchronous engine: add requests, call step() until none are left.

    Beam search, teacher forcing and other drivers use the same step: `step(sample)` hands each
    sampling request's logits row to `sample`, which picks tokens with `append_token`, `fork` and
    `release` instead of the sampler."""

    def __init__(self, config: EngineConfig, tp=None):
        """`tp`: under tensor_parallel_size > 1, rank 0's handle on the other ranks, started by
        kvserve.distributed.tensor_parallel.start_ranks (LLM(...) does it)."""
        config = engine_options(config)   # checked before anything loads, normalised once
        if (config.tensor_parallel_size > 1) != (tp is not None):
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} needs the ranks started "
                             "with it: build the engine through LLM(...), which starts them "
                             "(kvserve.distributed.tensor_parallel.start_ranks)")
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        self.tp = tp
        loaded = self.tp.loaded if self.tp is not None else load_model(config, self.device, self.dtype)
        self.model_path, self.model_config, self.tokenizer = loaded.path, loaded.config, loaded.tokenizer
        self.model, self.weight_format, self.load_seconds = loaded.model, loaded.weight_format, loaded.seconds
        self.max_model_len = loaded.max_model_len
        self._release_memory = memory_release(self.device)
        self.stats = EngineStats()
        self.sampler = Sampler(loaded.eos_ids(), self.model_config.vocab_size, config.seed, self.device)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, loaded.eos_ids())
        with phase("KV pool"):
            self._build_cache(loaded)
        self.output_processor = OutputProcessor(self.tokenizer, self.sampler.eos_token_ids, self.stats, self.release)
        self.groups = self.output_processor.groups   # user request id -> its requests (n > 1: forks)
        self.speculator = build_speculator(config.speculative_config, self.max_model_len,
                                           build_draft(config, loaded, self.planner))
        self._ids = itertools.count()
        # after the KV pool: its size never depends on compiling (engine/compile.py)
        self.startup = startup_compile(self, loaded.compiled and not self._native_decode())
        self.startup.start()

    def _native_decode(self) -> bool:
        """True when the native decode stack runs the decode steps: the model's regions then stay eager."""
        native = self.runner.native_stack is not None
        if native:
            log.info("model regions: eager, no compile (the native decode stack runs the decode steps; "
                     "native_stack='off' compiles the graphs instead)")
        return native

    @property
    def compiled(self) -> bool:
        """True once the model's steps run the compiled graphs."""
        return self.startup.compiled

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for a background compile to finish and run compiled from the next step; True when the
        engine runs compiled (False: it runs eagerly, by its config or because compiling failed)."""
        return self.startup.wait(timeout)

    def _build_cache(self, loaded) -> None:
        """KV manager, storage, eviction, swap, tiers and the scheduler and runner over them."""
        cfg = self.config
        self.planner = planner = (CachePlanner(cfg, loaded, self.device) if self.tp is None
                                  else self.tp.planner(cfg, loaded, self.device))
        self.kv_policy, self.kv_groups, self.kv_format = planner.policy, planner.groups, planner.format
        self.kv_bytes_per_token = self.kv_format.bytes_per_token
        self.page_bytes_per_token = self.kv_format.page_bytes_per_token
        # KV events first: the KV manager and the tiers are built with the publisher's queue (the
        # options refuse kv_events without a cache)
        self.kv_events = build_publisher(cfg.kv_events, cfg.kv_events_replay)
        self.kv, self.storage = self._build_kv(planner)
        self.tiers = planner.tiers                            # prefix store below the device (kv_tiers)
        self.connector = _connector(cfg, self.tiers)   # KV transfers between engines (kv_transfer_config)
        self.pool_plan, self.kv_residual_rows = planner.plan, planner.residual_rows
        # The KV manager's eviction strategy: keep everything, or kv/evictor.py's Evictor under
        # a kv_policy (the manager was built with it; the options refuse a kv_policy without a cache)
        self.evictor = self.kv.eviction
        if self.kv_policy is not None:
            self.evictor.check(self.kv_policy)
        runner = ModelRunner if self.tp is None else self.tp.runner
        self.runner = runner(self.model, self.kv, self.storage, self.device, cfg.max_num_seqs,
                             self.max_model_len, cfg.attention(), self.evictor,
                             native_stack=cfg.native_stack == "auto" and self.tp is None)
        self.swap = build_swap(cfg, self.storage, self.kv)   # host swap pool (swap_space GiB)
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, planner.token_budget, self.swap, cfg.preemption_mode,
                                   cfg.scheduling_policy)
        self.poison = PoisonedPrefixes(self.kv)   # evicts the prefix a request's NaN logits point at
        planner.log(self.storage)

    def _build_kv(self, planner):
        """The KV manager and storage (with the tiers, eviction and the events queue); the
        publisher is closed when building fails."""
        events = self.kv_events.events if self.kv_events is not None else None
        try:
            return planner.build(events, tiers=True, eviction=True)
        except BaseException:
            if self.kv_events is not None:
                self.kv_events.close()
            raise

    # ---- requests ------------------------------------------------------------------
    def make_request(self, prompt: PromptType, params: SamplingParams | None = None,
                     request_id: str | None = None) -> Request:
        """Validate a prompt and its parameters; no engine state changes."""
        params = _with_prompt_salt(params or SamplingParams(), prompt)
        text, ids = _tokenize(self.tokenizer, prompt)
        if not ids:
            raise ValueError("prompt is empty: give at least one token of text or token ids")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.model_config.vocab_size})")
        policy = request_policy(self.evictor, self.kv_policy, params, len(ids))
        chunk = self.planner.prefill_chunk(policy)
        params = self._fit_max_tokens(params, len(ids), policy, chunk)
        rid = request_id or str(next(self._ids))
        if rid in self.groups:
            raise ValueError(f"request_id {rid!r} is already in use")
        _check_token_ids(params, self.model_config.vocab_size)
        if (remote_decode(params) or remote_prefill(params)) and self.connector is None:
            raise ValueError("kv_transfer_params ask for a KV transfer, but this engine has no KV connector: "
                             "start it with kv_transfer_config (--kv-transfer-config)")
        if params.priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority={params.priority} needs an engine started with scheduling_policy='priority' "
                             "(--scheduling-policy priority); leave it at 0 under fcfs")
        req = Request(rid, ids, params, prompt=text, generator=_generator(params.seed, self.device), kv_policy=policy,
                      grammar=self.structured.grammar(params.structured_outputs),
                      bad_words=_bad_words_token_ids(self.tokenizer, params.bad_words))
        if chunk < self.config.max_num_batched_tokens:
            req.prefill_chunk = chunk
        return req

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; returns its id. Raises ValueError for input that can never run."""
        req = self.make_request(prompt, params, request_id)
        self.output_processor.add(req)
        self.admit(req)
        return req.request_id

    def receive_kv(self, prompt: PromptType, params: SamplingParams) -> int:
        """Receive the prompt's KV blocks from the producer its kv_transfer_params name (a consumer,
        before add_request; safe off the engine thread); how many arrived, 0 when nothing is asked.
        KVLoadError when some did not and kv_load_failure_policy is 'fail'."""
        params = _with_prompt_salt(params, prompt)
        if not remote_prefill(params):
            return 0
        if self.connector is None:
            raise ValueError("kv_transfer_params ask for a remote prefill, but this engine has no KV connector: "
                             "start it with kv_transfer_config (--kv-transfer-config)")
        _, ids = _tokenize(self.tokenizer, prompt)
        return self.connector.receive(self.kv.prompt_keys(ids, params.cache_salt), params.kv_transfer_params)

    def admit(self, req: Request) -> None:
        """Queue a request from make_request. Only add_request's requests get outputs from step();
        a driver that admits its own (beam search) reads their tokens itself."""
        self.stats.prompt_tokens += req.num_prompt_tokens
        if req.kv_policy is not None:
            self.evictor.add(req, req.kv_policy)   # forks copy the state: each evicts on its own
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now, free its blocks and forget it; returns its final output."""
        return self.output_processor.abort(request_id)

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
        kv_len = prompt_len + params.max_tokens
        if policy is not None:  # admitted against the policy's bound, not the full length
            kv_len = policy.cache_bound(prompt_len, kv_len, chunk)
        need = self.kv.max_blocks_for_tokens(kv_len)
        if need > self.kv.num_blocks:
            raise ValueError(f"request needs {need} KV blocks but the whole pool has {self.kv.num_blocks}: "
                             "lower max_tokens or raise kv_cache_memory")
        return params

    # ---- the step ------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished()

    def step(self, sample: SampleFn | None = None) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return outputs of requests that moved.

        `sample(logits, requests)`, if given, replaces the sampler: row i of `logits` belongs to
        requests[i] (every request whose next token is due), and `sample` advances them with
        append_token / fork / release. It is called for every step that ran (with no rows when only
        prompt chunks ran)."""
        batch = self._run_model()
        if self.kv_events is not None:
            self.kv_events.flush()  # this step's KV events, one batch
        if batch is None:
            return []
        if sample is None:
            self._sample(batch.logits, batch.requests)
            self.speculator.propose(self.scheduler.running)   # the next step verifies them
        else:
            sample(batch.logits, batch.requests)
        self.evictor.after_step(batch.scheduled)
        outputs = self.output_processor.outputs({r.group_id for r, _ in batch.scheduled})
        self.startup.launch()   # a background compile starts once a step has given its tokens
        return outputs

    def _run_model(self) -> ModelStep | None:
        """Schedule and run the model; the scheduled requests advance by the tokens they ran."""
        self.startup.at_step_boundary()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return None
        self.stats.num_steps += 1
        pl_reqs = [r for r, _ in sched.scheduled if r.params.prompt_logprobs is not None and r.num_output_tokens == 0]
        t0 = time.perf_counter()
        inp, logits, prompt_logits = self.runner.execute(sched.scheduled, pl_reqs)
        self.scheduler.observe_step(sched.num_tokens, time.perf_counter() - t0)
        for req, n in sched.scheduled:
            done = req.num_computed_tokens
            self.stats.prompt_tokens_computed += max(0, min(done + n, req.num_prompt_tokens) - done)
            req.num_computed_tokens += n - len(req.spec_token_ids)   # proposals wait for their verdict
            self.kv.cache_blocks(req.request_id, req.token_ids, req.num_computed_tokens)
        if self.tiers is not None:
            self.tiers.write_through()  # copies of the blocks just registered go to the writer threads
        self.output_processor.collect_prompt_logprobs(prompt_logits, pl_reqs)
        return ModelStep(sched.scheduled, inp.sampling_reqs, logits)

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """Sample each request's rows (one, or one per proposed token: speculation) and give it its
        tokens. A seeded sampled request with proposals draws its rows one at a time, stopping at the
        first rejection: its generator advances once per token, as without speculation."""
        in_order = [_draws_in_order(r) for r in reqs]
        if not any(in_order):
            return self._sample_batch(logits, reqs)
        starts = list(itertools.accumulate((1 + len(r.spec_token_ids) for r in reqs), initial=0))
        batch = [i for i, lone in enumerate(in_order) if not lone]
        if batch:
            rows = [row for i in batch for row in range(starts[i], starts[i + 1])]
            self._sample_batch(logits[rows], [reqs[i] for i in batch])
        for i, lone in enumerate(in_order):
            if lone:
                self._verify_in_order(reqs[i], logits[starts[i]:starts[i + 1]])

    def _verify_in_order(self, req: Request, logits: torch.Tensor) -> None:
        drafts, drawn = req.spec_token_ids, []
        for i, inp in enumerate(_sampling_inputs(req)):
            try:
                res = self.sampler(logits[i:i + 1], [inp])[0]
            except SamplingError:
                self._fail_sampling(req, logits[i])
                return
            drawn.append(res)
            if i == len(drafts) or res.token_ids[0] != drafts[i]:
                break
        self._verify(req, drawn)

    def _sample_batch(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        owners = [r for r in reqs for _ in range(1 + len(r.spec_token_ids))]   # the request of each row
        inputs = [x for r in reqs for x in _sampling_inputs(r)]
        try:
            results = self.sampler(logits, inputs, self.structured.bitmask([r.grammar for r in owners]))
        except SamplingError as exc:  # nothing was drawn: fail those requests, sample the rest
            for i in exc.rows:
                self._fail_sampling(owners[i], logits[i])
            keep = [i for i, r in enumerate(owners) if not r.is_finished]
            if keep:
                self._sample_batch(logits[keep], _runs(owners[i] for i in keep))
            return
        row = 0
        for req in reqs:
            rows = results[row:row + 1 + len(req.spec_token_ids)]
            row += len(rows)
            if req.spec_token_ids:
                self._verify(req, rows)
            else:
                self._give(req, rows[0])

    def _give(self, req: Request, res) -> None:
        """A request's sampled token(s): n > 1 at its first token forks the other samples."""
        top = res.top_logprobs or [None] * len(res.token_ids)
        for i in range(1, len(res.token_ids)):  # n > 1: the other samples fork from the first
            child = self.fork(req, f"{req.request_id}#{i}", i, _generator(req.params.seed, self.device, i))
            self.output_processor.add(child)
            self.append_token(child, res.token_ids[i], res.logprobs[i], top[i])
        self.append_token(req, res.token_ids[0], res.logprobs[0], top[0])

    def _verify(self, req: Request, rows: list) -> None:
        """Speculation's verdict: the accepted proposals and the token after them join the request
        (each drawn by its own row, as without speculation); the K/V of the accepted ones stays in the
        cache, the blocks past them go back to the pool and the accepted full blocks are hashed."""
        accepted = self.speculator.verdict(req, [res.token_ids[0] for res in rows])
        req.spec_token_ids = []
        for res in rows[:accepted + 1]:
            self.append_token(req, res.token_ids[0], res.logprobs[0], (res.top_logprobs or [None])[0])
            if req.is_finished:
                return   # its blocks are freed
        req.num_computed_tokens += accepted
        self.kv.trim(req.request_id, req.num_tokens)
        self.kv.cache_blocks(req.request_id, req.token_ids, req.num_computed_tokens)

    def _fail_sampling(self, req: Request, row: torch.Tensor) -> None:
        """Fail a request no token could be drawn for; non-finite logits evict its prefix first (poison.py)."""
        if req.is_finished:
            return   # a fork of a group failed by an earlier row
        prefix_error = self.poison.evict(req, row)
        self.output_processor.fail(req, prefix_error or _sampling_failure(req.params), prefix_fault=bool(prefix_error))

    # ---- the step API for drivers (sample functions) ----------------------------------------------
    def append_token(self, req: Request, token: int, logprob: float = 0.0, top=None) -> None:
        """Give `req` its next token: text, stop strings, EOS and max_tokens apply as after sampling;
        a constrained request's grammar advances by it and ends the request once it is complete."""
        grammar = req.grammar
        if grammar is not None and not grammar.accept(token):
            self.output_processor.fail(req, f"token {token} is outside the request's structured_outputs grammar")
            return
        self.output_processor.append(req, token, logprob, top)
        if grammar is not None and grammar.done and not req.is_finished:
            self.output_processor.finish(req, RequestStatus.FINISHED_STOPPED)

    def fork(self, parent: Request, request_id: str, index: int = 0,
             generator: torch.Generator | None = None) -> Request:
        """A copy of `parent` under `request_id` that shares its KV blocks (the partly filled last one
        is copied on write) and runs from the next step; a preempted parent's copy recomputes."""
        child = parent.fork(request_id, index, generator)
        self.evictor.fork(parent, child)  # evicts the parent first: children share its compressed cache
        if parent.status != RequestStatus.RUNNING:
            child.status = RequestStatus.PREEMPTED
            self.scheduler.add(child)
            return child
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.kv.fork(parent.request_id, child.request_id)
        self.scheduler.running.append(child)
        return child

    def release(self, req: Request, status: RequestStatus) -> None:
        """End `req` with `status` and free its blocks and eviction state (no output, not counted)."""
        if remote_decode(req.params) and req.index == 0 and status != RequestStatus.FINISHED_ABORTED:
            req.kv_transfer_params = self.connector.save(
                req.request_id, self.kv.transfer_blocks(req.request_id, req.prompt_token_ids))
        self.scheduler.finish(req, status)
        self.evictor.drop(req.request_id)
        self.speculator.finished(req)

    # ---- state ---------------------------------------------------------------------
    def get_metrics(self) -> dict:
        """Blocks, KV usage, prefix cache, preemptions, tokens and latencies."""
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
        m.update(_kv_metrics(self.kv, self.storage))
        m.update(offload_metrics(self))
        m.update(self.evictor.metrics())
        m.update(self.poison.metrics())
        m.update(self.speculator.metrics())
        m["kv_transfer"] = self.connector.metrics() if self.connector is not None else {}
        return m

    def reset_prefix_cache(self, offload: bool = False) -> int:
        """Forget all cached free blocks (`offload`: write them to the KV tiers first); returns how many."""
        if offload and self.tiers is not None:
            self.tiers.flush()  # write-through tiers got them when they were registered
        n = self.kv.reset_prefix_cache(offload)
        if self.kv_events is not None:
            self.kv_events.flush()
        return n

    def release_idle_memory(self) -> bool:
        """Hand the host memory the last busy spell's steps freed back to the OS (AsyncEngine calls it
        once the engine has been idle a while); True when some went back."""
        return self._release_memory()

    def close(self) -> None:
        """Write pending KV tier writes down and stop the writer threads (the engine stays usable,
        except under tensor parallel: the worker ranks exit)."""
        if self.tiers is not None:
            self.tiers.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.connector is not None:
            self.connector.close()
        if self.tp is not None:
            self.tp.close()


def _connector(cfg: EngineConfig, bridge):
    """The KV connector of kv_transfer_config over the engine's tier bridge, or None."""
    transfer = cfg.kv_transfer_config
    if transfer is None:
        return None
    receive = bridge.tiers[0] if transfer.is_consumer else None   # offload.build_tiers put it first
    tier = transfer.kv_connector_extra_config.get("tier")
    shared = make_tier(cfg.parse_tier(tier)) if transfer.kv_connector == "TierConnector" else None
    return build_connector(transfer, bridge, receive, shared)


def _runs(rows) -> list[Request]:
    """The requests of consecutive rows, each once (a request's rows are next to each other)."""
    out: list[Request] = []
    for req in rows:
        if not out or out[-1] is not req:
            out.append(req)
    return out


def _draws_in_order(req: Request) -> bool:
    """True for a seeded sampled request with proposals (see LLMEngine._sample)."""
    return bool(req.spec_token_ids) and req.generator is not None and not req.params.greedy


def _sampling_inputs(req: Request) -> list[SamplingInput]:
    """What the sampler needs for each row of `req`: its last token's, then (speculation) one per
    proposed token, each as if the proposals before it were accepted."""
    p = req.params
    if not req.spec_token_ids:
        n = p.n if req.index == 0 and req.num_output_tokens == 0 else 1
        return [SamplingInput(p, req.prompt_token_ids, req.output_token_ids, req.generator, n, req.bad_words)]
    return [SamplingInput(p, req.prompt_token_ids, req.output_token_ids + req.spec_token_ids[:i], req.generator,
                          1, req.bad_words) for i in range(len(req.spec_token_ids) + 1)]


def _check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """ValueError for logit_bias / allowed_token_ids naming tokens outside the vocabulary."""
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} names token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")


def _bad_words_token_ids(tokenizer, words: list[str] | None) -> list[list[int]]:
    """Each bad word as token ids, as it starts a text and after a space (vLLM's two spellings)."""
    if not words:
        return []
    if tokenizer is None:
        raise ValueError("bad_words needs the model's tokenizer, and this model ships none")
    out = []
    for word in words:
        for text in (word.strip(), " " + word.strip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def _kv_metrics(kv, storage) -> dict:
    pool = kv.pool
    return {
        "num_blocks_total": pool.num_usable,
        "num_blocks_free": pool.num_free,
        "num_blocks_used": pool.num_usable - pool.num_free,
        "num_blocks_cached": pool.num_cached,
        "num_blocks_cached_free": pool.num_cached_free,
        "kv_cache_usage": kv.usage(),
        "kv_cache_bytes": storage.nbytes,
        "kv_cache_residual_bytes": storage.residual_nbytes,
        "block_size": kv.block_size,
        "prefix_cache_queries": kv.stats.queries,
        "prefix_cache_hits": kv.stats.hits,
        "prompt_tokens_cached": kv.stats.hits,
        "kv_block_lifetime_seconds": pool.lifetime.snapshot(),
        "kv_block_reuse_gap_seconds": pool.reuse_gap.snapshot(),
        **pool.pin_metrics(),
    }


def _tokenize(tokenizer, prompt: PromptType) -> tuple[str | None, list[int]]:
    """(text, token ids) of a string, token id list or dict prompt."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if tokenizer is None and prompt:
            raise ValueError("this model directory has no tokenizer: pass prompts as token id lists")
        return prompt, tokenizer.encode(prompt) if prompt else []
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")


def _generator(seed: int | None, device: torch.device, offset: int = 0) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed((seed + offset) % 2**63)


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


