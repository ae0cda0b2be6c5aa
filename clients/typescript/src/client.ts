// SpecrpcClient: Generate / Infill / Converse / GetModelInfo over gRPC (HTTP/2) with @connectrpc/connect-node.
import { randomUUID } from "node:crypto";

import { type MessageInitShape } from "@bufbuild/protobuf";
import { Code, ConnectError, type Client, type Interceptor, createClient } from "@connectrpc/connect";
import { Http2SessionManager, createGrpcTransport } from "@connectrpc/connect-node";

import { Health, HealthCheckResponse_ServingStatus } from "./gen/grpc/health/v1/health_pb.js";
import {
  type ConverseRequestSchema,
  type ConverseResponse,
  type GenerateResponse,
  Generator,
} from "./gen/specrpc/v1/generator_pb.js";
import { AsyncQueue } from "./queue.js";
import {
  type Chunk,
  type Constraint,
  type ConstraintOptions,
  type ConverseEvent,
  type FinishReason,
  type GenerateOptions,
  type GenerationEvent,
  type InfillOptions,
  type ModelInfo,
  type RequestOptions,
  type Rewound,
  type SamplingOptions,
  type SessionStarted,
  type SpeculationOptions,
  type Summary,
  type Tool,
  type ToolChoice,
  type ToolResult,
  type TurnRole,
  chunkFrom,
  constraintToProto,
  editorToProto,
  invalidArgument,
  modelInfoFrom,
  phraseFrom,
  fimLayoutToProto,
  samplingToProto,
  speculationToProto,
  summaryFrom,
  toolCallFrom,
  toolChoiceToProto,
  toolsToProto,
  turnSummaryFrom,
} from "./types.js";

/** TLS settings (PEM strings or buffers). `ca` verifies the server; `cert` + `key` authenticate the client (mTLS). */
export interface TlsOptions {
  ca?: string | Buffer;
  cert?: string | Buffer;
  key?: string | Buffer;
  /** Name to verify in the server certificate (default: the host of `address`). */
  serverName?: string;
}

export interface ClientOptions {
  /** "host:port" (default "127.0.0.1:50051"). */
  address?: string;
  /** Full base URL ("http://host:port" or "https://host:port"); overrides address and the scheme from `tls`. */
  baseUrl?: string;
  /** Bearer token, sent as `authorization: Bearer <token>` on every call. */
  token?: string;
  /** true: TLS with the system roots; an object: custom roots and/or a client certificate. */
  tls?: boolean | TlsOptions;
  /** Default deadline in milliseconds for unary and generation calls (Converse has none unless given). */
  timeoutMs?: number;
  /** Extra connect interceptors (logging, tracing, ...). */
  interceptors?: Interceptor[];
  /** Retries of Generate/Infill on UNAVAILABLE before the first response (default `DEFAULT_RETRY`); false: none. */
  retry?: RetryOptions | false;
}

/** Exponential backoff on UNAVAILABLE only, and only before a call's first response has arrived (a server still
 * loading, restarting or draining); the call's deadline bounds all attempts together. Same policy as the Python
 * client: attempt n waits min(maxBackoffMs, initialBackoffMs · multiplier^(n-2)) ± jitter before it runs. */
export interface RetryOptions {
  maxAttempts?: number;
  initialBackoffMs?: number;
  maxBackoffMs?: number;
  multiplier?: number;
  jitter?: number;
}

export const DEFAULT_RETRY: Required<RetryOptions> = {
  maxAttempts: 5, initialBackoffMs: 100, maxBackoffMs: 2000, multiplier: 2, jitter: 0.2,
};

/** Milliseconds to wait before retry number `retry` (1 = the second attempt). */
function backoffMs(policy: Required<RetryOptions>, retry: number): number {
  const base = Math.min(policy.maxBackoffMs, policy.initialBackoffMs * policy.multiplier ** (retry - 1));
  return base * (1 + (Math.random() * 2 - 1) * policy.jitter);
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const timer = setTimeout(done, ms);
    function done(): void {
      clearTimeout(timer);
      signal.removeEventListener("abort", done);
      resolve();
    }
    signal.addEventListener("abort", done, { once: true });
  });
}

export type ServingStatus = "UNKNOWN" | "SERVING" | "NOT_SERVING" | "SERVICE_UNKNOWN";

/** The gRPC status name of an error ("INVALID_ARGUMENT", "DEADLINE_EXCEEDED", ...), or undefined. */
export function grpcStatus(err: unknown): string | undefined {
  if (!(err instanceof ConnectError)) return undefined;
  return Code[err.code].replace(/([a-z])([A-Z])/g, "$1_$2").toUpperCase();
}

/** A tool's result as a turn's text: a string as given, anything else as its JSON text. */
function resultText(result: string | object): string {
  return typeof result === "string" ? result : JSON.stringify(result);
}

function isAbort(err: unknown): boolean {
  return (err instanceof ConnectError && err.code === Code.Canceled) ||
    (err instanceof Error && err.name === "AbortError");
}

function sessionHeaders(sessionId: string | undefined): Record<string, string> {
  return sessionId ? { "x-session-id": sessionId } : {};
}

/** One Generate/Infill stream: `for await` its events (chunks, then one summary). Aborting (the caller's signal or
 * `cancel()`) ends the iteration quietly, with `finishReason` "cancelled". Iterate it once. */
export class Generation implements AsyncIterable<GenerationEvent> {
  readonly chunks: Chunk[] = [];
  summary: Summary | undefined;
  readonly startedAt = performance.now();
  firstTokenAt: number | undefined;
  private readonly controller = new AbortController();
  private readonly signal: AbortSignal;
  private source: AsyncIterable<GenerateResponse>;
  private iterator: AsyncGenerator<GenerationEvent> | undefined;
  private aborted = false;

  /** Calls made for this generation (1 + retries). */
  attempts = 0;
  private readonly start: (signal: AbortSignal, timeoutMs: number | undefined) => AsyncIterable<GenerateResponse>;
  private readonly retry: Required<RetryOptions>;
  private readonly deadline: number | undefined;

  constructor(start: (signal: AbortSignal, timeoutMs: number | undefined) => AsyncIterable<GenerateResponse>,
    signal?: AbortSignal, retry: Required<RetryOptions> = { ...DEFAULT_RETRY, maxAttempts: 1 }, timeoutMs?: number) {
    this.signal = signal ? AbortSignal.any([signal, this.controller.signal]) : this.controller.signal;
    this.start = start;
    this.retry = retry;
    this.deadline = timeoutMs === undefined ? undefined : this.startedAt + timeoutMs;
    this.source = this.open();
  }

  private open(): AsyncIterable<GenerateResponse> {
    this.attempts += 1;
    // grpc-timeout takes whole milliseconds
    const left = this.deadline === undefined ? undefined
      : Math.max(1, Math.floor(this.deadline - performance.now()));
    return this.start(this.signal, left);
  }

  /** Milliseconds to wait before another attempt after `err`, or undefined to give up. */
  private retryDelay(err: unknown, responded: boolean): number | undefined {
    if (responded || this.signal.aborted || this.attempts >= this.retry.maxAttempts) return undefined;
    if (!(err instanceof ConnectError) || err.code !== Code.Unavailable) return undefined;
    const delay = backoffMs(this.retry, this.attempts);
    if (this.deadline !== undefined && performance.now() + delay >= this.deadline) return undefined;
    return delay;
  }

  /** The text received so far. */
  get text(): string {
    return this.chunks.map((c) => c.text).join("");
  }

  /** The summary's reason, "cancelled" after an abort, undefined while running. */
  get finishReason(): FinishReason | undefined {
    return this.summary?.finishReason ?? (this.aborted || this.signal.aborted ? "cancelled" : undefined);
  }

  get cancelled(): boolean {
    return this.finishReason === "cancelled";
  }

  /** Client-side time to the first token in milliseconds (includes the network). */
  get ttftMs(): number | undefined {
    return this.firstTokenAt === undefined ? undefined : this.firstTokenAt - this.startedAt;
  }

  /** Stop now; the server stops within one engine step and keeps the prefix cached for the session. */
  cancel(): void {
    if (!this.summary) this.controller.abort();
  }

  [Symbol.asyncIterator](): AsyncIterator<GenerationEvent> {
    this.iterator ??= this.run();
    return this.iterator;
  }

  /** Read to the end; the summary (undefined when cancelled). */
  async result(): Promise<Summary | undefined> {
    for await (const _ of this) {
      // drain
    }
    return this.summary;
  }

  private async *run(): AsyncGenerator<GenerationEvent> {
    let responded = false;
    for (;;) {
      try {
        for await (const res of this.source) {
          responded = true;
          if (res.event.case === "chunk") {
            const chunk = chunkFrom(res.event.value);
            if (this.firstTokenAt === undefined && chunk.tokenIds.length > 0) this.firstTokenAt = performance.now();
            this.chunks.push(chunk);
            yield chunk;
          } else if (res.event.case === "summary") {
            this.summary = summaryFrom(res.event.value);
            yield this.summary;
          }
        }
        return;
      } catch (err) {
        if (this.signal.aborted && isAbort(err)) {
          this.aborted = true;
          return;
        }
        const delay = this.retryDelay(err, responded);
        if (delay === undefined) throw err;
        await sleep(delay, this.signal);
        if (this.signal.aborted) {
          this.aborted = true;
          return;
        }
        this.source = this.open();
      }
    }
  }
}

/** Completions for one editor buffer: each request aborts the previous one (cancel-on-keystroke) and all share one
 * session id, so the server reuses the cached prompt prefix (`summary.cachedPromptTokens`). */
export class CompletionSession {
  readonly sessionId: string;
  current: Generation | undefined;

  constructor(private readonly client: SpecrpcClient,
    private readonly defaults: RequestOptions & ConstraintOptions = {}, sessionId?: string) {
    this.sessionId = sessionId ?? randomUUID();
  }

  /** Cancels the request in flight, then completes; a bad constraint throws first and cancels nothing. */
  complete(prefix: string, options: GenerateOptions = {}): Generation {
    const merged = { ...this.defaults, ...options, sessionId: this.sessionId };
    constraintToProto(merged.constraint);
    this.cancel();
    this.current = this.client.complete(prefix, merged);
    return this.current;
  }

  /** Cancels the request in flight, then fills in; a bad constraint throws first and cancels nothing. */
  infill(prefix: string, suffix: string, options: InfillOptions = {}): Generation {
    const merged = { ...this.defaults, ...options, sessionId: this.sessionId };
    constraintToProto(merged.constraint);
    this.cancel();
    this.current = this.client.infill(prefix, suffix, merged);
    return this.current;
  }

  /** Abort the request in flight, if any (for example on Escape). */
  cancel(): void {
    this.current?.cancel();
  }
}

export interface ConverseOptions {
  /** Reuse an id to resume that session's history (default: a new random id, also sent as `x-session-id`). */
  sessionId?: string;
  system?: string;
  /** Emit phrase events for text-to-speech (default true). */
  phraseMode?: boolean;
  sampling?: SamplingOptions;
  speculation?: SpeculationOptions;
  maxNewTokens?: number;
  stop?: string[];
  signal?: AbortSignal;
  /** A deadline for the whole stream (default none: sessions are long-lived). */
  timeoutMs?: number;
  /** Functions the replies may call: rendered through the model's chat template, or described in the system prompt
   * for a model whose template does not speak of tools. Calls come as toolCall events. */
  tools?: Tool[];
  /** How replies use the tools (default: "auto" with tools, "none" without). */
  toolChoice?: ToolChoice;
  /** Whether a reply may make several calls (default true). */
  parallelToolCalls?: boolean;
}

export interface TurnOptions {
  /** Who speaks ("user" when unset). */
  role?: TurnRole;
  sampling?: SamplingOptions;
  maxNewTokens?: number;
  speculation?: SpeculationOptions;
  /** What this reply must match; exclusive with tools in use (set toolChoice "none" beside it). */
  constraint?: Constraint;
  /** Functions this reply may call instead of the session's (when not empty); toolChoice then defaults to "auto". */
  tools?: Tool[];
  /** How this reply uses the tools, instead of the session's choice. */
  toolChoice?: ToolChoice;
  /** With role "tool": the id of the call (ToolCall.id) this turn's text is the result of. */
  toolCallId?: string;
}

type ConverseRequestInit = MessageInitShape<typeof ConverseRequestSchema>;

/** A Converse session: `send`/`say` turns, `toolResult`/`toolResults`, `cancel` (barge-in), `rewind`; `for await`
 * gives every event (chunks, phrases, tool calls, turn summaries, rewinds). Consume events either through the session
 * or through `say`/`toolResult`/`toolResults`, not both. */
export class Conversation implements AsyncIterable<ConverseEvent> {
  sessionId: string;
  /** Resolves once the server has opened the session. */
  readonly started: Promise<SessionStarted>;
  private readonly requests = new AsyncQueue<ConverseRequestInit>();
  private readonly events = new AsyncQueue<ConverseEvent>();
  private readonly rewinds: { resolve: (r: Rewound) => void; reject: (e: unknown) => void }[] = [];
  private readonly controller = new AbortController();
  private readonly pumping: Promise<void>;
  private closing = false;

  constructor(generator: Client<typeof Generator>, options: ConverseOptions, headers: Record<string, string>) {
    this.sessionId = options.sessionId ?? randomUUID();
    this.requests.push({
      action: {
        case: "start",
        value: {
          sessionId: this.sessionId,
          system: options.system ?? "",
          phraseMode: options.phraseMode ?? true,
          sampling: samplingToProto(options.sampling),
          speculation: speculationToProto(options.speculation),
          maxNewTokens: options.maxNewTokens ?? 0,
          stop: options.stop ?? [],
          tools: toolsToProto(options.tools, "tools"),
          toolChoice: toolChoiceToProto(options.toolChoice, "toolChoice"),
          parallelToolCalls: options.parallelToolCalls,
        },
      },
    });
    const signal = options.signal ? AbortSignal.any([options.signal, this.controller.signal])
      : this.controller.signal;
    // connect wants a full async generator (with throw/return) for the request stream.
    const requests = (async function* (queue: AsyncQueue<ConverseRequestInit>) {
      yield* queue;
    })(this.requests);
    const responses = generator.converse(requests, {
      signal, timeoutMs: options.timeoutMs, headers: { ...headers, ...sessionHeaders(this.sessionId) },
    });
    let resolveStarted!: (s: SessionStarted) => void;
    let rejectStarted!: (e: unknown) => void;
    this.started = new Promise((resolve, reject) => {
      resolveStarted = resolve;
      rejectStarted = reject;
    });
    this.started.catch(() => undefined); // awaited by callers; never an unhandled rejection
    this.pumping = this.pump(responses, resolveStarted, rejectStarted);
  }

  private async pump(responses: AsyncIterable<ConverseResponse>,
    resolveStarted: (s: SessionStarted) => void, rejectStarted: (e: unknown) => void): Promise<void> {
    try {
      for await (const res of responses) {
        const ev = res.event;
        switch (ev.case) {
          case "started":
            this.sessionId = ev.value.sessionId;
            resolveStarted({ type: "started", sessionId: ev.value.sessionId, resumed: ev.value.resumed,
              historyTokens: ev.value.historyTokens });
            break;
          case "chunk":
            this.events.push(chunkFrom(ev.value));
            break;
          case "phrase":
            this.events.push(phraseFrom(ev.value));
            break;
          case "toolCall":
            this.events.push(toolCallFrom(ev.value));
            break;
          case "summary":
            this.events.push(turnSummaryFrom(ev.value));
            break;
          case "rewound": {
            const r: Rewound = { type: "rewound", keptChars: ev.value.keptChars, keptTokens: ev.value.keptTokens,
              historyTokens: ev.value.historyTokens };
            this.rewinds.shift()?.resolve(r);
            this.events.push(r);
            break;
          }
        }
      }
      const ended = new ConnectError("the Converse stream ended", Code.Canceled);
      rejectStarted(ended);
      for (const w of this.rewinds.splice(0)) w.reject(ended);
      this.events.end();
    } catch (err) {
      rejectStarted(err);
      for (const w of this.rewinds.splice(0)) w.reject(err);
      if (this.closing && isAbort(err)) this.events.end();
      else this.events.fail(err);
    }
  }

  /** Send a turn (a reply still in flight is cancelled by the server first). Throws INVALID_ARGUMENT, sending
   * nothing, on a constraint without exactly one kind, a tool choice it does not know, or toolCallId without role
   * "tool". */
  send(text: string, options: TurnOptions = {}): void {
    this.sendTurn(text, options, []);
  }

  /** `send` with the results of several calls (Turn.tool_results; text and toolCallId then empty). */
  private sendTurn(text: string, options: TurnOptions, results: ToolResult[]): void {
    if (options.toolCallId && options.role !== "tool") {
      throw invalidArgument(`toolCallId goes with role "tool" (got role ${JSON.stringify(options.role ?? "user")})`);
    }
    const value = {
      text, role: options.role ?? "", sampling: samplingToProto(options.sampling),
      maxNewTokens: options.maxNewTokens ?? 0, speculation: speculationToProto(options.speculation),
      constraint: constraintToProto(options.constraint, "turn.constraint"),
      tools: toolsToProto(options.tools, "turn.tools"),
      toolChoice: toolChoiceToProto(options.toolChoice, "turn.toolChoice"),
      toolCallId: options.toolCallId ?? "",
      toolResults: results.map((r) => ({ toolCallId: r.callId, text: resultText(r.result) })),
    };
    this.requests.push({ action: { case: "turn", value } });
  }

  /** Send a turn and iterate its events up to and including its turn summary. */
  say(text: string, options: TurnOptions = {}): AsyncIterable<ConverseEvent> {
    this.send(text, options);
    return this.reply();
  }

  /** The events of the turn just sent, up to and including its turn summary. */
  private reply(): AsyncIterable<ConverseEvent> {
    const events = this.events;
    return {
      async *[Symbol.asyncIterator]() {
        for await (const ev of events) {
          yield ev;
          if (ev.type === "turnSummary") return;
        }
      },
    };
  }

  /** Send the result of tool call `callId` (a turn with role "tool"; an object is sent as its JSON text) and
   * iterate the reply's events up to and including its turn summary, as `say`. Send it once the calling reply's
   * turn summary has come (a turn cancels the reply in flight); for a reply's several calls, `toolResults`. */
  toolResult(callId: string, result: string | object,
    options: Omit<TurnOptions, "role" | "toolCallId"> = {}): AsyncIterable<ConverseEvent> {
    if (!callId) throw invalidArgument("toolResult needs the call's id (ToolCall.id)");
    return this.say(resultText(result), { ...options, role: "tool", toolCallId: callId });
  }

  /** Send the results of a reply's several calls in one turn (role "tool"; they enter the history in order, as
   * OpenAI's API takes them) and iterate the one reply's events up to and including its turn summary, as `say`.
   * Throws INVALID_ARGUMENT, sending nothing, on no results or a result without its call's id. */
  toolResults(results: ToolResult[],
    options: Omit<TurnOptions, "role" | "toolCallId"> = {}): AsyncIterable<ConverseEvent> {
    if (results.length === 0) throw invalidArgument("toolResults needs at least one result");
    const missing = results.findIndex((r) => !r.callId);
    if (missing >= 0) throw invalidArgument(`toolResults[${missing}] needs the call's id (ToolCall.id)`);
    this.sendTurn("", { ...options, role: "tool" }, results);
    return this.reply();
  }

  /** Barge-in: stop the reply in flight within one engine step (its turn summary says "cancelled"). */
  cancel(): void {
    this.requests.push({ action: { case: "cancel", value: {} } });
  }

  /** Keep only the first `spokenChars` characters (code points) of the last reply in the history. */
  rewind(spokenChars: number): Promise<Rewound> {
    const done = new Promise<Rewound>((resolve, reject) => this.rewinds.push({ resolve, reject }));
    this.requests.push({ action: { case: "rewind", value: { spokenChars, sessionId: this.sessionId } } });
    return done;
  }

  [Symbol.asyncIterator](): AsyncIterator<ConverseEvent> {
    return this.events[Symbol.asyncIterator]();
  }

  /** Cancel what is in flight and close the stream (the server keeps the session until its TTL). */
  async close(): Promise<void> {
    this.closing = true;
    this.cancel();
    this.requests.end();
    const timer = setTimeout(() => this.controller.abort(), 2000);
    await this.pumping;
    clearTimeout(timer);
  }
}

/** Typed client for specrpc.v1.Generator. Call `close()` when done (it closes the HTTP/2 connection). */
export class SpecrpcClient {
  readonly baseUrl: string;
  readonly timeoutMs: number | undefined;
  private readonly sessionManager: Http2SessionManager;
  private readonly generator: Client<typeof Generator>;
  private readonly healthClient: Client<typeof Health>;
  private readonly retry: Required<RetryOptions>;

  constructor(options: ClientOptions = {}) {
    const tls = typeof options.tls === "object" ? options.tls : undefined;
    const scheme = options.tls ? "https" : "http";
    this.baseUrl = options.baseUrl ?? `${scheme}://${options.address ?? "127.0.0.1:50051"}`;
    this.timeoutMs = options.timeoutMs;
    this.retry = options.retry === false ? { ...DEFAULT_RETRY, maxAttempts: 1 }
      : { ...DEFAULT_RETRY, ...options.retry };
    const nodeOptions = tls ? { ca: tls.ca, cert: tls.cert, key: tls.key, servername: tls.serverName } : {};
    this.sessionManager = new Http2SessionManager(this.baseUrl, { idleConnectionTimeoutMs: 60_000 }, nodeOptions);
    const interceptors: Interceptor[] = [...(options.interceptors ?? [])];
    const token = options.token;
    if (token) {
      interceptors.unshift((next) => async (req) => {
        req.header.set("authorization", `Bearer ${token}`);
        return await next(req);
      });
    }
    const transport = createGrpcTransport({ baseUrl: this.baseUrl, sessionManager: this.sessionManager, interceptors });
    this.generator = createClient(Generator, transport);
    this.healthClient = createClient(Health, transport);
  }


  /** Continue `prompt`: an async iterable of chunks, then one summary. A constraint without exactly one kind throws
   * INVALID_ARGUMENT here, before any call. */
  complete(prompt: string, options: GenerateOptions = {}): Generation {
    const request = {
      constraint: constraintToProto(options.constraint),
      prompt, maxNewTokens: options.maxNewTokens ?? 0, sampling: samplingToProto(options.sampling),
      stop: options.stop ?? [], speculation: speculationToProto(options.speculation),
      sessionId: options.sessionId ?? "", truncatePrompt: options.truncatePrompt ?? false, path: options.path ?? "",
      ...editorToProto(options),
    };
    const headers = sessionHeaders(options.sessionId);
    return new Generation((signal, timeoutMs) => this.generator.generate(request, { headers, timeoutMs, signal }),
      options.signal, this.retry, options.timeoutMs ?? this.timeoutMs);
  }

  /** Fill in the middle between prefix and suffix (extraFiles: other files as context; typedLine, repoName,
   * truncate and layout as InfillOptions says). A constraint without exactly one kind throws INVALID_ARGUMENT here,
   * before any call. */
  infill(prefix: string, suffix: string, options: InfillOptions = {}): Generation {
    const request = {
      constraint: constraintToProto(options.constraint),
      prefix, suffix, extra: options.extraFiles ?? [], path: options.path ?? "",
      maxNewTokens: options.maxNewTokens ?? 0, sampling: samplingToProto(options.sampling),
      stop: options.stop ?? [], speculation: speculationToProto(options.speculation), sessionId: options.sessionId ?? "",
      typedLine: options.typedLine ?? "", repoName: options.repoName ?? "", truncate: options.truncate ?? false,
      layout: fimLayoutToProto(options.layout),
      ...editorToProto(options),
    };
    const headers = sessionHeaders(options.sessionId);
    return new Generation((signal, timeoutMs) => this.generator.infill(request, { headers, timeoutMs, signal }),
      options.signal, this.retry, options.timeoutMs ?? this.timeoutMs);
  }

  /** An editor buffer's completion session (see CompletionSession). */
  completionSession(defaults: RequestOptions & ConstraintOptions = {}, sessionId?: string): CompletionSession {
    return new CompletionSession(this, defaults, sessionId);
  }

  /** Open a Converse session (await `started` to know it is open). */
  converse(options: ConverseOptions = {}): Conversation {
    return new Conversation(this.generator, options, {});
  }

  async modelInfo(options: { timeoutMs?: number; signal?: AbortSignal } = {}): Promise<ModelInfo> {
    const info = await this.generator.getModelInfo({}, { timeoutMs: options.timeoutMs ?? this.timeoutMs,
      signal: options.signal });
    return modelInfoFrom(info);
  }

  /** grpc.health.v1 status of `service` ("" = the whole server). */
  async health(service = "", timeoutMs = 5000): Promise<ServingStatus> {
    const res = await this.healthClient.check({ service }, { timeoutMs });
    return (HealthCheckResponse_ServingStatus[res.status] ?? "UNKNOWN") as ServingStatus;
  }

  /** Poll health until SERVING (connection errors count as not yet); rejects after `timeoutMs`. */
  async waitForServing(timeoutMs = 60_000, intervalMs = 200): Promise<void> {
    const until = performance.now() + timeoutMs;
    let last: unknown = "no answer";
    while (performance.now() < until) {
      try {
        const status = await this.health("", Math.max(1, Math.min(2000, until - performance.now())));
        if (status === "SERVING") return;
        last = status;
      } catch (err) {
        last = err;
      }
      await new Promise((r) => setTimeout(r, intervalMs));
    }
    throw new ConnectError(`${this.baseUrl} not SERVING within ${timeoutMs} ms (last: ${String(last)})`,
      Code.Unavailable);
  }

  /** Close the HTTP/2 connection (and any stream still open). */
  close(): void {
    this.sessionManager.abort();
  }
}
