"""What structured outputs cost: decode tok/s of JSON-schema-constrained requests against the same
requests unconstrained, at batch 1 and batch 32 (a nested schema: objects, an enum, an array), with
the bitmask's share of the run and per step; and the next-token bitmask of xgrammar (the engine's)
against llguidance's on the same schema and tokens. Target: batch-32 ratio >= 0.9.

    .venv/bin/python benchmarks/structured.py [--batch 32] [--max-tokens 96] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import OtherLoad, command_line, machine_facts, md_table, replace_section  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.sampling_params import StructuredOutputsParams  # noqa: E402
from kvserve.structured import outputs as structured_outputs  # noqa: E402

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                         "role": {"enum": ["engineer", "artist", "doctor", "teacher"]},
                         "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                                      "country": {"type": "string", "maxLength": 24}},
                                     "required": ["city", "country"]},
                         "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4}},
          "required": ["name", "age", "role", "address", "skills"]}
PROMPT = "Invent a person and describe them as JSON with name, age, city and skills. Person {i}:"


class MaskTimer:
    """Wall time the engine spends filling bitmasks (StructuredOutputs.bitmask), summed, and the steps."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0
        self.real = structured_outputs.StructuredOutputs.bitmask

    def __enter__(self):
        timer = self

        def timed(this, grammars):
            t0 = time.perf_counter()
            try:
                return timer.real(this, grammars)
            finally:
                timer.seconds += time.perf_counter() - t0
                timer.calls += 1
        structured_outputs.StructuredOutputs.bitmask = timed
        return self

    def __exit__(self, *exc):
        structured_outputs.StructuredOutputs.bitmask = self.real


def run(llm: LLM, batch: int, max_tokens: int, constrained: bool, seed: int) -> dict:
    """One batch decoded to its end: output tokens per second and the mask's share of the time."""
    extra = {"structured_outputs": {"json": SCHEMA}} if constrained else {}
    params = [SamplingParams(temperature=0.7, seed=seed + i, max_tokens=max_tokens, ignore_eos=not constrained,
                             **extra) for i in range(batch)]
    with MaskTimer() as timer:
        t0 = time.perf_counter()
        outs = llm.generate([PROMPT.format(i=i) for i in range(batch)], params, use_tqdm=False)
        wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": tokens / wall, "tokens": tokens / batch, "mask_share": timer.seconds / wall,
            "mask_ms_per_step": 1e3 * timer.seconds / max(1, timer.calls)}


def grammar_engines(llm: LLM, reps: int) -> dict:
    """Median microseconds of one next-token bitmask, xgrammar and llguidance, over one JSON output."""
    import llguidance
    import llguidance.hf
    import llguidance.torch as lgt
    import xgrammar as xgr

    tok = llm.engine.tokenizer
    vocab = llm.engine.model_config.vocab_size
    text = json.dumps({"name": "Ada Lovelace", "age": 36, "role": "engineer",
                       "address": {"city": "London", "country": "England"}, "skills": ["math", "poetry"]})
    ids = tok.encode(text, add_special_tokens=False)
    compiled = llm.engine.structured.compiler.compile(StructuredOutputsParams(json=SCHEMA))
    xmask = xgr.allocate_token_bitmask(1, vocab)
    ll_tok = llguidance.hf.from_tokenizer(tok.hf_tokenizer, n_vocab=vocab)
    ll_grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    lmask = lgt.allocate_token_bitmask(1, vocab)
    times = {"xgrammar": [], "llguidance": []}
    for _ in range(reps):
        m = xgr.GrammarMatcher(compiled)
        lm = llguidance.LLMatcher(ll_tok, ll_grammar)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(xmask, 0)
            times["xgrammar"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            lgt.fill_next_token_bitmask(lm, lmask, 0)
            times["llguidance"].append(time.perf_counter() - t0)
            m.accept_token(t)
            lm.consume_token(t)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()} | {"tokens": len(ids)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--reps", type=int, default=2, help="runs of each row (the best is kept)")
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    load = OtherLoad()
    llm = LLM()
    llm.wait_compiled()
    llm.generate(PROMPT.format(i=0), SamplingParams(max_tokens=8, structured_outputs={"json": SCHEMA}),
                 use_tqdm=False)   # builds the compiler once, outside the timed runs
    rows = []
    cases = [(b, c) for b in (1, args.batch) for c in (False, True)]
    results = {}
    for batch, constrained in tqdm(cases, desc="structured outputs", unit="run"):
        best = max((run(llm, batch, args.max_tokens, constrained, seed=r) for r in range(args.reps)),
                   key=lambda r: r["tok_s"])
        results[(batch, constrained)] = best
    for batch in (1, args.batch):
        free, con = results[(batch, False)], results[(batch, True)]
        rows.append([str(batch), f"{free['tok_s']:.1f}", f"{con['tok_s']:.1f}", f"{con['tok_s'] / free['tok_s']:.2f}x",
                     f"{con['tokens']:.0f}", f"{100 * con['mask_share']:.1f}%", f"{con['mask_ms_per_step']:.2f}"])
    engines = grammar_engines(llm, reps=20)
    other = load.stop()
    table = md_table(["batch", "unconstrained tok/s", "JSON schema tok/s", "ratio", "tokens per constrained output",
                      "bitmask share of the constrained run", "bitmask ms per step"], rows)
    eng_table = md_table(["grammar engine", "next-token bitmask, median µs"],
                         [["xgrammar (kvserve's)", f"{engines['xgrammar']:.1f}"],
                          ["llguidance", f"{engines['llguidance']:.1f}"]])
    facts = machine_facts()
    note = (f"Default engine configuration (`LLM()`, bundled SmolLM2-135M, compiled), temperature 0.7, seeded; "
            f"unconstrained rows decode {args.max_tokens} tokens (`ignore_eos`), constrained rows until their JSON "
            f"object closes or {args.max_tokens} tokens; best of {args.reps}. The bitmask share is the wall time "
            "spent filling the step's bitmasks (the sampler's masking itself is in the step). Grammar engines: "
            f"the same schema, one matcher each, a {engines['tokens']}-token JSON output fed token by token, "
            f"20 passes. Machine: {facts['CPU']}, {facts['cores (os.cpu_count / usable)']} cores, torch "
            f"{facts['torch']}; other processes kept {'n/a' if other is None else f'{other:.2f}'} cores busy.")
    print(table, eng_table, note, sep="\n\n")
    if not args.no_write:
        replace_section("Structured outputs",
                        f"`{command_line()}` (tree {facts['kvserve tree']})\n\n{table}\n\n{eng_table}\n\n{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
