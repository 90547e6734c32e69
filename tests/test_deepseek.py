"""DeepSeek-V2/V3 (MLA latent cache, MoE) against transformers' own forward, on tiny random checkpoints.

Tolerance: 1e-4 on float32 logits and log-probs (observed differences are ~3e-6: the absorbed
attention sums in a different order than transformers' expanded K/V, nothing more).

The stock tiny checkpoints (initializer_range 0.02) have nearly uniform attention, so a wrong
RoPE or softmax scale moves their log-probs by only ~1e-3. The "sharp" variants use
initializer_range 0.1, where the same mistakes move log-probs by > 1 while kvserve still agrees
with transformers to ~3e-6; they also cover YaRN, rope_interleave=False, q_lora on V2, V2's
group_limited_greedy routing and attention biases.
"""

import pytest
import torch
from family_checkpoints import make_tiny_checkpoint
from helpers import all_blocks_free, assert_same_completions

from kvserve import LLM, SamplingParams
from kvserve.attention import AttentionMetadata, PrefillSpan

TOL = 1e-4
PROMPT_LEN = 40
DECODE = 32
LAYERS, KV_LORA_RANK, ROPE_DIM = 3, 32, 8  # family_checkpoints' deepseek shapes
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
SHARP = dict(initializer_range=0.1)
CHECKPOINTS = {
    "deepseek_v2": ("deepseek_v2", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v2_sharp_yarn_grouped": ("deepseek_v2", dict(
        SHARP, rope_parameters=YARN, q_lora_rank=24, topk_method="group_limited_greedy", n_group=2,
        topk_group=1, routed_scaling_factor=1.5)),
    "deepseek_v3_sharp_yarn": ("deepseek_v3", dict(SHARP, rope_parameters=YARN)),
    "deepseek_v3_sharp_half_rope_bias": ("deepseek_v3", dict(
        SHARP, rope_interleave=False, q_lora_rank=None, attention_bias=True, norm_topk_prob=False)),
}
FAMILIES = ["deepseek_v2", "deepseek_v3"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return {name: make_tiny_checkpoint(family, root / name, **overrides)
            for name, (family, overrides) in CHECKPOINTS.items()}


def _hf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompt(seed=0, n=PROMPT_LEN):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def _llm(path, **kw):
    kw.setdefault("dtype", "float32")  # the oracle mode: compared with transformers in float32
    return LLM(path, kv_cache_memory=kw.pop("mem", "16MiB"), max_model_len=256, block_size=4, **kw)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_prefill_logits_match_transformers(checkpoints, name):
    """The whole logit matrix of a no-cache prefill, straight from the model."""
    path = checkpoints[name]
    model = _llm(path, kv_cache_mode="none").engine.model
    ids = torch.tensor(_prompt())
    with torch.no_grad():
        meta = AttentionMetadata(prefills=[PrefillSpan(0, len(ids), len(ids))])  # no cache: plain causal
        hidden = model(ids, torch.arange(len(ids)), meta)
        got = model.compute_logits(hidden)
        ref = _hf(path)(ids[None]).logits[0].float()
    assert (got - ref).abs().max().item() < TOL
    assert model.kv_rows == len(ids)  # one latent row per token and layer, projected once


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_paged_prefill_and_decode_match_transformers(checkpoints, name):
    """Prompt log-probs (paged prefill) and 32 cached decode steps, transformers teacher-forced on our tokens."""
    path = checkpoints[name]
    llm = _llm(path)
    prompt = _prompt()
    params = SamplingParams(temperature=0, max_tokens=DECODE, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    assert len(tokens) == DECODE
    with torch.no_grad():
        ref = torch.log_softmax(_hf(path)(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)
    for i in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < TOL, i
    for step, tok in enumerate(tokens):
        row = ref[len(prompt) + step - 1]
        assert abs(out.outputs[0].logprobs[step][tok].logprob - row[tok].item()) < TOL, step
        assert row[tok].item() >= row.max().item() - 1e-5, step  # greedy picked transformers' argmax
    assert all_blocks_free(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers_generate(checkpoints, family):
    path = checkpoints[f"{family}_sharp_yarn" if family == "deepseek_v3" else "deepseek_v2_sharp_yarn_grouped"]
    prompt = _prompt(7, 12)
    out = _llm(path).generate([prompt], SamplingParams(temperature=0, max_tokens=DECODE, ignore_eos=True),
                              use_tqdm=False)[0]
    with torch.no_grad():
        ref = _hf(path).generate(torch.tensor([prompt]), max_new_tokens=DECODE, min_new_tokens=DECODE,
                                 do_sample=False)
    assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype, elem", [("float32", 4), ("bfloat16", 2)])
def test_bytes_per_token_is_latent_plus_rope_key(checkpoints, family, dtype, elem):
    llm = _llm(checkpoints[family], dtype=dtype)
    expected = (KV_LORA_RANK + ROPE_DIM) * LAYERS * elem  # no factor 2 (K and V), no head count
    assert llm.kv_bytes_per_token == expected
    eng = llm.engine
    assert [g.spec.kind for g in eng.kv_groups] == ["mla"]
    assert all(t.shape[2:] == (KV_LORA_RANK + ROPE_DIM,) for slot in eng.storage.slots for t in slot)
    assert eng.storage.nbytes == eng.storage.num_blocks * eng.storage.block_size * expected


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3_sharp_yarn"])
def test_paged_equals_recompute_with_chunks_and_prefix_hits(checkpoints, name):
    path = checkpoints[name]
    paged = _llm(path, max_num_batched_tokens=8)
    none = LLM(path, kv_cache_mode="none", max_model_len=256, dtype="float32")
    shared = _prompt(1, 24)
    prompts = [shared + _prompt(2, 5), _prompt(3, 9), shared + _prompt(4, 11), [7], _prompt(5, 17)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    first = paged.generate(prompts[:1], params, use_tqdm=False)
    out = paged.generate(prompts, params, use_tqdm=False)
    assert out[2].num_cached_tokens > 0  # the shared prefix's latents were reused
    assert_same_completions(first + out, none.generate(prompts[:1] + prompts, params, use_tqdm=False))
    assert all_blocks_free(paged)


def test_runs_without_tokenizer_files(checkpoints):
    """A tiny checkpoint ships no tokenizer: token-id prompts run, outputs have empty text."""
    llm = _llm(checkpoints["deepseek_v2"])
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="token id"):
        llm.generate(["some text"], SamplingParams(max_tokens=1), use_tqdm=False)
