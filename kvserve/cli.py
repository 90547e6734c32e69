"""`kvserve` command line: thin wrappers over the library."""

from __future__ import annotations

import argparse
import logging
import sys


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF model directory (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", default=None, help="KV pool size, e.g. 2GiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-cache-mode", default="paged", choices=["paged", "contiguous", "none"])
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    _kv_format_args(p)
    _offload_args(p)
    p.add_argument("--kv-policy", default=None, metavar="POLICY",
                   help="KV eviction for every request (docs/EVICTION.md): window:W, sinks:S,W, h2o:HEAVY,RECENT, "
                        "snapkv:BUDGET[,WINDOW,KERNEL] (budgets in tokens or a ratio of the prompt), or full")


def _offload_args(p: argparse.ArgumentParser) -> None:
    """Swap and KV tier options (docs/TIERS.md)."""
    g = p.add_argument_group("swap and KV tiers")
    g.add_argument("--swap-space", type=float, default=0.0, help="GiB of host memory for swapped-out requests")
    g.add_argument("--preemption-mode", default="auto", choices=["recompute", "swap", "auto"],
                   help="how a preempted request gives back its blocks (auto: the cheaper, needs --swap-space)")
    g.add_argument("--kv-tier", action="append", default=None, dest="kv_tiers", metavar="TIER",
                   help="prefix store below the device, in lookup order (repeatable): cpu:4GiB, "
                        "disk:/path:20GiB, redis://127.0.0.1:6379/0")


def _kv_format_args(p: argparse.ArgumentParser) -> None:
    """KV cache storage format options (kvserve/kv/formats.py, docs/QUANTIZATION.md)."""
    g = p.add_argument_group("KV cache format")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="auto, float16, bfloat16, float32, fp8_e4m3, fp8_e5m2, int8, kivi4, kivi2 "
                        "(kivi needs --block-size 32)")
    g.add_argument("--kv-cache-dtype-k", default=None, help="keys in another format than --kv-cache-dtype")
    g.add_argument("--kv-cache-dtype-v", default=None, help="values in another format than --kv-cache-dtype")
    g.add_argument("--kv-cache-dtype-skip-layers", default="", help="layers kept in full precision, e.g. 0,29")
    g.add_argument("--kv-cache-rotation", action="store_true", help="Hadamard rotation before quantizing")
    g.add_argument("--kv-cache-head-precision", type=float, default=None,
                   help="share of KV heads (the most sensitive, from a calibration run) kept in "
                        "--kv-cache-head-precision-dtype")
    g.add_argument("--kv-cache-head-precision-dtype", default="int8")


def kv_format_kwargs(args) -> dict:
    """LLM(...) keyword arguments from parsed KV format options."""
    return dict(kv_cache_dtype=args.kv_cache_dtype, kv_cache_dtype_k=args.kv_cache_dtype_k,
                kv_cache_dtype_v=args.kv_cache_dtype_v, kv_cache_dtype_skip_layers=args.kv_cache_dtype_skip_layers,
                kv_cache_rotation=args.kv_cache_rotation, kv_cache_head_precision=args.kv_cache_head_precision,
                kv_cache_head_precision_dtype=args.kv_cache_head_precision_dtype)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--n", type=int, default=1)


def make_llm(args):
    """Build an LLM from parsed engine arguments."""
    from kvserve.llm import LLM
    return LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
               block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
               gpu_memory_utilization=args.gpu_memory_utilization,
               enable_prefix_caching=not args.no_prefix_caching, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
               kv_cache_mode=args.kv_cache_mode, swap_space=args.swap_space,
               preemption_mode=args.preemption_mode, kv_tiers=args.kv_tiers, kv_policy=args.kv_policy,
               **kv_format_kwargs(args))


def make_params(args):
    """SamplingParams from parsed sampling arguments."""
    from kvserve.sampling_params import SamplingParams
    return SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.sample_seed, stop=args.stop)


def cmd_generate(args) -> int:
    """Generate completions for prompts given on the command line."""
    import time
    t0 = time.perf_counter()
    llm = make_llm(args)
    load = time.perf_counter() - t0
    outs = llm.generate(args.prompt, make_params(args), use_tqdm=not args.quiet)
    first = outs[0].metrics.first_token_time - outs[0].metrics.arrival_time if outs else 0.0
    for out in outs:
        for c in out.outputs:
            print(f"--- {out.prompt!r} [{c.index}] ({len(c.token_ids)} tokens, {c.finish_reason})")
            print(out.prompt + c.text)
    m = llm.get_metrics()
    print(f"--- load {load:.2f} s, cold start to first token {load + first:.2f} s, "
          f"{m['generation_tokens']} tokens generated, {m['prefix_cache_hits']} prompt tokens from "
          f"the prefix cache, KV pool {m['num_blocks_total']} blocks x {m.get('block_size', 0)} tokens",
          file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    """Interactive chat that keeps the conversation and reuses its cached prefix."""
    llm = make_llm(args)
    params = make_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("kvserve chat: type a message, empty line or Ctrl-D to quit.")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        out = llm.chat(messages, params, use_tqdm=False)[0]
        reply = out.outputs[0].text
        messages.append({"role": "assistant", "content": reply})
        print(f"assistant> {reply}")
        print(f"  [{len(out.prompt_token_ids)} prompt tokens, {out.num_cached_tokens} from cache, "
              f"{len(out.outputs[0].token_ids)} generated]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="kvserve", description="An LLM inference engine built around the KV cache.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--quiet", action="store_true")
    _engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with the model")
    chat.add_argument("--system", default=None)
    _engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat, max_tokens=256)
    _register_tools(sub)
    return parser


def _register_tools(sub) -> None:
    from kvserve.server.cli import register as register_serve
    register_serve(sub)
    try:
        from kvserve.tools import analyze, plan
    except ImportError:
        return
    plan.register(sub)
    analyze.register(sub)
    from kvserve.tools import evaluate
    evaluate.register(sub)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvserve` command."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
