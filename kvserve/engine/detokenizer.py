"""Incremental detokenization and stop strings."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_id: int) -> str:
        """Append a token; return the newly completed text ('' while a character is incomplete)."""
        self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]


def find_stop(text: str, new_len: int, stops: list[str], include: bool) -> tuple[str, str] | None:
    """If a stop string ends inside the last `new_len` chars, return (truncated text, stop)."""
    if not stops:
        return None
    best = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    if best is None:
        return None
    i, stop = best
    return text[:i + len(stop)] if include else text[:i], stop
