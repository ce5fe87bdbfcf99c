"""The `tokenpipe` command. Sub-commands import their modules lazily so `--help` is instant."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from tokenpipe import __version__
from tokenpipe.cli_support import DURATION, PORT, POSITIVE, configure_logging, fail
from tokenpipe.ports import CannotListen

if TYPE_CHECKING:
    from tokenpipe.settings import Settings


#: The one-line summary of each command in `tokenpipe --help` (click would cut each
#: command's docstring to fit); a command not named here shows its own short help.
_SUMMARIES = {
    "serve": "the streaming gateway; with no --upstream, on the embedded model",
    "local": "an OpenAI-compatible server over the embedded Gemma 3 270M model",
    "sim": "a simulated upstream with exact timing and fault injection",
    "bench": "a load generator with correct LLM latency metrics",
    "doctor": "explains where one request's latency goes",
    "kv": "KV-cache memory for a model and workload",
    "config": "checks a config file (`tokenpipe config check FILE`)",
}


class _Group(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *_OPTIONAL})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in _OPTIONAL:
            command = _load(*_OPTIONAL[cmd_name])
            if command is not None:
                self.add_command(command, cmd_name)
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """One list of commands, in the order a newcomer meets them."""
        names = self.list_commands(ctx)
        names = [n for n in _SUMMARIES if n in names] + [n for n in names if n not in _SUMMARIES]
        rows = []
        for name in names:
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, _SUMMARIES.get(name) or cmd.get_short_help_str()))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(
    cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.version_option(__version__, prog_name="tokenpipe")
def main() -> None:
    """tokenpipe: a fast, predictable OpenAI-compatible gateway for LLM APIs.

    Every command has --help. Start with `tokenpipe serve` (or `make run` in a checkout).
    """


@main.command()
@click.option(
    "--upstream",
    "upstreams",
    multiple=True,
    metavar="URL",
    help="Base URL of an OpenAI-compatible upstream, e.g. http://127.0.0.1:9000/v1; "
    "anthropic+URL for Anthropic's Messages API (anthropic+https://api.anthropic.com/v1). "
    "Repeat for fallbacks, tried in order. Overrides the config's upstreams. With none "
    "(here or in the config): the embedded model, run as a child `tokenpipe local`.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="YAML config (see docs/config.md).",
)
@click.option("--host", default=None, help="Address to listen on.  [default: 127.0.0.1]")
@click.option(
    "--port", type=PORT, default=None, help="HTTP port (0: any free port).  [default: 8000]"
)
@click.option(
    "--grpc-port", type=PORT, default=None, help="gRPC port, 0 to turn gRPC off.  [default: 50051]"
)
@click.option(
    "--drain-seconds",
    type=DURATION,
    default=None,
    help="How long open streams may finish after SIGTERM.  [default: 30]",
)
@click.option(
    "--drain-grace-seconds",
    type=DURATION,
    default=None,
    help="After SIGTERM, keep answering (/readyz and new requests: 503) for at least this long,"
    " so probes see it (not after Ctrl-C).  [default: 5]",
)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
)
@click.option(
    "--log-format",
    default="text",
    show_default=True,
    type=click.Choice(["text", "json"]),
    help="json: one object per line with the request id (x-request-id) of each line.",
)
@click.option(
    "--access-log",
    is_flag=True,
    default=None,
    help="One log line per request (also server.access_log in the config).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Gateway processes on one port (SO_REUSEPORT). Limits are shared through "
    "Redis, or split evenly across workers with the memory backend.",
)
def serve(
    upstreams: tuple[str, ...],
    config_path: str | None,
    host: str | None,
    port: int | None,
    grpc_port: int | None,
    drain_seconds: float | None,
    drain_grace_seconds: float | None,
    log_level: str,
    log_format: str,
    access_log: bool | None,
    workers: int,
) -> None:
    """Run the gateway: OpenAI-compatible HTTP (and gRPC) in front of one or more upstreams.

    With no --upstream (and no upstreams in --config) it runs the embedded model, Gemma 3 270M
    on llama.cpp, as its one upstream: what `make run` does.
    """
    from tokenpipe import config_file
    from tokenpipe import settings as settings_mod

    configure_logging(log_level, log_format)
    try:
        cfg = config_file.load(config_path) if config_path else settings_mod.Settings()
        if upstreams:
            cfg.upstreams = [config_file.upstream_from_url(u, i) for i, u in enumerate(upstreams)]
    except config_file.ConfigError as e:
        fail(str(e))
        return
    if host is not None:
        cfg.server.host = host
    if port is not None:
        cfg.server.port = port
    if grpc_port is not None:
        cfg.server.grpc_port = grpc_port
    if drain_seconds is not None:
        cfg.server.drain_seconds = drain_seconds
    if drain_grace_seconds is not None:
        cfg.server.drain_grace_seconds = drain_grace_seconds
    if access_log is not None:
        cfg.server.access_log = access_log
    try:
        _serve(cfg, workers, log_level)
    except CannotListen as e:
        fail(str(e))


def _serve(cfg: Settings, workers: int, log_level: str) -> None:
    """Holds or checks the ports first, then starts the local model if there is no upstream,
    then serves. An address or port it cannot listen on raises CannotListen (PortBusy when
    the port is taken) before any slow start-up work."""
    from tokenpipe import config_file, gateway, ports, serving
    from tokenpipe import settings as settings_mod
    from tokenpipe.context.tokens import LOCAL_MODEL
    from tokenpipe.engines.local import child
    from tokenpipe.engines.local import model as local_model

    if not cfg.upstreams and not local_model.installed():
        fail(
            "no upstream configured (--upstream URL or a --config with upstreams), and "
            + local_model.INSTALL_HINT
        )
    host, grpc_port = cfg.server.host, cfg.server.grpc_port
    # The HTTP port is held while the model starts, and let go just before the server binds it
    # (its own socket keeps aiohttp's backlog and options); a race lost in that moment is
    # caught by startup_errors. workers.run holds the port itself (SO_REUSEPORT).
    held = ports.bound_socket(host, cfg.server.port)
    cfg.server.port = held.getsockname()[1]  # port 0 resolved: the examples show the real one
    ports.check_free(host, grpc_port, "--grpc-port")

    def run_gateway() -> None:
        held.close()
        with ports.startup_errors(cfg.server.port, grpc_port, host):
            if workers > 1:
                from tokenpipe import workers as workers_mod

                workers_mod.run(cfg, workers, log_level)
            else:
                serving.run(gateway.run(cfg))

    if cfg.upstreams:
        run_gateway()
        return
    # No upstream: the embedded local model, run as a managed child process `tokenpipe
    # local` (not in this process: its per-token Python work would compete with the
    # gateway's event loop for the GIL, a native crash would take the gateway down, and as
    # a child it is reached like any other upstream). See engines/local/child.py.
    extra = ("--default-max-tokens", str(cfg.local.default_max_tokens), "--log-level", log_level)
    try:
        with child.local_engine(extra_args=extra) as url:
            # It has no Responses API: /v1/responses is translated to chat, unasked.
            local = config_file.upstream_from_url(url, 0)
            local.responses = "chat"
            cfg.upstreams = [local]
            # One model that runs one sequence at a time: a hedge would only queue behind
            # the request it hedges.
            cfg.tail.hedging.enabled = False
            # Named so its tokenizer is loaded at start (context/lookup.warm), not by the
            # first request (about 0.7 s of its TTFT); counted and windowed as before.
            if all(m.name != LOCAL_MODEL for m in cfg.context.models):
                cfg.context.models.append(settings_mod.ContextModel(name=LOCAL_MODEL))
            click.echo(f"upstream: the local model (Gemma 3 270M) at {url}", err=True)
            if cfg.server.port:
                click.echo(
                    child.examples(f"http://{cfg.server.host}:{cfg.server.port}/v1"), err=True
                )
            # With --workers, N gateway processes share the one model (its queue is fair).
            run_gateway()
    except child.ChildFailed as e:
        fail(str(e))


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=PORT, default=9000, show_default=True, help="0: any free port.")
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seeds the text and the fault dice: same seed and request order, same output.",
)
@click.option(
    "--ttft-ms", type=DURATION, default=50.0, show_default=True, help="Time to first content token."
)
@click.option(
    "--itl-ms",
    type=DURATION,
    default=5.0,
    show_default=True,
    help="Interval between tokens (0: as fast as the socket takes them).",
)
@click.option("--tokens-per-chunk", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--output-tokens",
    type=click.IntRange(min=0),
    default=64,
    show_default=True,
    help="Output length when a request gives no max_tokens.",
)
@click.option("--model", "models", multiple=True, help="Model name(s) listed. [default: sim-model]")
@click.option("--strict-models", is_flag=True, help="Answer 404 for models not listed.")
@click.option("--rpm", type=POSITIVE, default=None, help="Enforce a requests-per-minute bucket.")
@click.option("--tpm", type=POSITIVE, default=None, help="Enforce a tokens-per-minute bucket.")
@click.option(
    "--bucket-seconds",
    type=POSITIVE,
    default=60.0,
    show_default=True,
    help="Depth of the RPM/TPM buckets, in seconds of refill.",
)
@click.option(
    "--max-active",
    type=click.IntRange(min=1),
    default=None,
    help="Refuse a request with 503 (529 on /v1/messages) while this many answer: an "
    "upstream with N slots that refuses rather than queues. [default: no cap]",
)
@click.option(
    "--fault",
    "fault_specs",
    multiple=True,
    metavar="SPEC@RATE",
    help="Inject a fault into a share of requests, e.g. stall-first:3000@0.05, "
    "status:429@0.01, reset:20@0.02. Kinds: status:CODE, stall-first:MS, "
    "stall:AFTER:MS, reset:AFTER, truncate:AFTER, garbage, hang-after-headers.",
)
@click.option(
    "--no-responses",
    is_flag=True,
    help="Serve no /v1/responses (a 404), like a server without the Responses API.",
)
def sim(
    host: str,
    port: int,
    seed: int,
    ttft_ms: float,
    itl_ms: float,
    tokens_per_chunk: int,
    output_tokens: int,
    models: tuple[str, ...],
    strict_models: bool,
    rpm: float | None,
    tpm: float | None,
    bucket_seconds: float,
    max_active: int | None,
    fault_specs: tuple[str, ...],
    no_responses: bool,
) -> None:
    """Run a simulated OpenAI-compatible upstream with exact, seeded timing and faults.

    Serves /v1/chat/completions, /v1/completions, /v1/responses (Responses API events and
    bodies, natively) and /v1/embeddings (deterministic vectors seeded from the input).

    \b
    It speaks Anthropic's Messages API too (POST /v1/messages and
    /v1/messages/count_tokens; as an upstream: --upstream anthropic+URL),
    with the same timing and faults.
    Per request, these override the defaults: headers x-sim-ttft-ms,
    x-sim-itl-ms, x-sim-tokens-per-chunk, x-sim-output-tokens, x-sim-fault,
    x-sim-tool; or a directive anywhere in the prompt:
      [[sim ttft_ms=10 itl_ms=2 output_tokens=50 fault=stall:10:3000]]
    tool=NAME (Messages with tools; *: the first) answers with a call of
    that tool. GET /sim/stats reports counters and per-request records;
    POST /sim/reset clears them.
    """
    from tokenpipe import serving
    from tokenpipe.engines.sim import faults
    from tokenpipe.engines.sim.app import Sim
    from tokenpipe.engines.sim.config import SimConfig, Timing

    try:
        rated = [faults.parse_rated(s) for s in fault_specs]
        config = SimConfig(
            seed=seed,
            timing=Timing(
                ttft_ms=ttft_ms,
                itl_ms=itl_ms,
                tokens_per_chunk=tokens_per_chunk,
                output_tokens=output_tokens,
            ),
            models=list(models) or ["sim-model"],
            any_model=not strict_models,
            rpm=rpm,
            tpm=tpm,
            bucket_seconds=bucket_seconds,
            max_active=max_active,
            rated_faults=rated,
            responses=not no_responses,
        )
        app = Sim(config).app()
    except ValueError as e:
        fail(str(e))
        return
    from tokenpipe import ports

    try:
        with ports.startup_errors(port, host=host):
            ports.check_free(host, port, "--port")
            serving.run(serving.serve(app, host, port, drain_seconds=1.0, name="tokenpipe sim"))
    except CannotListen as e:
        fail(str(e))


#: Sub-commands that live in their own modules, by name, as (module, attribute): each module
#: defines a plain click command and never imports this one (no import cycle). `_Group` imports
#: one only when it is run or listed: the bench alone loads aiohttp's client (~115 ms), which
#: `tokenpipe sim`, `--version` and a command's `--help` need not wait for.
_OPTIONAL = {
    "local": ("tokenpipe.engines.local.cli", "local"),
    "bench": ("tokenpipe.bench.cli", "bench"),
    "doctor": ("tokenpipe.doctor.cli", "doctor"),
    "kv": ("tokenpipe.context.kv_cli", "kv_command"),
    "config": ("tokenpipe.config_cli", "config"),
}


def _load(module: str, name: str) -> click.Command | None:
    """The command `name` of `module`; None when the module (or its package: an extra not
    installed) is missing. Any other missing import is an error."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if not (e.name and module.startswith(e.name)):
            raise
        return None
    command: click.Command = getattr(mod, name)
    return command
