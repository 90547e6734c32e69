"""Incremental detokenization, output text kept as pieces, and stop strings checked on a bounded tail."""

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


class TextBuffer:
    """Output text as appended pieces: appending, reading the tail or what follows a position cost
    the size of the new text, not of the whole; the whole is joined only when read."""

    def __init__(self):
        self.parts: list[str] = []
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def append(self, piece: str) -> None:
        if piece:
            self.parts.append(piece)
            self.length += len(piece)

    def text(self) -> str:
        """All of it (joined once; later appends add pieces after the joined one)."""
        if len(self.parts) > 1:
            self.parts = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""

    def since(self, start: int) -> str:
        """The text from character `start` on (all of it for a negative `start`)."""
        start = max(0, start)
        if start >= self.length:
            return ""
        pieces, have = [], 0
        for part in reversed(self.parts):
            pieces.append(part)
            have += len(part)
            if have >= self.length - start:
                break
        joined = "".join(reversed(pieces))
        return joined[len(joined) - (self.length - start):]

    def truncate(self, length: int) -> None:
        """Keep the first `length` characters."""
        while self.parts and self.length - len(self.parts[-1]) >= length:
            self.length -= len(self.parts.pop())
        if self.length > length:
            last = self.parts[-1]
            self.parts[-1] = last[:len(last) - (self.length - length)]
            self.length = length


def find_stop(tail: str, new_len: int, stops: list[str], include: bool) -> tuple[int, str] | None:
    """If a stop string ends inside the last `new_len` chars of `tail`, return (chars of `tail` to
    keep, stop). `tail` must hold the new text plus the longest stop string less one character."""
    if not stops:
        return None
    best = None
    for stop in stops:
        start = max(0, len(tail) - new_len - len(stop) + 1)
        i = tail.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    if best is None:
        return None
    i, stop = best
    return (i + len(stop) if include else i), stop
