"""Prompt lookup (vLLM's `ngram` method): the request's own tokens propose its next ones."""

from __future__ import annotations


class NgramIndex:
    """The latest earlier occurrence of every n-gram (n in [min_n, max_n]) of one token sequence,
    kept as the sequence grows: n-gram -> the position right after it."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.after: dict[tuple[int, ...], int] = {}
        self.size = 0   # tokens indexed: every n-gram ending before position size - 1 is in `after`

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams that gained a following token since the last call."""
        for end in range(max(self.size - 1, 0), len(tokens) - 1):   # n-grams tokens[end-n+1 .. end]
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.after[tuple(tokens[end - n + 1:end + 1])] = end + 1
        self.size = len(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix of `tokens` seen before, longest n first."""
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self.after.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + k]
        return []


class NgramProposer:
    """One NgramIndex per request, grown by the tokens it accepted."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, reqs: list, ks: list[int]) -> list[list[int]]:
        """Up to ks[i] proposed tokens after reqs[i]'s tokens."""
        return [self.propose_one(req, k) for req, k in zip(reqs, ks)]

    def propose_one(self, req, k: int) -> list[int]:
        """Up to k proposed tokens after `req`'s tokens."""
        index = self.indexes.get(req.request_id)
        if index is None:
            index = self.indexes[req.request_id] = NgramIndex(self.min_n, self.max_n)
        index.extend(req.token_ids)
        return index.propose(req.token_ids, k)

    def finished(self, req) -> None:
        """Forget a request that ended."""
        self.indexes.pop(req.request_id, None)
