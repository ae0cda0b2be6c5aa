"""`specrpc complete` and `specrpc chat`: the Python client on the command line.

Only argparse is imported at module level; the client loads when a command runs. Generated text goes to stdout,
the stats line (and errors) to stderr, so `specrpc complete ... > out.txt` keeps the text clean.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def _connection_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection")
    g.add_argument("--host", default="127.0.0.1", help="server host (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=50051, help="server port (default 50051)")
    g.add_argument("--timeout", type=float, default=None, help="deadline in seconds (default: none)")
    g.add_argument("--tls", action="store_true", help="use TLS (system roots unless --ca-cert)")
    g.add_argument("--ca-cert", type=Path, help="root certificates (PEM) to verify the server; implies --tls")
    g.add_argument("--client-cert", type=Path, help="client certificate (PEM) for mutual TLS")
    g.add_argument("--client-key", type=Path, help="client private key (PEM) for mutual TLS")
    g.add_argument("--server-name", help="name to verify in the server certificate (default: --host)")
    g.add_argument("--token", default=None,
                   help="bearer token (default: env SPECRPC_CLIENT_TOKEN; prefer --token-file, argv is visible)")
    g.add_argument("--token-file", type=Path, help="file holding the bearer token")


def _generation_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=0, help="most tokens to generate (0: server default)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=0.0, help="nucleus mass in (0, 1]; 0 or 1 = off")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    g.add_argument("--seed", type=int, default=None, help="seed for sampled output")
    g.add_argument("--num-draft-tokens", type=int, default=None,
                   help="draft tokens per step: unset = the server's adaptive policy, 0 = no speculation")
    g.add_argument("--proposer", choices=["draft", "lookup", "combined"], default=None,
                   help="draft proposer (default: the server's)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--session-id", default="", help="session id (reuses that session's KV cache)")


def _editor_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("editor")
    g.add_argument("--n-indent", type=int, default=0,
                   help="end before a new line indented less than N characters (0: off)")
    g.add_argument("--max-time-ms", type=int, default=0,
                   help="time budget from the first token; ends at the next newline once spent (0: off)")
    g.add_argument("--prefill-only", action="store_true",
                   help="only cache the prompt in the session (--session-id) and generate nothing")
    g.add_argument("--logprobs", action="store_true", help="print each token's log-probability to stderr")
    g.add_argument("--top-logprobs", type=int, default=0,
                   help="with --logprobs: also the N most likely tokens at each position (N <= 20)")
    g.add_argument("--prediction", type=Path, default=None, metavar="FILE",
                   help="the output as you predict it (for example the text being rewritten): a draft, verified "
                        "token by token; the stats count its accepted and rejected tokens")


def _constraint_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured output (one of)")
    one = g.add_mutually_exclusive_group()
    one.add_argument("--json-schema", type=Path, metavar="FILE",
                     help="a JSON Schema file: the output is JSON that validates against it")
    one.add_argument("--regex", metavar="PATTERN", help="a regular expression (Rust regex syntax) the whole output "
                                                         "matches")
    one.add_argument("--grammar", type=Path, metavar="FILE",
                     help="a grammar file (Lark, or llama.cpp's GBNF `root ::= ...`) the output matches")
    one.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument("--lenient", action="store_true",
                   help="with --json-schema: ignore keywords the server does not implement instead of refusing")


def _tool_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tools")
    g.add_argument("--tools", type=Path, metavar="FILE",
                   help="a JSON file: a list of functions the model may call, as OpenAI declares them "
                        '({"type": "function", "function": {...}}) or as {"name", "description", "parameters"}')
    g.add_argument("--tool-choice", default=None, metavar="auto|none|required|NAME",
                   help="for the turns you type: 'auto' (default with --tools), 'none', 'required', or the name of "
                        "the function to call; the replies to tool results use 'auto'")
    g.add_argument("--no-parallel-tool-calls", action="store_true", help="at most one call per reply")


CHAT_DESCRIPTION = """\
Chat over Converse: each stdin line is a turn, the reply streams back. Ctrl-C during a reply
cancels it (barge-in); '/rewind N' keeps N characters of the last reply; '/quit' or EOF ends.

With --tools, a call the model makes is printed on stdout as
  [tool call CALL_ID] NAME {"argument": ...}
and the next line you type (prompt 'CALL_ID> ') is its result, text or JSON. A reply with several
calls asks for each result in turn, then sends them all in one `tool` turn; the one reply to them
streams as usual and may call again."""


def add_commands(commands: Any) -> None:
    """Register `complete` and `chat` on an argparse subparsers object."""
    complete = commands.add_parser(
        "complete", help="stream a completion from a server",
        description="Stream the completion of PROMPT (or fill in the middle with --suffix) from a running server.")
    complete.add_argument("prompt", help="text to continue ('-' reads stdin)")
    complete.add_argument("--suffix", default=None, help="text after the cursor: use Infill (fill-in-the-middle)")
    complete.add_argument("--path", default="", help="path of the file the prompt belongs to (shown to the model)")
    fim = complete.add_argument_group("fill-in-the-middle (with --suffix)")
    fim.add_argument("--extra", action="append", default=[], type=Path, metavar="FILE",
                     help="a file given as repository context (repeatable; read from disk, its path as given)")
    fim.add_argument("--repo-name", default="", help="repository name, for families with a repository token")
    fim.add_argument("--truncate", action="store_true",
                     help="trim the prompt to fit the context (far ends first) instead of failing")
    fim.add_argument("--layout", choices=["auto", "psm", "spm", "typed_line"], default="auto",
                     help="prompt layout (default: the server's choice)")
    _connection_arguments(complete)
    _generation_arguments(complete)
    _editor_arguments(complete)
    _constraint_arguments(complete)
    complete.set_defaults(func=run_complete)

    chat = commands.add_parser("chat", help="interactive Converse session", description=CHAT_DESCRIPTION,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    chat.add_argument("--system", default="", help="system prompt")
    chat.add_argument("--phrases", action="store_true", help="print phrase events (text-to-speech chunks)")
    _tool_arguments(chat)
    _connection_arguments(chat)
    _generation_arguments(chat)
    chat.set_defaults(func=run_chat)


def _client(args: argparse.Namespace) -> Any:
    from specrpc_client import Client

    token = args.token or os.environ.get("SPECRPC_CLIENT_TOKEN") or None
    if args.token_file:
        token = args.token_file.read_text().strip()
    return Client(f"{args.host}:{args.port}", token=token, tls=args.tls, root_certificates=args.ca_cert,
                  client_cert=args.client_cert, client_key=args.client_key, server_name=args.server_name,
                  timeout=args.timeout)


def _request_options(args: argparse.Namespace) -> dict[str, Any]:
    from specrpc_client import Proposer, Sampling, Speculation

    speculation = None
    if args.num_draft_tokens is not None or args.proposer:
        speculation = Speculation(args.num_draft_tokens, Proposer.parse(args.proposer or ""))
    sampling = Sampling(args.temperature, args.top_p, args.top_k, args.seed)
    return {"max_new_tokens": args.max_new_tokens, "sampling": sampling, "stop": args.stop,
            "speculation": speculation}


def _constraint(args: argparse.Namespace) -> Any:
    """The Constraint the structured-output flags ask for, or None."""
    from specrpc_client import Constraint

    if args.json_schema is not None:
        return Constraint(json_schema=args.json_schema.read_text(), lenient=args.lenient)
    if args.lenient:
        raise ValueError("--lenient goes with --json-schema")
    if args.regex is not None:
        return Constraint(regex=args.regex)
    if args.grammar is not None:
        return Constraint(grammar=args.grammar.read_text())
    return Constraint(json_object=True) if args.json_object else None


def _tools(path: Path | None) -> list[Any]:
    """The declarations in a --tools file (a JSON list)."""
    from specrpc_client import Tool

    if path is None:
        return []
    declared = json.loads(path.read_text())
    if not isinstance(declared, list):
        raise ValueError(f"{path}: a list of function declarations is expected")
    return [Tool.parse(d) for d in declared]


def stats_line(summary: Any, ttft_ms: float | None, elapsed_s: float) -> str:
    """tokens, TTFT, tokens/s, acceptance rate (and why it ended) in one line."""
    spec = summary.speculation
    rate = f"{spec.acceptance_rate:.0%} ({spec.draft_tokens_accepted}/{spec.draft_tokens_proposed} drafted)" \
        if spec.draft_tokens_proposed else "n/a (no drafts)"
    ttft = summary.timing.ttft_ms if ttft_ms is None else ttft_ms
    tps = summary.completion_tokens / elapsed_s if elapsed_s > 0 else 0.0
    cached = f" · cached {summary.cached_prompt_tokens}" if summary.cached_prompt_tokens else ""
    trimmed = f" · trimmed {summary.trimmed_prompt_tokens} prompt tokens" if summary.trimmed_prompt_tokens else ""
    predicted = summary.accepted_prediction_tokens + summary.rejected_prediction_tokens
    prediction = f" · prediction {summary.accepted_prediction_tokens}/{predicted} used" if predicted else ""
    return (f"[{summary.completion_tokens} tokens · TTFT {ttft:.1f} ms · {tps:.1f} tokens/s · acceptance {rate} · "
            f"{summary.finish_reason.name.lower()}{cached}{trimmed}{prediction}]")


def logprob_lines(chunks: list[Any]) -> list[str]:
    """One line per token: its log-probability and text, then the alternatives asked for."""
    lines = []
    for chunk in chunks:
        for lp in chunk.logprobs:
            alternatives = "  ".join(f"{a.text!r} {a.logprob:.3f}" for a in lp.top_logprobs)
            lines.append(f"{lp.logprob:9.4f} {lp.text!r}" + (f"    [{alternatives}]" if alternatives else ""))
    return lines


def _fail(exc: BaseException) -> int:
    print(f"specrpc: {exc}", file=sys.stderr)
    return 1


def run_complete(args: argparse.Namespace) -> int:
    from specrpc_client import SpecrpcError

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    options = _request_options(args)
    try:
        options.update(n_indent=args.n_indent, max_time_ms=args.max_time_ms, prefill_only=args.prefill_only,
                       logprobs=args.logprobs, top_logprobs=args.top_logprobs,
                       prediction=args.prediction.read_text() if args.prediction is not None else "",
                       constraint=_constraint(args))
    except (OSError, ValueError) as exc:
        return _fail(exc)
    chunks = []
    try:
        with _client(args) as client:
            if args.suffix is None:
                gen = client.generate(prompt, session_id=args.session_id, path=args.path, **options)
            else:
                extra = [(str(f), f.read_text()) for f in args.extra]
                gen = client.infill(prompt, args.suffix, session_id=args.session_id, path=args.path,
                                    extra_files=extra, repo_name=args.repo_name, truncate=args.truncate,
                                    layout=args.layout, **options)
            try:
                for chunk in gen:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    chunks.append(chunk)
            except KeyboardInterrupt:
                gen.cancel()
                print("\n[cancelled]", file=sys.stderr)
                return 130
            sys.stdout.write("\n")
            if gen.summary is not None:
                elapsed = (gen.ended_at or gen.started_at) - gen.started_at
                print(stats_line(gen.summary, gen.ttft_ms, elapsed), file=sys.stderr)
            for line in logprob_lines(chunks):
                print(line, file=sys.stderr)
    except SpecrpcError as exc:
        return _fail(exc)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    import signal
    import threading
    import time

    from specrpc_client import Chunk, Phrase, SpecrpcError, ToolCall, TurnSummary

    options = _request_options(args)
    options.pop("stop")
    try:
        tools = _tools(args.tools)
    except (OSError, ValueError) as exc:
        return _fail(exc)
    interactive = sys.stdin.isatty()
    totals = {"turns": 0, "tokens": 0, "proposed": 0, "accepted": 0, "seconds": 0.0}

    def read_line(prompt: str) -> str | None:
        """The next stdin line without its newline; None at EOF or '/quit'."""
        if interactive:
            print(prompt, end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        return None if not line or line.strip() == "/quit" else line.rstrip("\n")

    def show(events: Any) -> list[ToolCall]:
        """Stream a reply's events (Ctrl-C meanwhile is a barge-in, not an exit); the calls it made."""
        started = time.perf_counter()
        first: float | None = None
        calls: list[ToolCall] = []
        previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
        if previous is not None:
            signal.signal(signal.SIGINT, lambda *_: conv.cancel())
        try:
            for event in events:
                if isinstance(event, Chunk):
                    if first is None and event.token_ids:
                        first = (time.perf_counter() - started) * 1e3
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                elif isinstance(event, Phrase):
                    print(f"\n  [phrase {event.start_char}-{event.end_char} at {event.time_ms:.0f} ms]",
                          file=sys.stderr)
                elif isinstance(event, ToolCall):
                    calls.append(event)
                    print(f"\n[tool call {event.id}] {event.name} {event.arguments}", flush=True)
                elif isinstance(event, TurnSummary):
                    elapsed = time.perf_counter() - started
                    g = event.generation
                    sys.stdout.write("\n")
                    print(stats_line(g, first, elapsed), file=sys.stderr)
                    totals["turns"] += 1
                    totals["tokens"] += g.completion_tokens
                    totals["proposed"] += g.speculation.draft_tokens_proposed
                    totals["accepted"] += g.speculation.draft_tokens_accepted
                    totals["seconds"] += elapsed
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        return calls

    try:
        with _client(args) as client, client.conversation(
                args.session_id or None, system=args.system, phrase_mode=args.phrases, stop=args.stop,
                tools=tools, tool_choice=args.tool_choice,
                parallel_tool_calls=False if args.no_parallel_tool_calls else None, **options) as conv:
            print(f"[session {conv.session_id}{' resumed' if conv.started and conv.started.resumed else ''}; "
                  f"/rewind N, /quit]", file=sys.stderr)
            while (text := read_line("> ")) is not None:
                if not text.strip():
                    continue
                if text.startswith("/rewind"):
                    parts = text.split()
                    try:
                        r = conv.rewind(int(parts[1]))
                    except (IndexError, ValueError):
                        print("usage: /rewind N", file=sys.stderr)
                        continue
                    print(f"[rewound: kept {r.kept_chars} chars, {r.kept_tokens} tokens; history "
                          f"{r.history_tokens} tokens]", file=sys.stderr)
                    continue
                calls = show(conv.say(text))
                while calls:  # each call's result is a line; a reply's results go in one tool turn, one reply
                    results = []
                    for call in calls:
                        result = read_line(f"{call.id}> ")
                        if result is None:
                            return _summarize(totals)
                        results.append((call, result))
                    calls = show(conv.tool_results(results, tool_choice="auto"))
    except KeyboardInterrupt:
        print(file=sys.stderr)
    except SpecrpcError as exc:
        return _fail(exc)
    return _summarize(totals)


def _summarize(totals: dict[str, Any]) -> int:
    """Print the session's totals (after at least one turn); the exit status, 0."""
    if totals["turns"]:
        rate = totals["accepted"] / totals["proposed"] if totals["proposed"] else 0.0
        tps = totals["tokens"] / totals["seconds"] if totals["seconds"] else 0.0
        print(f"[session: {totals['turns']} turns · {totals['tokens']} tokens · {tps:.1f} tokens/s · acceptance "
              f"{rate:.0%}]", file=sys.stderr)
    return 0
