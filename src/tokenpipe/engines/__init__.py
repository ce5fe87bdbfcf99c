"""The engines that ship with tokenpipe, separate programs the gateway can sit in front of:
`sim` (seeded, exact timing and faults, for tests and benchmarks) and `local` (Gemma 3 270M
via llama.cpp on the CPU, the default upstream).

Layer: beside the gateway, never imported by it (`serve` starts `local` as a child process).
Engines may use `control`, `observe`, `sse`, `errors`, `clock`, `serving` and `ports`.
"""
