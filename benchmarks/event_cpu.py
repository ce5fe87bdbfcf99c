"""What one upstream event costs each stream reader, in the gateway's own code: the relay's
EventParser (SSE framing, the dialect's read, the books) fed a typical text delta of each
API, natively and translated, for this tree and, with `--base-src`, another checkout's, side
by side. The per-token part of a stream's CPU that is the gateway's own Python, without the
sockets and the event loop around it (relay_cost.py times those too, for chat alone).

    python benchmarks/event_cpu.py                           # ~20 s
    python benchmarks/event_cpu.py --base-src ../base/src    # before/after, ~40 s

Each target runs in child processes (PYTHONPATH=its src), `--rounds` rounds interleaved, each
feeding `--events` events to a fresh stream's reader after its opening events; the figure is
the median round's us an event. The readers: `chat` (an OpenAI chunk passed through, its
`"usage":null` cut: the gateway asked for the usage, the client did not),
`messages` and `responses` (their native events), `messages via chat` and `responses via
chat` (a chat upstream's chunks written as the client's API), `chat via messages` (an
Anthropic upstream's events written as chat chunks). JSON in results/event_cpu.json.
"""

from __future__ import annotations

import argparse
import statistics

from _common import ROOT, child_figure, src_dir, src_targets, write_json

READERS = (
    "chat",
    "messages",
    "responses",
    "messages via chat",
    "responses via chat",
    "chat via messages",
)

_CHILD = r"""
import json, sys, time
from tokenpipe.relay.events import EventParser
from tokenpipe.relay.tally import StreamTally

reader, n = sys.argv[1], int(sys.argv[2])
req = {"model": "m", "max_tokens": 10, "stream": True,
       "messages": [{"role": "user", "content": "hi"}]}
CHAT = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1694268190,'
        b'"model":"gpt-4o-mini","system_fingerprint":"fp_1","choices":[{"index":0,'
        b'"delta":{"content":" Hello"},"logprobs":null,"finish_reason":null}],'
        b'"usage":null}\n\n')
ROLE = b'data: {"id":"c","model":"m","choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
ANTHROPIC = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
             b'"delta":{"type":"text_delta","text":" Hello"}}\n\n')
START = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"m",'
         b'"model":"m","usage":{"input_tokens":1}}}\n\n')
RESPONSES = (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
             b'"item_id":"msg_1","output_index":0,"content_index":0,"delta":" Hello",'
             b'"logprobs":[],"sequence_number":5}\n\n')
if reader in ("chat", "messages via chat", "responses via chat"):
    event, opening = CHAT, ROLE
elif reader in ("messages", "chat via messages"):
    event, opening = ANTHROPIC, START
else:
    event, opening = RESPONSES, b""

def dialect():
    if reader == "chat":
        from tokenpipe.dialects.openai import CHAT as d
        return d
    if reader == "messages":
        from tokenpipe.dialects.anthropic import MESSAGES
        return MESSAGES.for_stream()
    if reader == "responses":
        from tokenpipe.dialects.responses import RESPONSES as d
        return d.for_stream()
    if reader == "messages via chat":
        from tokenpipe.dialects.messages_via_chat import MessagesViaChat
        return MessagesViaChat(req).for_stream()
    if reader == "responses via chat":
        from tokenpipe.dialects.responses_chat import ResponsesViaChat
        return ResponsesViaChat({"model": "m", "input": "hi", "stream": True}).for_stream()
    from tokenpipe.dialects.chat_via_messages import ChatViaMessages
    return ChatViaMessages(req).for_stream()

# The gateway asks a chat upstream for the usage the client did not ask for (every chunk then
# says `"usage":null`), and takes it out of what it passes on.
parser = EventParser(StreamTally("u", "m", 0.0), event is CHAT, dialect())
parser.feed(opening)
feed = parser.feed
t = time.process_time()
for _ in range(n):
    assert feed(event)
print(json.dumps((time.process_time() - t) / n * 1e6))
"""


def _run(src: str, reader: str, events: int) -> float:
    return child_figure(src, _CHILD, reader, str(events))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--events", type=int, default=20_000, help="events a round (default 20,000)")
    p.add_argument("--base-src", type=src_dir, help="src/ of another checkout, measured too")
    p.add_argument("--json", default=str(ROOT / "results" / "event_cpu.json"))
    args = p.parse_args()
    targets = src_targets(args.base_src)
    us: dict[tuple[str, str], list[float]] = {(t, r): [] for t in targets for r in READERS}
    for i in range(args.rounds):
        print(f"  round {i + 1}/{args.rounds}", flush=True)
        for reader in READERS:
            for target, src in targets.items():
                us[(target, reader)].append(_run(src, reader, args.events))
    print("\nus of CPU an event (median of the rounds, their range)")
    print(f"{'reader':<20}" + "".join(f"{t:>22}" for t in targets))
    rows = []
    for reader in READERS:
        cells = ""
        for target in targets:
            v = us[(target, reader)]
            cells += f"{statistics.median(v):>10.2f} ({min(v):.2f}-{max(v):.2f})"
            rows.append({"reader": reader, "target": target, "us": v})
        print(f"{reader:<20}{cells}")
    write_json(args.json, "event_cpu", args, rows=rows)


if __name__ == "__main__":
    main()
