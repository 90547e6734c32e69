"""`kvserve top`: the KV-cache state of a running `kvserve serve` in the terminal, refreshing.

It reads `GET /v1/kv/state` (the dashboard's data) every `--interval` seconds and draws the block
counts, a block map (one character per block, or per run of blocks on a large pool), the requests
with their block tables, and the counters.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

STATE_STYLE = {"f": ("·", "grey39"), "c": ("c", "blue"), "u": ("u", "green"), "s": ("s", "bold yellow"),
               "r": ("r", "red")}
MAP_ROWS = 8          # most lines the block map takes
MAX_REQUESTS = 16     # request rows shown


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `top` subcommand."""
    p = subparsers.add_parser("top", help="the KV cache of a running server in the terminal",
                              description="Show the KV-cache state of a `kvserve serve` (blocks, requests, "
                                          "counters), refreshing.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    p.add_argument("--api-key", default=None, help="bearer key of the server (default: $KVSERVE_API_KEY)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print the state once and exit")
    p.set_defaults(func=run)
    return p


def fetch_state(url: str, api_key: str | None) -> dict:
    """The server's /v1/kv/state; ValueError on a refused key."""
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url.rstrip("/") + "/v1/kv/state", headers=headers, timeout=10)
    if r.status_code == 401:
        raise ValueError(f"{url} refused the API key: give it with --api-key or $KVSERVE_API_KEY")
    r.raise_for_status()
    return r.json()


def render(state: dict, width: int = 100):
    """A rich renderable of one snapshot."""
    from rich.console import Group
    from rich.text import Text
    kv, pool, c, a = state["kv"], state["pool"], state["counters"], state["analyzer"]
    k = pool["counts"]
    head = Text.assemble(("kvserve top ", "bold"), f"{state['model']} · KV {kv['format']} · "
                         f"{kv['bytes_per_token']:,} B/token · block {kv['block_size']} tokens · step {state['step']:,}")
    counts = Text.assemble(
        ("blocks ", "bold"), f"total {len(pool['state'])}  ", ("free ", "grey62"), f"{k['f']}  ",
        ("cached ", "blue"), f"{k['c']}  ", ("used ", "green"), f"{k['u']}  ", ("shared ", "yellow"),
        f"{k['s']}  ", f"usage {c['kv_usage']:.1%}")
    stats = Text(f"prefix hits {c['prefix_hit_rate']:.1%} of {c['prefix_queries']:,} tokens · preemptions "
                 f"{c['preemptions']} · swap out/in {c['num_swapped_out_blocks']}/{c['num_swapped_in_blocks']} "
                 f"blocks · evicted tokens {c.get('kv_evicted_tokens', 0):,} · K/V rows {a['kv_rows_computed']:,} "
                 f"vs {a['kv_rows_no_cache']:,} without a cache ({a['saving']:.1%} avoided)")
    parts = [head, counts, block_map(pool["state"], width), stats, requests_table(state)]
    if "spec_decode_num_draft_tokens" in c:
        drafted, accepted = c["spec_decode_num_draft_tokens"], c["spec_decode_num_accepted_tokens"]
        parts.append(Text(f"speculation: {accepted:,} of {drafted:,} proposed tokens accepted "
                          f"({accepted / drafted if drafted else 0:.1%}) in {c['spec_decode_num_drafts']:,} steps"))
    tiers = c.get("kv_tiers") or {}
    if tiers:
        parts.append(Text("tiers: " + "  ".join(
            f"{n} hits {t['hits']} misses {t['misses']} written {t['bytes_written']:,} B" for n, t in tiers.items())))
    return Group(*parts)


def block_map(states: str, width: int):
    """One character per block; on a pool too large for MAP_ROWS lines, one per run of blocks
    (the run's busiest state: shared, used, cached, reserved, free)."""
    from rich.text import Text
    per = max(1, -(-len(states) // (width * MAP_ROWS)))
    text = Text()
    for i in range(0, len(states), per):
        run = states[i:i + per]
        s = next((x for x in "sucr" if x in run), "f")
        ch, style = STATE_STYLE[s]
        text.append(ch, style=style)
    if per > 1:
        text.append(f"  (one character per {per} blocks)", style="grey50")
    return text


def requests_table(state: dict):
    """Requests with their tokens and block tables."""
    from rich.table import Table
    t = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("request", "state", "prompt+out", "computed", "prefix hit", "blocks", "policy"):
        t.add_column(col)
    ref = state["pool"]["ref"]
    for r in state["requests"][:MAX_REQUESTS]:
        table = r["blocks"][0] if r["blocks"] else []
        shared = sum(1 for b in table if 0 <= b < len(ref) and ref[b] > 1)
        blocks = f"{sum(len(g) for g in r['blocks'])}" + (f" ({shared} shared)" if shared else "")
        t.add_row(r["id"][-24:], r["state"], f"{r['prompt_tokens']}+{r['output_tokens']}",
                  str(r["computed_tokens"]), str(r["prefix_hit_tokens"]), blocks, r["policy"] or "")
    more = len(state["requests"]) - MAX_REQUESTS
    if more > 0:
        t.add_row(f"... {more} more", "", "", "", "", "", "")
    return t


def run(args: argparse.Namespace) -> int:
    """Entry point of `kvserve top`."""
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text
    key = args.api_key or os.environ.get("KVSERVE_API_KEY")
    console = Console()
    if args.once:
        console.print(render(fetch_state(args.url, key), console.width))
        return 0
    with Live(Text("connecting to " + args.url), console=console, auto_refresh=False, screen=False) as live:
        try:
            while True:
                live.update(_frame(args.url, key, console.width), refresh=True)
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0


def _frame(url: str, key: str | None, width: int):
    """The screen for one refresh; a connection error is shown, not raised (the server may restart)."""
    from rich.text import Text
    try:
        return render(fetch_state(url, key), width)
    except ValueError:
        raise
    except Exception as exc:
        return Text(f"kvserve top: cannot read {url}/v1/kv/state: {exc!r} (retrying)", style="red")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="kvserve")
    register(parser.add_subparsers(dest="command", required=True))
    sys.exit(run(parser.parse_args()))
