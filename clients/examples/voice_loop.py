"""A voice backend's loop: turns in, phrases out to text-to-speech, a barge-in, and a rewind to what was spoken.

    .venv/bin/python clients/examples/voice_loop.py --port 50051

Phrases go to `espeak-ng` when it is installed (one phrase at a time, while the next ones are generated); otherwise
they are printed, "spoken" at --chars-per-second. The barge-in turn is interrupted after its first phrase: the reply
is cancelled on the server and the history rewound to the characters actually spoken.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import time

from specrpc_client import AsyncClient, Phrase, Reply, VoiceSession

TURNS = ["Hello! Who are you?", "What can you help me with today?"]
BARGE_IN_TURN = "Tell me a long story about a lighthouse keeper."


class Speaker:
    """Speaks phrases in order; knows how many characters of the current reply were spoken."""

    def __init__(self, chars_per_second: float) -> None:
        self.espeak = shutil.which("espeak-ng")
        self.cps = chars_per_second
        self.spoken_chars = 0
        self.process: asyncio.subprocess.Process | None = None

    async def speak(self, phrase: Phrase) -> None:
        print(f"  🔊 [{phrase.received_ms:7.1f} ms] {phrase.text.strip()}")
        if self.espeak:
            self.process = await asyncio.create_subprocess_exec(self.espeak, phrase.text)
            await self.process.wait()
        else:
            await asyncio.sleep(len(phrase.text) / self.cps)
        self.spoken_chars = phrase.end_char

    def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()


async def speak_reply(reply: Reply, speaker: Speaker) -> None:
    speaker.spoken_chars = 0
    queue: asyncio.Queue[Phrase | None] = asyncio.Queue()

    async def play() -> None:
        while (phrase := await queue.get()) is not None:
            await speaker.speak(phrase)

    player = asyncio.create_task(play())
    async for phrase in reply:  # phrases arrive while earlier ones are being spoken
        queue.put_nowait(phrase)
    queue.put_nowait(None)
    await player


async def turn(voice: VoiceSession, text: str, speaker: Speaker) -> None:
    print(f"user: {text}")
    t0 = time.perf_counter()
    reply = voice.say(text)
    await speak_reply(reply, speaker)
    s = await reply.done()
    g = s.generation
    client_ms = reply.time_to_first_phrase_ms or 0.0
    print(f"  time to first phrase {s.time_to_first_phrase_ms:.1f} ms (server), {client_ms:.1f} ms (client); "
          f"{g.completion_tokens} tokens, acceptance {g.speculation.acceptance_rate:.0%}, "
          f"{(time.perf_counter() - t0):.2f} s with speech")


async def barge_in(voice: VoiceSession, text: str, speaker: Speaker) -> None:
    print(f"user: {text}")
    speaker.spoken_chars = 0
    reply = voice.say(text)
    async for phrase in reply:
        await speaker.speak(phrase)
        break  # the user starts talking during the first phrase
    speaker.stop()
    summary = await voice.barge_in()
    ended = summary.generation.finish_reason.name.lower() if summary else "already finished"
    print(f"  ✋ barge-in: reply {ended} after {len(reply.text)} characters; {speaker.spoken_chars} were spoken")
    rewound = await voice.rewind(speaker.spoken_chars)
    print(f"  ⏪ rewound: kept {rewound.kept_chars} characters ({rewound.kept_tokens} tokens); history "
          f"{rewound.history_tokens} tokens")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50051)
    ap.add_argument("--token", default=None, help="bearer token")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--chars-per-second", type=float, default=80.0, help="simulated speech rate without espeak-ng")
    args = ap.parse_args()

    speaker = Speaker(args.chars_per_second)
    print(f"speech: {speaker.espeak or 'printed (espeak-ng not installed)'}")
    async with AsyncClient(f"{args.host}:{args.port}", token=args.token) as client:
        await client.wait_ready()
        async with client.voice_session(system="You are a helpful voice assistant. Answer briefly.",
                                        max_new_tokens=args.max_new_tokens) as voice:
            print(f"session {voice.session_id}")
            for text in TURNS:
                await turn(voice, text, speaker)
            await barge_in(voice, BARGE_IN_TURN, speaker)
            await turn(voice, "Sorry, go on, but keep it short.", speaker)


if __name__ == "__main__":
    asyncio.run(main())
