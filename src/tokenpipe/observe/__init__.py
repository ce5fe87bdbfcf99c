"""Observability: the Prometheus metrics (`metrics`, with bounded label values), structured
logs carrying the request id (`logs`), and event-loop runtime samples (`runtime`).

Layer: below the request path, imported by every layer; imports nothing of tokenpipe
outside this package.
"""
