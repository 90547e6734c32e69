"""Options given as one JSON object (vLLM's --speculative-config, --kv-transfer-config): a leaf
module every room may import."""

from __future__ import annotations

import json
from dataclasses import fields


def json_object(name: str, value, cls, required: tuple[str, ...], usage: str) -> dict:
    """`value` (JSON text or a dict) as a dict of `cls`'s fields with every `required` key;
    ValueError naming the option and what to give."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not JSON ({exc.msg}): {usage}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}: {usage}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; known: {sorted(known)}")
    for key in required:
        if key not in value:
            raise ValueError(f"{name} needs {key!r}: {usage}")
    return value
