"""Private code objects for compiled functions: torch.compile keeps its graphs per code object, so a
function given a code object of its own looks up its own graphs only (each other engine's would
add its guard checks to every call)."""

from __future__ import annotations

import itertools
import types

_copies = itertools.count()


def private_copy(fn):
    """`fn` with a code object of its own (a fresh name, the same body, globals and closure)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_copies)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
