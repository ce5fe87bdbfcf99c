"""LLM load generation and latency metrics, as a library.

    import asyncio
    from tokenpipe.bench import run_load, parse_slo

    result = asyncio.run(run_load("http://127.0.0.1:8000/v1", "sim-model",
                                  concurrency=8, requests=200, max_tokens=64))
    s = result.summary(slo=parse_slo("ttft=500ms,tpot=50ms"))
    print(s.to_json()["ttft_ms"]["p50"], s.to_json()["output_tokens_per_s"])

`run_load` returns a `RunResult` (every `RequestRecord` plus when the run ran);
`summarise(records)` / `RunResult.summary()` give a `Summary` whose HDR sketches merge across
runs and processes (`Summary.merge`). `report.bench_json(runs)` builds the `--json` document.
See docs/observability.md for the metric definitions.
"""

from tokenpipe.bench.clients import ChatRequest, ProtocolUnavailable, chat_url
from tokenpipe.bench.load import RunResult, run_load, run_load_processes
from tokenpipe.bench.metrics import (
    LATENCY_METRICS,
    SLO,
    LatencySketch,
    RequestRecord,
    Summary,
    parse_slo,
    summarise,
)
from tokenpipe.bench.stream import StreamRecorder

__all__ = [
    "LATENCY_METRICS",
    "SLO",
    "ChatRequest",
    "LatencySketch",
    "ProtocolUnavailable",
    "RequestRecord",
    "RunResult",
    "StreamRecorder",
    "Summary",
    "chat_url",
    "parse_slo",
    "run_load",
    "run_load_processes",
    "summarise",
]
