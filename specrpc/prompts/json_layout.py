"""How JSON is laid out under a grammar (response_format's schemas and json_object, tool calls): `", "` between
items, `": "` after keys, no other whitespace, as `json.dumps` prints it and models mostly write it.

Fixed separators make the text between two values forced (the punctuation, and the next key where the schema fixes
it), and speculation drafts forced tokens without a draft forward of their own (`Constraint.forced`); optional
whitespace would leave every separator a guess of the draft's. No reply can run to its token limit on whitespace
either. Pure text: llguidance reads these options (its `JsonCompileOptions`, or `x-guidance` inside a schema)."""

from __future__ import annotations

ITEM_SEPARATOR = ", "
"""Between an object's members and an array's items."""

KEY_SEPARATOR = ": "
"""Between a key and its value."""


def json_layout(lenient: bool) -> dict[str, str | bool]:
    """llguidance's JSON options for the layout; `lenient`: schema keywords it does not implement are ignored
    rather than refused (OpenAI's `strict: false`)."""
    return {"item_separator": ITEM_SEPARATOR, "key_separator": KEY_SEPARATOR, "whitespace_flexible": False,
            "lenient": lenient}
