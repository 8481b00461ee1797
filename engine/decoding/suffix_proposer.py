"""Suffix decoding's proposer (issue 25): token tries over the request's own prompt and output and over a bounded
cache of recent requests' outputs shared on the replica, each cache scoped by the tenant's salt as the prefix cache
is (engine/kv/prefix_cache.py), so one tenant's outputs never shape another's proposals. Plain Python: no torch.

A trie holds every window of at most `depth` tokens of the sequences put in it, with a count per node (how many
windows pass through). To propose, find the longest suffix of the sequence (at most `match` tokens) that is a path
of a trie, then follow the most frequent child while its share of its parent's count is at least `min_share`, up to
k tokens. The request's own trie is grown as its tokens arrive (O(depth) per token: one cursor per window still
open); a finished request's output goes into its tenant's shared trie, and the oldest is taken out again (its counts
decremented, empty nodes dropped) once `cached_requests` are held.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class _Node:
    count: int = 0
    children: dict[int, _Node] = field(default_factory=dict)


class TokenTrie:
    """Windows of at most `depth` tokens, counted."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: Sequence[int], sign: int = 1) -> None:
        """Counts (sign=1) or uncounts (sign=-1) every window of `tokens` (of at most depth tokens)."""
        for start in range(len(tokens)):
            node = self.root
            for t in tokens[start:start + self.depth]:
                child = node.children.get(t)
                if child is None:
                    if sign < 0:
                        break
                    child = node.children[t] = _Node()
                child.count += sign
                if child.count <= 0:
                    del node.children[t]
                    break
                node = child

    def walk(self, tokens: Sequence[int]) -> _Node | None:
        node = self.root
        for t in tokens:
            node = node.children.get(t)
            if node is None:
                return None
        return node


def _continue(node: _Node, k: int, min_share: float) -> list[int]:
    out = []
    while len(out) < k and node.children:
        token, child = max(node.children.items(), key=lambda item: item[1].count)
        if child.count < min_share * node.count:
            break
        out.append(token)
        node = child
    return out


@dataclass
class _Live:
    """A running request: its trie, the cursors of its open windows and how many of its tokens are in it."""

    trie: TokenTrie
    cursors: deque
    added: int = 0
    salt: str | None = None


class SuffixProposer:
    """depth: the longest window kept; match: the longest suffix looked up; min_share: how dominant a child must be
    to be proposed; cached_requests: finished requests' outputs kept per tenant salt."""

    name = "suffix"
    MATCH = 8

    def __init__(self, depth: int = 24, match: int = MATCH, min_share: float = 0.1, cached_requests: int = 256):
        if not 1 <= match <= depth or cached_requests < 0 or not 0 <= min_share <= 1:
            raise ValueError("need 1 <= match <= depth, cached_requests >= 0 and 0 <= min_share <= 1")
        self.depth, self.match, self.min_share, self.cached_requests = depth, match, min_share, cached_requests
        self._live: dict[str, _Live] = {}
        self._shared: dict[str | None, TokenTrie] = {}
        self._recent: dict[str | None, OrderedDict[str, tuple[int, ...]]] = {}

    def start(self, seq_id: str, salt: str | None) -> None:
        """Registers a request (its tenant's cache salt, None without one) before its first proposal."""
        self._live[seq_id] = _Live(TokenTrie(self.depth), deque(), salt=salt)

    def _grow(self, live: _Live, token_ids: Sequence[int], upto: int) -> None:
        """Adds the windows of token_ids[:upto] not yet in the request's trie."""
        if len(token_ids) < live.added:  # cut back: index it again
            live.trie, live.cursors, live.added = TokenTrie(self.depth), deque(), 0
        for t in token_ids[live.added:upto]:
            live.cursors.append(live.trie.root)
            if len(live.cursors) > self.depth:
                live.cursors.popleft()
            for i, node in enumerate(live.cursors):
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                child.count += 1
                live.cursors[i] = child
        live.added = max(live.added, upto)

    def propose(self, seq_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        live = self._live.get(seq_id)
        if live is None:
            live = self._live[seq_id] = _Live(TokenTrie(self.depth), deque())
        # Every window but those ending at the last token: the suffix must match an earlier occurrence.
        self._grow(live, token_ids, len(token_ids) - 1)
        shared = self._shared.get(live.salt)
        best: list[int] = []
        for m in range(min(self.match, len(token_ids)), 0, -1):
            suffix = token_ids[len(token_ids) - m:]
            for trie in (live.trie, shared):
                node = trie.walk(suffix) if trie is not None else None
                if node is not None and node.children:
                    best = _continue(node, k, self.min_share)
                    if best:
                        break
            if best:
                break
        self._grow(live, token_ids, len(token_ids))
        return best

    def forget(self, seq_id: str, output_token_ids: Sequence[int] = ()) -> None:
        """Ends a request; its output (when given) joins its tenant's shared cache."""
        live = self._live.pop(seq_id, None)
        if live is None or not output_token_ids or not self.cached_requests:
            return
        shared = self._shared.setdefault(live.salt, TokenTrie(self.depth))
        recent = self._recent.setdefault(live.salt, OrderedDict())
        tokens = tuple(output_token_ids)
        shared.add(tokens)
        recent[seq_id] = tokens
        while len(recent) > self.cached_requests:
            _, old = recent.popitem(last=False)
            shared.add(old, sign=-1)
