"""Optional features: each one's package is imported only when the feature runs, and a missing one
names the extra that installs it (`pip install 'kvserve[redis]'`)."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module`, or raise ModuleNotFoundError saying which kvserve extra installs it."""
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != top:
            raise  # the package is there but something it imports is not
        raise ModuleNotFoundError(
            f"{feature} needs the {top!r} package, which kvserve does not install by default; "
            f"install it with: pip install 'kvserve[{extra}]'") from e
