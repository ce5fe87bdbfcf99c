"""KV-cache memory: what a model's attention cache costs per token, per sequence, per batch.

Per layer and token, standard attention caches one key and one value vector per KV head:

    bytes = 2 * n_kv_heads * head_dim * dtype_bytes            (K and V)

With grouped-query attention n_kv_heads < n_heads (Llama-3.1-8B: 8 of 32), with multi-query
attention n_kv_heads = 1. Keys and values may have different widths (`head_dim_k`, `head_dim_v`).

Multi-head latent attention (DeepSeek-V2/V3) caches one compressed latent of kv_lora_rank
elements plus the shared rotary key of qk_rope_head_dim elements per layer and token:

    bytes = (kv_lora_rank + qk_rope_head_dim) * dtype_bytes

A sliding-window layer keeps at most `window` tokens, so its cost stops growing there.

The widely shared formula `2 * n_layers * d_model * tokens * batch * dtype_bytes` assumes one KV
head per query head (n_kv_heads * head_dim = d_model): right for the original Llama/GPT-3,
wrong by n_heads / n_kv_heads for every GQA/MQA model. We print it next to ours.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Bytes per cached element. q8_0 / q4_0 are llama.cpp's block formats: 32 elements share one
#: fp16 scale, so 34 and 18 bytes per 32 elements.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
}


@dataclass(frozen=True, slots=True)
class KVModel:
    name: str
    n_layers: int
    d_model: int  # hidden size, for the naive formula
    n_heads: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    #: Trained context length (tokens), the default for --tokens.
    context: int
    #: Tokens a sliding-window layer keeps; None: no sliding window.
    window: int | None = None
    #: Which layers slide (True) — empty with a window means every layer.
    sliding: tuple[bool, ...] = ()
    #: Multi-head latent attention: cached latent width and rotary key width (elements).
    kv_lora_rank: int | None = None
    rope_dim: int | None = None
    source: str = ""
    notes: list[str] = field(default_factory=list)

    def layer_slides(self, layer: int) -> bool:
        if self.window is None:
            return False
        return self.sliding[layer] if self.sliding else True

    def elements_per_token_layer(self) -> int:
        """Cached elements per token in one layer."""
        if self.kv_lora_rank is not None:
            return self.kv_lora_rank + (self.rope_dim or 0)
        return self.n_kv_heads * (self.head_dim_k + self.head_dim_v)


@dataclass(frozen=True, slots=True)
class KVEstimate:
    model: str
    dtype: str
    tokens: int
    batch: int
    #: Bytes one token adds while every layer still stores it (below any sliding window).
    bytes_per_token: float
    #: Bytes per token at this length (sliding layers capped): total / (tokens * batch).
    effective_bytes_per_token: float
    total_bytes: float
    naive_bytes_per_token: float
    naive_total_bytes: float
    memory: float | None = None
    max_batch: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "bytes_per_token": _num(self.bytes_per_token),
            "total_bytes": _num(self.total_bytes),
            "naive_total_bytes": _num(self.naive_total_bytes),
            "max_batch": self.max_batch,
            "dtype": self.dtype,
            "tokens": self.tokens,
            "batch": self.batch,
            "effective_bytes_per_token": _num(self.effective_bytes_per_token),
            "naive_bytes_per_token": _num(self.naive_bytes_per_token),
            "memory_bytes": _num(self.memory) if self.memory is not None else None,
        }


def _num(x: float) -> int | float:
    """Whole byte counts as integers in JSON (q8_0/q4_0 can give fractions per token)."""
    return int(x) if float(x).is_integer() else x


def estimate(
    m: KVModel, tokens: int, batch: int = 1, dtype: str = "bf16", memory: float | None = None
) -> KVEstimate:
    size = DTYPE_BYTES[dtype]
    per_layer = m.elements_per_token_layer() * size  # bytes per token per layer
    per_seq = 0.0
    for layer in range(m.n_layers):
        kept = min(tokens, m.window) if m.layer_slides(layer) and m.window else tokens
        per_seq += per_layer * kept
    naive_per_token = 2 * m.n_layers * m.d_model * size
    max_batch = int(memory // per_seq) if memory is not None and per_seq > 0 else None
    return KVEstimate(
        model=m.name,
        dtype=dtype,
        tokens=tokens,
        batch=batch,
        bytes_per_token=per_layer * m.n_layers,
        effective_bytes_per_token=per_seq / tokens if tokens else 0.0,
        total_bytes=per_seq * batch,
        naive_bytes_per_token=naive_per_token,
        naive_total_bytes=naive_per_token * tokens * batch,
        memory=memory,
        max_batch=max_batch,
    )


def _pattern(n_layers: int, every: int) -> tuple[bool, ...]:
    """Interleaved local/global attention: every `every`-th layer is global, the rest slide."""
    return tuple((i + 1) % every != 0 for i in range(n_layers))


# Presets: the numbers of each model's published config.json (tests check them against the
# figures written there, with the source).
PRESETS: dict[str, KVModel] = {
    m.name: m
    for m in (
        KVModel(
            "llama-3.1-8b",
            n_layers=32,
            d_model=4096,
            n_heads=32,
            n_kv_heads=8,
            head_dim_k=128,
            head_dim_v=128,
            context=131072,
            source="meta-llama/Llama-3.1-8B config.json",
        ),
        KVModel(
            "llama-3.1-70b",
            n_layers=80,
            d_model=8192,
            n_heads=64,
            n_kv_heads=8,
            head_dim_k=128,
            head_dim_v=128,
            context=131072,
            source="meta-llama/Llama-3.1-70B config.json",
        ),
        KVModel(
            "qwen2.5-7b",
            n_layers=28,
            d_model=3584,
            n_heads=28,
            n_kv_heads=4,
            head_dim_k=128,
            head_dim_v=128,
            context=131072,
            source="Qwen/Qwen2.5-7B config.json (use_sliding_window: false)",
        ),
        KVModel(
            "mistral-7b",
            n_layers=32,
            d_model=4096,
            n_heads=32,
            n_kv_heads=8,
            head_dim_k=128,
            head_dim_v=128,
            context=32768,
            window=4096,
            source="mistralai/Mistral-7B-v0.1 config.json (sliding_window: 4096, every layer)",
        ),
        KVModel(
            "gemma-3-270m",
            n_layers=18,
            d_model=640,
            n_heads=4,
            n_kv_heads=1,
            head_dim_k=256,
            head_dim_v=256,
            context=32768,
            window=512,
            sliding=_pattern(18, 6),
            source="google/gemma-3-270m config.json (5 sliding layers per global one)",
        ),
        KVModel(
            "falcon-7b",
            n_layers=32,
            d_model=4544,
            n_heads=71,
            n_kv_heads=1,
            head_dim_k=64,
            head_dim_v=64,
            context=2048,
            source="tiiuae/falcon-7b config.json (multi_query: true)",
        ),
        KVModel(
            "deepseek-v3",
            n_layers=61,
            d_model=7168,
            n_heads=128,
            n_kv_heads=128,
            head_dim_k=192,
            head_dim_v=128,
            context=163840,
            kv_lora_rank=512,
            rope_dim=64,
            source="deepseek-ai/DeepSeek-V3 config.json (MLA latent cache)",
        ),
    )
}
ALIASES = {
    "mistral-7b-v0.1": "mistral-7b",
    "llama-3-8b": "llama-3.1-8b",
    "meta-llama-3.1-8b": "llama-3.1-8b",
    "gemma3-270m": "gemma-3-270m",
}


class KVModelError(ValueError):
    pass


def preset(name: str) -> KVModel:
    key = name.lower()
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        raise KVModelError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[key]


def from_hf_config(cfg: dict[str, Any], name: str = "config.json") -> KVModel:
    """A Hugging Face config.json (multimodal configs: their `text_config`)."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "_name_or_path": cfg.get("_name_or_path")}

    def first(*keys: str) -> Any:
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        return None

    n_layers = first("num_hidden_layers", "n_layer", "num_layers")
    d_model = first("hidden_size", "d_model", "n_embd")
    n_heads = first("num_attention_heads", "n_head")
    if not (n_layers and d_model and n_heads):
        raise KVModelError(f"{name}: needs num_hidden_layers, hidden_size, num_attention_heads")
    n_kv = first("num_key_value_heads", "num_kv_heads", "n_head_kv")
    if n_kv is None:
        n_kv = 1 if cfg.get("multi_query") else n_heads
    head_dim = first("head_dim") or d_model // n_heads
    context = first("max_position_embeddings", "n_positions", "seq_length") or 0
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    sliding: tuple[bool, ...] = ()
    layer_types = cfg.get("layer_types")
    if window and isinstance(layer_types, list) and len(layer_types) == n_layers:
        sliding = tuple(t == "sliding_attention" for t in layer_types)
    elif window and cfg.get("sliding_window_pattern"):
        sliding = _pattern(n_layers, int(cfg["sliding_window_pattern"]))
    kv_lora = cfg.get("kv_lora_rank")
    return KVModel(
        name=str(cfg.get("_name_or_path") or cfg.get("model_type") or name),
        n_layers=int(n_layers),
        d_model=int(d_model),
        n_heads=int(n_heads),
        n_kv_heads=int(n_kv),
        head_dim_k=int(first("qk_nope_head_dim") or 0) + int(first("qk_rope_head_dim") or 0)
        if kv_lora
        else int(head_dim),
        head_dim_v=int(first("v_head_dim") or head_dim),
        context=int(context),
        window=int(window) if window else None,
        sliding=sliding,
        kv_lora_rank=int(kv_lora) if kv_lora else None,
        rope_dim=int(cfg["qk_rope_head_dim"]) if kv_lora else None,
        source=name,
    )


#: Architectures whose sliding window is interleaved; llama.cpp hard-codes these patterns.
_GGUF_PATTERNS = {"gemma3": 6, "gemma2": 2, "cohere2": 4}


def from_gguf(path: str | Path) -> KVModel:
    from tokenpipe.context.gguf_meta import read_metadata

    meta = read_metadata(path)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise KVModelError(f"{path}: no general.architecture in the GGUF metadata")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    n_layers = get("block_count")
    d_model = get("embedding_length")
    n_heads = get("attention.head_count")
    if not (n_layers and d_model and n_heads):
        raise KVModelError(f"{path}: GGUF lacks {arch}.block_count/embedding_length/head_count")
    if isinstance(n_heads, list):
        n_heads = max(n_heads)
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer counts: the cache is sized by the largest here
        n_kv = max(n_kv)
    head_k = get("attention.key_length") or d_model // n_heads
    head_v = get("attention.value_length") or head_k
    window = get("attention.sliding_window")
    sliding: tuple[bool, ...] = ()
    pattern = get("attention.sliding_window_pattern")
    if window and isinstance(pattern, list) and len(pattern) == n_layers:
        sliding = tuple(bool(p) for p in pattern)
    elif window and arch in _GGUF_PATTERNS:
        sliding = _pattern(n_layers, _GGUF_PATTERNS[arch])
    kv_lora = get("attention.kv_lora_rank")
    return KVModel(
        name=str(meta.get("general.name") or Path(path).stem),
        n_layers=int(n_layers),
        d_model=int(d_model),
        n_heads=int(n_heads),
        n_kv_heads=int(n_kv),
        head_dim_k=int(head_k),
        head_dim_v=int(head_v),
        context=int(get("context_length", 0)),
        window=int(window) if window else None,
        sliding=sliding,
        kv_lora_rank=int(kv_lora) if kv_lora else None,
        rope_dim=int(get("rope.dimension_count", 0)) if kv_lora else None,
        source=str(path),
    )


def load(spec: str) -> KVModel:
    """A preset name, a .gguf file, or a config.json (a file, or a directory holding one)."""
    p = Path(spec)
    if p.is_dir() and (p / "config.json").is_file():
        p = p / "config.json"
    if p.is_file():
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return from_gguf(p)
        try:
            cfg = json.loads(p.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise KVModelError(f"{spec}: neither a GGUF file nor JSON ({e})") from None
        return from_hf_config(cfg, str(p))
    return preset(spec)


def parse_size(text: str) -> float:
    """Bytes from '24GiB', '80GB', '512MiB', '1e9' (binary units are powers of 1024)."""
    units: Sequence[tuple[str, float]] = (
        ("tib", 1024.0**4),
        ("gib", 1024.0**3),
        ("mib", 1024.0**2),
        ("kib", 1024.0),
        ("tb", 1e12),
        ("gb", 1e9),
        ("mb", 1e6),
        ("kb", 1e3),
        ("b", 1.0),
    )
    t = text.strip().lower().replace(" ", "")
    number, factor = t, 1.0
    for suffix, unit in units:
        if t.endswith(suffix):
            number, factor = t[: -len(suffix)], unit
            break
    try:
        size = float(number) * factor
    except ValueError:
        size = math.nan
    if not (math.isfinite(size) and size > 0):
        raise ValueError(f"--memory takes a size above 0 such as 24GiB or 80GB, got {text!r}")
    return size
