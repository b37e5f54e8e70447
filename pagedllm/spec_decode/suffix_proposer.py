"""Suffix-trie drafts (vLLM's ``method="suffix"``: Oliaro et al. 2024, "SuffixDecoding: Extreme
Speculative Decoding for Emerging AI Applications"; vLLM v1 ``spec_decode/suffix_decoding.py``
over Arctic Inference's suffix tree).

Per request, a trie holds every substring of its prompt and accepted output up to
``max_tree_depth`` tokens, each node counting how often its substring occurred. To draft, the
longest suffix of the sequence that occurred before *and was followed by something* is found,
and the trie is walked from it, always to the most frequent child, while the product of the
children's frequencies (an estimate of the draft's probability) stays at least
``min_token_prob``. Unlike prompt lookup, which copies the continuation of one occurrence, the
trie's counts choose the continuation most often seen, and the draft's length adapts to how
sure the counts are.

Left out from vLLM's: the global tree over earlier requests' outputs
(``suffix_decoding_max_cached_requests``) and tree-shaped drafts (verification here takes one
path).
"""

from __future__ import annotations

from typing import Sequence

from pagedllm.core.request import Request


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class _RequestTrie:
    """All substrings (up to ``depth`` tokens) of one request's tokens, with counts.

    ``active[i]`` is the node of the sequence's suffix of ``i + 1`` tokens; appending a token
    extends each of them (and the empty suffix) by one child: O(depth) per token, at most
    ``depth`` new nodes per token.
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()
        self.active: list[_Node] = []
        self.num_tokens = 0

    def extend(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            extended = []
            for node in [self.root, *self.active[:self.depth - 1]]:
                child = node.children.get(token_id)
                if child is None:
                    child = node.children[token_id] = _Node()
                child.count += 1
                extended.append(child)
            self.active = extended
        self.num_tokens += len(token_ids)


class SuffixProposer:
    """``method="suffix"``: drafts from each request's suffix trie (built on first use, then
    extended with the tokens accepted since; ``remove`` forgets a finished request's).

    Args:
        max_tree_depth: longest substring the trie holds, so the longest match plus draft.
        max_spec_factor: at most ``max_spec_factor x match length`` draft tokens.
        min_token_prob: stop drafting when the estimated probability of the draft falls below.
    """

    def __init__(self, max_tree_depth: int, max_spec_factor: float, min_token_prob: float) -> None:
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._tries: dict[str, _RequestTrie] = {}

    def propose(self, request: Request, max_num_tokens: int) -> list[int]:
        """Drafts to follow ``request.all_token_ids`` (at most ``max_num_tokens``)."""
        trie = self._tries.get(request.request_id)
        if trie is None or trie.num_tokens > request.num_tokens:
            trie = self._tries[request.request_id] = _RequestTrie(self.max_tree_depth)
        if trie.num_tokens < request.num_tokens:
            trie.extend(request.all_token_ids[trie.num_tokens:])
        # Arctic Inference's rule: every suffix of the sequence that occurred before with a
        # continuation gives a draft (at most max_spec_factor x its length); the draft with
        # the highest score (its expected number of accepted tokens: the sum of its
        # estimated prefix probabilities) wins, the longer match on a tie. Longest first: a
        # draft of at most `limit` tokens scores at most `limit`, so once the limit of the
        # suffixes left is no more than the best score, none of them can win.
        best: list[int] = []
        best_score = 0.0
        for length in range(len(trie.active), 0, -1):
            allowed = self.max_spec_factor * length
            limit = max_num_tokens if allowed >= max_num_tokens else int(allowed + 1e-6)
            if limit <= best_score:
                break
            node = trie.active[length - 1]
            if node.children:
                draft, score = self._walk(node, limit)
                if score > best_score:
                    best, best_score = draft, score
        return best

    def _walk(self, node: _Node, limit: int) -> tuple[list[int], float]:
        """Follow the most frequent children from ``node`` (at most ``limit`` of them) while
        the product of their frequencies stays >= ``min_token_prob``; returns the tokens and
        the sum of those products."""
        draft: list[int] = []
        probability, score = 1.0, 0.0
        while len(draft) < limit and node.children:
            token_id, child = max(node.children.items(), key=lambda item: item[1].count)
            probability *= child.count / sum(c.count for c in node.children.values())
            if probability < self.min_token_prob:
                break
            draft.append(token_id)
            score += probability
            node = child
        return draft, score

    def propose_batch(self, candidates: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """``propose`` for each ``(request, max_num_tokens)``, in order."""
        return [self.propose(request, max_num_tokens) for request, max_num_tokens in candidates]

    def remove(self, request_id: str) -> None:
        """Forget a finished request's trie."""
        self._tries.pop(request_id, None)
