"""A client's prediction of the output as a draft (OpenAI's Predicted Outputs): an editor rewriting a region sends
the region, and most of the rewrite copies it. The predicted text is aligned to the output by characters as the
output grows, and re-aligned after a divergence where the output's recent text occurs in it again, as a diff would
match them (a deleted, inserted or changed line does not end the copying). Proposed as a point mass, like prompt
lookup: the target decides every token, so the output is the target's whatever the prediction says."""

from __future__ import annotations

import difflib
from collections.abc import Callable

import torch

from specrpc.engine.proposers import EMPTY, REPLACEMENT, Proposal, TokenEnds
from specrpc.engine.sampling import SamplingParams

MIN_ANCHOR_CHARS = 8
"""Fewest characters of the output's end that must occur in the prediction to align there after a divergence:
fewer would align on any indentation or common word."""

MAX_ANCHOR_CHARS = 96
"""Most characters of the output's end looked up to re-align: a longer match says no more about where it is."""


class PredictionProposer:
    """The request's predicted output (`ids`, tokens of its text) as a draft for the output after `prompt_len`."""

    name = "prediction"

    def __init__(self, ids: list[int], prompt_len: int, decode: Callable[[list[int]], str],
                 min_anchor: int = MIN_ANCHOR_CHARS) -> None:
        self.ids = ids
        self.prompt_len = prompt_len
        self._decode = decode
        self._ends = TokenEnds(ids, decode(ids), decode)
        self.text = self._ends.text
        self._min_anchor = min_anchor
        self._aligned = True  # the output's text since `_out_at` is the prediction's since `_pred_at`
        self._out_at = 0  # characters of the output at the anchor
        self._pred_at = 0  # characters of the prediction at the anchor
        self._reached = 0  # the furthest prediction position the output was aligned to: a diff matches onwards

    def propose(
        self, tokens: list[int], slot: int, k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """Up to k tokens of the prediction after the text generated so far (EMPTY where that text ends inside
        one of its tokens, or occurs nowhere in it)."""
        if k == 0:
            return EMPTY
        done = self._decode(tokens[self.prompt_len :]).rstrip(REPLACEMENT) if len(tokens) > self.prompt_len else ""
        at = self._position(done)
        start = self._ends.tokens_at(at) if at is not None else None
        ids = self.ids[start : start + k] if start is not None else []
        return Proposal(ids, None, self.name) if ids else EMPTY

    def _position(self, done: str) -> int | None:
        """Characters of the prediction the output `done` has reached: along the alignment while the output
        follows it, else after the output's end where it occurs in the prediction again (None: nowhere yet)."""
        if self._aligned:
            at = self._pred_at + len(done) - self._out_at
            if self.text.startswith(done[self._out_at :], self._pred_at) and at <= len(self.text):
                self._reached = max(self._reached, at)
                return at
            self._aligned = False
        found = self._realign(done)
        if found is None:
            return None
        self._aligned, self._out_at, self._pred_at = True, len(done), found
        self._reached = max(self._reached, found)
        return found

    def _realign(self, done: str) -> int | None:
        """The end of the longest tail of `done` (MIN..MAX_ANCHOR_CHARS characters) that occurs in the prediction:
        its first occurrence ending at or after the furthest position aligned so far, else its last before."""
        lo, hi = self._min_anchor, min(len(done), MAX_ANCHOR_CHARS)
        if hi < lo or done[-lo:] not in self.text:
            return None
        while lo < hi:  # every tail of an occurring tail occurs too: bisect on the length
            mid = (lo + hi + 1) // 2
            if done[-mid:] in self.text:
                lo = mid
            else:
                hi = mid - 1
        tail = done[-lo:]
        start = self.text.find(tail, max(0, self._reached - lo))
        if start < 0:
            start = self.text.rfind(tail)
        return start + lo

    def count(self, completion: list[int]) -> tuple[int, int]:
        """(accepted, rejected) prediction tokens as OpenAI reports them: the prediction's tokens that appear in
        the completion (those a diff of the two matches, in order), and the rest; whatever the verify steps
        tried."""
        matcher = difflib.SequenceMatcher(None, self.ids, completion, autojunk=False)
        accepted = sum(block.size for block in matcher.get_matching_blocks())
        return accepted, len(self.ids) - accepted
