#!/usr/bin/env bash
# Stream a chat completion from tokenpipe with curl (server-sent events, one `data:` line per
# chunk, ending with `data: [DONE]`; the comment line before it, `: tokenpipe first_token_ms=...`,
# is the gateway's Server-Timing for the stream: docs/observability.md).
#
#   TOKENPIPE_URL=http://127.0.0.1:8000/v1 bash examples/curl.sh "Say hello"
#
# -N turns off curl's output buffering so tokens show as they arrive. The optional
# x-tokenpipe-max-tokens-per-second header asks the gateway to pace the stream to that rate.
set -euo pipefail
URL="${TOKENPIPE_URL:-http://127.0.0.1:8000/v1}"
PROMPT="${1:-Say hello}"
MODEL="${TOKENPIPE_MODEL:-sim-model}"
MAX_TOKENS="${TOKENPIPE_MAX_TOKENS:-64}"
BODY=$(printf '{"model": "%s", "stream": true, "max_tokens": %d, "messages": [{"role": "user", "content": "%s"}]}' \
  "$MODEL" "$MAX_TOKENS" "${PROMPT//\"/\\\"}")
exec curl -sS -N --fail-with-body "$URL/chat/completions" \
  -H "Content-Type: application/json" \
  -H "Authorization: Bearer ${TOKENPIPE_API_KEY:-none}" \
  -H "x-tokenpipe-max-tokens-per-second: ${TOKENPIPE_RATE:-0}" \
  -H "x-request-id: ${TOKENPIPE_REQUEST_ID:-curl-example}" \
  -d "$BODY"
