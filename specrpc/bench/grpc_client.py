"""The bench's gRPC clients, in a process of their own (`RemoteClients`), as a user's client runs: the requests'
protobuf and streaming work in the client's own interpreter, not on the server process's event loop and GIL, where
it would come out of the device thread's time (with eight streams in the server's process, the aggregate was half
of what the same server gives clients in another process, on a 2-core AMD EPYC Zen 3).

The client process (`python -m specrpc.bench.grpc_client '{"port": …, "temperature": …, "top_p": …, "top_k": …}'`)
reads one JSON request a line from stdin (an id, the case's prompt and suffix, new tokens, k and seed), streams each
at once as it comes, and writes one JSON line per finished request (its id, the `Run` fields, the messages it took,
or the error)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import grpc

from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc


async def stream(stub: pb_grpc.GeneratorStub, sampling: dict[str, Any], ask: dict[str, Any]) -> dict[str, Any]:
    """One request streamed to its end: the `Run` fields (tokens, times from the call, chunk sizes, the summary's
    speculation figures, the server's own TTFT and the prompt tokens it prefilled) and the messages it took."""
    k = ask["k"]
    spec = pb.SpeculationParams() if k is None else pb.SpeculationParams(num_draft_tokens=k)
    common: dict[str, Any] = {"max_new_tokens": ask["max_new_tokens"], "speculation": spec,
                              "sampling": pb.SamplingParams(seed=ask["seed"], **sampling)}
    call: Any = (stub.Generate(pb.GenerateRequest(prompt=ask["prompt"], **common)) if ask["suffix"] is None
                 else stub.Infill(pb.InfillRequest(prefix=ask["prompt"], suffix=ask["suffix"], **common)))
    t0 = time.perf_counter()
    run: dict[str, Any] = {"tokens": [], "chunk_times": [], "chunk_sizes": []}
    messages = 0
    async for response in call:
        messages += 1
        if response.HasField("chunk") and response.chunk.token_ids:
            run["tokens"] += list(response.chunk.token_ids)
            run["chunk_times"].append(time.perf_counter() - t0)
            run["chunk_sizes"].append(len(response.chunk.token_ids))
        elif response.HasField("summary"):
            summary = response.summary
            run.update(proposed=summary.speculation.draft_tokens_proposed,
                       accepted=summary.speculation.draft_tokens_accepted, steps=summary.speculation.verify_steps,
                       server_ttft_s=summary.timing.ttft_ms / 1e3,
                       prefilled=summary.prompt_tokens - summary.cached_prompt_tokens,
                       prompt_tokens=summary.prompt_tokens)
    times = run["chunk_times"]
    run.update(ttft_s=times[0] if times else 0.0, total_s=times[-1] if times else 0.0)
    return {"run": run, "messages": messages}


async def serve(settings: dict[str, Any]) -> None:
    """The client process: requests from stdin, streamed concurrently, answers on stdout as each ends."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    sampling = {name: settings[name] for name in ("temperature", "top_p", "top_k")}
    tasks: set[asyncio.Task[None]] = set()

    async def answer(stub: pb_grpc.GeneratorStub, ask: dict[str, Any]) -> None:
        try:
            reply = {"id": ask["id"], **await stream(stub, sampling, ask)}
        except grpc.aio.AioRpcError as exc:
            reply = {"id": ask["id"], "error": f"{exc.code().name}: {exc.details()}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()

    async with grpc.aio.insecure_channel(f"127.0.0.1:{settings['port']}") as channel:
        stub = pb_grpc.GeneratorStub(channel)
        while line := await reader.readline():
            task = asyncio.create_task(answer(stub, json.loads(line)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)


class RemoteClients:
    """The parent's side: `one` sends a request to the client process and returns its `Run` fields and messages
    once it has streamed; any number may be in flight."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.next_id = 0
        self.reading = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, port: int, temperature: float, top_p: float, top_k: int) -> RemoteClients:
        """A client process for the server on loopback `port`, sampling as given."""
        settings = {"port": port, "temperature": temperature, "top_p": top_p, "top_k": top_k}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "specrpc.bench.grpc_client", json.dumps(settings),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 24)
        return cls(process)

    async def _read(self) -> None:
        assert self.process.stdout is not None
        while line := await self.process.stdout.readline():
            reply = json.loads(line)
            future = self.waiting.pop(reply["id"])
            if "error" in reply:
                future.set_exception(RuntimeError(f"a bench request failed: {reply['error']}"))
            else:
                future.set_result(reply)
        for future in self.waiting.values():
            future.set_exception(RuntimeError("the bench's gRPC client process ended"))
        self.waiting.clear()

    async def one(self, prompt: str, suffix: str | None, max_new_tokens: int, k: int | None,
                  seed: int) -> dict[str, Any]:
        """Stream one request from the client process: {"run": the `Run` fields, "messages": n}."""
        assert self.process.stdin is not None
        if self.reading.done():
            raise RuntimeError("the bench's gRPC client process ended")
        self.next_id += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[self.next_id] = future
        ask = {"id": self.next_id, "prompt": prompt, "suffix": suffix, "max_new_tokens": max_new_tokens, "k": k,
               "seed": seed}
        self.process.stdin.write((json.dumps(ask) + "\n").encode())
        await self.process.stdin.drain()
        return await future

    async def close(self) -> None:
        """End the client process once its requests have streamed."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        await self.process.wait()
        await self.reading


if __name__ == "__main__":
    asyncio.run(serve(json.loads(sys.argv[1])))
