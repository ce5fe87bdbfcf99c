"""Dialects: one small object per client/upstream API, asked what an event means.

The relay and the router never look inside an event themselves. They ask the dialect of the
request (`Dialect`, in `base.py`): read this SSE event into a `Piece` (is it content, and its
text for merging; usage; a finish; an error; the end of the stream), merge neighbouring
content pieces and write the merged event, say whether a cut stream can continue and build
the continuation request. OpenAI chat and completions (`openai.py`), Anthropic Messages
(`anthropic.py`, its request schema in `anthropic_schema.py`), the Responses API natively
(`responses.py`) and over chat (`responses_request.py`, `responses_chat.py`), embeddings
(`embeddings.py`), and the translations between chat and Messages (`chat_via_messages.py`,
`messages_via_chat.py`). A new API is new files here, not edits to `relay/` or `router/`. A
dialect that keeps per-stream state reads the relayed stream with an object of its own
(`Dialect.for_stream`).

Layer: below relay and router. May import only `sse`, `settings`, `errors` and `usage`.
"""

from tokenpipe.dialects.anthropic import COUNT_TOKENS, MESSAGES
from tokenpipe.dialects.base import Dialect, Piece
from tokenpipe.dialects.openai import CHAT, COMPLETIONS, chunk_has_content

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "COUNT_TOKENS",
    "MESSAGES",
    "Dialect",
    "Piece",
    "chunk_has_content",
]
