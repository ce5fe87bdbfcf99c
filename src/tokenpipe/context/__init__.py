"""The context hop and KV-cache arithmetic.

`budget.ContextBudget` keeps requests inside their model's window (counting in `tokens`,
windows from `windows`, both looked up per model in `lookup`, decisions in `plan`, summaries
cached in `summary` and written by `summarizer`); `kv` and `kv_cli` are
`tokenpipe kv`. Nothing is imported here, so `tokenpipe kv --help` stays light.

Layer: below pipeline, above router (a summary call is a request of the gateway's own, sent
through the router's whole policy). May import `router`, `engines.local` (the local model's
vocabulary), `dialects`, `upstream`, `control` and below.
"""
