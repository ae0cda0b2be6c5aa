"""Next-edit rewrites: the generic (Zeta) prompt, offsets checked, changed lines as a line diff finds them, and the
Rewrite RPC and its HTTP route on the live test server: the region is the prediction, the output is the target's
own, and the summary names the changed lines."""

from __future__ import annotations

import grpc
import httpx2
import pytest
from service_helpers import text_of

from specrpc.edges.server import Running
from specrpc.prompts.rewrite import (
    CURSOR,
    REGION_END,
    REGION_START,
    BadRewrite,
    LineChange,
    RewriteInput,
    changed_lines,
)
from specrpc.prompts.rewrite import render as render_rewrite
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

FILE = "import os\n\n\ndef walk(path):\n    for name in os.listdir(path):\n        print(name)\n\n\nwalk('.')\n"
REGION = (FILE.index("def walk"), FILE.index("\n\n\nwalk") + 1)
EDIT = "@@ -1,3 +1,3 @@\n-import sys\n+import os\n"


def test_the_prompt_marks_the_region_and_cursor_and_predicts_the_region() -> None:
    cursor = FILE.index("print")
    framed = render_rewrite(RewriteInput("walk.py", FILE, *REGION, cursor, (EDIT,)))
    assert framed.region == FILE[REGION[0] : REGION[1]]
    assert framed.prediction == framed.region + "\n" + REGION_END and framed.stop == REGION_END
    assert f'User edited "walk.py":\n```diff\n{EDIT.rstrip()}\n```' in framed.text
    marked = f"{REGION_START}\n{FILE[REGION[0] : cursor]}{CURSOR}{FILE[cursor : REGION[1]]}\n{REGION_END}\n"
    assert marked in framed.text
    assert framed.text.startswith("### Instruction:\n") and framed.text.endswith(f"### Response:\n{REGION_START}\n")
    with pytest.raises(BadRewrite, match="region_end"):
        render_rewrite(RewriteInput("walk.py", FILE, 5, len(FILE) + 1, 5))
    with pytest.raises(BadRewrite, match="cursor"):
        render_rewrite(RewriteInput("walk.py", FILE, *REGION, 0))


def test_changed_lines_are_the_line_diff() -> None:
    region = "a\nb\nc\nd"
    assert changed_lines(region, region) == []
    assert changed_lines(region, "a\nB\nc\nd") == [LineChange(1, 2, 1, 2)]
    assert changed_lines(region, "a\nc\nd") == [LineChange(1, 2, 1, 1)]
    assert changed_lines(region, "a\nb\nx\ny\nc\nd") == [LineChange(2, 2, 2, 4)]


async def test_rewrite_streams_the_targets_output_with_the_region_as_prediction(
        server: Running, stub: pb_grpc.GeneratorStub) -> None:
    """Greedy: the same text as a Generate of the rendered prompt without a prediction; the summary counts the
    prediction and names the changed lines; the HTTP route answers the same; bad offsets are INVALID_ARGUMENT / 400."""
    request = pb.RewriteRequest(path="walk.py", text=FILE, region_start=REGION[0], region_end=REGION[1],
                                cursor=FILE.index("print"), recent_edits=[EDIT], max_new_tokens=48)
    chunks: list[pb.TokenChunk] = []
    summary: pb.RewriteSummary | None = None
    async for response in stub.Rewrite(request):
        if response.WhichOneof("event") == "chunk":
            chunks.append(response.chunk)
        else:
            summary = response.summary
    assert summary is not None
    framed = render_rewrite(RewriteInput("walk.py", FILE, *REGION, FILE.index("print"), (EDIT,)))
    plain_chunks = []
    async for response in stub.Generate(pb.GenerateRequest(prompt=framed.text, max_new_tokens=48, stop=[REGION_END],
                                                           speculation=pb.SpeculationParams(num_draft_tokens=0))):
        if response.WhichOneof("event") == "chunk":
            plain_chunks.append(response.chunk)
    assert text_of(chunks) == text_of(plain_chunks)
    assert summary.region == text_of(chunks).removesuffix("\n")
    generation = summary.generation
    assert generation.accepted_prediction_tokens + generation.rejected_prediction_tokens > 0
    assert [(c.old_start, c.old_end, c.new_start, c.new_end) for c in summary.changes] == [
        (c.old_start, c.old_end, c.new_start, c.new_end) for c in changed_lines(framed.region, summary.region)]
    async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}", timeout=60) as http:
        body = {"path": "walk.py", "text": FILE, "region_start": REGION[0], "region_end": REGION[1],
                "cursor": FILE.index("print"), "recent_edits": [EDIT], "max_tokens": 48}
        answer = (await http.post("/v1/rewrite", json=body)).json()
        assert answer["region"] == summary.region and len(answer["changes"]) == len(summary.changes)
        assert answer["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == (
            generation.accepted_prediction_tokens)
        refused = await http.post("/v1/rewrite", json={**body, "cursor": 0})
        assert refused.status_code == 400 and "cursor" in refused.json()["error"]["message"]
        refused = await http.post("/v1/rewrite", json={**body, "recent_edits": [3]})
        assert refused.status_code == 400 and "recent_edits[0]" in refused.json()["error"]["message"]
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        async for _ in stub.Rewrite(pb.RewriteRequest(path="x", text="abc", region_start=2, region_end=9)):
            pass
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "region_end" in str(bad.value.details())
