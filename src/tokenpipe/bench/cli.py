"""`tokenpipe bench`: the load generator's command line."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import click
import orjson

from tokenpipe import cli_support
from tokenpipe.cli_support import DURATION, POSITIVE

#: Most users of one run: each holds a connection, and a client machine runs out of ports
#: (~28,000 to one address) and files long before.
MAX_CONCURRENCY = 100_000


@click.command("bench")
@click.argument("url", required=False)
@click.option("--model", default="sim-model", show_default=True, help="Model name to request.")
@click.option(
    "--concurrency",
    default="8",
    show_default=True,
    help="Users (closed loop) or most in flight (with --rate); a list sweeps: 1,8,64.",
)
@click.option(
    "--requests",
    "n_requests",
    type=click.IntRange(min=1),
    default=None,
    help="Requests per run.  [default: 100 unless --duration]",
)
@click.option("--duration", type=POSITIVE, default=None, help="Seconds per run instead of a count.")
@click.option(
    "--rate", type=POSITIVE, default=None, help="Open loop: arrivals per second (else closed loop)."
)
@click.option(
    "--arrival",
    type=click.Choice(["poisson", "gamma"]),
    default="poisson",
    show_default=True,
    help="Open loop: how arrivals are spaced (gamma takes --burstiness).",
)
@click.option(
    "--burstiness",
    type=POSITIVE,
    default=1.0,
    show_default=True,
    help="Gamma shape: 1 is Poisson, <1 burstier, >1 more regular.",
)
@click.option(
    "--ramp",
    type=DURATION,
    default=0.0,
    show_default=True,
    help="Closed loop: start the users spread over this many seconds (one request's duration "
    "gives steady load from the start; 0: all at once).",
)
@click.option(
    "--prompt-tokens",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Length of synthetic prompts (tokens).",
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(exists=True, dir_okay=False),
    help='JSONL of prompts: {"messages": [...]}, {"prompt": "..."} or strings.',
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=0),
    default=64,
    show_default=True,
    help="max_tokens per request (0: leave it to the server).",
)
@click.option(
    "--protocol",
    type=click.Choice(["sse", "h2", "grpc"]),
    default="sse",
    show_default=True,
    help="Client: SSE over HTTP/1.1, SSE over HTTP/2, or the gateway's gRPC stream.",
)
@click.option(
    "--api",
    type=click.Choice(["chat", "responses", "messages"]),
    default="chat",
    show_default=True,
    help="The API to speak (sse and h2): chat completions, OpenAI Responses, Anthropic Messages.",
)
@click.option(
    "--compare",
    default=None,
    metavar="P1,P2",
    help="A/B protocols in one interleaved run, e.g. sse,grpc.",
)
@click.option("--h2c", is_flag=True, help="h2 over http:// with prior knowledge (no upgrade).")
@click.option(
    "--grpc-url",
    default=None,
    callback=cli_support.grpc_target,
    metavar="HOST:PORT",
    help="gRPC target.  [default: URL's host, port 50051]",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=4,
    show_default=True,
    help="Requests sent and discarded before each run.",
)
@click.option("--slo", default=None, help="Goodput targets, e.g. ttft=500ms,tpot=50ms.")
@click.option(
    "--temperature",
    default=None,
    metavar="T1,T2",
    help="Runs per temperature, e.g. 0.2,0.7,1.2: tokens/s per temperature.",
)
@click.option(
    "--header",
    "headers",
    multiple=True,
    metavar="NAME:VALUE",
    help="Extra request header (repeat), e.g. x-sim-itl-ms:2. x-sim-* headers steer "
    "`tokenpipe sim` only when sent to it directly: a gateway drops them (bench warns).",
)
@click.option(
    "--api-key",
    envvar="TOKENPIPE_API_KEY",
    default=None,
    callback=cli_support.api_key,
    help="Bearer key (or env TOKENPIPE_API_KEY). Never printed.",
)
@click.option(
    "--processes",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Worker processes (0: one per core) when the client is the limit.",
)
@click.option(
    "--self-test",
    is_flag=True,
    help="Measure the client's own ceiling against an unpaced sim it starts.",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of prompts and arrivals."
)
@click.option(
    "--timeout",
    type=POSITIVE,
    default=600.0,
    show_default=True,
    help="Seconds one request may take.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    callback=cli_support.output_file,
    metavar="FILE",
    help="Write every request and the summaries as JSON.",
)
@click.option(
    "--html",
    "html_path",
    type=click.Path(dir_okay=False),
    callback=cli_support.output_file,
    metavar="FILE",
    help="Write a self-contained HTML report with plots.",
)
@click.option("--no-progress", is_flag=True, help="No live progress bar.")
@click.option(
    "--wide",
    is_flag=True,
    help="One table row per run with every column, however wide (default: that layout "
    "only if it fits the terminal, else one column per run).",
)
def bench(
    url: str | None,
    model: str,
    concurrency: str,
    n_requests: int | None,
    duration: float | None,
    rate: float | None,
    arrival: str,
    burstiness: float,
    ramp: float,
    prompt_tokens: int,
    prompts_file: str | None,
    max_tokens: int,
    protocol: str,
    api: str,
    compare: str | None,
    h2c: bool,
    grpc_url: str | None,
    warmup: int,
    slo: str | None,
    temperature: str | None,
    headers: tuple[str, ...],
    api_key: str | None,
    processes: int,
    self_test: bool,
    seed: int,
    timeout: float,
    json_path: str | None,
    html_path: str | None,
    no_progress: bool,
    wide: bool,
) -> None:
    """Load-test an OpenAI-compatible streaming endpoint with correct LLM latency metrics.

    \b
    URL is a base URL (http://127.0.0.1:8000/v1) or the endpoint of --api.
    TTFT counts to the first content token; ITL is reported per token and
    per chunk; TPOT = (last - first token) / (tokens - 1); goodput counts
    requests within --slo.
    Examples:
      tokenpipe bench http://127.0.0.1:8000/v1 --concurrency 1,8,64 --requests 200
      tokenpipe bench URL --rate 20 --arrival gamma --burstiness 0.5 --duration 60
      tokenpipe bench URL --compare sse,h2 --json out.json --html out.html
      tokenpipe bench --self-test --processes 2
    """
    from rich.console import Console

    from tokenpipe.bench import html as html_mod
    from tokenpipe.bench import prompts as prompts_mod
    from tokenpipe.bench import report
    from tokenpipe.bench import table as table_mod
    from tokenpipe.bench.clients import ProtocolUnavailable, grpc_modules
    from tokenpipe.bench.metrics import parse_slo
    from tokenpipe.bench.sweep import run_sweep
    from tokenpipe.bench.target import sim_header_warning

    console = Console(width=None if sys.stdout.isatty() else 200)
    err = Console(stderr=True)
    try:
        slo_obj = parse_slo(slo) if slo else None
        concurrencies = cli_support.numbers(concurrency, "--concurrency", int, 1, MAX_CONCURRENCY)
        temps: list[float | None] = [None]
        if temperature is not None:
            temps = cli_support.numbers(temperature, "--temperature", float, 0, 2)
        prompt_list = prompts_mod.from_jsonl(prompts_file) if prompts_file else None
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if ramp and rate is not None:
        raise click.UsageError("--ramp works only in a closed loop (no --rate)")
    protocols = [p.strip() for p in compare.split(",")] if compare else [protocol]
    for p in protocols:
        if p not in ("sse", "h2", "grpc"):
            raise click.UsageError(f"unknown protocol {p!r} in --compare")
    if "grpc" in protocols and api != "chat":
        raise click.UsageError("grpc speaks chat only (--api chat)")
    if "grpc" in protocols:
        try:
            grpc_modules()
        except ProtocolUnavailable as e:
            err.print(f"[yellow]skipped[/] {e}")
            protocols = [p for p in protocols if p != "grpc"]
            if not protocols:
                sys.exit(2)
    extra_headers = cli_support.headers(headers)
    if n_requests is None and duration is None:
        n_requests = 2000 if self_test else 100

    kwargs: dict[str, Any] = dict(
        requests=n_requests,
        duration_s=duration,
        rate=rate,
        arrival=arrival,
        burstiness=burstiness,
        ramp_s=ramp,
        protocols=tuple(protocols),
        prompts=prompt_list,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens or None,
        warmup=warmup,
        headers=extra_headers,
        api_key=api_key,
        seed=seed,
        h2c=h2c,
        grpc_url=grpc_url,
        timeout_s=timeout,
        api=api,
    )

    if processes == 0:
        processes = os.cpu_count() or 1
    if self_test:
        from tokenpipe.bench.selftest import run_self_test

        run_self_test(
            url,
            model,
            concurrencies,
            processes,
            kwargs,
            max_tokens or 256,
            console,
            json_path,
            wide,
        )
        return
    if not url:
        raise click.UsageError("URL is required (or --self-test)")
    cli_support.http_url(url)
    warning = asyncio.run(sim_header_warning(url, extra_headers))
    if warning:
        err.print(f"[yellow]tokenpipe bench: {warning}[/]")

    runs = run_sweep(
        url,
        model,
        concurrencies,
        temps,
        processes,
        kwargs,
        console,
        err,
        no_progress or (not console.is_terminal and processes > 1),
    )
    report.print_report(runs, slo_obj, console, wide=wide)
    if temps != [None]:
        table_mod.temperature_table(console, runs, wide=wide)
    command = cli_support.command_line("bench", sys.argv[2:])
    meta = {
        "command": command,
        "url": url,
        "model": model,
        "processes": processes,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if json_path:
        Path(json_path).write_bytes(
            orjson.dumps(report.bench_json(runs, slo_obj, meta=meta), option=orjson.OPT_INDENT_2)
        )
        console.print(f"wrote {json_path}")
    if html_path:
        Path(html_path).write_text(html_mod.render(runs, slo_obj, command=command))
        console.print(f"wrote {html_path}")
    if all(not r.summary().requests_ok for r in runs):
        sys.exit(1)
