// The TypeScript client against a real `specrpc serve` (started here, stopped at the end).
// The server uses the same models as the Python suite: SPECRPC_TARGET / SPECRPC_DRAFT pass through, else the
// shipped pair in specrpc/assets. Without them (still training) the tests are skipped, like pytest's.
import assert from "node:assert/strict";
import { type ChildProcess, spawn } from "node:child_process";
import { existsSync } from "node:fs";
import { createServer } from "node:net";
import { dirname, join, resolve } from "node:path";
import { after, before, describe, test } from "node:test";
import { fileURLToPath } from "node:url";

import {
  Code, ConnectError, type Constraint, type ConverseEvent, type GenerateOptions, type GenerationEvent, SpecrpcClient,
  type Tool, type ToolCall, grpcStatus,
} from "../src/index.js";
import { type ConverseRequest } from "../src/gen/specrpc/v1/generator_pb.js";

const REPO = resolve(dirname(fileURLToPath(import.meta.url)), "../../../..");
const SPECRPC = join(REPO, ".venv", "bin", "specrpc");

function whyNot(): string | undefined {
  if (!existsSync(SPECRPC)) return `${SPECRPC} not found: run \`make install\` first`;
  const target = process.env.SPECRPC_TARGET ?? join(REPO, "specrpc", "assets", "target");
  const draft = process.env.SPECRPC_DRAFT ?? join(REPO, "specrpc", "assets", "draft");
  for (const [role, dir] of [["target", target], ["draft", draft]] as const) {
    if (role === "draft" && dir.toLowerCase() === "none") continue;
    if (!existsSync(join(dir, "config.json"))) {
      return `${role} model ${dir} not there yet (still training? set SPECRPC_TARGET/SPECRPC_DRAFT)`;
    }
  }
  return undefined;
}

function freePort(): Promise<number> {
  return new Promise((res, rej) => {
    const srv = createServer();
    srv.once("error", rej);
    srv.listen(0, "127.0.0.1", () => {
      const addr = srv.address();
      srv.close(() => (typeof addr === "object" && addr ? res(addr.port) : rej(new Error("no port"))));
    });
  });
}

async function collect<T>(it: AsyncIterable<T>): Promise<T[]> {
  const out: T[] = [];
  for await (const x of it) out.push(x);
  return out;
}

const skip = whyNot();

const PERSON = {
  type: "object",
  properties: { name: { type: "string", maxLength: 12 }, age: { type: "integer", minimum: 0, maximum: 150 } },
  required: ["name", "age"],
  additionalProperties: false,
};

const WEATHER: Tool = {
  name: "get_weather", description: "The current weather in a city",
  parameters: {
    type: "object",
    properties: { city: { type: "string", maxLength: 16 }, unit: { type: "string", enum: ["celsius", "fahrenheit"] } },
    required: ["city", "unit"], additionalProperties: false,
  },
};

const TIME: Tool = {
  name: "get_time", description: "The time in a time zone",
  parameters: JSON.stringify({
    type: "object", properties: { zone: { type: "string", maxLength: 16 } }, required: ["zone"],
    additionalProperties: false,
  }),
};

function isInvalidArgument(pattern: RegExp): (err: unknown) => boolean {
  return (err: unknown) => err instanceof ConnectError && err.code === Code.InvalidArgument &&
    pattern.test(err.rawMessage);
}

describe("SpecrpcClient against specrpc serve", { skip }, () => {
  let server: ChildProcess | undefined;
  let client: SpecrpcClient;
  let logs = "";

  before(async () => {
    const port = await freePort();
    server = spawn(SPECRPC, ["serve", "--host", "127.0.0.1", "--port", String(port), "--threads", "1",
      "--max-sessions", "4", "--max-context", "512", "--max-new-tokens", "256", "--metrics-port", "0",
      "--log-format", "console", "--grace-s", "1"], { env: process.env, stdio: ["ignore", "pipe", "pipe"] });
    server.stdout?.on("data", (d: Buffer) => (logs += d.toString()));
    server.stderr?.on("data", (d: Buffer) => (logs += d.toString()));
    const exited = new Promise<never>((_, rej) => server?.once("exit", (code) =>
      rej(new Error(`specrpc serve exited early (${code}):\n${logs}`))));
    client = new SpecrpcClient({ address: `127.0.0.1:${port}`, timeoutMs: 60_000 });
    await Promise.race([client.waitForServing(180_000), exited]);
  });

  after(async () => {
    client?.close();
    if (server && server.exitCode === null) {
      const gone = new Promise((r) => server?.once("exit", r));
      server.kill("SIGTERM");
      const timer = setTimeout(() => server?.kill("SIGKILL"), 10_000);
      await gone;
      clearTimeout(timer);
    }
  });

  test("health and model info", async () => {
    assert.equal(await client.health(), "SERVING");
    const info = await client.modelInfo();
    assert.ok(info.kvSlotsTotal >= 1 && info.target.vocabSize > 0 && info.maxContext > 0);
  });

  test("complete streams typed chunks, then exactly one summary", async () => {
    const gen = client.complete("def fibonacci(n):", { maxNewTokens: 16 });
    const events: GenerationEvent[] = await collect(gen);
    const last = events.at(-1);
    assert.equal(last?.type, "summary");
    assert.equal(events.filter((e) => e.type === "summary").length, 1);
    const chunks = events.filter((e) => e.type === "chunk");
    assert.ok(last?.type === "summary");
    assert.equal(last.completionTokens, chunks.reduce((n, c) => n + c.tokenIds.length, 0));
    assert.ok(last.completionTokens <= 16 && last.promptTokens > 0);
    assert.ok(["length", "stop"].includes(last.finishReason));
    assert.equal(gen.text, chunks.map((c) => c.text).join(""));
  });

  test("complete with a path frames the prompt as the start of that file", async () => {
    const summaryOf = async (options: GenerateOptions) => {
      const events = await collect(client.complete("def fibonacci(n):", { maxNewTokens: 2, ...options }));
      const last = events.at(-1);
      assert.ok(last?.type === "summary");
      return last;
    };
    const plain = await summaryOf({});
    const framed = await summaryOf({ path: "maths/fib.py" });
    assert.ok(framed.promptTokens > plain.promptTokens);
  });

  test("infill streams the middle", async (t) => {
    if (!(await client.modelInfo()).supportsInfill) return t.skip("no fill-in-the-middle tokens");
    const gen = client.infill("def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n", {
      maxNewTokens: 8, path: "main.py", extraFiles: [{ path: "util.py", text: "def sub(a, b):\n    return a - b\n" }],
    });
    const summary = await gen.result();
    assert.ok(summary && summary.promptTokens > 0 && summary.completionTokens <= 8);
  });

  test("infill: layout, typed line, repository name and truncation", async (t) => {
    const info = await client.modelInfo();
    if (!info.supportsInfill) return t.skip("no fill-in-the-middle tokens");
    assert.ok(info.fimTemplate !== "" && info.fimOrders.length > 0 && info.fimDefaultLayout !== "auto");
    let lines = "";
    for (let i = 0; i < 120; i++) lines += `item_${i} = build(${i}, size=${i * 5})\n`;
    const summary = await client.infill(lines + "last = ", "\n" + lines, {
      maxNewTokens: 4, typedLine: "build(", repoName: "demo", truncate: true, layout: "psm",
    }).result();
    assert.ok(summary && summary.fimLayout === "psm");
    assert.ok(summary.trimmedPromptTokens > 0 && summary.trimmedPrefixChars > 0);
    await assert.rejects(client.infill(lines, "\n" + lines, { maxNewTokens: 4 }).result(),
      (e: unknown) => e instanceof ConnectError && e.code === Code.InvalidArgument && e.message.includes("truncate"));
  });

  test("editor fields: logprobs on chunks, prefill-only warms a session, n_indent ends on a line", async () => {
    const events = await collect(client.complete("def fibonacci(n):", {
      maxNewTokens: 6, logprobs: true, topLogprobs: 2,
    }));
    const chunks = events.filter((e) => e.type === "chunk");
    const logprobs = chunks.flatMap((c) => c.logprobs);
    assert.deepEqual(logprobs.map((lp) => lp.tokenId), chunks.flatMap((c) => c.tokenIds));
    assert.ok(logprobs.every((lp) => lp.logprob <= 0 && lp.topLogprobs.length === 2));
    const sessionId = `ts-open-${Date.now()}`;
    const warm = await client.complete("def fibonacci(n):\n", { sessionId, prefillOnly: true }).result();
    assert.ok(warm && warm.completionTokens === 0 && warm.tokensCached === warm.promptTokens);
    const next = await client.complete("def fibonacci(n):\n", { sessionId, maxNewTokens: 40, nIndent: 40 }).result();
    assert.ok(next && ["indent", "stop"].includes(next.finishReason));
    assert.equal(next.cachedPromptTokens, warm.promptTokens - 1);
  });

  test("streamIntervalMs travels as the request's field: 0 streams, out of range is INVALID_ARGUMENT", async () => {
    const events = await collect(client.complete("def fibonacci(n):", { maxNewTokens: 8, streamIntervalMs: 0 }));
    const tokens = events.filter((e) => e.type === "chunk").flatMap((c) => c.tokenIds);
    assert.equal(tokens.length, 8);
    await assert.rejects(client.infill("a", "b", { maxNewTokens: 4, streamIntervalMs: 1001 }).result(),
      (e: unknown) => e instanceof ConnectError && e.code === Code.InvalidArgument &&
        e.message.includes("stream_interval_ms must be in 0..1000"));
  });

  test("AbortSignal mid-stream ends the iteration quietly as cancelled", async () => {
    const controller = new AbortController();
    const gen = client.complete("Once upon a time", {
      maxNewTokens: 256, speculation: { numDraftTokens: 0 }, signal: controller.signal,
    });
    let chunks = 0;
    for await (const ev of gen) {
      if (ev.type === "chunk") {
        chunks += 1;
        controller.abort(); // the keystroke
      }
    }
    assert.ok(chunks >= 1);
    // One token per step, so 256 tokens cannot be done yet: cancelled, unless the model stopped by itself first.
    assert.ok(gen.finishReason === "cancelled" || gen.summary?.finishReason === "stop", String(gen.finishReason));
  });

  test("completion session: a new keystroke aborts the previous request and reuses its prefix", async () => {
    const session = client.completionSession({ maxNewTokens: 256, speculation: { numDraftTokens: 0 } });
    const prefix = "def fibonacci(n):\n    if n < 2:\n        return n\n    return";
    const first = session.complete(prefix);
    const firstEvent = await first[Symbol.asyncIterator]().next(); // the first request is streaming...
    const second = session.complete(prefix + " fib", { maxNewTokens: 4 }); // ...when the next keystroke comes
    await first.result(); // the first ends quietly, as cancelled (unless its model ended it before any chunk)
    assert.ok(first.finishReason === "cancelled" || firstEvent.value?.type === "summary", first.finishReason);
    const summary = await second.result();
    assert.ok(summary && summary.cachedPromptTokens > 0, JSON.stringify(summary));
    assert.equal(summary?.sessionId, session.sessionId);
  });

  test("converse: phrases, barge-in and rewind", async () => {
    const conv = client.converse({ system: "Answer briefly.", maxNewTokens: 16 });
    const started = await conv.started;
    assert.equal(started.sessionId, conv.sessionId);

    const events: ConverseEvent[] = await collect(conv.say("Hello! How are you?"));
    const summary = events.at(-1);
    assert.ok(summary?.type === "turnSummary");
    const phrases = events.filter((e) => e.type === "phrase");
    assert.equal(phrases.map((p) => p.text).join(""), summary.replyText);
    assert.equal(events.filter((e) => e.type === "chunk").map((c) => c.text).join(""), summary.replyText);

    let barged: ConverseEvent | undefined;
    for await (const ev of conv.say("Tell me a long story.", { maxNewTokens: 200, speculation: { numDraftTokens: 0 } })) {
      if (ev.type === "chunk" && ev.text) conv.cancel(); // the user speaks
      if (ev.type === "turnSummary") barged = ev;
    }
    assert.ok(barged?.type === "turnSummary");
    assert.ok(barged.generation.finishReason === "cancelled" || barged.generation.stopSequence,
      barged.generation.finishReason);
    assert.ok(barged.generation.completionTokens < 200);

    const rewound = await conv.rewind(2);
    assert.equal(rewound.keptChars, Math.min(2, [...barged.replyText].length));
    await conv.close();
  });

  test("a JSON-schema constraint: the completion parses and has the required keys", async () => {
    const gen = client.complete("Here is a person as JSON:", { maxNewTokens: 96, constraint: { jsonSchema: PERSON } });
    const summary = await gen.result();
    assert.equal(summary?.finishReason, "stop", gen.text); // the grammar completed
    const person = JSON.parse(gen.text) as Record<string, unknown>;
    assert.deepEqual(Object.keys(person).sort(), ["age", "name"]);
    assert.ok(typeof person.name === "string" && Number.isInteger(person.age), gen.text);
    const again = client.complete("Here is a person as JSON:", { maxNewTokens: 96,
      constraint: { jsonSchema: JSON.stringify(PERSON) } }); // the same schema as its text
    await again.result();
    assert.equal(again.text, gen.text);
  });

  test("a regex constraint on infill and on a completion session; jsonObject", async (t) => {
    const session = client.completionSession({ maxNewTokens: 16, constraint: { regex: "[0-9]{3}" } });
    const number = session.complete("The answer is ");
    assert.equal((await number.result())?.finishReason, "stop");
    assert.match(number.text, /^[0-9]{3}$/);
    const object = client.complete("{", { maxNewTokens: 64, constraint: { jsonObject: true } });
    if ((await object.result())?.finishReason === "stop") assert.equal(typeof JSON.parse(object.text), "object");
    else assert.match(object.text, /^\{/);
    if (!(await client.modelInfo()).supportsInfill) return t.skip("no fill-in-the-middle tokens");
    const middle = client.infill("x = ", "\nprint(x)\n", { maxNewTokens: 16, constraint: { regex: "[0-9]{2}" } });
    assert.equal((await middle.result())?.finishReason, "stop");
    assert.match(middle.text, /^[0-9]{2}$/);
  });

  test("a bad schema is INVALID_ARGUMENT from the server; no kind or two kinds, from the client before any call",
    async () => {
      await assert.rejects(client.complete("x", { constraint: { jsonSchema: { type: "strange" } } }).result(),
        isInvalidArgument(/json_schema/));
      await assert.rejects(client.complete("x", { constraint: { regex: "[a-" } }).result(),
        isInvalidArgument(/regex/));
      const calls: string[] = [];
      const spy = new SpecrpcClient({ baseUrl: client.baseUrl,
        interceptors: [(next) => async (req) => { calls.push(req.url); return await next(req); }] });
      try {
        const two = { regex: "a", grammar: "root ::= \"a\"" } as unknown as Constraint;
        assert.throws(() => spy.complete("x", { constraint: two }), isInvalidArgument(/exactly one.*regex, grammar/));
        assert.throws(() => spy.infill("x", "y", { constraint: {} as Constraint }), isInvalidArgument(/got none/));
        const session = spy.completionSession();
        assert.throws(() => session.complete("x", { constraint: { jsonSchema: [1] } as unknown as Constraint }),
          isInvalidArgument(/jsonSchema must be a JSON Schema object/));
        assert.equal(session.current, undefined);
      } finally {
        spy.close();
      }
      assert.deepEqual(calls, []);
    });

  test("converse: tools with toolChoice required yield toolCall events whose arguments parse; a tool result " +
    "turn is accepted", async (t) => {
    const sent: ConverseRequest[] = []; // what the server cannot show back: parallelToolCalls, toolCallId
    const spy = new SpecrpcClient({ baseUrl: client.baseUrl, interceptors: [(next) => async (req) => {
      if (!req.stream) return await next(req);
      const messages = req.message;
      return await next({ ...req, message: (async function* () {
        for await (const m of messages) {
          sent.push(m as unknown as ConverseRequest);
          yield m;
        }
      })() });
    }] });
    t.after(() => spy.close());
    const conv = spy.converse({ system: "You can call functions.", tools: [WEATHER], toolChoice: "required",
      parallelToolCalls: false, maxNewTokens: 200 });
    await conv.started;
    const events: ConverseEvent[] = await collect(conv.say("What is the weather in Paris?"));
    const calls = events.filter((e): e is ToolCall => e.type === "toolCall");
    const summary = events.at(-1);
    assert.ok(summary?.type === "turnSummary");
    assert.equal(calls.length, 1, JSON.stringify(events));
    assert.deepEqual(summary.toolCalls, calls);
    const [call] = calls;
    assert.ok(call && call.name === "get_weather" && call.index === 0 && call.id !== "");
    const args = JSON.parse(call.argumentsJson) as Record<string, unknown>;
    assert.ok(typeof args.city === "string" && ["celsius", "fahrenheit"].includes(String(args.unit)));
    assert.equal(events.filter((e) => e.type === "chunk").map((c) => c.text).join(""), ""); // calls are not text

    assert.throws(() => conv.send("21", { toolCallId: call.id }), isInvalidArgument(/role "tool"/));
    const reply: ConverseEvent[] = await collect(conv.toolResult(call.id, { temperature: 21 },
      { toolChoice: "none", maxNewTokens: 6 }));
    const after = reply.at(-1);
    assert.ok(after?.type === "turnSummary" && after.toolCalls.length === 0 && after.replyText !== "");
    assert.ok(!reply.some((e) => e.type === "toolCall"));

    // a turn's own tools and a named function; then a turn constrained to a JSON object, its tools off
    const timed = await collect(conv.say("And the time in Tokyo?", { tools: [WEATHER, TIME],
      toolChoice: { function: "get_time" } }));
    const timeCall = timed.find((e): e is ToolCall => e.type === "toolCall");
    assert.ok(timeCall && timeCall.name === "get_time", JSON.stringify(timed));
    assert.equal(typeof (JSON.parse(timeCall.argumentsJson) as { zone: unknown }).zone, "string");
    await collect(conv.toolResult(timeCall.id, "09:00", { toolChoice: "none", maxNewTokens: 4 }));
    const json = await collect(conv.say("Summarise as JSON.", { toolChoice: "none", maxNewTokens: 64,
      constraint: { jsonSchema: PERSON } }));
    const last = json.at(-1);
    assert.ok(last?.type === "turnSummary");
    if (last.generation.finishReason === "stop") assert.ok("age" in (JSON.parse(last.replyText) as object));
    else assert.match(last.replyText, /^\{"name": /);
    await conv.close();
    const start = sent[0]?.action;
    assert.ok(start?.case === "start" && start.value.parallelToolCalls === false);
    const results = sent.flatMap((m) => m.action.case === "turn" && m.action.value.role === "tool"
      ? [m.action.value.toolCallId] : []);
    assert.deepEqual(results, [call.id, timeCall.id]);
  });

  test("converse: toolResults sends a reply's two calls' results in one turn and one reply follows", async (t) => {
    const turns: ConverseRequest[] = []; // the turns as sent
    const spy = new SpecrpcClient({ baseUrl: client.baseUrl, interceptors: [(next) => async (req) => {
      if (!req.stream) return await next(req);
      const messages = req.message;
      return await next({ ...req, message: (async function* () {
        for await (const m of messages) {
          if ((m as unknown as ConverseRequest).action.case === "turn") turns.push(m as unknown as ConverseRequest);
          yield m;
        }
      })() });
    }] });
    t.after(() => spy.close());
    for (let seed = 0; seed < 12; seed++) { // a random model makes several calls about one reply in two
      const conv = spy.converse({ tools: [WEATHER, TIME], toolChoice: "required", maxNewTokens: 250 });
      await conv.started;
      const events = await collect(conv.say("Weather in Paris and the time there?",
        { sampling: { temperature: 1, seed } }));
      const calls = events.filter((e): e is ToolCall => e.type === "toolCall");
      if (calls.length < 2) {
        await conv.close();
        continue;
      }
      const [first, second] = calls as [ToolCall, ToolCall];
      assert.throws(() => conv.toolResults([{ callId: first.id, result: "1" }, { callId: "", result: "2" }]),
        isInvalidArgument(/toolResults\[1\]/));
      const reply = await collect(conv.toolResults([{ callId: first.id, result: { temperature: 21 } },
        { callId: second.id, result: "09:00" }], { toolChoice: "none", maxNewTokens: 6 }));
      const summary = reply.at(-1);
      assert.ok(summary?.type === "turnSummary" && summary.turnIndex === 1 && summary.toolCalls.length === 0);
      await conv.close();
      assert.ok(!(await collect(conv)).some((e) => e.type === "turnSummary")); // no second reply
      const sent = turns.at(-1)?.action;
      assert.ok(sent?.case === "turn" && sent.value.role === "tool" && sent.value.text === "");
      assert.deepEqual(sent.value.toolResults.map((r) => [r.toolCallId, r.text]),
        [[first.id, '{"temperature":21}'], [second.id, "09:00"]]);
      return;
    }
    assert.fail("no reply made several calls");
  });

  test("converse: a bad tool schema is INVALID_ARGUMENT naming start.tools", async () => {
    const conv = client.converse({ tools: [{ name: "f", parameters: "[]" }] });
    await assert.rejects(conv.started, isInvalidArgument(/start\.tools\[0\]/));
    await conv.close();
  });

  test("INVALID_ARGUMENT surfaces as a ConnectError with its code", async () => {
    await assert.rejects(client.complete("x", { sampling: { temperature: -1 } }).result(), (err: unknown) => {
      assert.ok(err instanceof ConnectError);
      assert.equal(err.code, Code.InvalidArgument);
      assert.equal(grpcStatus(err), "INVALID_ARGUMENT");
      assert.match(err.rawMessage, /temperature/);
      return true;
    });
  });

  test("a deadline surfaces as DEADLINE_EXCEEDED", async () => {
    const gen = client.complete("x", { maxNewTokens: 256, speculation: { numDraftTokens: 0 }, timeoutMs: 1 });
    await assert.rejects(gen.result(), (err: unknown) => grpcStatus(err) === "DEADLINE_EXCEEDED");
  });

  test("bearer token and x-session-id travel as request metadata", async () => {
    const seen: Headers[] = [];
    const spy = new SpecrpcClient({
      baseUrl: client.baseUrl, token: "s3cret",
      interceptors: [(next) => async (req) => { seen.push(req.header); return await next(req); }],
    });
    try {
      await spy.complete("x", { maxNewTokens: 1, sessionId: "editor-1" }).result();
    } finally {
      spy.close();
    }
    assert.equal(seen[0]?.get("authorization"), "Bearer s3cret");
    assert.equal(seen[0]?.get("x-session-id"), "editor-1");
  });

  test("UNAVAILABLE before the first response is retried up to maxAttempts; retry: false tries once", async () => {
    const port = await freePort(); // nothing listens there
    for (const [retry, attempts] of [[{ maxAttempts: 3, initialBackoffMs: 20 }, 3], [false, 1]] as const) {
      const nobody = new SpecrpcClient({ address: `127.0.0.1:${port}`, retry, timeoutMs: 10_000 });
      const gen = nobody.complete("x", { maxNewTokens: 1 });
      try {
        await assert.rejects(gen.result(), (err: unknown) => grpcStatus(err) === "UNAVAILABLE");
      } finally {
        nobody.close();
      }
      assert.equal(gen.attempts, attempts);
    }
  });

  test("a client that starts before its server gets through once the server is up", async () => {
    const port = await freePort();
    const late = new SpecrpcClient({ address: `127.0.0.1:${port}`, timeoutMs: 120_000,
      retry: { maxAttempts: 400, initialBackoffMs: 50, maxBackoffMs: 300 } });
    const gen = late.complete("def f(x):", { maxNewTokens: 4 }); // before the server exists
    const second = spawn(SPECRPC, ["serve", "--host", "127.0.0.1", "--port", String(port), "--threads", "1",
      "--max-sessions", "1", "--max-context", "256", "--metrics-port", "0", "--grace-s", "1"],
    { env: process.env, stdio: "ignore" });
    try {
      const summary = await gen.result(); // refused while the port is closed, UNAVAILABLE while loading: retried
      assert.ok(summary && summary.completionTokens > 0);
      assert.ok(gen.attempts > 1, `attempts ${gen.attempts}`);
    } finally {
      late.close();
      const gone = new Promise((r) => second.once("exit", r));
      second.kill("SIGTERM");
      await gone;
    }
  });
});
