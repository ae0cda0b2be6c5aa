"""Drafts from what earlier requests generated (SuffixDecoding, Oliaro et al. 2024; Arctic Inference's suffix
decoding): agents and voice stacks repeat themselves across requests (tool-call skeletons, the same boilerplate),
which prompt lookup, confined to one context, cannot see.

A depth-limited suffix trie over recent outputs counts how often each continuation followed each context of up to
`depth` tokens. The stream's context is matched at its longest suffix found in the trie, and the draft follows the
most frequent continuation while its estimated probability (the product of each step's count ÷ its parent's)
stays above `min_probability`, at most as many tokens as the match is long (a longer match is more specific, so its
continuation more likely: the draft length comes from the match's confidence). Proposed as a point mass, verified
like prompt lookup: the output is the target's whatever was drafted.

Bounded: each trie holds at most `max_nodes` nodes and drops its least recently added outputs past that (LRU).
Tries are kept per scope (`SuffixStore`): one client's outputs never draft for another's (tenants with auth tokens,
else sessions, or all clients together only where the operator allows it, since shared drafts leak timing)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specrpc.engine.proposers import EMPTY, Proposal
from specrpc.engine.sampling import SamplingParams

DEPTH = 64
"""Tokens of context plus continuation a trie path holds: a draft is at most as long as its match, so a deeper trie
drafts further along outputs that repeat whole (tool-call skeletons of about 100 tokens: replayed along the given
bench's repeated outputs with the best source chosen each step, k ≤ 8, 3.43 tokens a verify at 64 against 3.14 at
32)."""

MIN_MATCH = 2
"""Fewest tokens of the context's end that must match to draft (one token continues anything). Two-token matches draft
at most two tokens, kept apart by the policy (`suffix_kind`); replayed along the given bench's repeated outputs they
raise the tokens a verify from 3.81 to 3.99 (at 3, the skeleton after each new value waits a token longer)."""


@dataclass
class Node:
    """A trie node: how many indexed positions passed through it, and its children by token."""

    count: int = 0
    children: dict[int, Node] = field(default_factory=dict)


class SuffixTrie:
    """Recent outputs' suffixes, up to `depth` tokens each, with counts; safe to add to from one thread while
    another drafts from it."""

    def __init__(self, depth: int = DEPTH, max_nodes: int = 200_000, min_probability: float = 0.3) -> None:
        self.depth = depth
        self.max_nodes = max_nodes
        self.min_probability = min_probability
        self.root = Node()
        self.nodes = 0
        self._texts: OrderedDict[int, list[int]] = OrderedDict()  # what is indexed, oldest first
        self._next = 0
        self._lock = threading.Lock()

    def add(self, ids: list[int]) -> None:
        """Index `ids` (one output); the oldest outputs go while the trie is over `max_nodes`."""
        if len(ids) < 2:
            return
        with self._lock:
            self._walk(ids, +1)
            self._texts[self._next] = ids
            self._next += 1
            while self.nodes > self.max_nodes and len(self._texts) > 1:
                _, old = self._texts.popitem(last=False)
                self._walk(old, -1)

    def _walk(self, ids: list[int], delta: int) -> None:
        """Add `delta` to the count of every node on every suffix's path (`depth` tokens each); nodes whose count
        drops to 0 are removed."""
        for start in range(len(ids)):
            node = self.root
            for token in ids[start : start + self.depth]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = Node()
                    self.nodes += 1
                child.count += delta
                if child.count <= 0:
                    self.nodes -= _size(child)
                    del node.children[token]
                    break
                node = child

    def draft(self, context: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens continuing `context` and the length of the match they continue ([] and 0: none)."""
        with self._lock:
            for size in range(self._longest_match(context), MIN_MATCH - 1, -1):  # the longest one something followed
                node = self._node(context[len(context) - size :])
                if node is None or not node.children:
                    continue
                ids: list[int] = []
                probability = 1.0
                while node.children and len(ids) < min(k, size):
                    token, child = max(node.children.items(), key=lambda item: item[1].count)
                    probability *= child.count / node.count
                    if probability < self.min_probability:
                        break
                    ids.append(token)
                    node = child
                return ids, size
        return [], 0

    def _longest_match(self, context: list[int]) -> int:
        """The most tokens of the context's end found in the trie (below `depth`, so that something can follow; 0:
        fewer than MIN_MATCH). Binary search: every suffix of an indexed path is indexed too (each position's
        suffix is), so the matched sizes are all those up to the longest, and log2(depth) walks find it where
        trying each size from the longest costs a walk of each."""
        lo, hi = MIN_MATCH - 1, min(len(context), self.depth - 1)  # context[-lo:] matches (or lo < MIN_MATCH)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._node(context[len(context) - mid :]) is None:
                hi = mid - 1
            else:
                lo = mid
        return lo if lo >= MIN_MATCH else 0

    def _node(self, path: list[int]) -> Node | None:
        """The node at `path` from the root, None where it leaves the trie."""
        node = self.root
        for token in path:
            child = node.children.get(token)
            if child is None:
                return None
            node = child
        return node


def _size(node: Node) -> int:
    """Nodes in the subtree at `node`, itself included."""
    return 1 + sum(_size(child) for child in node.children.values())


class SuffixProposer:
    """A request's drafts from its scope's trie (`SuffixStore.trie`); the match's length is its `kind`, as prompt
    lookup's n-gram size is, so the policy keeps their acceptance apart."""

    name = "suffix"

    def __init__(self, trie: SuffixTrie) -> None:
        self.trie = trie

    def propose(
        self, tokens: list[int], slot: int, k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """Up to k tokens of the most frequent continuation of the context's longest indexed suffix."""
        if k == 0:
            return EMPTY
        ids, size = self.trie.draft(tokens[-self.trie.depth :], k)
        return Proposal(ids, None, self.name, kind=suffix_kind(size)) if ids else EMPTY


def suffix_kind(size: int) -> str:
    """The policy's key for a suffix match of `size` tokens: short, medium and long matches apart."""
    return "suffix" + ("1" if size < 6 else "2" if size < 12 else "3")


class SuffixStore:
    """One trie per scope, at most `max_scopes` of them (the least recently used goes)."""

    def __init__(self, max_scopes: int = 64, max_nodes: int = 200_000) -> None:
        self.max_scopes = max_scopes
        self.max_nodes = max_nodes
        self._tries: OrderedDict[str, SuffixTrie] = OrderedDict()
        self._lock = threading.Lock()

    def trie(self, scope: str) -> SuffixTrie:
        """`scope`'s trie, made when first asked for."""
        with self._lock:
            found = self._tries.get(scope)
            if found is None:
                found = self._tries[scope] = SuffixTrie(max_nodes=self.max_nodes)
                while len(self._tries) > self.max_scopes:
                    self._tries.popitem(last=False)
            self._tries.move_to_end(scope)
            return found
