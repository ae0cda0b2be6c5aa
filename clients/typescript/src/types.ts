// Plain typed results and options: stable shapes for plugins, mapped from the generated protobuf-es messages.
import { create } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";

import {
  type Constraint as ConstraintMsg,
  ConstraintSchema,
  type GenerationSummary,
  type ModelInfo as ModelInfoMsg,
  type Phrase as PhraseMsg,
  type SamplingParams,
  SamplingParamsSchema,
  type SpeculationParams,
  SpeculationParamsSchema,
  type TokenChunk,
  type Tool as ToolMsg,
  type ToolCall as ToolCallMsg,
  type ToolChoice as ToolChoiceMsg,
  ToolChoiceMode,
  ToolChoiceSchema,
  ToolSchema,
  type TurnSummary as TurnSummaryMsg,
  FimLayout as FimLayoutEnum,
  FinishReason as FinishReasonEnum,
  Proposer as ProposerEnum,
} from "./gen/specrpc/v1/generator_pb.js";

/** Why generation ended. */
export type FinishReason = "unspecified" | "length" | "stop" | "cancelled" | "indent" | "time_limit";

/** How an infill prompt is laid out ("auto": the server's choice; "spm": suffix first; "typed_line": the current
 * line's text after the middle token; "psm": prefix, suffix, middle). */
export type FimLayout = "auto" | "psm" | "spm" | "typed_line";

/** Which proposer drafts tokens ("default": the server's). */
export type ProposerName = "default" | "draft" | "lookup" | "combined";

/** How tokens are chosen; all unset means greedy. */
export interface SamplingOptions {
  /** 0 = greedy. */
  temperature?: number;
  /** Nucleus mass in (0, 1]; 0 or 1 = off. */
  topP?: number;
  /** Keep the k most likely tokens; 0 = off. */
  topK?: number;
  /** Seed: the same seed and request give the same output. */
  seed?: number | bigint;
}

/** Per-request speculation: numDraftTokens unset = the server's adaptive policy, 0 = off. */
export interface SpeculationOptions {
  numDraftTokens?: number;
  proposer?: ProposerName;
}

/** Options every generation call takes. */
export interface RequestOptions {
  /** Most tokens to generate; 0 or unset = the server default. */
  maxNewTokens?: number;
  sampling?: SamplingOptions;
  /** Generation ends before the first occurrence of any of these (not emitted). */
  stop?: string[];
  speculation?: SpeculationOptions;
  /** Session: the server reuses its KV cache for the common prefix and cancels the request still in flight on it.
   * Sent as request metadata `x-session-id` too (for load balancers). */
  sessionId?: string;
  /** Abort the call (an editor aborts on every keystroke): the iteration then ends quietly. */
  signal?: AbortSignal;
  /** Deadline for this call in milliseconds (default: the client's timeoutMs). */
  timeoutMs?: number;
}

/** What editors ask a completion server for (as llama.cpp's `/infill`), on complete and infill. */
export interface EditorOptions {
  /** End before a new line indented less than this many characters (spaces and tabs count one); 0 = off. That line
   * is not emitted; the first line and blank lines are never judged. Finish reason "indent". At most 1024. */
  nIndent?: number;
  /** A time budget in milliseconds from the first token: once spent, generation ends at the next newline (emitted).
   * Finish reason "time_limit"; 0 = off; at most 600000. */
  maxTimeMs?: number;
  /** Only cache the prompt in the session's KV cache and generate nothing (for example when a file opens): the
   * reply is a summary alone. Leave maxNewTokens, stop, nIndent, maxTimeMs and logprobs unset with it. */
  prefillOnly?: boolean;
  /** Put each emitted token's log-probability (the target's log-softmax, before temperature) on its chunk. */
  logprobs?: boolean;
  /** With logprobs: also this many most likely tokens per position, 0..20. */
  topLogprobs?: number;
  /** How often at most, in milliseconds, the server hands this stream's tokens over, 0..1000: 0 = each verify step's
   * tokens at once (a client that times every token); unset = the server's --stream-interval-ms. */
  streamIntervalMs?: number;
}

/** A JSON Schema: an object (sent as its JSON text) or its JSON text. */
export type JsonSchema = Record<string, unknown> | string;

/** What a reply must match: exactly one of `jsonSchema`, `regex` (Rust `regex` syntax, matching the whole reply),
 * `grammar` (Lark, llguidance's dialect, or llama.cpp's GBNF `root ::= ...`) or `jsonObject: true` (any JSON object).
 * The server masks every token the grammar forbids, on the draft and the target alike, so speculation stays exact.
 * The reply ends with finish reason "stop" when the grammar is complete; one cut by maxNewTokens, a stop string or
 * an editor limit ends with that reason and may be incomplete. JSON comes laid out as `", "` and `": "`. A schema
 * or grammar that does not compile is INVALID_ARGUMENT naming the problem; giving none or several kinds is
 * INVALID_ARGUMENT from the client, before any call. Logprobs stay the target's raw ones, before the mask. */
export type Constraint =
  | { jsonSchema: JsonSchema; regex?: never; grammar?: never; jsonObject?: never;
    /** Ignore schema keywords the compiler does not implement instead of refusing the schema (OpenAI's
     * `strict: false`): the reply then matches what was implemented and may not validate in full. */
    lenient?: boolean; }
  | { regex: string; jsonSchema?: never; grammar?: never; jsonObject?: never; lenient?: never }
  | { grammar: string; jsonSchema?: never; regex?: never; jsonObject?: never; lenient?: never }
  | { jsonObject: true; jsonSchema?: never; regex?: never; grammar?: never; lenient?: never };

/** The output constraint complete and infill (and a Converse turn) take. */
export interface ConstraintOptions {
  /** What the output must match; unset: free text. */
  constraint?: Constraint;
}

export interface GenerateOptions extends RequestOptions, EditorOptions, ConstraintOptions {
  /** Keep the prompt's last tokens when it does not fit the context instead of failing. */
  truncatePrompt?: boolean;
  /** Path of the file the prompt opens: the model sees the prompt as the start of that file. */
  path?: string;
}

/** A file given to infill as context (for example an open tab). */
export interface ExtraFile {
  path: string;
  text: string;
}

export interface InfillOptions extends RequestOptions, EditorOptions, ConstraintOptions {
  extraFiles?: ExtraFile[];
  /** Path of the file being edited. */
  path?: string;
  /** The current line's text before the cursor, when sent apart from the prefix (llama.cpp's `/infill` `prompt`). */
  typedLine?: string;
  /** Repository name, for model families with a repository token. */
  repoName?: string;
  /** Trim the prompt to fit the context (far ends first, in coarse steps) instead of failing. */
  truncate?: boolean;
  /** Prompt layout; unset is the server's choice. */
  layout?: FimLayout;
}

/** One of the most likely tokens at a position. */
export interface TokenAlternative {
  tokenId: number;
  /** The token's text on its own (a character split across tokens shows as U+FFFD). */
  text: string;
  /** Natural log of its probability under the target. */
  logprob: number;
}

/** An emitted token's log-probability and the most likely tokens at its position, best first. */
export interface TokenLogprob extends TokenAlternative {
  topLogprobs: TokenAlternative[];
}

/** The tokens of one verify step and the text they complete (logprobs: one per token when asked for). */
export interface Chunk {
  type: "chunk";
  text: string;
  tokenIds: number[];
  acceptedDraftTokens: number;
  logprobs: TokenLogprob[];
}

export interface SpeculationStats {
  draftTokensProposed: number;
  draftTokensAccepted: number;
  verifySteps: number;
  meanAcceptedLength: number;
  numDraftTokens: number;
  acceptanceRate: number;
}

/** Server-side timings, milliseconds from the request's arrival. */
export interface Timing {
  ttftMs: number;
  totalMs: number;
  queueMs: number;
}

/** The last event of a generation. */
export interface Summary {
  type: "summary";
  finishReason: FinishReason;
  promptTokens: number;
  completionTokens: number;
  cachedPromptTokens: number;
  speculation: SpeculationStats;
  timing: Timing;
  sessionId: string;
  stopSequence: string;
  /** Infill with `truncate`: characters trimmed from the prefix's start and the suffix's end, extra files left out,
   * prompt tokens trimmed in all. */
  trimmedPrefixChars: number;
  trimmedSuffixChars: number;
  trimmedExtraFiles: number;
  trimmedPromptTokens: number;
  /** Infill: the layout the prompt was built in ("auto" for Generate and Converse). */
  fimLayout: FimLayout;
  /** Tokens of the session's context held in its KV cache when the request ended. */
  tokensCached: number;
  /** Draft tokens accepted from the session's last completion. */
  suggestionTokensAccepted: number;
}

export type GenerationEvent = Chunk | Summary;

/** A complete sentence or clause of a reply, for text-to-speech. Offsets are in Unicode code points. */
export interface Phrase {
  type: "phrase";
  text: string;
  startChar: number;
  endChar: number;
  /** Milliseconds from the turn's start (server clock). */
  timeMs: number;
}

/** A function a Converse reply may call. */
export interface Tool {
  /** 1 to 64 letters, digits, '_', '.' or '-'; distinct among the tools of a session or turn. */
  name: string;
  /** What it does, for the model. */
  description?: string;
  /** Its parameters as a JSON Schema object (or its JSON text); unset: none. A call's arguments are
   * grammar-constrained to it, so they parse and validate. */
  parameters?: JsonSchema;
  /** Refuse (INVALID_ARGUMENT) schema keywords the compiler does not implement instead of ignoring them. */
  strict?: boolean;
}

/** Whether and how a reply calls the tools: "auto" (text, or calls once the model writes its call marker; the
 * default with tools), "none" (text only; the tools stay in the prompt), "required" (calls only, at least one), or
 * `{ function: name }` (a call of that declared function only). */
export type ToolChoice = "auto" | "none" | "required" | { function: string };

/** Who speaks a Converse turn ("user" when unset); "tool" carries a call's result (with toolCallId). */
export type TurnRole = "user" | "assistant" | "system" | "tool";

/** The result of one call of a reply, for Conversation.toolResults. */
export interface ToolResult {
  /** The id of the call (ToolCall.id) this is the result of. */
  callId: string;
  /** The result: a string as given, anything else sent as its JSON text. */
  result: string | object;
}

/** A complete tool call of a reply (its text is not in the chunks or phrases). */
export interface ToolCall {
  type: "toolCall";
  /** The call's id (`call_…`): a tool-result turn names it (Conversation.toolResult). */
  id: string;
  /** The function called. */
  name: string;
  /** Its arguments: a JSON object as the model wrote it (it validates against the function's parameters unless
   * the reply was cut short). */
  argumentsJson: string;
  /** Its position among the reply's calls, from 0. */
  index: number;
}

/** The end of one reply. */
export interface TurnSummary {
  type: "turnSummary";
  turnIndex: number;
  generation: Summary;
  timeToFirstPhraseMs: number;
  /** The reply's text outside tool calls. */
  replyText: string;
  /** The reply's tool calls, as their toolCall events came, then a call the token limit or a stop string cut short
   * (as far as it was written, its arguments maybe not JSON; it has no event). */
  toolCalls: ToolCall[];
}

export interface SessionStarted {
  type: "started";
  sessionId: string;
  resumed: boolean;
  historyTokens: number;
}

export interface Rewound {
  type: "rewound";
  keptChars: number;
  keptTokens: number;
  historyTokens: number;
}

export type ConverseEvent = Chunk | Phrase | ToolCall | TurnSummary | Rewound;

export interface ModelDescription {
  name: string;
  architecture: string;
  parameters: number;
  vocabSize: number;
  weightBytes: number;
  contextLength: number;
  leanForward: boolean;
}

export interface ModelInfo {
  target: ModelDescription;
  draft?: ModelDescription;
  device: string;
  dtype: string;
  maxContext: number;
  speculationPolicy: { mode: string; maxDraftTokens: number; proposer: ProposerName };
  kvSlotsTotal: number;
  kvSlotsInUse: number;
  kvCacheBytes: number;
  supportsInfill: boolean;
  tokenizerVocabSize: number;
  /** The fill-in-the-middle template ("" without infill), the orders its model was trained with, and the layout
   * infill uses by default. */
  fimTemplate: string;
  fimOrders: string[];
  fimDefaultLayout: FimLayout;
}

// ---- conversions ------------------------------------------------------------------------------------------------

const FINISH: Record<number, FinishReason> = {
  [FinishReasonEnum.UNSPECIFIED]: "unspecified",
  [FinishReasonEnum.LENGTH]: "length",
  [FinishReasonEnum.STOP]: "stop",
  [FinishReasonEnum.CANCELLED]: "cancelled",
  [FinishReasonEnum.INDENT]: "indent",
  [FinishReasonEnum.TIME_LIMIT]: "time_limit",
};

const PROPOSER_TO: Record<ProposerName, ProposerEnum> = {
  default: ProposerEnum.UNSPECIFIED,
  draft: ProposerEnum.DRAFT_MODEL,
  lookup: ProposerEnum.PROMPT_LOOKUP,
  combined: ProposerEnum.COMBINED,
};

const FIM_LAYOUT_TO: Record<FimLayout, FimLayoutEnum> = {
  auto: FimLayoutEnum.UNSPECIFIED,
  psm: FimLayoutEnum.PSM,
  spm: FimLayoutEnum.SPM,
  typed_line: FimLayoutEnum.TYPED_LINE,
};

export function fimLayoutToProto(layout: FimLayout | undefined): FimLayoutEnum {
  return FIM_LAYOUT_TO[layout ?? "auto"];
}

function fimLayoutName(l: FimLayoutEnum): FimLayout {
  const found = (Object.keys(FIM_LAYOUT_TO) as FimLayout[]).find((k) => FIM_LAYOUT_TO[k] === l);
  return found ?? "auto";
}

function proposerName(p: ProposerEnum): ProposerName {
  const found = (Object.keys(PROPOSER_TO) as ProposerName[]).find((k) => PROPOSER_TO[k] === p);
  return found ?? "default";
}

export function samplingToProto(s: SamplingOptions | undefined): SamplingParams | undefined {
  if (s === undefined) return undefined;
  return create(SamplingParamsSchema, {
    temperature: s.temperature ?? 0,
    topP: s.topP ?? 0,
    topK: s.topK ?? 0,
    seed: s.seed === undefined ? undefined : BigInt(s.seed),
  });
}

export function speculationToProto(s: SpeculationOptions | undefined): SpeculationParams | undefined {
  if (s === undefined) return undefined;
  return create(SpeculationParamsSchema, {
    numDraftTokens: s.numDraftTokens,
    proposer: PROPOSER_TO[s.proposer ?? "default"],
  });
}

/** The request fields of EditorOptions (unset = off; an unset stream interval is left out: the server's). */
export function editorToProto(o: EditorOptions): {
  nIndent: number; maxTimeMs: number; prefillOnly: boolean; logprobs: boolean; topLogprobs: number;
  streamIntervalMs?: number;
} {
  return {
    nIndent: o.nIndent ?? 0, maxTimeMs: o.maxTimeMs ?? 0, prefillOnly: o.prefillOnly ?? false,
    logprobs: o.logprobs ?? false, topLogprobs: o.topLogprobs ?? 0,
    ...(o.streamIntervalMs === undefined ? {} : { streamIntervalMs: o.streamIntervalMs }),
  };
}

/** A request the client refuses before calling: INVALID_ARGUMENT, as the server would answer. */
export function invalidArgument(message: string): ConnectError {
  return new ConnectError(message, Code.InvalidArgument);
}

/** A JSON Schema as JSON text; `field` names it in errors. */
function schemaText(schema: unknown, field: string): string {
  if (typeof schema === "string") return schema;
  if (typeof schema !== "object" || schema === null || Array.isArray(schema)) {
    throw invalidArgument(`${field} must be a JSON Schema object or its JSON text`);
  }
  try {
    return JSON.stringify(schema);
  } catch (err) {
    throw invalidArgument(`${field} is not serialisable as JSON: ${String(err)}`);
  }
}

const CONSTRAINT_KINDS = ["jsonSchema", "regex", "grammar", "jsonObject"] as const;

/** The request's Constraint message (undefined when unset); exactly one kind, else INVALID_ARGUMENT naming
 * `field`. */
export function constraintToProto(c: Constraint | undefined, field = "constraint"): ConstraintMsg | undefined {
  if (c === undefined) return undefined;
  const fields = c as Record<string, unknown>;
  const given = CONSTRAINT_KINDS.filter((k) => fields[k] !== undefined);
  const kind = given[0];
  if (given.length !== 1 || kind === undefined) {
    throw invalidArgument(`${field}: give exactly one of jsonSchema, regex, grammar or jsonObject (got ${
      given.length === 0 ? "none" : given.join(", ")})`);
  }
  if (fields.lenient !== undefined && kind !== "jsonSchema") {
    throw invalidArgument(`${field}.lenient applies to jsonSchema only`);
  }
  const value = fields[kind];
  if (kind === "jsonObject") {
    if (value !== true) throw invalidArgument(`${field}.jsonObject must be true (leave ${field} unset for free text)`);
    return create(ConstraintSchema, { kind: { case: kind, value } });
  }
  if (kind === "jsonSchema") {
    return create(ConstraintSchema, {
      kind: { case: kind, value: schemaText(value, `${field}.jsonSchema`) }, lenient: fields.lenient === true,
    });
  }
  if (typeof value !== "string") throw invalidArgument(`${field}.${kind} must be a string`);
  return create(ConstraintSchema, { kind: { case: kind, value } });
}

/** Tool declarations as messages; `field` names them in errors. */
export function toolsToProto(tools: Tool[] | undefined, field: string): ToolMsg[] {
  return (tools ?? []).map((t, i) => create(ToolSchema, {
    name: t.name, description: t.description ?? "", strict: t.strict ?? false,
    parametersJson: t.parameters === undefined ? "" : schemaText(t.parameters, `${field}[${i}].parameters`),
  }));
}

const TOOL_CHOICE_MODES: Record<Exclude<ToolChoice, object>, ToolChoiceMode> = {
  auto: ToolChoiceMode.AUTO, none: ToolChoiceMode.NONE, required: ToolChoiceMode.REQUIRED,
};

/** A tool choice as its message (undefined when unset: the server's default); `field` names it in errors. */
export function toolChoiceToProto(choice: ToolChoice | undefined, field: string): ToolChoiceMsg | undefined {
  if (choice === undefined) return undefined;
  if (typeof choice === "object" && choice !== null && typeof choice.function === "string" && choice.function) {
    return create(ToolChoiceSchema, { function: choice.function });
  }
  const mode = typeof choice === "string" ? TOOL_CHOICE_MODES[choice as keyof typeof TOOL_CHOICE_MODES] : undefined;
  if (mode === undefined) {
    throw invalidArgument(`${field} must be "auto", "none", "required" or { function: name }; got ${
      JSON.stringify(choice)}`);
  }
  return create(ToolChoiceSchema, { mode });
}

export function toolCallFrom(c: ToolCallMsg): ToolCall {
  return { type: "toolCall", id: c.id, name: c.name, argumentsJson: c.argumentsJson, index: c.index };
}

export function chunkFrom(c: TokenChunk): Chunk {
  return {
    type: "chunk", text: c.text, tokenIds: [...c.tokenIds], acceptedDraftTokens: c.acceptedDraftTokens,
    logprobs: c.logprobs.map((lp) => ({
      tokenId: lp.tokenId, text: lp.text, logprob: lp.logprob,
      topLogprobs: lp.topLogprobs.map((a) => ({ tokenId: a.tokenId, text: a.text, logprob: a.logprob })),
    })),
  };
}

export function summaryFrom(s: GenerationSummary): Summary {
  const spec = s.speculation;
  return {
    type: "summary",
    finishReason: FINISH[s.finishReason] ?? "unspecified",
    promptTokens: s.promptTokens,
    completionTokens: s.completionTokens,
    cachedPromptTokens: s.cachedPromptTokens,
    speculation: {
      draftTokensProposed: Number(spec?.draftTokensProposed ?? 0),
      draftTokensAccepted: Number(spec?.draftTokensAccepted ?? 0),
      verifySteps: spec?.verifySteps ?? 0,
      meanAcceptedLength: spec?.meanAcceptedLength ?? 0,
      numDraftTokens: spec?.numDraftTokens ?? 0,
      acceptanceRate: spec?.acceptanceRate ?? 0,
    },
    timing: { ttftMs: s.timing?.ttftMs ?? 0, totalMs: s.timing?.totalMs ?? 0, queueMs: s.timing?.queueMs ?? 0 },
    sessionId: s.sessionId,
    stopSequence: s.stopSequence,
    trimmedPrefixChars: s.trimmedPrefixChars ?? 0,
    trimmedSuffixChars: s.trimmedSuffixChars ?? 0,
    trimmedExtraFiles: s.trimmedExtraFiles ?? 0,
    trimmedPromptTokens: s.trimmedPromptTokens ?? 0,
    fimLayout: fimLayoutName(s.fimLayout ?? FimLayoutEnum.UNSPECIFIED),
    tokensCached: s.tokensCached,
    suggestionTokensAccepted: s.suggestionTokensAccepted,
  };
}

export function phraseFrom(p: PhraseMsg): Phrase {
  return { type: "phrase", text: p.text, startChar: p.startChar, endChar: p.endChar, timeMs: p.timeMs };
}

export function turnSummaryFrom(t: TurnSummaryMsg): TurnSummary {
  return {
    type: "turnSummary",
    turnIndex: t.turnIndex,
    generation: t.generation ? summaryFrom(t.generation) : summaryFrom({} as GenerationSummary),
    timeToFirstPhraseMs: t.timeToFirstPhraseMs,
    replyText: t.replyText,
    toolCalls: t.toolCalls.map(toolCallFrom),
  };
}

function describe(m: NonNullable<ModelInfoMsg["target"]>): ModelDescription {
  return {
    name: m.name,
    architecture: m.architecture,
    parameters: Number(m.parameters),
    vocabSize: m.vocabSize,
    weightBytes: Number(m.weightBytes),
    contextLength: m.contextLength,
    leanForward: m.leanForward,
  };
}

export function modelInfoFrom(m: ModelInfoMsg): ModelInfo {
  const policy = m.speculationPolicy;
  return {
    target: m.target ? describe(m.target) : describe({} as NonNullable<ModelInfoMsg["target"]>),
    draft: m.draft ? describe(m.draft) : undefined,
    device: m.device,
    dtype: m.dtype,
    maxContext: m.maxContext,
    speculationPolicy: {
      mode: policy?.mode ?? "",
      maxDraftTokens: policy?.maxDraftTokens ?? 0,
      proposer: proposerName(policy?.proposer ?? ProposerEnum.UNSPECIFIED),
    },
    kvSlotsTotal: m.kvSlotsTotal,
    kvSlotsInUse: m.kvSlotsInUse,
    kvCacheBytes: Number(m.kvCacheBytes),
    supportsInfill: m.supportsInfill,
    tokenizerVocabSize: m.tokenizerVocabSize,
    fimTemplate: m.fimTemplate,
    fimOrders: [...m.fimOrders],
    fimDefaultLayout: fimLayoutName(m.fimDefaultLayout),
  };
}
