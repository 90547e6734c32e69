"""KV cache quantization: quality against a full-precision cache vs bytes per token.

Runs `kvserve eval kv-quant`'s protocol (kvserve/tools/evaluate.py) on the bundled SmolLM2-135M and
on Gemma-3-270M, writes the `## KV cache quantization` section of BENCHMARKS.md and the plot
docs/kv_quality.png. Results are kept in benchmarks/kv_quality.json, one entry per model, so one
model can be re-run alone (`--models gemma3-270m`) and `--render` redraws from the file.

    python benchmarks/kv_quality.py                  # both models, the default (scaled) settings
    python benchmarks/kv_quality.py --render         # table and plot from kv_quality.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # a shared 2-core machine: one thread, before torch loads

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import command_line, machine_facts, md_table, replace_section  # noqa: E402

from kvserve.tools.evaluate import HEADER, EvalSettings, FormatResult, evaluate, table_rows  # noqa: E402

RESULTS = HERE / "kv_quality.json"
PLOT = HERE.parent / "docs" / "kv_quality.png"
MODELS = {"smollm2": None, "gemma3-270m": "gemma3-270m"}
FORMATS = ["auto", "float16", "fp8_e4m3", "fp8_e5m2", "int8", "kivi4", "kivi4+rot", "kivi2", "kivi2+rot",
           "K=int8/V=kivi2", "kivi2+heads=0.25", "kivi2+rot+heads=0.25"]
PASSKEY_FORMATS = ["auto", "int8", "fp8_e4m3", "kivi4", "kivi2", "kivi2+rot"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: smollm2, gemma3-270m")
    p.add_argument("--formats", default=";".join(FORMATS),
                   help="';'-separated format specs (see kvserve eval kv-quant --help)")
    p.add_argument("--passkey-formats", default=";".join(PASSKEY_FORMATS))
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--score-tokens", type=int, default=128)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--passkey-lengths", default="1024,2048")
    p.add_argument("--passkey-cases", type=int, default=5)
    p.add_argument("--dtype", default="float32", help="model dtype (the 'auto' reference cache is kept in it)")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--passkey-grid", action="store_true",
                   help="passkey only (no KL/PPL scoring), kept apart in kv_quality.json under '<model>/passkey'")
    p.add_argument("--merge", action="store_true",
                   help="add these formats to the model's stored run (same scoring settings) instead of replacing it")
    p.add_argument("--render", action="store_true", help="only redraw the table and plot from kv_quality.json")
    p.add_argument("--results", type=Path, default=RESULTS, help="JSON file the results are merged into")
    return p.parse_args(argv)


def load(path: Path = RESULTS) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def to_result(d: dict) -> FormatResult:
    d = dict(d)
    d.pop("ppl_change", None)
    d["passkey"] = {int(k): v for k, v in d.get("passkey", {}).items()}
    return FormatResult(**d)


def plot(store: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for model, entry in store.items():
        rs = [to_result(r) for r in entry["results"]]
        base = next(r for r in rs if r.spec == "auto")
        ref16 = next((r.bytes_per_token for r in rs if r.spec == "float16"), base.bytes_per_token / 2)
        for ax, key, label in ((axes[0], "top1", "top-1 agreement with full precision"),
                               (axes[1], "mean_kl", "mean KL(full || quantized), nats")):
            pts = [(r.bytes_per_token / ref16, getattr(r, key), r.spec) for r in rs if r.spec != "auto"]
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label=model)[0]
            for x, y, s in pts:
                ax.annotate(s, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points", color=line.get_color())
            ax.set_xlabel("KV bytes per token / float16 bytes per token")
            ax.set_title(label)
            ax.grid(True, alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend()
    fig.suptitle("KV cache formats: quality vs memory (teacher-forced decode after a 1K-token prefill)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(store: dict) -> None:
    grids = {k: v for k, v in store.items() if k.endswith("/passkey")}
    store = {k: v for k, v in store.items() if k not in grids}
    rows, notes = [], []
    for model, entry in store.items():
        rows += table_rows([to_result(r) for r in entry["results"]])
        notes.append(f"- {model}: `{entry['command']}`, {entry['seconds']:.0f} s; settings {entry['settings']}")
    facts = next(iter(store.values()))["machine"]
    body = f"""Quality of each KV cache format against the full-precision cache (float32 on this CPU), and what it
costs in memory. Protocol (`kvserve eval kv-quant`, kvserve/tools/evaluate.py): prefill {_setting(store, 'context')}
tokens of `pydoc_data.topics` text into the cache, then score the next {_setting(store, 'score_tokens')} tokens one decode
step at a time with teacher forcing, for {_setting(store, 'samples')} windows: mean KL(full ‖ format) over the
vocabulary, top-1 agreement, perplexity of the true tokens and its change. "greedy match" is the common
prefix of {_setting(store, 'score_tokens')} greedy tokens with full precision's (mean over windows). Passkey: a
5-digit key at depths 0..1 in filler text (Landmark/KIVI template), greedy answer; accuracy per prompt
length. "tokens in 1 GiB" counts the pool's blocks for a 1 GiB budget, residual rows (KIVI) included.

{md_table(HEADER, rows)}

![quality vs bytes per token](docs/kv_quality.png)

Runs:
{chr(10).join(notes)}

Machine: {facts}
"""
    replace_section("KV cache quantization", body + "\n" + passkey_grid(grids) + targets(store) + "\n" + NOTES)
    plot(store, PLOT)


def passkey_grid(grids: dict) -> str:
    """The full-size passkey runs: accuracy per format and prompt length, cases per cell."""
    if not grids:
        return ""
    lengths = sorted({int(k) for e in grids.values() for r in e["results"] for k in r["passkey"]})
    rows = []
    for key, entry in grids.items():
        cases = entry["settings"]["passkey_cases"]
        for r in entry["results"]:
            row = [key.split("/")[0], r["spec"], f"{r['bytes_per_token']:,}"]
            acc = {int(k): v for k, v in r["passkey"].items()}
            row += [f"{acc[n]:.0%}" if n in acc else "—" for n in lengths]
            rows.append(row + [str(cases), entry["settings"].get("dtype", "float32")])
    cmds = "\n".join(f"- {k}: `{e['command']}`, {e['seconds']:.0f} s" for k, e in grids.items())
    return ("Passkey retrieval at full size (same template; cases spread over depths 0..1; the "
            "'auto' row is the reference cache in the model dtype of the run):\n\n"
            + md_table(["model", "format", "B/token", *[f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths],
                        "cases per cell", "model dtype"], rows) + "\n\n" + cmds + "\n\n")


def _setting(store, key):
    values = {str(e["settings"][key]) for e in store.values()}
    return "/".join(sorted(values))


NOTES = """What the numbers say (read by hand from the runs above):
- The KL/top-1/PPL table ran in float32 on one torch thread: 2 windows x 128 scored tokens per
  format (256 steps: top-1 moves in steps of 0.4%); its passkey column is the earlier small run
  (5 cases per length). The full-size passkey grid (20 cases per cell at 1K/2K/4K) ran afterwards
  in bfloat16 on both cores (float32 would have taken hours here): the table just above.
- Rotation fixes int8: with `kv_cache_rotation` int8 meets the target on SmolLM2 (top-1 99.2%, KL
  2.3e-4, 4x lower than without) and cuts Gemma's KL 10x (9.7e-3 -> 1.0e-3, top-1 96.1% -> 97.7%:
  still short of 99%). It does not rescue fp8_e4m3 (96.5% SmolLM2, 93.8% Gemma): fp8's error is
  relative (3 mantissa bits per value), so spreading outliers does not shrink it.
- Passkey at full size, Gemma-3-270M: 100% in every cell for auto, int8, fp8_e4m3 and kivi4.
- Passkey at full size, SmolLM2: int8 matches the reference in every cell (100/100/90%); fp8_e4m3
  and kivi4 lose one case of 20 at 1K and 2K and match at 4K; kivi2 collapses (20/15/25%);
  rotation brings kivi2 back to 80/60/60%. The reference misses 2 of 20 at 4K, so 4K is judged
  against 90%.
- The reference is float32 (CPU). float16 is indistinguishable from it (KL < 1e-6).
- int8 is the safe 1.9x: on SmolLM2 top-1 99.2% and KL 1.02e-3 (the KL target is missed by 2%);
  on Gemma-3-270M (head_dim 256, one scale per 256 values) KL 1e-2 and top-1 96% miss the target,
  perplexity +0.4%. fp8_e4m3 (same bytes) is a little worse than int8 on both (top-1 ~96%):
  3 mantissa bits. fp8_e5m2 is clearly worse.
- kivi4 (3.2x float16 tokens) costs about as much as fp8 in KL; perplexity +1.7% on SmolLM2 (target
  missed; +1.1% with rotation) and -0.7% on Gemma (within 1%).
- kivi2 (5.3x) is not usable as is on models this small: KL 0.25-0.28, top-1 72-76%, and SmolLM2's
  passkey drops to 40%/0%. Rotation helps SmolLM2 (KL 0.16, PPL +13%, passkey 100%/80%) but hurts
  Gemma (KL 0.73): KIVI quantizes keys per channel precisely so that outlier channels get their own
  range, and the rotation spreads them over every channel.
- Mixed precision buys quality back at a memory price: keys in int8 with kivi2 values
  (`K=int8/V=kivi2`, 2.8x float16 tokens) gives KL 0.04-0.05 and PPL +6%; keeping the 25% most
  sensitive KV heads in int8 (`kivi2+heads=0.25`, 3.6x) lands between kivi2 and K=int8/V=kivi2
  (SmolLM2 KL 0.086, PPL +11%; Gemma, whose 1 KV head per layer gives only 3 pool-slot heads to
  choose from, KL 0.22). On these models the split by K/V is the better trade than the split by head.
"""


def targets(store: dict) -> str:
    """The issue's targets, checked against the table: met or not, per model."""
    lines = ["Targets, checked per model:"]
    for model, entry in store.items():
        rs = {r["spec"]: to_result(r) for r in entry["results"]}

        def check(spec, ok, text):
            r = rs.get(spec)
            if r is None or r.top1 is None:
                return f"{text}: not run"
            return f"{text}: **{'met' if ok(r) else 'not met'}**"
        items = [
            check("int8", lambda r: r.top1 >= 0.99 and r.mean_kl < 1e-3, "int8 top-1 >= 99% and KL < 1e-3"),
            check("fp8_e4m3", lambda r: r.top1 >= 0.98, "fp8_e4m3 top-1 >= 98%"),
            check("kivi4", lambda r: abs(r.ppl_change) <= 0.01, "kivi4 perplexity within 1%"),
        ]
        rotated = [("int8+rot", lambda r: r.top1 >= 0.99 and r.mean_kl < 1e-3, "top-1 >= 99% and KL < 1e-3"),
                   ("fp8_e4m3+rot", lambda r: r.top1 >= 0.98, "top-1 >= 98%")]
        for spec, ok, goal in rotated:   # the same targets with the Hadamard rotation, where run
            r = rs.get(spec)
            if r is not None and r.top1 is not None:
                items.append(check(spec, ok, f"{spec} {goal}") + f" (top-1 {r.top1:.1%}, KL {r.mean_kl:.3g})")
        k2, k2r = rs.get("kivi2"), rs.get("kivi2+rot")
        if k2 and k2r and k2.top1 is not None and k2r.top1 is not None:
            items.append(f"kivi2 without / with rotation: top-1 {k2.top1:.1%} / {k2r.top1:.1%}, "
                         f"KL {k2.mean_kl:.3g} / {k2r.mean_kl:.3g}, PPL {k2.ppl_change:+.1%} / {k2r.ppl_change:+.1%}")
        lines.append(f"- {model}: " + "; ".join(items))
    return "\n".join(lines) + "\n"


SCORING = ("context", "score_tokens", "samples", "dtype", "block_size")


def merged(old: dict | None, new: dict) -> dict:
    """`new`'s formats added to (or replacing the same specs in) `old`, whose scoring settings must match."""
    if old is None:
        return new
    differ = [k for k in SCORING if old["settings"].get(k, "float32" if k == "dtype" else None) != new["settings"].get(k)]
    if differ:
        raise SystemExit(f"--merge needs the stored run's scoring settings; these differ: {differ}")
    specs = {r["spec"] for r in new["results"]}
    results = [r for r in old["results"] if r["spec"] not in specs] + [r for r in new["results"] if r["spec"] != "auto"]
    if not any(r["spec"] == "auto" for r in results):
        results.insert(0, next(r for r in new["results"] if r["spec"] == "auto"))
    return {**new, "results": results, "command": f"{old['command']}; then {new['command']}",
            "seconds": old["seconds"] + new["seconds"], "settings": old["settings"]}


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.render:
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            settings = EvalSettings(
                model=MODELS.get(name, name), formats=[f for f in args.formats.split(";") if f],
                context=args.context, score_tokens=args.score_tokens, samples=args.samples,
                passkey_lengths=[int(x) for x in args.passkey_lengths.split(",") if x],
                passkey_cases=args.passkey_cases,
                passkey_formats=[f for f in args.passkey_formats.split(";") if f],
                dtype=args.dtype, kv_cache_memory=args.kv_cache_memory)
            if args.passkey_grid:
                settings.formats, settings.score_tokens = settings.passkey_formats, 0
            t0 = time.perf_counter()
            print(" | ".join(HEADER), flush=True)
            results = evaluate(settings, log=lambda line: print(line, flush=True))
            store = load(args.results)  # merge: another run may have written another model meanwhile
            key = name + ("/passkey" if args.passkey_grid else "")
            entry = {"results": [asdict(r) for r in results], "command": command_line(),
                     "seconds": time.perf_counter() - t0, "machine": machine_facts(),
                     "settings": {k: v for k, v in asdict(settings).items() if k not in ("formats", "model")}}
            store[key] = merged(store.get(key), entry) if args.merge else entry
            args.results.write_text(json.dumps(store, indent=1))
    render(load(args.results))
    print(f"wrote {RESULTS.name}, BENCHMARKS.md and {PLOT.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
