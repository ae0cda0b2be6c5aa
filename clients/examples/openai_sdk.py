"""The official `openai` SDK against `specrpc serve --http-port 8080`: configuration only, nothing specrpc-specific
beyond the base URL and (optionally) a session header that keeps a conversation on one KV slot.

    .venv/bin/specrpc serve --http-port 8080 &
    .venv/bin/python clients/examples/openai_sdk.py --base-url http://127.0.0.1:8080/v1
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    parser.add_argument("--api-key", default="unused", help="a token from --auth-tokens-file, when the server has one")
    parser.add_argument("--session", default="openai-sdk-demo", help="x-session-id: turns reuse this KV slot")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    session = {"x-session-id": args.session}
    messages = [{"role": "system", "content": "You answer in one short sentence."}]
    for question in ("Who are you?", "What can you do?"):
        messages.append({"role": "user", "content": question})
        reply = ""
        stream = client.chat.completions.create(model="specrpc", messages=messages, max_tokens=48,  # type: ignore[arg-type]
                                                stream=True, stream_options={"include_usage": True},
                                                extra_headers=session)
        for chunk in stream:
            if chunk.usage is not None:
                details = chunk.usage.prompt_tokens_details
                cached = details.cached_tokens if details is not None else 0
                print(f"\n  [prompt {chunk.usage.prompt_tokens} tokens, {cached} from the cache; "
                      f"{chunk.usage.completion_tokens} generated]")
            elif chunk.choices and chunk.choices[0].delta.content:
                reply += chunk.choices[0].delta.content
                print(chunk.choices[0].delta.content, end="", flush=True)
        messages.append({"role": "assistant", "content": reply})
    completion = client.completions.create(model="specrpc", prompt="def add(a, b):\n    return ",
                                           suffix="\n\nprint(add(1, 2))\n", max_tokens=16, temperature=0)
    print("fill-in-the-middle:", repr(completion.choices[0].text))


if __name__ == "__main__":
    main()
