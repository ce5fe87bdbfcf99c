"""What input that grows costs the gateway where a peer controls its shape: CPU seconds for
size n and 2n of each case, this tree and, with `--base-src`, another checkout's, side by
side in one run. Work that is linear in its input takes ~2x for 2n; ~4x means it is
quadratic, which a client or an upstream turns into seconds of a blocked event loop.

    python benchmarks/hostile_cost.py                          # ~10 s
    python benchmarks/hostile_cost.py --base-src ../base/src   # before/after, ~2 min
    python benchmarks/hostile_cost.py --case body              # the request bodies alone

The cases, each run in a child process of its target (PYTHONPATH=its src), rounds
interleaved, medians:
- `sse event`: one SSE event of n MiB from the upstream, in 1 KiB reads (sse.py);
- `tool calls`: one chat delta with n tool calls, to an Anthropic Messages client
  (dialects/messages_via_chat.py);
- `tool results`: a chat request of n consecutive tool messages, to an Anthropic upstream
  (dialects/messages_request.py);
- `responses text`: n characters of answer in 4-character deltas, to a Responses client
  on a chat upstream (dialects/responses_chat.py);
- `pool waiters`: n requests waiting for a full upstream pool's connection, then given up
  newest first, as clients that disconnect together (upstream/h1.py);
- `body: ...`: a chat request body of n bytes parsed and checked as the front does
  (dialects/openai_schema.py `parse`, in a heap settled as the gateway's: serving.settle_heap)
  whose one message's content is text, text parts (`{"type":"text","text":""}`) or empty
  objects (`{}`), or whose text message comes with an unread field of n bytes of `[]`. The
  same bytes cost up to ~30x more as small containers than as text: the shapes a client with
  a valid key can make the event loop parse.
- `event: READER, FIELD`: one upstream event of n bytes through a stream's reader
  (relay/events.py EventParser and the dialect), its bytes mostly `[]`s in one field: a
  field the reader does not read (`unread`), one it only tests or passes on (`logprobs`),
  or an object it reads whole (`usage`). READER: `chat`, `messages` and `responses` are the
  native readers; `messages via chat` and `responses via chat` translate a chat upstream's
  chunks, `chat via messages` an Anthropic upstream's events (dialects/event_json.py).
- `answer: READER, FIELD`: a non-streamed answer of n bytes that a translation reads whole
  (up to 4 MiB, front/answer.py), its bytes in an unread field or a tool call's input
  (Messages) or arguments (chat).
JSON in results/hostile_cost.json.
"""

from __future__ import annotations

import argparse
import statistics

from _common import ROOT, child_figure, src_dir, src_targets, write_json

#: (case, n): each is also run at 2n.
CASES = {
    "sse event": 1 << 20,
    "tool calls": 2000,
    "tool results": 10000,
    "responses text": 250_000,
    "pool waiters": 10_000,
    "body: text": 2 << 20,
    "body: text parts": 2 << 20,
    "body: {} parts": 2 << 20,
    "body: [] unread": 2 << 20,
    "event: chat, logprobs": 2 << 20,
    "event: chat, usage": 2 << 20,
    "event: messages, usage": 2 << 20,
    "event: responses, logprobs": 2 << 20,
    "event: messages via chat, unread": 2 << 20,
    "event: responses via chat, unread": 2 << 20,
    "event: chat via messages, unread": 2 << 20,
    "answer: messages via chat, unread": 2 << 20,
    "answer: responses via chat, unread": 2 << 20,
    "answer: chat via messages, unread": 2 << 20,
    "answer: messages via chat, tool": 2 << 20,
    "answer: chat via messages, tool": 2 << 20,
}

_CHILD = r"""
import json, sys, time
import orjson
from tokenpipe import sse
from tokenpipe.relay.events import EventParser
from tokenpipe.relay.tally import StreamTally

def chunk(delta):
    obj = {"id": "c", "object": "chat.completion.chunk", "model": "m",
           "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    return sse.encode(orjson.dumps(obj))

def parser(dialect):
    return EventParser(StreamTally("u", "m", 0.0), False, dialect)

def sse_event(n):
    data = b"data: " + b"a" * (n - 8) + b"\n\n"
    reads = [data[i : i + 1024] for i in range(0, len(data), 1024)]
    d = sse.SSEDecoder(max_event_bytes=n)
    t = time.process_time()
    events = [e for r in reads for e in d.feed(r)]
    assert len(events) == 1
    return time.process_time() - t

def tool_calls(n):
    from tokenpipe.dialects.messages_via_chat import MessagesViaChat
    req = {"model": "m", "max_tokens": 10, "stream": True,
           "messages": [{"role": "user", "content": "hi"}]}
    calls = [{"index": i, "id": f"c{i}", "type": "function",
              "function": {"name": "f", "arguments": "{}"}} for i in range(n)]
    body = chunk({"role": "assistant", "content": ""}) + chunk({"tool_calls": calls})
    p = parser(MessagesViaChat(req))
    t = time.process_time()
    assert p.feed(body)
    return time.process_time() - t

def tool_results(n):
    from tokenpipe.dialects.messages_request import messages_request
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
             for i in range(n)]
    chat = {"model": "m", "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": f"c{i}", "content": "r"} for i in range(n))]}
    t = time.process_time()
    out = messages_request(chat)
    assert len(out["messages"][2]["content"]) == n
    return time.process_time() - t

def responses_text(n):
    from tokenpipe.dialects.responses_chat import ResponsesViaChat
    p = parser(ResponsesViaChat({"model": "m", "input": "hi", "stream": True}).for_stream())
    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": "abcd"})] * (n // 4)
    t = time.process_time()
    for e in events:
        p.feed(e)
    return time.process_time() - t

def pool_waiters(n):
    import asyncio
    from yarl import URL
    from tokenpipe.upstream.h1 import Pool

    async def run():
        async def hold(reader, writer):
            await reader.read()
        server = await asyncio.start_server(hold, "127.0.0.1", 0)
        pool = Pool(URL(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"), limit=1,
                    connect_timeout=5.0)
        await pool._acquire()  # the only connection, held
        tasks = [asyncio.create_task(pool._acquire()) for _ in range(n)]
        await asyncio.sleep(0)  # each one runs to its wait
        t = time.process_time()
        for task in reversed(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        spent = time.process_time() - t
        pool.close()
        server.close()
        return spent
    return asyncio.run(run())

def body(shape, n):
    from tokenpipe import serving
    from tokenpipe.dialects import openai_schema
    from tokenpipe.errors import GatewayError

    head = b'{"model":"m","stream":true,"messages":[{"role":"user","content":'
    if shape == "text":
        data = head + b'"' + b"a " * (n // 2) + b'"}]}'
    elif shape == "[] unread":
        data = head + b'"hi"}],"x":[' + b",".join([b"[]"] * (n // 3)) + b"]}"
    else:
        part = b"{}" if shape == "{} parts" else b'{"type":"text","text":""}'
        data = head + b"[" + b",".join([part] * (n // (len(part) + 1))) + b"]}]}"
    serving.settle_heap()
    t = time.process_time()
    try:
        openai_schema.parse(data, openai_schema.ChatRequest)
    except GatewayError:  # refused: what it cost to find out is the figure
        pass
    return time.process_time() - t

def event(reader, where, n):
    from tokenpipe import serving
    from tokenpipe.dialects.anthropic import MESSAGES
    from tokenpipe.dialects.chat_via_messages import ChatViaMessages
    from tokenpipe.dialects.messages_via_chat import MessagesViaChat
    from tokenpipe.dialects.openai import CHAT
    from tokenpipe.dialects.responses import RESPONSES
    from tokenpipe.dialects.responses_chat import ResponsesViaChat

    junk = b"[" + b",".join([b"[]"] * (n // 3)) + b"]"
    req = {"model": "m", "max_tokens": 10, "stream": True,
           "messages": [{"role": "user", "content": "hi"}]}
    if reader in ("chat", "messages via chat", "responses via chat"):
        choice = b'{"index":0,"delta":{"content":"hi"},"finish_reason":null'
        if where == "logprobs":
            choice += b',"logprobs":{"content":' + junk + b"}"
        data = b'{"id":"c","model":"m","choices":[' + choice + b"}]"
        data += {"usage": b',"usage":{"prompt_tokens":1,"x":' + junk + b"}",
                 "unread": b',"x":' + junk}.get(where, b"") + b"}"
        body = b"data: " + data + b"\n\n"
    elif reader in ("messages", "chat via messages"):
        if where == "usage":
            data = b'{"type":"message_delta","delta":{},"usage":{"x":' + junk + b"}}"
            body = b"event: message_delta\ndata: " + data + b"\n\n"
        else:
            data = (b'{"type":"content_block_delta","index":0,'
                    b'"delta":{"type":"text_delta","text":"hi"},"x":' + junk + b"}")
            body = b"event: content_block_delta\ndata: " + data + b"\n\n"
    else:
        data = (b'{"type":"response.output_text.delta","output_index":0,"content_index":0,'
                b'"delta":"hi","logprobs":' + junk + b"}")
        body = b"event: response.output_text.delta\ndata: " + data + b"\n\n"
    dialect = {
        "chat": lambda: CHAT,
        "messages via chat": lambda: MessagesViaChat(req).for_stream(),
        "responses via chat":
            lambda: ResponsesViaChat({"model": "m", "input": "hi", "stream": True}).for_stream(),
        "messages": lambda: MESSAGES.for_stream(),
        "chat via messages": lambda: ChatViaMessages(req).for_stream(),
        "responses": lambda: RESPONSES.for_stream(),
    }[reader]()
    p = parser(dialect)
    serving.settle_heap()
    t = time.process_time()
    assert p.feed(body) and p.fault is None
    return time.process_time() - t

def answer(reader, where, n):
    from tokenpipe import serving
    from tokenpipe.dialects.chat_via_messages import ChatViaMessages
    from tokenpipe.dialects.messages_via_chat import MessagesViaChat
    from tokenpipe.dialects.responses_chat import ResponsesViaChat

    junk = b"[" + b",".join([b"[]"] * (n // 3)) + b"]"
    req = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    unread = b',"x":' + junk if where == "unread" else b""
    if reader == "chat via messages":
        tool = b'{"x":' + junk + b"}" if where == "tool" else b"{}"
        body = (b'{"id":"m","model":"m","content":[{"type":"text","text":"hi"},{"type":"tool_use",'
                b'"id":"t","name":"f","input":' + tool + b'}],"stop_reason":"tool_use",'
                b'"usage":{"input_tokens":1}' + unread + b"}")
        dialect = ChatViaMessages(req)
    else:
        args = orjson.dumps('{"x":' + junk.decode() + "}") if where == "tool" else b'"{}"'
        body = (b'{"id":"c","model":"m","choices":[{"index":0,"message":{"content":"hi",'
                b'"tool_calls":[{"id":"t","function":{"name":"f","arguments":' + args + b'}}]},'
                b'"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":1}' + unread + b"}")
        dialect = (MessagesViaChat(req) if reader == "messages via chat"
                   else ResponsesViaChat({"model": "m", "input": "hi"}))
    parse = getattr(dialect, "parse_answer", orjson.loads)  # (the tree before: orjson, whole)
    serving.settle_heap()
    t = time.process_time()
    dialect.answer(body, parse(body))
    return time.process_time() - t

case, n = sys.argv[1], int(sys.argv[2])
if case.startswith("answer: "):
    print(json.dumps(answer(*case[8:].split(", "), n)))
    sys.exit()
if case.startswith("body: "):
    print(json.dumps(body(case[6:], n)))
    sys.exit()
if case.startswith("event: "):
    print(json.dumps(event(*case[7:].split(", "), n)))
    sys.exit()
fn = {"sse event": sse_event, "tool calls": tool_calls, "tool results": tool_results,
      "responses text": responses_text, "pool waiters": pool_waiters}[case]
print(json.dumps(fn(n)))
"""


def _run(src: str, case: str, n: int) -> float:
    return child_figure(src, _CHILD, case, str(n))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--base-src", type=src_dir, help="src/ of another checkout, measured too")
    p.add_argument("--case", action="append", help="only the cases starting with this")
    p.add_argument("--json", default=str(ROOT / "results" / "hostile_cost.json"))
    args = p.parse_args()
    targets = src_targets(args.base_src)
    cases = {
        c: n for c, n in CASES.items() if not args.case or any(c.startswith(x) for x in args.case)
    }
    if not cases:
        p.error(f"no case starts with {args.case}; the cases: {', '.join(CASES)}")
    runs = [(t, c, m * n) for c, n in cases.items() for m in (1, 2) for t in targets]
    seconds: dict[tuple[str, str, int], list[float]] = {r: [] for r in runs}
    for i in range(args.rounds):
        print(f"  round {i + 1}/{args.rounds}", flush=True)
        for target, case, n in runs:
            seconds[(target, case, n)].append(_run(targets[target], case, n))
    med = {r: statistics.median(v) for r, v in seconds.items()}
    print("\nCPU seconds for n and 2n (median), and their ratio (2: linear, 4: quadratic)")
    w = max(16, *(len(c) + 1 for c in cases))  # the event cases' names run to 34
    print(f"{'case':<{w}}{'n':>9} {'target':<10}{'n':>7}{'2n':>7}{'2n/n':>6}")
    rows = []
    for case, n in cases.items():
        for target in targets:
            one, two = med[(target, case, n)], med[(target, case, 2 * n)]
            ratio = two / one if one > 0 else float("nan")
            print(f"{case:<{w}}{n:>9} {target:<10}{one:>7.3f}{two:>7.3f}{ratio:>6.1f}")
            rows.append({"case": case, "n": n, "target": target, "n_s": one, "2n_s": two})
    write_json(args.json, "hostile_cost", args, rows=rows)


if __name__ == "__main__":
    main()
