"""Stream two chat requests over one gRPC ChatStream (tokenpipe.v1.Chat), with flow control.

    python examples/grpc_client.py --target 127.0.0.1:50051 "Say hello" "Say goodbye"

Stubs come with the package (`tokenpipe.front.grpc_gen`, built from chat.proto); another
language generates its own from the same proto. Requests on one stream are independent: each
has its own id, its own FlowControl (credit in tokens, or a rate) and its own Done or Error.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator

import grpc

from tokenpipe.front.grpc_gen import chat_pb2 as pb
from tokenpipe.front.grpc_gen import chat_pb2_grpc as pb_grpc


async def run(target: str, prompts: list[str], model: str, max_tokens: int, key: str) -> int:
    texts = {f"req-{i}": "" for i in range(len(prompts))}
    open_ids = set(texts)
    finished = asyncio.Event()

    async def messages() -> AsyncIterator[pb.ClientMessage]:
        for rid, prompt in zip(texts, prompts, strict=True):
            # Optional: pace this request to what the client can render (tokens per second).
            yield pb.ClientMessage(flow=pb.FlowControl(request_id=rid, max_tokens_per_second=500))
            yield pb.ClientMessage(
                request=pb.ChatRequest(
                    request_id=rid,
                    model=model,
                    max_tokens=max_tokens,
                    messages=[pb.Message(role="user", content=prompt)],
                )
            )
        await finished.wait()  # keep the stream open until every request is done

    failed = 0
    metadata = (("authorization", f"Bearer {key}"),) if key else None
    async with grpc.aio.insecure_channel(target) as channel:
        call = pb_grpc.ChatStub(channel).ChatStream(messages(), metadata=metadata)
        async for msg in call:
            kind = msg.WhichOneof("kind")
            if kind == "delta":
                texts[msg.request_id] += msg.delta.content
            elif kind == "usage":
                print(f"[{msg.request_id}: {msg.usage.completion_tokens} tokens]", file=sys.stderr)
            elif kind in ("done", "error"):
                if kind == "error":
                    failed += 1
                    print(
                        f"[{msg.request_id}: error {msg.error.status}: {msg.error.message}]",
                        file=sys.stderr,
                    )
                open_ids.discard(msg.request_id)
                if not open_ids:
                    finished.set()
                    break
        call.cancel()
    for rid, text in texts.items():
        print(f"{rid}: {text}")
    return 1 if failed else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompts", nargs="*", default=["Say hello", "Say goodbye"])
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--model", default="sim-model")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--api-key", default="", help="the gateway's key, when it has auth")
    a = p.parse_args()
    sys.exit(asyncio.run(run(a.target, a.prompts, a.model, a.max_tokens, a.api_key)))


if __name__ == "__main__":
    main()
