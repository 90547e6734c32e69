"""Speculative decoding: proposers (ngram.py, suffix.py, draft.py) behind one interface, the
Speculator that proposes and judges (speculator.py), and speculative_config (config.py).
The KV side lives with the cache: the scheduler reserves the lookahead slots, KVCacheManager.trim
returns the blocks past the accepted tokens, and only accepted tokens' blocks are hashed."""

from kvserve.engine.spec.config import (
    SpeculativeConfig,
    check_combination,
    parse_speculative_config,
)
from kvserve.engine.spec.speculator import NoSpeculation, SpecStats, Speculator, num_accepted


def build_draft(config, target, planner):
    """The DraftProposer (draft.py) of method draft_model, built over the target's loaded model and
    KV planner (which set its pool aside); None for the other methods and without speculation."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    from kvserve.engine.spec.draft import DraftProposer
    return DraftProposer.build(config, target, planner)


def build_speculator(spec: SpeculativeConfig | None, max_model_len: int, draft=None):
    """The engine's Speculator for `spec` (NoSpeculation for None); `draft`: a built DraftProposer
    for method draft_model (build_draft)."""
    if spec is None:
        return NoSpeculation()
    if spec.method == "ngram":
        from kvserve.engine.spec.ngram import NgramProposer
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    elif spec.method == "suffix":
        from kvserve.engine.spec.suffix import SuffixProposer
        proposer = SuffixProposer(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                                  spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob)
    elif draft is None:
        raise ValueError("speculative_config method 'draft_model' needs its draft model built first "
                         "(build_draft; LLMEngine does it)")
    else:
        proposer = draft
    return Speculator(spec, proposer, max_model_len)


__all__ = ["NoSpeculation", "SpecStats", "SpeculativeConfig", "Speculator", "build_draft", "build_speculator",
           "check_combination", "num_accepted", "parse_speculative_config"]
