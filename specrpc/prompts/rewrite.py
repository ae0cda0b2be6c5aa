"""Next-edit rewrites for editors (Zed's Zeta, Sweep's next-edit models): the file, an editable region around the
cursor and the user's recent edits in; the region as rewritten out. Pure text: the prompt, the region as the
prediction (most of a rewrite copies it), the stop marker, and the changed lines of a finished rewrite.

The generic format is Zeta's layout (a model fine-tuned on it reads it as trained; any instruction-following code
model can follow it):

    ### Instruction:
    <one line: what to do>

    ### User Edits:

    User edited "<path>":
    ```diff
    <a recent edit, as a unified diff>
    ```
    ... (oldest first)

    ### User Excerpt:

    ```<path>
    <|start_of_file|>            (where the excerpt opens the file)
    <text before the region>
    <|editable_region_start|>
    <the region, with <|user_cursor_is_here|> at the cursor>
    <|editable_region_end|>
    <text after the region>
    ```

    ### Response:
    <|editable_region_start|>

and the model writes the rewritten region, ended by `<|editable_region_end|>`."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

INSTRUCTION = ("Rewrite the editable region of the excerpt as the user will edit it next, following their recent "
               "edits and the cursor.")
START_OF_FILE = "<|start_of_file|>"
REGION_START = "<|editable_region_start|>"
REGION_END = "<|editable_region_end|>"
CURSOR = "<|user_cursor_is_here|>"


class BadRewrite(ValueError):
    """Offsets that do not fit the file (INVALID_ARGUMENT / HTTP 400 at the edges)."""


@dataclass(frozen=True)
class RewriteInput:
    """A next-edit request: the file's text, the editable region [region_start, region_end) and the cursor within
    it, in characters, and the recent edits as unified diffs, oldest first."""

    path: str
    text: str
    region_start: int
    region_end: int
    cursor: int
    edits: tuple[str, ...] = ()


@dataclass(frozen=True)
class RewritePrompt:
    """The prompt text, the region as the prediction (with the end marker, which the model writes too) and the stop
    string that ends the rewrite."""

    text: str
    region: str
    prediction: str
    stop: str = REGION_END


def render(rewrite: RewriteInput) -> RewritePrompt:
    """The generic (Zeta) prompt for `rewrite`; BadRewrite when its offsets do not fit the file."""
    text, start, end, cursor = rewrite.text, rewrite.region_start, rewrite.region_end, rewrite.cursor
    if not 0 <= start <= end <= len(text):
        raise BadRewrite(f"region_start and region_end must satisfy 0 <= region_start <= region_end <= {len(text)} "
                         f"(the file's length in characters); got {start} and {end}")
    if not start <= cursor <= end:
        raise BadRewrite(f"cursor must lie within the region [{start}, {end}]; got {cursor}")
    region = text[start:end]
    edits = "\n\n".join(f'User edited "{rewrite.path}":\n```diff\n{edit.rstrip()}\n```' for edit in rewrite.edits)
    before = (START_OF_FILE + "\n" if start == 0 else "") + text[:start]
    excerpt = (f"```{rewrite.path}\n{before}{REGION_START}\n{text[start:cursor]}{CURSOR}{text[cursor:end]}\n"
               f"{REGION_END}\n{text[end:]}\n```")
    prompt = (f"### Instruction:\n{INSTRUCTION}\n\n### User Edits:\n\n{edits}\n\n### User Excerpt:\n\n{excerpt}\n\n"
              f"### Response:\n{REGION_START}\n")
    return RewritePrompt(prompt, region, f"{region}\n{REGION_END}")


@dataclass(frozen=True)
class LineChange:
    """Lines [old_start, old_end) of the region became lines [new_start, new_end) of the rewrite (0-based)."""

    old_start: int
    old_end: int
    new_start: int
    new_end: int


def changed_lines(region: str, rewritten: str) -> list[LineChange]:
    """The line ranges a rewrite changed, as a line diff finds them (empty: the region came back as it was)."""
    matcher = difflib.SequenceMatcher(None, region.split("\n"), rewritten.split("\n"), autojunk=False)
    return [LineChange(i1, i2, j1, j2) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"]
