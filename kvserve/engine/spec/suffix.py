"""Suffix decoding (vLLM's `suffix` method): a bounded suffix tree over each request's own tokens
and one over the outputs of recently finished requests; the longest match of the context's suffix
proposes the most frequent continuation, as far as it stays likely."""

from __future__ import annotations

from collections import OrderedDict


class Node:
    """A substring: how often it occurred, and its one-token extensions."""

    __slots__ = ("children", "count")

    def __init__(self):
        self.children: dict[int, Node] = {}
        self.count = 0


class SuffixTree:
    """Counts of every substring of at most `depth` tokens of the sequences added to it."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = Node()

    def add(self, tokens: list[int], delta: int = 1) -> None:
        """Count (delta 1) or uncount (delta -1) every substring of `tokens` up to `depth` long."""
        for start in range(len(tokens)):
            node = self.root
            for t in tokens[start:start + self.depth]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = Node()
                child.count += delta
                if child.count <= 0:
                    del node.children[t]
                    break
                node = child

    def match(self, context: list[int]) -> tuple[Node | None, int]:
        """The node of the longest suffix of `context` (at most depth - 1 long) that has a
        continuation, and that suffix's length."""
        for n in range(min(self.depth - 1, len(context)), 0, -1):
            node = self._walk(context[-n:])
            if node is not None and node.children:
                return node, n
        return None, 0

    def _walk(self, tokens: list[int]) -> Node | None:
        node = self.root
        for t in tokens:
            node = node.children.get(t)
            if node is None:
                return None
        return node


class GrowingTree(SuffixTree):
    """A SuffixTree of one sequence that grows at its end: each new token extends the substrings
    ending at the previous one (`active`: their nodes, shortest first)."""

    def __init__(self, depth: int):
        super().__init__(depth)
        self.active: list[Node] = []
        self.size = 0

    def extend(self, tokens: list[int]) -> None:
        """Count the substrings that end in tokens[size:]."""
        for t in tokens[self.size:]:
            grown = [self.root] + self.active[:self.depth - 1]
            self.active = []
            for node in grown:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = Node()
                child.count += 1
                self.active.append(child)
        self.size = len(tokens)

    def match(self, context: list[int]) -> tuple[Node | None, int]:
        """As SuffixTree.match, from the nodes of the context's own suffixes (its last token's)."""
        for n in range(len(self.active), 0, -1):
            if self.active[n - 1].children:
                return self.active[n - 1], n
        return None, 0


def best_path(node: Node, limit: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent continuation from `node`, up to `limit` tokens, while its probability
    (counts of each step over its siblings', multiplied) stays >= min_prob; and its score (the
    sum of those probabilities: the expected number of accepted tokens)."""
    path, prob, score = [], 1.0, 0.0
    while len(path) < limit and node.children:
        token, child = max(node.children.items(), key=lambda kv: kv[1].count)
        prob *= child.count / sum(c.count for c in node.children.values())
        if prob < min_prob:
            break
        path.append(token)
        score += prob
        node = child
    return path, score


class SuffixProposer:
    """Per-request trees over prompt and output, one shared tree over the outputs of the last
    `max_cached` finished requests; the better-scoring proposal of the two wins."""

    def __init__(self, depth: int, max_cached: int, spec_factor: float, min_prob: float):
        self.depth, self.max_cached = depth, max_cached
        self.spec_factor, self.min_prob = spec_factor, min_prob
        self.trees: dict[str, GrowingTree] = {}
        self.shared = SuffixTree(depth)
        self.cached: OrderedDict[str, list[int]] = OrderedDict()   # request id -> output in `shared`

    def propose(self, reqs: list, ks: list[int]) -> list[list[int]]:
        """Up to ks[i] proposed tokens after reqs[i]'s tokens."""
        return [self.propose_one(req, k) for req, k in zip(reqs, ks)]

    def propose_one(self, req, k: int) -> list[int]:
        """Up to k proposed tokens after `req`'s tokens."""
        tree = self.trees.get(req.request_id)
        if tree is None:
            tree = self.trees[req.request_id] = GrowingTree(self.depth)
        tree.extend(req.token_ids)
        best, best_score = [], 0.0
        for source in (tree, self.shared):
            node, n = source.match(req.token_ids)
            if node is None:
                continue
            path, score = best_path(node, min(k, max(1, int(self.spec_factor * n))), self.min_prob)
            if score > best_score:
                best, best_score = path, score
        return best

    def finished(self, req) -> None:
        """Forget the request's own tree; keep its output for the others (the oldest leaves first)."""
        self.trees.pop(req.request_id, None)
        if self.max_cached == 0 or not req.output_token_ids:
            return
        output = list(req.output_token_ids)
        self.shared.add(output)
        self.cached[req.request_id] = output
        while len(self.cached) > self.max_cached:
            _, old = self.cached.popitem(last=False)
            self.shared.add(old, delta=-1)
