"""Triton kernels over the paged KV cache (docs/KERNELS.md).

Nothing here imports triton until a kernel is called: `available()` says whether it can be.
On a CPU, kernels run under the Triton interpreter (set TRITON_INTERPRET=1 before the first
import of triton); on CUDA they are compiled.

- source.py   what a kernel reads: one KV entry's tensors in one format (native, int8, fp8, KIVI)
- decode.py   paged decode: grouped query heads per KV head, windows, split-K; MLA latents
- extend.py   paged prefill/extend: a chunk of new queries over its cached prefix
- store.py    the K/V write: quantize-on-store into the pool
- backend.py  TritonBackend: the attention backend that calls them
- flashinfer.py  an adapter to FlashInfer's paged kernels where it is installed
"""

from __future__ import annotations

import importlib.util


def available() -> bool:
    """True when the triton package can be imported (nothing is imported here)."""
    return importlib.util.find_spec("triton") is not None
