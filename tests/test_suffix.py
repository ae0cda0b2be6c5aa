"""The suffix source: continuations of earlier outputs weighted by how often they followed, a draft as long as the
match is specific and its probability high, bounded memory (oldest outputs go first), scopes apart."""

from __future__ import annotations

import torch

from specrpc.engine.proposers import EMPTY
from specrpc.engine.sampling import SamplingParams
from specrpc.engine.suffix import Node, SuffixProposer, SuffixStore, SuffixTrie

GREEDY = SamplingParams(temperature=0.0)


def test_the_most_frequent_continuation_is_drafted_while_likely() -> None:
    trie = SuffixTrie(depth=16, min_probability=0.3)
    skeleton = [1, 2, 3, 4, 5, 6, 7, 8]
    for value in (10, 11, 12):
        trie.add([*skeleton[:4], value, *skeleton[4:]])  # the same skeleton, a new value at position 4
    trie.add([1, 2, 3, 4, 99, 98])  # once, a different continuation
    assert trie.draft([0, 1, 2, 3, 4], 8) == ([], 4), "after the skeleton's start the values split: 1/4 each"
    assert trie.draft([7, 1, 2, 3, 4, 11], 8) == ([5, 6, 7, 8], 5), "after a value the skeleton follows: always"
    assert trie.draft([1, 2, 3, 4, 11], 2) == ([5, 6], 5), "k bounds it"
    assert trie.draft([3, 4, 11], 8) == ([5, 6, 7], 3), "a draft no longer than its match"
    assert trie.draft([50, 51, 52], 8) == ([], 0), "no match of MIN_MATCH tokens"


def test_a_two_token_match_drafts_two() -> None:
    trie = SuffixTrie(depth=16)
    trie.add([1, 2, 3, 4, 5, 6])
    assert trie.draft([9, 8, 2, 3], 8) == ([4, 5], 2), "right after a new value, two tokens of the skeleton match"
    assert trie.draft([9, 8, 7, 3], 8) == ([], 0), "one token continues anything: no draft"


def count(node: Node) -> int:
    """Nodes below `node`."""
    return sum(1 + count(child) for child in node.children.values())


def test_memory_is_bounded_and_the_oldest_outputs_go_first() -> None:
    trie = SuffixTrie(depth=8, max_nodes=200)
    rng = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, 1000, (10,), generator=rng).tolist() for _ in range(30)]
    for text in texts:
        trie.add(text)
        assert trie.nodes <= 200 and trie.nodes == count(trie.root), "evicted nodes are counted off exactly"
    assert trie.draft(texts[-1][:5], 3) == (texts[-1][5:8], 5), "the newest output is kept"
    assert trie.draft(texts[0][:5], 3) == ([], 0), "the oldest went"


def test_scopes_keep_their_outputs_apart() -> None:
    store = SuffixStore(max_scopes=2)
    store.trie("token:a").add([1, 2, 3, 4, 5, 6])
    alice, bob = SuffixProposer(store.trie("token:a")), SuffixProposer(store.trie("token:b"))
    assert alice.propose([9, 1, 2, 3], 0, 4, GREEDY, None).token_ids == [4, 5, 6]
    assert bob.propose([9, 1, 2, 3], 0, 4, GREEDY, None) is EMPTY
    store.trie("session:c")
    assert store.trie("token:a").nodes == 0, "the least recently used scope went past max_scopes"
