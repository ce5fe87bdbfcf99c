"""One generation, run in the decode thread: prompt eval, then one token at a time into the
bounded hand-off. The loop is llama-cpp-python's lazy `generate()`: the next token is computed
only when we ask for it, so a blocked `put` (slow client) pauses the model itself, and a closed
hand-off (client gone) ends the generator, and with it the use of the model, after at most the
token being computed.
"""

from __future__ import annotations

import codecs
import random
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from tokenpipe.engines.local.handoff import PauseTimeout, TokenHandoff
from tokenpipe.engines.local.model import LoadedModel


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int
    #: Gemma 3's recommended sampling (temperature 1, top-k 64, top-p 0.95); 0 is greedy.
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 64
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    #: llama.cpp server's extension: keep going past end-of-turn (fixed output length, for
    #: benchmarks and tests).
    ignore_eos: bool = False


@dataclass(slots=True)
class Record:
    """One request, for the timing headers, /local/stats and metrics. Times are
    time.monotonic() seconds (comparable across processes on one machine)."""

    id: str
    kind: str
    client: str
    started: float
    prompt_tokens: int
    max_tokens: int
    outcome: str = "queued"  # queued | running | completed | cancelled | error
    queue_ms: float = 0.0
    #: llama.cpp's own prompt-eval and eval time (compute only: no queue, no pauses).
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    completion_tokens: int = 0
    #: When each output token was sampled. Bounded: at most max_tokens <= the context window.
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    ended: float | None = None
    handoff: TokenHandoff[Item] | None = None

    def _pause_now(self) -> float:
        """Seconds the current pause has lasted (0 while decoding). The decode thread may end
        the pause at any moment, so its start is read once."""
        since = self.handoff.paused_since if self.handoff is not None else None
        return time.monotonic() - since if since is not None else 0.0

    @property
    def paused_ms(self) -> float:
        total = self.handoff.paused_total if self.handoff is not None else 0.0
        return (total + self._pause_now()) * 1000

    @property
    def tokens_per_second(self) -> float:
        n = max(0, self.completion_tokens - 1)  # the first token is priced into prefill
        return n / (self.decode_ms / 1000) if self.decode_ms > 0 else 0.0

    def as_dict(self, with_times: bool = True) -> dict[str, object]:
        now = self._pause_now()
        out: dict[str, object] = {
            "id": self.id,
            "kind": self.kind,
            "client": self.client,
            "started": self.started,
            "ended": self.ended,
            "outcome": self.outcome,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "completion_tokens": self.completion_tokens,
            "queue_ms": round(self.queue_ms, 3),
            "prefill_ms": round(self.prefill_ms, 3),
            "decode_ms": round(self.decode_ms, 3),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "paused": now > 0,
            "paused_ms": round(self.paused_ms, 3),
            "paused_now_ms": round(now * 1000, 3),
        }
        if with_times:
            out["token_times"] = self.token_times
        return out


class Done(NamedTuple):
    finish_reason: str


class Failed(NamedTuple):
    message: str


#: What the hand-off carries: text pieces, then one Done or Failed.
Item = str | Done | Failed


class StopMatcher:
    """Cuts the output at the first stop string. Holds back the last len(longest stop) - 1
    characters, which could be the start of a stop string split across tokens."""

    __slots__ = ("_hold", "_pending", "_stops")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was hit)."""
        if not self._stops:
            return text, False
        buf = self._pending + text
        cut = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._pending = ""
            return buf[:cut], True
        keep = min(self._hold, len(buf))
        self._pending = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


def run(
    model: LoadedModel,
    prompt: list[int],
    params: SamplingParams,
    handoff: TokenHandoff[Item],
    rec: Record,
) -> None:
    """The decode thread's work for one request. Always ends the hand-off with Done or Failed."""
    rec.outcome = "running"
    llm = model.llm
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    stop = StopMatcher(params.stop)
    finish = "length"
    end: Item | None = None
    llm.set_seed(params.seed if params.seed is not None else random.getrandbits(31))
    model.perf_reset()
    tokens = None
    try:
        n = 0
        if params.max_tokens > 0:
            tokens = llm.generate(
                prompt,
                temp=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                min_p=params.min_p,
                presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty,
                reset=True,
            )
            for token in tokens:
                rec.token_times.append(time.monotonic())
                ended = model.is_end(token)
                if ended and not params.ignore_eos:
                    rec.token_times.pop()  # the end marker is not output
                    finish = "stop"
                    break
                n += 1
                rec.completion_tokens = n
                text, hit = stop.feed(utf8.decode(model.piece(token)))
                if text and not handoff.put(text):
                    rec.outcome = "cancelled"
                    break
                if hit:
                    finish = "stop"
                    break
                if n >= params.max_tokens:
                    break
                if handoff.closed:
                    rec.outcome = "cancelled"
                    break
        if rec.outcome != "cancelled":
            tail = stop.flush() + utf8.decode(b"", final=True)
            if tail and not handoff.put(tail):
                rec.outcome = "cancelled"
    except PauseTimeout as e:
        rec.outcome = "error"
        end = Failed(f"The stream was stopped: {e}.")
    except Exception as e:  # llama.cpp failures reach the client as a 500, not a dead thread
        rec.outcome = "error"
        end = Failed(f"The local model failed: {type(e).__name__}: {e}")
    finally:
        if tokens is not None:
            tokens.close()  # ends the generator's use of the model now, not at GC
        prefill_ms, decode_ms, _, _ = model.perf()
        rec.prefill_ms, rec.decode_ms = prefill_ms, decode_ms
        if rec.outcome == "running":
            rec.outcome = "completed"
            rec.finish_reason = finish
        rec.error = end.message if isinstance(end, Failed) else None
        rec.ended = time.monotonic()
        handoff.end(end if end is not None else Done(rec.finish_reason or finish))
