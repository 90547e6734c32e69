"""The native decode stack (kvserve/model/native): decode steps of the bundled model run as one C++
call, against the same engine with the stack off (its layers eager, the same kernels) and against
the float32 oracle; the models and modes it does not run keep the other paths."""

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model import native
from kvserve.model.regions import STACK_ROWS, compiled_regions
from kvserve.tools.evaluate import common_prefix, fidelity, run_forced

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "A KV cache stores the keys and values of every past token so that"]
OPTIONS = dict(kv_cache_memory="32MiB", max_model_len=512, enforce_eager=True)
pytestmark = pytest.mark.skipif(not native.available(), reason="needs the C++ kernels (a C++ compiler)")


@pytest.fixture(scope="module")
def stacked():
    return LLM(**OPTIONS)


@pytest.fixture(scope="module")
def unstacked():
    """The same engine with the stack off: decode steps run the layers eagerly."""
    return LLM(native_stack="off", **OPTIONS)


def _stack(llm):
    captured = llm.engine.runner.captured
    return None if captured is None else captured.stack


def _count_calls(monkeypatch, llm) -> list[int]:
    """Rows of each call of `llm`'s native stack from now on."""
    stack, rows = _stack(llm), []
    real = stack.stack

    class Counting:
        def run(self, x, *args):
            rows.append(x.shape[0])
            return real.run(x, *args)
    monkeypatch.setattr(stack, "stack", Counting())
    return rows


def test_the_bundled_model_decodes_on_the_stack(stacked, unstacked):
    assert isinstance(_stack(stacked), native.NativeStack)
    assert _stack(unstacked) is None


def test_decode_steps_match_the_eager_layers_and_stay_close_to_float32(llm, stacked, unstacked, monkeypatch):
    """Teacher-forced decode steps: the stack's logits are the eager layers' to float rounding (the
    same GEMVs and attention; only the order of the element-wise float arithmetic differs), and as
    close to the float32 oracle."""
    rows = _count_calls(monkeypatch, stacked)
    ids = stacked.engine.tokenizer.encode(" ".join(PROMPTS) * 2)
    forced = [(ids[:20], ids[20:52])]
    targets = torch.tensor(ids[20:52])
    got = run_forced(stacked, forced, [])[0][0]
    want = run_forced(unstacked, forced, [])[0][0]
    assert rows == [1] * 31          # every step after the prompt's
    assert (got - want).abs().max() < 0.005 * want.abs().max()
    same = fidelity(want, got, targets)
    assert max(same["kl"]) < 5e-4 and min(same["top1"]) == 1.0
    oracle = run_forced(llm, forced, [])[0][0]
    kl = {name: sum(fidelity(oracle, x, targets)["kl"]) / 32 for name, x in (("stack", got), ("eager", want))}
    assert kl["stack"] < 2e-3 and kl["stack"] <= 1.2 * kl["eager"] + 1e-5, kl


def test_a_few_decodes_share_a_call_and_get_their_lone_tokens(stacked, unstacked, monkeypatch):
    """Three sequences decoding together run three-row calls, counting their K/V rows, and each gets
    the greedy tokens it gets alone (the stack's rows do not depend on each other) and the eager
    layers' tokens."""
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = [stacked.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    rows = _count_calls(monkeypatch, stacked)
    model = stacked.engine.model
    before = model.kv_rows
    out = stacked.generate(PROMPTS, greedy, use_tqdm=False)
    prompts = sum(len(o.prompt_token_ids) for o in out)
    assert rows == [3] * 9
    assert model.kv_rows - before == prompts + 27
    assert [o.outputs[0].token_ids for o in out] == alone
    eager = unstacked.generate(PROMPTS, greedy, use_tqdm=False)
    same = [common_prefix(o.outputs[0].token_ids, w.outputs[0].token_ids) for o, w in zip(out, eager)]
    assert min(same) >= 8, same


def test_steps_of_more_rows_or_with_a_prompt_run_the_layers(stacked, monkeypatch):
    """Up to STACK_ROWS decode rows a step run the stack; a step of more, or one with a prompt chunk,
    runs the layers (and its attention through the backends)."""
    rows = _count_calls(monkeypatch, stacked)
    prompts = [f"{p} {i}" for i in range(STACK_ROWS + 1) for p in PROMPTS[:1]]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    stacked.generate(prompts, greedy, use_tqdm=False)
    assert all(r <= STACK_ROWS for r in rows)
    assert STACK_ROWS + 1 not in rows


def test_kernels_the_stack_does_not_call_keep_the_layers():
    """The batch-invariant mode's kernels (row-invariant chunks) are not the stack's: no stack."""
    llm = LLM(batch_invariant=True, kv_cache_memory="16MiB", max_model_len=256)
    assert _stack(llm) is None
    layer = llm.engine.model.model.layers[0]
    assert layer.self_attn.qkv.quant.native_form(STACK_ROWS) is None


def test_compiled_regions_for_the_stack_leave_out_the_stack_graphs(stacked):
    regions = compiled_regions(stacked.engine.model, stacks=False)
    assert regions.compiled and regions.one_token_paged is None and regions.few_paged is None
    assert regions.one_token is None and regions.attend is None


def test_bad_input_gets_a_clear_error_and_the_engine_keeps_serving(stacked):
    stack = _stack(stacked)
    hidden = stacked.engine.model_config.hidden_size
    cos, sin = [r.cos for r in stack.ropes], [r.sin for r in stack.ropes]
    slot = torch.zeros(1, dtype=torch.long)
    blocks, span = torch.zeros(1, dtype=torch.long), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="native stack: x of shape"):
        stack.stack.run(torch.zeros(1, hidden + 1), slot, cos, sin, [slot], [blocks], [span])
    with pytest.raises(RuntimeError, match="beyond the rotary tables"):
        stack.stack.run(torch.zeros(1, hidden), torch.tensor([cos[0].shape[0]]), cos, sin, [slot], [blocks], [span])
    with pytest.raises(RuntimeError, match="one int64 position a row"):
        stack.stack.run(torch.zeros(2, hidden), slot, cos, sin, [slot], [blocks], [span])
    with pytest.raises(RuntimeError, match="as many cos as sin tables"):
        stack.stack.run(torch.zeros(1, hidden), slot, cos, [], [slot], [blocks], [span])
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(stacked.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_an_engine_on_the_stack_never_imports_the_compiler():
    """No compile and no graph input to mark: a fresh process serving the bundled model on the stack
    (a prompt, a few decodes, three at once) never imports torch._dynamo, Inductor or triton (about
    150 MiB of its memory)."""
    import subprocess
    import sys
    script = (
        "import sys\n"
        "from kvserve import LLM, SamplingParams\n"
        "llm = LLM(kv_cache_memory='16MiB', max_model_len=256)\n"
        "assert llm.engine.runner.native_stack is not None and not llm.engine.compiled\n"
        "llm.generate(['Hello there', 'a b c', 'One two'], SamplingParams(max_tokens=6), use_tqdm=False)\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'triton') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


FAMILIES = ["qwen2", "qwen3", "mistral", "gemma3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_decodes_on_the_stack_as_its_layers_do(family, tmp_path_factory):
    """Tiny random checkpoints in int4 (the q4g GEMV): Qwen2's Q/K/V biases, Qwen3's q/k norms,
    Mistral's sliding window, Gemma 3's sandwich norms, (1 + w) norm factors, tanh-GELU, two rotary
    bases and sliding layers beside a global one. The stack runs every decode step; its logits are
    the eager layers' to float rounding at every teacher-forced step across the window (8 tokens),
    and its greedy tokens theirs."""
    from family_checkpoints import make_tiny_checkpoint
    path = make_tiny_checkpoint(family, tmp_path_factory.mktemp(family))
    opts = dict(weights="int4", kv_cache_memory="4MiB", max_model_len=256, block_size=4, enforce_eager=True)
    stacked, unstacked = LLM(path, **opts), LLM(path, native_stack="off", **opts)
    assert isinstance(_stack(stacked), native.NativeStack) and _stack(unstacked) is None
    ids = list(range(3, 43))
    forced = [(ids[:5], ids[5:40])]
    got = run_forced(stacked, forced, [])[0][0]
    want = run_forced(unstacked, forced, [])[0][0]
    assert (got - want).abs().max() < 1e-3 * want.abs().max(), family
    assert (got.argmax(-1) == want.argmax(-1)).all()
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids[:n]} for n in (3, 11, 20)]
    out = [o.outputs[0].token_ids for o in stacked.generate(prompts, greedy, use_tqdm=False)]
    assert out == [o.outputs[0].token_ids for o in unstacked.generate(prompts, greedy, use_tqdm=False)]
