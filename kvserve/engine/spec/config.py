"""speculative_config: vLLM's JSON shape and names, read once into a SpeculativeConfig."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import parse_bytes
from kvserve.json_options import json_object

METHODS = ("ngram", "suffix", "draft_model")
DRAFT_SHARE = 8   # draft_model: its KV pool takes 1/DRAFT_SHARE of the KV budget unless draft_kv_cache_memory says
USAGE = ("give a JSON object such as '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
         "(methods: ngram, suffix, draft_model; docs/SPECULATIVE.md)")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates (docs/SPECULATIVE.md); field names are vLLM's."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2             # ngram: shortest suffix of the context looked up
    prompt_lookup_max: int = 5             # ngram: longest
    suffix_decoding_max_tree_depth: int = 24         # suffix: longest context matched, and path proposed
    suffix_decoding_max_cached_requests: int = 1000  # suffix: finished outputs kept for other requests
    suffix_decoding_max_spec_factor: float = 1.0     # suffix: proposals <= factor x matched length
    suffix_decoding_min_token_prob: float = 0.1      # suffix: stop where the continuation is rarer
    model: str | None = None               # draft_model: its GGUF file or HF directory
    draft_kv_cache_memory: int | str | None = None   # draft_model: its KV pool, out of the KV budget (default 1/8)
    disable_by_batch_size: int | None = 8  # no proposals while more sequences than this run

    def check(self) -> None:
        """ValueError naming the first bad field."""
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config num_speculative_tokens must be in [1, 16], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("speculative_config suffix_decoding_max_tree_depth must be >= 1 and "
                             "suffix_decoding_max_cached_requests >= 0")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1 or self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("speculative_config suffix_decoding_min_token_prob must be in [0, 1] and "
                             "suffix_decoding_max_spec_factor > 0")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (the draft's GGUF file or "
                             "HF directory, same tokenizer as the target), and only it takes one")
        if self.draft_kv_cache_memory is not None:
            if self.method != "draft_model":
                raise ValueError("speculative_config draft_kv_cache_memory sizes a draft model's KV pool: "
                                 "only method 'draft_model' takes it")
            if parse_bytes(self.draft_kv_cache_memory) <= 0:
                raise ValueError(f"speculative_config draft_kv_cache_memory must be > 0 bytes, "
                                 f"got {self.draft_kv_cache_memory!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config disable_by_batch_size must be >= 1 or null, "
                             f"got {self.disable_by_batch_size}")

    def draft_kv_bytes(self, budget: int) -> tuple[int, str]:
        """The draft model's KV pool, taken out of the engine's KV budget of `budget` bytes, and
        what set it; ValueError when it leaves the target nothing."""
        if self.draft_kv_cache_memory is None:
            return budget // DRAFT_SHARE, f"1/{DRAFT_SHARE} of the KV budget of {budget / 2**20:.1f} MiB"
        n = parse_bytes(self.draft_kv_cache_memory)
        if n >= budget:
            raise ValueError(f"speculative_config draft_kv_cache_memory ({n / 2**20:.1f} MiB) comes out of the KV "
                             f"budget ({budget / 2**20:.1f} MiB) and leaves the target nothing: lower it, or raise "
                             "kv_cache_memory / gpu_memory_utilization")
        return n, f"draft_kv_cache_memory={n / 2**20:.1f} MiB"


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """A SpeculativeConfig from a dict, a JSON string or a SpeculativeConfig; None stays None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    value = json_object("speculative_config", value, SpeculativeConfig, ("method", "num_speculative_tokens"), USAGE)
    spec = SpeculativeConfig(**value)
    spec.check()
    return spec


def check_combination(config, spec: SpeculativeConfig) -> None:
    """ValueError for engine options speculation does not run with, saying which (`config`: normalised
    by engine_options, KV format names canonical)."""
    refused = []
    if config.kv_cache_mode == "none":
        refused.append("kv_cache_mode='none' (nothing is cached to verify against)")
    if config.kv_policy is not None:
        refused.append(f"kv_policy={config.kv_policy!r} (eviction rewrites the cache a rollback must restore)")
    if config.tensor_parallel_size > 1:
        refused.append(f"tensor_parallel_size={config.tensor_parallel_size}")
    kivi = [n for n in (config.kv_cache_dtype, config.kv_cache_dtype_k, config.kv_cache_dtype_v) if n and n.startswith("kivi")]
    if kivi:
        refused.append(f"kv_cache_dtype {kivi[0]!r} (KIVI quantizes a block as it fills: a rejected token "
                       "would stay in its groups)")
    if refused:
        raise ValueError(f"speculative_config method {spec.method!r} cannot run with " + "; ".join(refused)
                         + ": remove speculative_config or those options")
