"""`tokenpipe doctor`: the diagnosis tool's command line."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click
import orjson

from tokenpipe import cli_support
from tokenpipe.cli_support import DURATION, POSITIVE, Number


@click.command("doctor")
@click.argument("url")
@click.option("--model", default="sim-model", show_default=True, help="Model name to request.")
@click.option(
    "--requests",
    "n_requests",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Traced requests (each on a fresh connection).",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="max_tokens of the traced requests and the shared-connection probe.",
)
@click.option(
    "--prompt-tokens",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Length of the synthetic prompt (tokens).",
)
@click.option(
    "--temperature",
    type=Number(min=0, max=2),
    default=None,
    help="Sampling temperature to request.  [default: the server's]",
)
@click.option(
    "--sweep",
    default="16,32,64,128",
    show_default=True,
    help="Output lengths for the latency-vs-length fit ('' for none).",
)
@click.option(
    "--sweep-repeats",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Requests per output length in the sweep.",
)
@click.option(
    "--streams",
    type=click.IntRange(min=0),
    default=4,
    show_default=True,
    help="Concurrent streams of the shared-connection (HOL) probe; 0: none.",
)
@click.option("--h2c", is_flag=True, help="HTTP/2 over http:// with prior knowledge.")
@click.option(
    "--grpc-url",
    default=None,
    callback=cli_support.grpc_target,
    metavar="HOST:PORT",
    help="Run the shared-connection probe over this gRPC target (one channel).",
)
@click.option(
    "--stall-factor",
    type=Number(min=1),
    default=8.0,
    show_default=True,
    help="A gap over this x the median chunk gap (and --stall-min-ms) is a stall.",
)
@click.option(
    "--stall-min-ms",
    type=DURATION,
    default=100.0,
    show_default=True,
    help="A gap shorter than this (ms) is never a stall.",
)
@click.option(
    "--slow-first-token-ms",
    type=DURATION,
    default=500.0,
    show_default=True,
    help="TTFT beyond the network phases over this (ms) is slow_first_token.",
)
@click.option(
    "--header",
    "headers",
    multiple=True,
    metavar="NAME:VALUE",
    help="Extra request header (repeat), e.g. x-sim-fault:stall:10:500. x-sim-* headers "
    "steer `tokenpipe sim` only when sent to it directly: a gateway drops them, so "
    "doctor warns and an injected fault would not happen.",
)
@click.option(
    "--api-key",
    envvar="TOKENPIPE_API_KEY",
    default=None,
    callback=cli_support.api_key,
    help="Bearer key (or env TOKENPIPE_API_KEY). Never printed.",
)
@click.option(
    "--profile",
    "profile_pid",
    type=click.IntRange(min=1),
    default=None,
    metavar="PID",
    help="Record a py-spy flame graph of this (tokenpipe) process meanwhile.",
)
@click.option(
    "--profile-out",
    type=click.Path(dir_okay=False),
    callback=cli_support.output_file,
    default="doctor-flame.svg",
    show_default=True,
    help="Where --profile writes the flame graph (SVG).",
)
@click.option(
    "--profile-seconds",
    type=POSITIVE,
    default=None,
    help="How long to sample.  [default: while the doctor runs, estimated]",
)
@click.option(
    "--timeout",
    type=POSITIVE,
    default=300.0,
    show_default=True,
    help="Seconds one request may take.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    callback=cli_support.output_file,
    metavar="FILE",
    help="Write phases_ms, findings and the raw timings as JSON.",
)
@click.option(
    "--html",
    "html_path",
    type=click.Path(dir_okay=False),
    callback=cli_support.output_file,
    metavar="FILE",
    help="Write a self-contained HTML report with the waterfall and plots.",
)
def doctor(
    url: str,
    model: str,
    n_requests: int,
    max_tokens: int,
    prompt_tokens: int,
    temperature: float | None,
    sweep: str,
    sweep_repeats: int,
    streams: int,
    h2c: bool,
    grpc_url: str | None,
    stall_factor: float,
    stall_min_ms: float,
    slow_first_token_ms: float,
    headers: tuple[str, ...],
    api_key: str | None,
    profile_pid: int | None,
    profile_out: str,
    profile_seconds: float | None,
    timeout: float,
    json_path: str | None,
    html_path: str | None,
) -> None:
    """Explain where one streaming request's latency goes, and name what is wrong.

    \b
    Waterfall: dns, connect, tls, request_sent, headers, first_token,
    decode, tail (+ the server's own phases when it reports them: a tokenpipe
    gateway's Server-Timing, drawn inside the waterfall, and an engine's
    queue/prefill/decode).
    Findings: stall, slow_first_token, chunking, queueing, slow_dns, slow_tls,
    hol_blocking, superlinear_output_scaling, each with its evidence.
    To see a finding on purpose, inject it at the sim itself (not through a
    gateway, which drops x-sim-* headers): --header x-sim-fault:stall:10:500.
    """
    from tokenpipe.doctor import render
    from tokenpipe.doctor.findings import Thresholds
    from tokenpipe.doctor.profile import FlameGraph, ProfilerUnavailable
    from tokenpipe.doctor.run import DoctorOptions, diagnose
    from tokenpipe.serving import install_uvloop

    cli_support.http_url(url)
    hdrs = cli_support.headers(headers)
    lengths = cli_support.numbers(sweep, "--sweep", int, 1, 1 << 20) if sweep.strip() else []
    opts = DoctorOptions(
        url=url,
        model=model,
        requests=n_requests,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        temperature=temperature,
        headers=hdrs,
        api_key=api_key,
        sweep=lengths,
        sweep_repeats=sweep_repeats,
        hol_streams=streams,
        h2c=h2c,
        grpc_url=grpc_url,
        thresholds=Thresholds(
            stall_factor=stall_factor,
            stall_min_ms=stall_min_ms,
            slow_first_token_ms=slow_first_token_ms,
        ),
        timeout_s=timeout,
    )
    flame = None
    if profile_pid is not None:
        seconds = profile_seconds or 10.0
        try:
            flame = FlameGraph(profile_pid, profile_out, seconds)
        except ProfilerUnavailable as e:
            click.echo(f"tokenpipe doctor: {e}", err=True)
    from tokenpipe.bench.target import sim_header_warning

    install_uvloop()
    warning = asyncio.run(sim_header_warning(url, hdrs))
    if warning:
        click.echo(f"tokenpipe doctor: {warning}", err=True)
    report = asyncio.run(diagnose(opts))
    if warning:
        report.notes.append(warning)
    if flame is not None:
        try:
            report.profile_svg = str(flame.wait(timeout_s=(profile_seconds or 10.0) + 60))
        except ProfilerUnavailable as e:
            report.notes.append(str(e))
    from rich.console import Console

    render.print_text(report, Console(width=None if sys.stdout.isatty() else 140))
    command = cli_support.command_line("doctor", sys.argv[2:])
    if json_path:
        doc = report.to_json()
        doc["command"] = command
        Path(json_path).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        click.echo(f"wrote {json_path}")
    if html_path:
        Path(html_path).write_text(render.render_html(report, command))
        click.echo(f"wrote {html_path}")
    if report.shown is None:
        sys.exit(1)
