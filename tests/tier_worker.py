"""One engine in its own process, for the tier tests: `python tests/tier_worker.py '<json>'`.

The JSON names the engine options (`engine`), the prompts (text) to run in order, greedy
`max_tokens`, and whether to write the device prefix cache down to the tiers at the end
(`offload`). The engine is closed on the way out (`with LLM(...)`), as a script would. Prints one
JSON line: token ids and cached-token counts per prompt, and metrics taken after the close.
"""

import json
import sys

from kvserve import LLM, SamplingParams


def main() -> None:
    job = json.loads(sys.argv[1])
    params = SamplingParams(temperature=0, max_tokens=job.get("max_tokens", 8))
    outputs, cached, lengths = [], [], []
    with LLM(**job["engine"]) as llm:
        for prompt in job["prompts"]:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            outputs.append(out.outputs[0].token_ids)
            cached.append(out.num_cached_tokens)
            lengths.append(len(out.prompt_token_ids))
        if job.get("offload"):
            llm.reset_prefix_cache(offload=True)
    m = llm.get_metrics()
    print(json.dumps({"outputs": outputs, "cached": cached, "kv_tiers": m["kv_tiers"],
                      "hits_by_source": m["prefix_cache_hits_by_source"],
                      "num_prompt_tokens": lengths}))


if __name__ == "__main__":
    main()
