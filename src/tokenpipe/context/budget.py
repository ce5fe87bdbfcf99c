"""The context hop of the gateway: keeps each request inside its model's context window.

`ContextBudget.apply` runs once per request, after parsing and before routing. It counts the
prompt, and when the request would not fit it lowers `max_tokens`, compresses the history
(truncate or summarize) or answers 400 itself; it never alters a request that fits.
`ContextOutcome.observe` feeds the upstream's `usage` back into the token estimator.

Per request, the header `x-tokenpipe-context-policy: off|truncate|summarize` overrides the
configured policy. What was done is reported in response headers (`x-tokenpipe-max-tokens`,
`x-tokenpipe-context`) and metrics (`tokenpipe_context_*`).

This module applies the decisions of `plan`; each model's window and token counter come from
`lookup`, and the summarize policy's call is `summarizer`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from tokenpipe.context import plan, summary, tokens
from tokenpipe.context.lookup import ModelLookup
from tokenpipe.context.summarizer import Summarizer
from tokenpipe.control.deadline import UNBOUNDED, Scope
from tokenpipe.control.traffic import Ticket
from tokenpipe.dialects import openai_schema as schema
from tokenpipe.errors import GatewayError, dumps_request
from tokenpipe.observe import metrics, tracing
from tokenpipe.router.policy import Policy
from tokenpipe.settings import ContextSettings

POLICY_HEADER = "x-tokenpipe-context-policy"
MAX_TOKENS_HEADER = "x-tokenpipe-max-tokens"
REPORT_HEADER = "x-tokenpipe-context"
POLICIES = ("off", "truncate", "summarize")
#: compress_target of the summarize policy when the config leaves it unset.
SUMMARIZE_TARGET = 0.7


class ContextOutcome:
    """What `apply` did: the new body (None: unchanged), headers for the client, calibration."""

    __slots__ = ("_calibrate", "body", "headers")

    def __init__(
        self,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        calibrate: tuple[tokens.Estimator, int, int] | None = None,
    ) -> None:
        self.body = body
        self.headers = headers or {}
        self._calibrate = calibrate

    def observe(self, usage: Mapping[str, Any] | None) -> None:
        """The upstream's usage for this request: teaches the estimator the model's ratio."""
        if self._calibrate is None or not usage:
            return
        prompt_tokens = usage.get("prompt_tokens")
        if isinstance(prompt_tokens, int):
            estimator, chars, overhead = self._calibrate
            estimator.observe(chars, overhead, prompt_tokens)


UNCHANGED = ContextOutcome()


class ContextBudget:
    def __init__(
        self,
        settings: ContextSettings,
        policy: Policy,
        tickets: Callable[[dict[str, Any]], Ticket] | None = None,
    ) -> None:
        self.settings = settings
        self.lookup = ModelLookup({m.name: m for m in settings.models}, policy.router)
        #: Summaries by history-prefix hash: the summarizer writes them, `_sticky_cut` reuses them.
        self.cache = summary.SummaryCache(settings.summary_cache_entries)
        #: Where truncation cut recent histories (prefix hashes), to cut there again.
        self.cuts = summary.SummaryCache(settings.summary_cache_entries)
        self.summarizer = Summarizer(settings, policy, self.lookup, self.cache, tickets)

    def policy(self, model: str, headers: Mapping[str, str]) -> str:
        asked = headers.get(POLICY_HEADER)
        if asked is not None:
            if asked not in POLICIES:
                raise GatewayError(
                    400,
                    f"{POLICY_HEADER} must be one of {', '.join(POLICIES)}.",
                    param=POLICY_HEADER,
                    code="invalid_request",
                )
            return asked
        cfg = self.lookup.models.get(model)
        return (cfg.policy if cfg and cfg.policy else None) or self.settings.policy

    async def apply(
        self,
        kind: type[Any],
        req: Any,
        obj: dict[str, Any],
        headers: Mapping[str, str],
        scope: Scope = UNBOUNDED,
        trace: tracing.RequestTrace = tracing.OFF,
    ) -> ContextOutcome:
        """Fits `obj` (the request as sent, changed in place) into the model's window; a
        summary call waits within the request's `scope`. Traced: a `context` span, with the
        summary call's span below it."""
        if not trace.on:
            return await self._apply(kind, req, obj, headers, scope, trace)
        with trace.step("context") as span:
            out = await self._apply(kind, req, obj, headers, scope, trace.under(span))
            span.set("tokenpipe.context.report", out.headers.get(REPORT_HEADER, "unchanged"))
            return out

    async def _apply(
        self,
        kind: type[Any],
        req: Any,
        obj: dict[str, Any],
        headers: Mapping[str, str],
        scope: Scope,
        trace: tracing.RequestTrace,
    ) -> ContextOutcome:
        if kind is not schema.ChatRequest and kind is not schema.CompletionRequest:
            return UNCHANGED  # budgeted only for chat and text completions (so far)
        policy = self.policy(req.model, headers)
        if policy == "off":
            return UNCHANGED
        window = await self.lookup.window(req.model)
        if window is None:
            return UNCHANGED
        counter = await self.lookup.counter(req.model)
        if kind is schema.ChatRequest:
            return await self._chat(req, obj, counter, window, policy, scope, trace)
        return self._text(req, obj, counter, window)

    def _limits(
        self, window: int, counter: tokens.TokenCounter, prompt: int, policy: str = "truncate"
    ) -> plan.Limits:
        s = self.settings
        target = s.compress_target
        if target is None:  # a summary is a call: cut deeper so it serves several turns
            target = SUMMARIZE_TARGET if policy == "summarize" else 1.0
        margin = s.margin_tokens
        if not counter.exact:
            margin += math.ceil(s.estimate_margin * prompt)
        return plan.Limits(
            window=window,
            margin=margin,
            reserve_output=s.reserve_output_tokens,
            min_output=s.min_output_tokens,
            compress_target=target,
        )

    def _text(
        self, req: Any, obj: dict[str, Any], counter: tokens.TokenCounter, window: int
    ) -> ContextOutcome:
        p = obj.get("prompt")
        if isinstance(p, str):
            prompt, chars = counter.count(p), len(p)
        elif isinstance(p, list) and all(isinstance(t, int) for t in p):
            prompt, chars = len(p), 0  # token ids: exact whatever the counter
        else:
            return UNCHANGED  # a batch of prompts: each fits or fails on its own
        calibrate = self._calibration(counter, chars, 0)
        d = plan.decide_text(prompt, req.max_tokens, self._limits(window, counter, prompt))
        if d.action == "fits":
            return ContextOutcome(calibrate=calibrate)
        if d.action == "reject":
            raise _too_long(window, prompt)
        obj["max_tokens"] = d.max_tokens
        metrics.CONTEXT_MAX_TOKENS_LOWERED.inc()
        return ContextOutcome(dumps_request(obj), {MAX_TOKENS_HEADER: str(d.max_tokens)}, calibrate)

    @staticmethod
    def _calibration(
        counter: tokens.TokenCounter, chars: int, overhead: int
    ) -> tuple[tokens.Estimator, int, int] | None:
        return (counter, chars, overhead) if isinstance(counter, tokens.Estimator) else None

    async def _chat(
        self,
        req: Any,
        obj: dict[str, Any],
        counter: tokens.TokenCounter,
        window: int,
        policy: str,
        scope: Scope,
        trace: tracing.RequestTrace,
    ) -> ContextOutcome:
        messages: list[dict[str, Any]] = obj["messages"]
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens or req.max_tokens
        # Tool definitions are rendered into the prompt too; their JSON approximates them.
        tools = obj.get("tools") or obj.get("functions")
        tools_json = dumps_request(tools) if tools else b""
        texts = tokens.message_texts(messages)  # (once: each pass ~0.2 us a message)
        # Fast paths: most requests are far below the window, and a bound of their tokens,
        # drawn without a call a message, says so.
        want = max_tokens if max_tokens is not None else self.settings.reserve_output_tokens
        if counter.exact:  # bytes bound the tokens
            upper = tokens.upper_bound(counter, messages, texts) + len(tools_json)  # (UTF-8)
            if upper + want + self.settings.margin_tokens <= window:
                return UNCHANGED
        tools_text = tools_json.decode()  # (here: most requests fit, and need only its size)
        chars = sum(map(len, texts)) + len(tools_text)
        calibrate = self._calibration(
            counter, chars, counter.chat.per_message * len(messages) + counter.chat.reply
        )
        # Tokens per request outside the messages: the reply's opening and the tools.
        tools = counter.count(tools_text) if tools_text else 0
        if isinstance(counter, tokens.Estimator):  # the estimate's own bound
            upper = counter.upper_bound(messages, texts) + tools
            if window - self._limits(window, counter, upper, policy).margin - upper >= want:
                return ContextOutcome(calibrate=calibrate)  # as plan.decide's "fits" below
        costs = await tokens.count_messages_off_loop(counter, messages, texts)
        reply = counter.chat.reply + tools
        prompt = sum(costs) + reply
        limits = self._limits(window, counter, prompt, policy)
        extra = 0
        if policy == "summarize":
            extra = (
                self.settings.summary_max_tokens
                + counter.chat.per_message
                + counter.count(summary.SUMMARY_PREFIX)
            )
        d = plan.decide(messages, costs, reply, max_tokens, limits, extra=extra)
        out_headers: dict[str, str] = {}
        if d.action == "fits":
            return ContextOutcome(calibrate=calibrate)
        if d.action == "reject":
            raise _too_long(window, d.prompt_tokens)
        if d.action == "lower":
            obj[field] = d.max_tokens
            metrics.CONTEXT_MAX_TOKENS_LOWERED.inc()
            return ContextOutcome(
                dumps_request(obj), {MAX_TOKENS_HEADER: str(d.max_tokens)}, calibrate
            )

        want = max_tokens if max_tokens is not None else limits.reserve_output
        keep_from = self._sticky_cut(
            policy, messages, costs, reply, limits, want, counter, d.keep_from
        )
        system, older, kept = plan.split(messages, keep_from)
        done = "truncate"
        note = ""
        new_messages = [*system, *kept]
        if policy == "summarize":
            text, note = await self.summarizer.summarize(req.model, messages, older, scope, trace)
            if text is not None:
                done = "summarize"
                at = next(
                    (i for i, m in enumerate(messages) if m.get("role") not in plan.KEPT_ROLES), 0
                )  # after the leading system messages
                lead = messages[:at]  # all system/developer messages
                rest = [m for m in messages[at:] if m.get("role") in plan.KEPT_ROLES]
                note_msg = {"role": "system", "content": summary.SUMMARY_PREFIX + text}
                new_messages = [*lead, note_msg, *rest, *kept]
        elif policy == "truncate":
            self.cuts.put(self._cut_key(messages, keep_from), "")
        new_prompt = sum(await tokens.count_messages_off_loop(counter, new_messages)) + reply
        room = window - limits.margin - new_prompt
        if done == "summarize" and room < min(want, limits.min_output):
            # A summary longer than asked for (or counted longer): send the cut without it.
            done, note = "truncate", "too-long"
            new_messages = [*system, *kept]
            new_prompt = sum(await tokens.count_messages_off_loop(counter, new_messages)) + reply
            room = window - limits.margin - new_prompt
        if room < min(want, limits.min_output):
            raise _too_long(window, new_prompt)
        obj["messages"] = new_messages
        # The upstream will report the tokens of what is sent now, not of what arrived.
        calibrate = self._calibration(
            counter,
            sum(map(len, tokens.message_texts(new_messages))) + len(tools_text),
            counter.chat.per_message * len(new_messages) + counter.chat.reply,
        )
        if room < want:
            obj[field] = room
            out_headers[MAX_TOKENS_HEADER] = str(room)
            metrics.CONTEXT_MAX_TOKENS_LOWERED.inc()
        report = (
            f"policy={done}; dropped_messages={len(older)}; prompt_tokens={prompt}->{new_prompt}"
        )
        out_headers[REPORT_HEADER] = report + (f"; summary={note}" if note else "")
        _count(done, max(0, prompt - new_prompt))
        return ContextOutcome(dumps_request(obj), out_headers, calibrate)

    @staticmethod
    def _cut_key(messages: list[dict[str, Any]], keep_from: int) -> bytes:
        older = [m for m in messages[:keep_from] if m.get("role") not in plan.KEPT_ROLES]
        return summary.prefix_hashes(older)[-1]

    def _sticky_cut(
        self,
        policy: str,
        messages: list[dict[str, Any]],
        costs: list[int],
        reply: int,
        limits: plan.Limits,
        want: int,
        counter: tokens.TokenCounter,
        planned: int,
    ) -> int:
        """The earliest cut an earlier turn made that still fits, else `planned`.

        (It may keep less than `planned` would: when the estimate changed since that turn.)

        Turn after turn the client resends the whole history; cutting it where the previous
        turn did keeps the compressed prefix identical, so a summary serves several turns and
        an upstream's prompt cache keeps hitting. With `compress_target` < 1 a new cut leaves
        room for the next turns to reuse it.
        """
        memory = self.cache if policy == "summarize" else self.cuts
        if not len(memory):
            return planned
        kept_roles = plan.KEPT_ROLES
        convo = [m for m in messages if m.get("role") not in kept_roles]
        hashes = summary.prefix_hashes(convo)
        system_cost = sum(
            c for m, c in zip(messages, costs, strict=True) if m.get("role") in kept_roles
        )
        budget = (
            limits.window - limits.margin - min(want, limits.reserve_output) - reply - system_cost
        )
        tail = [0] * (len(messages) + 1)  # tail[i]: tokens of non-system messages from i on
        for i in range(len(messages) - 1, -1, -1):
            own = costs[i] if messages[i].get("role") not in kept_roles else 0
            tail[i] = tail[i + 1] + own
        before = 0  # non-system messages before index i
        for i, m in enumerate(messages):
            if i > 0 and m.get("role") == "user" and tail[i] <= budget:
                known = memory.get(hashes[before])
                if known is not None:
                    extra = 0
                    if policy == "summarize":
                        extra = tokens.count_message(
                            counter, {"role": "system", "content": summary.SUMMARY_PREFIX + known}
                        )
                    if tail[i] + extra <= budget:
                        return i
            if m.get("role") not in kept_roles:
                before += 1
        return planned


def _too_long(window: int, prompt: int) -> GatewayError:
    return GatewayError(
        400,
        f"This model's maximum context length is {window} tokens. However, your messages "
        f"resulted in about {prompt} tokens, and the gateway could not shorten them enough "
        "(the system messages and the last turn alone do not fit). Please reduce the length "
        "of the messages.",
        param="messages",
        code="context_length_exceeded",
    )


def _count(action: str, saved: int) -> None:
    metrics.CONTEXT_COMPRESSED.labels(action).inc()
    if saved:
        metrics.CONTEXT_TOKENS_SAVED.labels(action).inc(saved)
