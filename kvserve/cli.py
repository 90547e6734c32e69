"""`kvserve` command line: thin wrappers over the library."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from kvserve.engine_args import add_engine_args, make_llm


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--n", type=int, default=1)


def make_params(args):
    """SamplingParams from parsed sampling arguments."""
    from kvserve.sampling_params import SamplingParams
    return SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.sample_seed, stop=args.stop)


def cmd_generate(args) -> int:
    """Generate completions for prompts given on the command line."""
    import time

    from kvserve.startup import seconds_since_launch
    t0 = time.perf_counter()
    launched = seconds_since_launch()
    llm = make_llm(args)
    load = time.perf_counter() - t0
    outs = llm.generate(args.prompt, make_params(args), use_tqdm=not args.quiet)
    first = outs[0].metrics.first_token_time - outs[0].metrics.arrival_time if outs else 0.0
    for out in outs:
        for c in out.outputs:
            print(f"--- {out.prompt!r} [{c.index}] ({len(c.token_ids)} tokens, {c.finish_reason})")
            print(out.prompt + c.text)
    m = llm.get_metrics()
    print(f"--- load {load:.2f} s, cold start to first token {launched + load + first:.2f} s after launch, "
          f"{m['generation_tokens']} tokens generated, {m['prefix_cache_hits']} prompt tokens from "
          f"the prefix cache, KV pool {m['num_blocks_total']} blocks x {m.get('block_size', 0)} tokens",
          file=sys.stderr)
    llm.close()
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
    llm.close()
    return 0


def package_version() -> str:
    """The installed package's version (its metadata), else the source tree's."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kvserve")
    except PackageNotFoundError:
        import kvserve
        return kvserve.__version__


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="kvserve", description="An LLM inference engine built around the KV cache.")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--version", action="version", version=f"kvserve {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--quiet", action="store_true")
    add_engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with the model")
    chat.add_argument("--system", default=None)
    add_engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat, max_tokens=256)
    kernels = sub.add_parser("build-kernels", help="compile the C++ kernels for this CPU into the installed package "
                             "(what `make install` runs; otherwise the first start builds them)")
    kernels.set_defaults(func=cmd_build_kernels)
    _register_tools(sub)
    return parser


def cmd_build_kernels(args) -> int:
    from kvserve import native
    t0 = time.perf_counter()
    try:
        paths = native.build_installed()
    except (native.BuildError, OSError) as exc:
        print(f"error: kernels not built ({exc}); kvserve runs without them, slower", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    print(f"built in {time.perf_counter() - t0:.1f} s")
    return 0


def _register_tools(sub) -> None:
    from kvserve.distributed.launch import register as register_tp_node
    from kvserve.server.cli import register as register_serve
    from kvserve.server.disagg import register as register_proxy
    from kvserve.tools import analyze, evaluate, plan, top
    register_serve(sub)
    register_proxy(sub)
    register_tp_node(sub)
    for tool in (plan, analyze, evaluate, top):
        tool.register(sub)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvserve` command."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return _exit_now_if_compiling(args.func(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if e.name is not None:  # an import that failed, not a missing package kvserve explained
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


def _exit_now_if_compiling(status: int) -> int:
    """Exit at once with `status` when a background compile still runs (a short `generate`, whose
    engine the command has closed): waiting for torch to stop compiling takes seconds
    (library users get engine/compile.py's exit hook instead)."""
    from kvserve.engine.compile import compiling
    if compiling():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
