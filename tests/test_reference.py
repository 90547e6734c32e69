"""kvserve against transformers' own Llama implementation loaded from the same GGUF."""

import torch
from test_engine import PROMPTS

from kvserve import SamplingParams


def test_greedy_tokens_match_transformers(llm, hf_model):
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            ref = hf_model.generate(ids, max_new_tokens=32, do_sample=False)  # both stop at EOS
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), prompt
    assert sum(len(o.outputs[0].token_ids) for o in outs) >= 150  # most prompts run the full 32 tokens


def test_prefill_logits_match_transformers(llm, hf_model):
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for i in range(1, len(ids)):
        got = out.prompt_logprobs[i][ids[i]].logprob
        assert abs(got - ref[i - 1, ids[i]].item()) < 1e-3, i
