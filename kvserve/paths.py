"""kvserve's cache folder, the root of every cache it keeps (models' built weights, compiled
graphs, kernels, fingerprints): a leaf module every room may import."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_root() -> Path:
    """kvserve's cache folder: `$XDG_CACHE_HOME/kvserve`, else `~/.cache/kvserve`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvserve"
