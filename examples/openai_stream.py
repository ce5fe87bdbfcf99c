"""Stream a chat completion through tokenpipe with the official OpenAI SDK.

    TOKENPIPE_URL=http://127.0.0.1:8000/v1 python examples/openai_stream.py "Say hello"

The gateway speaks the OpenAI API, so the only change to an existing client is `base_url`.
`TOKENPIPE_API_KEY` is the gateway's key (any string when the gateway has no `auth`); the
upstream's own key stays in the gateway's environment. The `extra_body` stream option is a
tokenpipe extension: the gateway paces the stream to the rate the client can render.
"""

from __future__ import annotations

import os
import sys

from openai import OpenAI


def main() -> None:
    client = OpenAI(
        base_url=os.environ.get("TOKENPIPE_URL", "http://127.0.0.1:8000/v1"),
        api_key=os.environ.get("TOKENPIPE_API_KEY", "none"),
    )
    prompt = sys.argv[1] if len(sys.argv) > 1 else "Say hello"
    stream = client.chat.completions.create(
        model=os.environ.get("TOKENPIPE_MODEL", "sim-model"),
        messages=[{"role": "user", "content": prompt}],
        max_tokens=int(os.environ.get("TOKENPIPE_MAX_TOKENS", "64")),
        stream=True,
        # tokenpipe extension (optional): at most this many tokens per second to this client.
        extra_body={"stream_options": {"include_usage": True, "max_tokens_per_second": 200}},
    )
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                print(choice.delta.content, end="", flush=True)
        if chunk.usage:
            usage = chunk.usage
    print()
    if usage:
        print(
            f"[{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens]",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
