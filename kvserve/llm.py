"""LLM: the offline API, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from tqdm.auto import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine, PromptType
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

CONFIG_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def _ranks(config: EngineConfig):
    """The tensor-parallel ranks `config` asks for, started (None for one rank)."""
    if config.tensor_parallel_size == 1:
        return None
    from kvserve.distributed.tensor_parallel import start_ranks
    return start_ranks(config)


class LLM:
    """Generate text with the paged, prefix-cached KV cache."""

    def __init__(self, model: str | None = None, **options):
        """`options` are EngineConfig's fields (kvserve/config.py), e.g. dtype, weights, kv_cache_memory."""
        unknown = sorted(set(options) - CONFIG_FIELDS)
        if unknown:
            raise TypeError(f"LLM() got unknown option(s) {unknown}; the options are EngineConfig's fields: "
                            f"{', '.join(sorted(CONFIG_FIELDS - {'model'}))}")
        config = EngineConfig(model=model, **options)
        self.engine = LLMEngine(config, _ranks(config))

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait until the model's graphs are compiled (compile_mode="background" compiles them while the
        engine already serves eagerly); True when steps now run compiled, False when the engine runs
        eagerly (enforce_eager, a float32 oracle, a failed compile: the log says why)."""
        return self.engine.wait_compiled(timeout)

    @property
    def model_config(self):
        """The loaded model's shape."""
        return self.engine.model_config

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes the KV pool holds per token."""
        return self.engine.kv_bytes_per_token

    def get_tokenizer(self):
        """The model's tokenizer."""
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order."""
        prompts = _as_list(prompts)
        params = [_final_only(sp) for sp in _params_list(sampling_params, len(prompts))]
        reqs = [self.engine.make_request(p, sp) for p, sp in zip(prompts, params)]  # validate all first
        for p, sp in zip(prompts, params):
            self.engine.receive_kv(p, sp)   # a KV consumer's blocks from the producer, if asked
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        del reqs
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the chat template to one or many conversations, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tok.apply_chat_template(c, add_generation_prompt)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams):
        """Beam search; beams share KV blocks copy-on-write."""
        from kvserve.engine.beam_search import run_beam_search
        return [run_beam_search(self.engine, p, params) for p in _as_list(prompts)]

    def get_metrics(self) -> dict:
        """Blocks, KV usage, prefix-cache queries/hits, preemptions, tokens, TTFT/TPOT."""
        return self.engine.get_metrics()

    def reset_prefix_cache(self, offload: bool = False) -> int:
        """Forget cached blocks that no request holds (`offload=True`: write them to the KV tiers first)."""
        return self.engine.reset_prefix_cache(offload)

    def close(self) -> None:
        """Finish pending writes to the KV tiers (write_through) and stop their writer threads."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start = time.perf_counter()
        stats = self.engine.stats
        p0, g0 = stats.prompt_tokens_computed, stats.generation_tokens
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
                if use_tqdm:
                    dt = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"input: {(stats.prompt_tokens_computed - p0) / dt:.1f} toks/s, "
                                        f"output: {(stats.generation_tokens - g0) / dt:.1f} toks/s")
                if not self.engine.has_unfinished_requests() and len(done) < len(ids):
                    raise RuntimeError("engine stopped with unfinished requests")
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)


def _final_only(sp: SamplingParams) -> SamplingParams:
    """generate() reads only finished outputs: the engine need not build the others."""
    if sp.output_kind == RequestOutputKind.FINAL_ONLY:
        return sp
    return dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)


def _params_list(sp, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sp, SamplingParams):
        return [sp] * n
    if len(sp) != n:
        raise ValueError(f"got {len(sp)} sampling_params for {n} prompts; give one or one per prompt")
    return list(sp)
