"""KV eviction quality and memory (kvserve eval kv-policy): streaming perplexity, passkey / needle under
compression, fidelity against the full cache, KV bytes held per sequence from the pool.

Results accumulate in benchmarks/kv_policies.json (each run replaces the parts it ran, so parts can run
in separate processes); the `## KV eviction` section of BENCHMARKS.md and docs/kv_eviction.png are
written from that file.

    python benchmarks/kv_policies.py --parts stream                 # ~10 min on 1 CPU core
    python benchmarks/kv_policies.py --parts compression,fidelity   # ~6 min
    python benchmarks/kv_policies.py --parts compression --lengths 4096 --merge         # add a length
    python benchmarks/kv_policies.py --parts compression --cases 4 --seed 1 --merge     # add cases
    python benchmarks/kv_policies.py --report-only
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from common import command_line, machine_facts, md_table, replace_section  # noqa: E402

RESULTS = HERE / "kv_policies.json"
PLOT = HERE.parent / "docs" / "kv_eviction.png"


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def ppl_from(curve: list, start: int) -> float:
    """Perplexity over the curve's windows that start at or after token `start` (length-weighted)."""
    nll, n, prev = 0.0, 0, 0
    for end, ppl in curve:
        if prev >= start:
            nll += (end - prev) * math.log(ppl)
            n += end - prev
        prev = end
    return math.exp(nll / n)


def stream_table(rows: list[dict]) -> str:
    header = ["policy", "cache budget (tokens)", "perplexity", "vs full", "perplexity once evicting", "vs full",
              "worst window vs full", "KV held (MiB, peak)", "vs full"]
    full = next(r for r in rows if r["budget"] is None)
    step = full["ppl_curve"][0][0]
    out = []
    for r in rows:
        cells = [f"`{r['policy']}`", "—" if r["budget"] is None else str(r["budget"]), f"{r['ppl']:.3f}",
                 f"{r['ppl_ratio']:.3f}x"]
        if r["budget"] is None:
            cells += ["—", "—", "—"]
        else:
            start = -(-(r["budget"] - 2) // step) * step   # first window boundary >= budget - 2
            mine, ref = ppl_from(r["ppl_curve"], start), ppl_from(full["ppl_curve"], start)
            worst = max(a[1] / b[1] for a, b in zip(r["ppl_curve"], full["ppl_curve"]))
            cells += [f"{mine:.3f}", f"{mine / ref:.3f}x", f"{worst:.2f}x"]
        cells += [mib(r["held_bytes"]), f"{r['held_bytes'] / r['full_bytes']:.1%}"]
        out.append(cells)
    return md_table(header, out)


def compression_table(rows: list[dict], kind: str) -> str:
    rows = [r for r in rows if r["kind"] == kind]
    lengths = sorted({r["length"] for r in rows})
    ratios = sorted({r["evicted"] for r in rows if r["policy"] != "full"})
    policies = [p for p in ("full", "snapkv", "snapkv-qafter", "h2o", "sinks", "random")
                if any(r["policy"] == p for r in rows)]
    header = ["policy", "evicted"] + [f"{n} tokens" for n in lengths] + ["KV held vs full"]
    out = []
    for p in policies:
        for e in ([0.0] if p == "full" else ratios):
            cells = []
            held = []
            for n in lengths:
                hit = [r for r in rows if r["policy"] == p and r["evicted"] == e and r["length"] == n]
                cells.append(f"{hit[0]['accuracy']:.0%} ({hit[0]['cases']})" if hit else "—")
                held += [r["held_bytes"] / r["full_bytes"] for r in hit]
            out.append([p, f"{e:.0%}", *cells, f"{max(held):.0%}" if held else "—"])
    return md_table(header, out)


def fidelity_table(rows: list[dict]) -> str:
    header = ["policy", "evicted", "mean KL(full ‖ policy)", "top-1 agreement", "KV held vs full"]
    return md_table(header, [[r["policy"], f"{r['evicted']:.0%}", f"{r['mean_kl']:.3f}", f"{r['top1']:.1%}",
                              f"{r['held_bytes'] / r['full_bytes']:.0%}"] for r in rows])


def plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [k for k in ("stream", "compression") if k in res]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for ax, key in zip(axes[0], panels):
        if key == "stream":
            for r in res["stream"]["rows"]:
                xs, ys = zip(*r["ppl_curve"])
                ax.plot(xs, ys, label=r["policy"], lw=1.4, ls="-" if r["budget"] != 256 else "--")
            ax.set_yscale("log")
            ax.set_xlabel("token of the stream")
            ax.set_ylabel("perplexity (windows of the stream)")
            ax.set_title("Streaming one token at a time")
        else:
            rows = [r for r in res["compression"]["rows"] if r["kind"] == "passkey"]
            for p in ("snapkv", "snapkv-qafter", "h2o", "sinks", "random"):
                pts = sorted({r["evicted"] for r in rows if r["policy"] == p})
                acc = [sum(r["accuracy"] for r in rows if r["policy"] == p and r["evicted"] == e)
                       / max(1, sum(1 for r in rows if r["policy"] == p and r["evicted"] == e)) for e in pts]
                if pts:
                    ax.plot([e * 100 for e in pts], [a * 100 for a in acc], marker="o", label=p)
            full = [r["accuracy"] for r in rows if r["policy"] == "full"]
            if full:
                ax.axhline(100 * sum(full) / len(full), color="k", ls=":", label="full cache")
            ax.set_xlabel("% of the prompt evicted")
            ax.set_ylabel("passkey accuracy (%, all lengths)")
            ax.set_title("Long-prompt compression")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def merge_row(old: dict | None, new: dict) -> dict:
    """One cell over all seeds run: a new seed adds its cases, a seed run again replaces its own."""
    if not old:
        return new
    by_seed = dict(old.get("by_seed") or {str(old.get("seeds", [0])[0]): [old["accuracy"], old["cases"]]})
    by_seed[str(new["seeds"][0])] = [new["accuracy"], new["cases"]]
    n = sum(c for _, c in by_seed.values())
    return {**new, "accuracy": sum(a * c for a, c in by_seed.values()) / n, "cases": n,
            "seeds": sorted(int(k) for k in by_seed), "by_seed": by_seed,
            "held_bytes": max(old["held_bytes"], new["held_bytes"]),
            "full_bytes": max(old["full_bytes"], new["full_bytes"])}


def merge_part(old: dict | None, new: dict) -> dict:
    """Compression rows of `new` merged into those of `old` (a row per kind, length, policy, ratio)."""
    if not old:
        return new
    key = lambda r: (r["kind"], r["length"], r["policy"], r["evicted"])  # noqa: E731
    rows = {key(r): r for r in old["rows"]}
    for r in new["rows"]:
        rows[key(r)] = merge_row(rows.get(key(r)), r)
    settings = dict(old["settings"])
    settings["lengths"] = sorted({r["length"] for r in rows.values()})
    commands = old.get("commands", [old["command"]])
    return {"rows": sorted(rows.values(), key=lambda r: (r["kind"], r["length"])), "settings": settings,
            "command": new["command"], "commands": [*commands, new["command"]]}


def paths(model: str | None) -> tuple[Path, Path]:
    """(results file, plot) of a model: the bundled one in kv_policies.json, others beside it."""
    if model in (None, "smollm2"):
        return RESULTS, PLOT
    return HERE / f"kv_policies-{model}.json", PLOT.with_name(f"kv_eviction-{model}.png")


def section() -> str:
    """The whole `## KV eviction` section: the bundled model, then every other model's file."""
    res = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    text = [report(res, PLOT)]
    for extra in sorted(HERE.glob("kv_policies-*.json")):
        other = json.loads(extra.read_text())
        tag = extra.stem.removeprefix("kv_policies-")
        body = report(other, PLOT.with_name(f"kv_eviction-{tag}.png")).replace("\n### ", "\n#### ")
        text.append(f"### {other.get('model', tag)}\n\n" + body)
    return "\n\n".join(text)


def report(res: dict, plot_path: Path = PLOT) -> str:
    parts = [f"Model: {res.get('model', 'SmolLM2-135M-Instruct')} (CPU; model dtype per part below). Command(s): "
             + "; ".join(f"`{c}`" for c in sorted({c for v in res.values() if isinstance(v, dict)
                                                     for c in v.get("commands", [v.get("command")]) if c}))]
    facts = res.get("machine")
    if facts:
        parts.append("Machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()) + ".")
    parts.append(
        "Every configuration is one request with its own `kv_policy` on one engine started with "
        "`kv_policy=\"full\"` (every layer its own block table); evicted blocks go back to the pool, and "
        "*KV held* is the request's blocks x bytes per block, read from the pool. Protocol: "
        "`kvserve eval kv-policy --help`, docs/EVICTION.md.")
    if "stream" in res:
        s = res["stream"]
        parts.append(f"### Streaming perplexity\n\nModel dtype {s['settings'].get('dtype', 'float32')}. "
                     f"{s['tokens']} tokens of `pydoc_data.topics` fed one token at a "
                     "time (every step evicts once the cache is full). StreamingLLM's result — window-only "
                     "explodes, four sink tokens bring it back — is the check. *Once evicting*: the windows of "
                     f"{s['rows'][0]['ppl_curve'][0][0]} tokens from the budget on (the first ones are the full "
                     "cache for every policy); *worst window*: the largest per-window ratio.\n\n"
                     + stream_table(s["rows"]))
    if "compression" in res:
        c = res["compression"]
        st = c["settings"]
        parts.append(f"### Long-prompt compression\n\nModel dtype {st.get('dtype', 'float32')}. "
                     "Greedy answer after the prompt, depths spread over the prompt; cells: accuracy "
                     "(cases). `snapkv`: the "
                     "question ends the prompt, inside the 32-token observation window; `snapkv-qafter`: the "
                     "context alone is compressed, then the question is fed token by token; `h2o` half heavy "
                     "half recent; `sinks` 4 + the rest; `random` the window + random others.\n\n"
                     "Passkey:\n\n" + compression_table(c["rows"], "passkey")
                     + "\n\nNeedle (\"the best thing to do in San Francisco\", both phrases must appear):\n\n"
                     + compression_table(c["rows"], "needle"))
    if "fidelity" in res:
        f = res["fidelity"]
        st = f["settings"]
        parts.append(f"### Fidelity after compression\n\nModel dtype {st.get('dtype', 'float32')}. "
                     f"A context of {st['context']} tokens compressed, then "
                     f"{st['score_tokens']} tokens forced one at a time; compared with the full cache step by "
                     "step.\n\n" + fidelity_table(f["rows"]))
    if plot_path.exists():
        parts.append(f"![KV eviction](docs/{plot_path.name})")
    if res.get("notes"):
        parts.append(res["notes"])
    return "\n\n".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="alias or path (default: the bundled SmolLM2)")
    p.add_argument("--parts", default="stream,compression,fidelity")
    p.add_argument("--stream-tokens", type=int, default=4096)
    p.add_argument("--budgets", default="256,512")
    p.add_argument("--lengths", default="1024,2048")
    p.add_argument("--ratios", default="0.25,0.5,0.75")
    p.add_argument("--cases", type=int, default=2)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--score-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtype", default="float32", help="model dtype")
    p.add_argument("--seed", type=int, default=0, help="compression cases (with --merge: adds cases to a cell)")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--notes", default=None, help="a paragraph appended to the section")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--merge", action="store_true",
                   help="merge compression rows into the stored ones instead of replacing the part: a cell "
                        "run with a new --seed adds its cases; a seed run again replaces its own")
    args = p.parse_args(argv)
    results, plot_path = paths(args.model)
    res = json.loads(results.read_text()) if results.exists() else {}
    if not args.report_only:
        import torch

        from kvserve.tools.evaluate_policies import PolicyEvalSettings, evaluate_policies
        if args.threads:
            torch.set_num_threads(args.threads)
        s = PolicyEvalSettings(model=args.model, stream_tokens=args.stream_tokens,
                               budgets=[int(x) for x in args.budgets.split(",")],
                               lengths=[int(x) for x in args.lengths.split(",")],
                               ratios=[float(x) for x in args.ratios.split(",")], cases=args.cases,
                               context=args.context, score_tokens=args.score_tokens,
                               parts=args.parts.split(","), dtype=args.dtype,
                               kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                               seed=args.seed)
        out = evaluate_policies(s, log=lambda line: print(line, file=sys.stderr, flush=True))
        res = json.loads(results.read_text()) if results.exists() else {}  # parts may run in parallel
        res["model"] = out["model"]
        res["machine"] = machine_facts()
        for part in s.parts:
            new = {"rows": out[part], "settings": out["settings"], "command": command_line()}
            res[part] = merge_part(res.get(part), new) if args.merge and part == "compression" else new
        if "stream" in s.parts:
            res["stream"]["tokens"] = s.stream_tokens
    if args.notes is not None:
        res["notes"] = args.notes
    results.write_text(json.dumps(res, indent=1))
    plot(res, plot_path)
    replace_section("KV eviction", section())
    print(section())
    return 0


if __name__ == "__main__":
    sys.exit(main())
