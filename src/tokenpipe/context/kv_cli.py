"""`tokenpipe kv`: KV-cache memory for a model and a workload (formulas in docs/context.md)."""

from __future__ import annotations

import json
import sys

import click

from tokenpipe import cli_support
from tokenpipe.context import kv


def _size(n: float) -> str:
    for unit, factor in (
        ("TiB", 1024.0**4),
        ("GiB", 1024.0**3),
        ("MiB", 1024.0**2),
        ("KiB", 1024.0),
    ):
        if n >= factor:
            return f"{n / factor:,.2f} {unit}"
    return f"{n:,.0f} B"


@click.command("kv")
@click.option(
    "--model",
    "model_spec",
    required=True,
    metavar="PRESET|FILE",
    help="A preset name (" + ", ".join(sorted(kv.PRESETS)) + "), a GGUF file, "
    "or a Hugging Face config.json (or its directory).",
)
@click.option(
    "--tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Tokens per sequence (prompt + output).  [default: the model's context]",
)
@click.option(
    "--batch",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Sequences held at once.",
)
@click.option(
    "--dtype",
    type=click.Choice(list(kv.DTYPE_BYTES)),
    default="bf16",
    show_default=True,
    help="Element type of the cache.",
)
@click.option(
    "--memory",
    default=None,
    metavar="SIZE",
    help="Memory for the cache, e.g. 24GiB or 80GB: prints the largest batch of "
    "--tokens-long sequences that fits.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    callback=cli_support.output_file,
    default=None,
    metavar="FILE",
    help="Also write the figures as JSON ('-': standard output).",
)
def kv_command(
    model_spec: str,
    tokens: int | None,
    batch: int,
    dtype: str,
    memory: str | None,
    json_path: str | None,
) -> None:
    """KV-cache memory: per token, in total, and the largest batch that fits in --memory.

    Counts KV heads (grouped-query and multi-query attention), caps sliding-window layers at
    their window, and caches the latent of multi-head latent attention. Also prints what the
    common 2 x layers x d_model formula would say, which ignores all three.
    """
    try:
        model = kv.load(model_spec)
        mem = kv.parse_size(memory) if memory is not None else None
    except (kv.KVModelError, ValueError, OSError) as err:
        click.echo(f"tokenpipe kv: {err}", err=True)
        sys.exit(2)
    n_tokens = tokens or model.context or 4096
    e = kv.estimate(model, n_tokens, batch, dtype, mem)
    attn = (
        "MLA latent"
        if model.kv_lora_rank
        else "MQA"
        if model.n_kv_heads == 1
        else "GQA"
        if model.n_kv_heads < model.n_heads
        else "MHA"
    )
    lines = [
        f"model            {model.name}",
        f"attention        {attn}: {model.n_layers} layers, {model.n_heads} heads, "
        f"{model.n_kv_heads} KV heads, head_dim {model.head_dim_k}/{model.head_dim_v}"
        + (f", latent {model.kv_lora_rank}+{model.rope_dim}" if model.kv_lora_rank else ""),
    ]
    if model.window:
        n_slide = sum(model.layer_slides(i) for i in range(model.n_layers))
        lines.append(
            f"sliding window   {model.window} tokens on {n_slide} of {model.n_layers} layers"
        )
    lines += [
        f"workload         {n_tokens:,} tokens x batch {batch}, {dtype}",
        f"per token        {e.bytes_per_token:,.0f} B"
        + (
            f"  ({e.effective_bytes_per_token:,.0f} B averaged at this length)"
            if e.effective_bytes_per_token != e.bytes_per_token
            else ""
        ),
        f"total            {e.total_bytes:,.0f} B = {_size(e.total_bytes)}",
        f"naive formula    {e.naive_total_bytes:,.0f} B = {_size(e.naive_total_bytes)}  "
        f"(2 x layers x d_model: x{e.naive_total_bytes / e.total_bytes:.2f} ours)",
    ]
    if mem is not None:
        lines.append(
            f"max batch        {e.max_batch} sequences of {n_tokens:,} tokens in {_size(mem)}"
        )
    click.echo("\n".join(lines))
    if json_path:
        text = json.dumps(e.as_json(), indent=2) + "\n"
        if json_path == "-":
            click.echo(text, nl=False)
        else:
            with open(json_path, "w") as f:
                f.write(text)
