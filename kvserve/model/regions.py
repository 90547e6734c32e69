"""How a decoder stack runs: attention through its backend, and the dense work between two
attention calls (output projection, residuals, norms, MLP, the next layer's norm, Q/K/V projection
and rotary embedding) as one region, run eagerly or compiled.

Compiled, every region of a model is one `torch.compile` graph shared by all its layers (the
layer's weights are graph inputs, not constants), so a 30-layer model compiles two graphs:
one for single-token steps and one for any larger number of tokens (dynamic shapes). Between
regions the attention backend reads the paged cache as it does eagerly.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from tqdm.auto import tqdm

log = logging.getLogger("kvserve")

# Token counts a warm-up runs: one token (decode at batch 1 gets its own graph), then two and 64
# (the dynamic graph, and past the int8 kernel's row limit, model/quant.py SMALL_ROWS).
WARMUP_TOKENS = (1, 2, 64)
# Graphs kept per region across every engine of the process (torch's default is 8).
RECOMPILE_LIMIT = 64
EAGER_ENV = "KVSERVE_ENFORCE_EAGER"


def _first(layer, x, positions):
    return layer.pre_attention(x, positions)


def _between(layer, following, x, o, positions):
    x = layer.post_attention(x, o)
    return x, following.pre_attention(x, positions)


def _last(layer, x, o):
    return layer.post_attention(x, o)


class Regions:
    """The dense regions of a decoder stack; `compiled` wraps each with torch.compile."""

    def __init__(self, compiled: bool = False):
        self.compiled = compiled
        wrap = _compile if compiled else (lambda f: f)
        self.first, self.between, self.last = wrap(_first), wrap(_between), wrap(_last)

    def run(self, layers, x: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """x through every layer: layer i's attention, then the region up to layer i + 1's."""
        q, k, v = self.first(layers[0], x, positions)
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            o = layer.self_attn.attend(q, k, v, meta)
            if i == last:
                return self.last(layer, x, o)
            x, (q, k, v) = self.between(layer, layers[i + 1], x, o, positions)
        return x


EAGER = Regions(False)


def _compile(fn):
    return torch.compile(fn, dynamic=True, fullgraph=True)


def supports_regions(model: torch.nn.Module) -> bool:
    """True when every layer splits into pre_attention / attend / post_attention."""
    layers = getattr(model.model, "layers", ())
    return bool(layers) and all(hasattr(layer, "pre_attention") and hasattr(layer, "post_attention")
                                for layer in layers)


def eager_by_env() -> bool:
    """KVSERVE_ENFORCE_EAGER=1 runs every engine of the process eagerly (the test suite sets it)."""
    return os.environ.get(EAGER_ENV, "") not in ("", "0")


def compile_regions(model: torch.nn.Module, device: torch.device, show_progress: bool = True) -> bool:
    """Compile `model`'s decoder regions and warm them up (no KV cache is touched); False, and the
    model stays eager, when its layers have no regions."""
    if not supports_regions(model):
        log.info("compiled regions: %s runs eagerly (its layers have no dense regions)", type(model).__name__)
        return False
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    model.model.regions = Regions(True)
    t0 = time.perf_counter()
    try:
        _warm_up(model, device, show_progress)
    except Exception as exc:  # e.g. no C++ compiler for torch's CPU code generation
        model.model.regions = EAGER
        log.warning("compiled regions: compiling failed (%s: %s); the model runs eagerly "
                    "(enforce_eager=True skips the attempt)", type(exc).__name__, str(exc).splitlines()[0][:200])
        return False
    log.info("compiled regions: %s, warmed up for %s tokens in %.1f s (enforce_eager=True skips this)",
             type(model).__name__, "/".join(map(str, WARMUP_TOKENS)), time.perf_counter() - t0)
    return True


@torch.inference_mode()
def _warm_up(model: torch.nn.Module, device: torch.device, show_progress: bool) -> None:
    """Compile each graph now (forwards without a cache), not on a request's first step."""
    from kvserve.attention import AttentionMetadata, PrefillSpan
    for n in tqdm(WARMUP_TOKENS, desc="compiling the model's regions", disable=not show_progress, unit="shape"):
        meta = AttentionMetadata(prefills=[PrefillSpan(0, n, n)])
        model(torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, device=device), meta)
    for layer in model.model.layers:
        layer.self_attn.kv_rows = 0
