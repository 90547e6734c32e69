"""Each model family against transformers' own forward, on tiny random checkpoints."""

import pytest
import torch
from family_checkpoints import make_tiny_checkpoint, tiny_config
from helpers import all_blocks_free, assert_same_completions

from kvserve import LLM, SamplingParams

FAMILIES = ["llama", "llama_mqa", "qwen2", "qwen2_mqa", "qwen3", "mistral", "gemma3"]
TOL = 1e-4       # float32 log-prob tolerance against transformers
PROMPT_LEN = 20  # longer than the sliding window (8) of mistral and gemma3
DECODE = 32


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: make_tiny_checkpoint(f, root) for f in FAMILIES}


def _hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompt(seed=0, n=PROMPT_LEN):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def _llm(path, **kw):
    kw.setdefault("dtype", "float32")  # the oracle mode: compared with transformers in float32
    return LLM(path, kv_cache_memory=kw.pop("mem", "8MiB"), max_model_len=256, block_size=4, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_logits_match_transformers(checkpoints, family):
    path = checkpoints[family]
    llm = _llm(path)
    prompt = _prompt()
    params = SamplingParams(temperature=0, max_tokens=DECODE, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    seq = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(_hf(path)(torch.tensor([seq])).logits[0].float(), dim=-1)
    for i in range(1, len(prompt)):  # prefill: every prompt position
        assert abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < TOL, i
    for step, tok in enumerate(out.outputs[0].token_ids):  # 32 cached decode steps, teacher-forced reference
        row = ref[len(prompt) + step - 1]
        assert abs(out.outputs[0].logprobs[step][tok].logprob - row[tok].item()) < TOL, step
        assert row[tok].item() >= row.max().item() - 1e-5, step  # greedy picked transformers' argmax
    assert all_blocks_free(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_equals_recompute_with_chunks_and_prefix_hits(checkpoints, family):
    path = checkpoints[family]
    paged = _llm(path, max_num_batched_tokens=8)
    none = LLM(path, kv_cache_mode="none", max_model_len=256, dtype="float32")
    shared = _prompt(1, 24)
    prompts = [shared + _prompt(2, 5), _prompt(3, 9), shared + _prompt(4, 11), [7]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    first = paged.generate(prompts[:1], params, use_tqdm=False)
    out = paged.generate(prompts, params, use_tqdm=False)
    assert out[2].num_cached_tokens > 0  # the shared prefix was reused (hybrid: only what the window needs)
    assert_same_completions(first + out, none.generate(prompts[:1] + prompts, params, use_tqdm=False))
    assert all_blocks_free(paged)


@pytest.mark.parametrize("family, expected", [
    ("llama", 2 * 2 * 2 * 16 * 4),     # 2 (K,V) x 2 layers x 2 kv heads x head_dim 16 x 4 B
    ("llama_mqa", 2 * 2 * 1 * 16 * 4),
    ("qwen3", 2 * 2 * 2 * 32 * 4),     # explicit head_dim 32
    ("gemma3", 2 * 4 * 2 * 32 * 4),    # 4 layers; sliding layers cost the same per token, but fewer tokens
])
def test_bytes_per_token_analytic(checkpoints, family, expected):
    assert _llm(checkpoints[family]).kv_bytes_per_token == expected


def test_sliding_window_memory_stays_bounded(checkpoints):
    llm = _llm(checkpoints["mistral"], mem="32MiB")  # every layer slides with window 8, block 4
    eng = llm.engine
    eng.add_request(_prompt(5, 10), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, llm.get_metrics()["num_blocks_used"])
    assert peak <= 8 // 4 + 2  # window blocks plus the partly filled one, not 210 / 4 = 53
    assert all_blocks_free(llm)


def test_gemma3_hybrid_groups_hold_window_only(checkpoints):
    llm = _llm(checkpoints["gemma3"], mem="32MiB")
    groups = llm.engine.kv_groups
    assert [g.spec.kind for g in groups] == ["sliding", "sliding", "sliding", "full"]
    eng = llm.engine
    eng.add_request(_prompt(6, 12), SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
    peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, llm.get_metrics()["num_blocks_used"])
    # at the last step the full group holds ceil(161 / 4) = 41 blocks; each sliding group (window 8,
    # block 4) holds the window's 2 blocks and at most 2 partly covered ones, never the 41
    assert 41 + 3 * 2 <= peak <= 41 + 3 * 4
    assert all_blocks_free(llm)


def test_unsupported_architecture_lists_supported(tmp_path):
    import json
    path = make_tiny_checkpoint("llama", tmp_path)
    cfg = json.load(open(f"{path}/config.json"))
    cfg["model_type"] = "gpt_neox"
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    json.dump(cfg, open(f"{path}/config.json", "w"))
    with pytest.raises(ValueError, match="supported"):
        LLM(path, kv_cache_memory="8MiB", max_model_len=64, dtype="float32")


def test_tiny_config_windows_are_what_tests_assume():
    assert tiny_config("mistral").sliding_window == 8
    assert tiny_config("gemma3").sliding_window == 8
