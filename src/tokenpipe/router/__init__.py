"""The router: which upstream a request goes to, and everything that happens before the
client's stream is settled on one upstream.

- `candidates.Router`: the upstreams serving a model.
- `policy.Policy`: latency estimates and the deadlines and hedge delay drawn from them,
  circuit breakers, retry and hedge budgets, the order upstreams are tried in (no I/O).
- `attempt`: one send (limiter wait, headers, first token) and the one retry loop
  (`until_answered`), through which the first send, every retry and every continuation go.
- `route`: the first send (`open_route`) and the state of one request after it (`Route`).
- `race`: the race for the first token (hedge, TTFT retry); `resume`: continuing a cut
  stream; `stream.reader`: the reader the relay runs (race, body, resume).

Every wait lies inside the request's deadline scope (`control.deadline.Scope`).

Layer: below pipeline (and context, whose summary calls go through it), above relay. May
import `relay`, `dialects`, `upstream`, `control`, `observe`, `settings`, `sse`, `errors`.
"""

from tokenpipe.router.candidates import Router

__all__ = ["Router"]
