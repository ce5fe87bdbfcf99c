"""The context hop and KV-cache arithmetic.

`budget.ContextBudget` keeps requests inside their model's window (counting in `tokens`,
windows from `windows`, both looked up per model in `lookup`, decisions in `plan`, summaries
cached in `summary` and written by `summarizer`); `kv` and `kv_cli` are
`tokenpipe kv`. Nothing is imported here, so `tokenpipe kv --help` stays light.
"""
