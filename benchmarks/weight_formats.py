"""Weight formats against float32 weights (`kvserve eval weights`), written to BENCHMARKS.md.

    python benchmarks/weight_formats.py                 # bundled SmolLM2, default specs
    python benchmarks/weight_formats.py --model gemma3-270m --no-write
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, machine_facts, md_table, replace_section  # noqa: E402

from kvserve.tools.evaluate_weights import (  # noqa: E402
    DEFAULT_SPECS,
    GATE_KL,
    GATE_TOP1,
    HEADER,
    evaluate_weights,
    table_rows,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--formats", default=DEFAULT_SPECS)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--score-tokens", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    specs = [s.strip() for s in args.formats.split(",") if s.strip()]
    results = evaluate_weights(args.model, specs, args.context, args.score_tokens, args.samples)
    name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct (bundled Q4_1 GGUF)"
    text = "\n".join([
        f"Command: `{command_line()}`", "",
        f"{name}: {args.samples} windows of CPython's documentation, {args.context} tokens prefilled, "
        f"{args.score_tokens} tokens teacher-forced per window, against float32 weights and activations "
        f"(the dequantized GGUF). Gate of weights='auto': mean KL < {GATE_KL:g} and top-1 >= {GATE_TOP1:.0%}.",
        "", md_table(HEADER, table_rows(results)), "",
        "Machine: " + "; ".join(f"{k} {v}" for k, v in machine_facts().items())])
    print(text)
    if not args.no_write:
        replace_section("Weight formats" + (f" ({name})" if args.model else ""), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
