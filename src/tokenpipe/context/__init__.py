"""The context hop and KV-cache arithmetic.

`budget.ContextBudget` keeps requests inside their model's window (counting in `tokens`,
windows from `windows`, decisions in `plan`, summaries in `summary`); `kv` and `kv_cli` are
`tokenpipe kv`. Nothing is imported here, so `tokenpipe kv --help` stays light.
"""
