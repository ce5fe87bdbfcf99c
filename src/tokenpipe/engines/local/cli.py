"""`tokenpipe local`: the embedded model's server; `tokenpipe.cli` adds it to its group."""

from __future__ import annotations

import click

from tokenpipe.cli_support import PORT, POSITIVE, configure_logging, fail


@click.command("local")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=PORT, default=8001, show_default=True, help="0: any free port.")
@click.option(
    "--ctx",
    "n_ctx",
    type=click.IntRange(min=256),
    default=4096,
    show_default=True,
    help="Context window in tokens (prompt + output).",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1, max=512),  # ggml's GGML_MAX_N_THREADS
    default=None,
    help="llama.cpp threads.  [default: one fewer than the CPUs, at least 1]",
)
@click.option(
    "--max-queue",
    type=click.IntRange(min=0),
    default=16,
    show_default=True,
    help="Requests that may wait for the model; one more gets 503 + Retry-After.",
)
@click.option(
    "--max-queue-wait",
    type=POSITIVE,
    default=30.0,
    show_default=True,
    help="Longest wait for the model in seconds; then 503.",
)
@click.option(
    "--max-pause",
    type=POSITIVE,
    default=30.0,
    show_default=True,
    help="Longest decoding waits for a client that stopped reading (seconds); then the "
    "stream ends with an error and the model serves the next request.",
)
@click.option(
    "--handoff-tokens",
    type=click.IntRange(min=1, max=1024),
    default=4,
    show_default=True,
    help="Tokens decoded ahead of the client (the decode thread's hand-off bound).",
)
@click.option(
    "--default-max-tokens",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Output cap for a request that gives no max_tokens (finish_reason: length at it); "
    "the pretrained model seldom stops by itself.",
)
@click.option(
    "--model-path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Another GGUF file instead of the packaged Gemma 3 270M.",
)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
    help="debug also shows llama.cpp's own log (model loading, KV-cache layout).",
)
def local(
    host: str,
    port: int,
    n_ctx: int,
    threads: int | None,
    max_queue: int,
    max_queue_wait: float,
    max_pause: float,
    handoff_tokens: int,
    default_max_tokens: int,
    model_path: str | None,
    log_level: str,
) -> None:
    """Serve the embedded Gemma 3 270M (llama.cpp, CPU) as an OpenAI-compatible API.

    \b
    Routes: POST /v1/chat/completions, POST /v1/completions (stream or
    not), GET /v1/models, GET /healthz, GET /metrics, GET /local/stats
    (per-request timing and token timestamps).
    Non-streamed responses carry x-tokenpipe-queue-ms, x-tokenpipe-prefill-ms
    and x-tokenpipe-decode-ms; streams end with the comment
    `: tokenpipe queue_ms=... prefill_ms=... decode_ms=...` before
    `data: [DONE]`.
    """
    from tokenpipe import ports, serving
    from tokenpipe.engines.local import model as model_mod

    configure_logging(log_level)
    if model_path is None and not model_mod.installed():
        fail(model_mod.INSTALL_HINT)
        return
    try:  # the port before the model: a busy port fails at once, not after loading
        held = ports.bound_socket(host, port)  # let go just before the server binds it
    except ports.CannotListen as e:
        fail(str(e))
        return
    port = held.getsockname()[1]
    from tokenpipe.engines.local.app import EngineConfig, LocalServer

    try:
        loaded = model_mod.LoadedModel(
            model_mod.ModelOptions(
                n_ctx=n_ctx, n_threads=threads or model_mod.default_threads(), path=model_path
            )
        )
    except (model_mod.ModelMissing, ValueError, OSError) as e:
        fail(f"cannot load the model: {e}")
        return
    server = LocalServer(
        loaded,
        EngineConfig(
            max_waiting=max_queue,
            max_wait_seconds=max_queue_wait,
            max_pause_seconds=max_pause,
            handoff_tokens=handoff_tokens,
            default_max_tokens=default_max_tokens,
        ),
    )
    held.close()
    try:
        with ports.startup_errors(port, host=host):
            app = server.app()
            serving.run(serving.serve(app, host, port, drain_seconds=5.0, name="tokenpipe local"))
    except ports.CannotListen as e:
        fail(str(e))
