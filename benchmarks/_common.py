"""Small helpers shared by the benchmarks (process CPU and memory, ports, the processes
compared, JSON)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

from tokenpipe.bench import procs, run_load
from tokenpipe.bench import prompts as prompts_mod
from tokenpipe.bench.apis import ChatRequest, Wire
from tokenpipe.bench.procs import Service
from tokenpipe.doctor.profile import py_spy_path

ROOT = Path(__file__).resolve().parent.parent
#: LiteLLM lives in its own venv: its pins must not touch ours.
LITELLM_VENV = ROOT / ".cache" / "litellm-venv"


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a process and its children so far (0 for None)."""
    if pid is None:
        return 0.0
    p = psutil.Process(pid)
    total = sum(p.cpu_times()[:2])
    for child in p.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def cpu_ns(pid: int) -> int:
    """Nanoseconds the process's threads have run on a CPU: the scheduler's own count
    (/proc/PID/task/*/schedstat). `cpu_seconds` (psutil) counts 10 ms ticks: over 400
    requests, 25 us a request (rate_cpu.py). Threads that ended are not counted."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:  # the thread ended
            pass
    return total


def process_tree(pid: int) -> list[psutil.Process]:
    """A process and its descendants as they are now (with `serve --workers N`: the parent
    holding the port, multiprocessing's resource tracker and the N workers)."""
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


def pin(pid: int, cpu: int) -> None:
    """Every thread of `pid` and of its descendants (`process_tree`) on `cpu` only. Threads
    started later inherit it from the thread that starts them."""
    for proc in process_tree(pid):
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.sched_setaffinity(int(tid), {cpu})


#: `tokenpipe sim` arguments for `--ratelimit-headers`: OpenAI's x-ratelimit-* headers on
#: every answer, as OpenAI sends them, with limits far above any benchmark's load (nothing
#: waits), so the gateway learns from every answer.
RATELIMIT_HEADERS_SIM = ("--rpm", "1e9", "--tpm", "1e12")


def sim_models(model: str) -> tuple[str, ...]:
    """`tokenpipe sim` arguments listing `model` beside its own `sim-model`: the gateway
    routes only the models its upstream lists (another is a 404)."""
    return ("--model", "sim-model", "--model", model) if model != "sim-model" else ()


#: Linux's PM QoS interface for the CPUs' wake-up latency (root only).
CPU_DMA_LATENCY = Path("/dev/cpu_dma_latency")


@contextlib.contextmanager
def idle_polling(on: bool = True) -> Iterator[None]:
    """While inside, idle CPUs poll instead of halting: a PM QoS request of 0 us wake-up
    latency, held as long as /dev/cpu_dma_latency stays open (what tuned's latency-performance
    profile sets). On a VM a halted vCPU leaves the guest, and the next event on it starts
    cold: a diagnostic of how much of a latency is the machine's idle states. Machine-wide:
    every process on it runs without idle halts meanwhile. `on=False`: does nothing."""
    if not on:
        yield
        return
    with CPU_DMA_LATENCY.open("wb", buffering=0) as f:
        f.write(struct.pack("i", 0))
        yield


def rss_bytes(procs: list[psutil.Process]) -> int:
    """The summed resident set of `procs` (0 for those that have exited)."""
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


class RssPeak:
    """The summed RSS of a process tree before a block (`before`) and its peak during it
    (`peak`, bytes), sampled every `period_s` by a thread: the event loop is busy with the
    load, a thread wakes on time. The tree is taken once, on entry (it must be complete)."""

    def __init__(self, pid: int, period_s: float = 0.05) -> None:
        self.procs = process_tree(pid)
        self.period_s = period_s
        self.before = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak = max(self.peak, rss_bytes(self.procs))

    def __enter__(self) -> RssPeak:
        self.before = self.peak = rss_bytes(self.procs)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes(self.procs))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Returns once 127.0.0.1:`port` accepts a connection. Raises RuntimeError past `timeout`
    seconds, or once `proc` (the server) has ended. A server's start is not signalled, so
    it is polled."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
            raise RuntimeError(f"nothing listens on port {port}")
        time.sleep(0.05)  # a server's start, polled with a deadline


def stop(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL past `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def fmt(v: float | None, width: int, digits: int = 2) -> str:
    """A table cell: the number, or '-' where there is none (e.g. no ITL in 1-chunk streams)."""
    return f"{'-':>{width}}" if v is None else f"{v:{width}.{digits}f}"


def src_dir(text: str) -> str:
    """argparse type of a `--base-src`: another checkout's src/ directory, made absolute (the
    gateway runs from it, `gateway(src=...)`), refused unless it holds the tokenpipe package."""
    path = Path(text).resolve()
    if not (path / "tokenpipe" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text}: no tokenpipe/__init__.py (give a src/ dir)")
    return str(path)


#: `serve` arguments for a log line a request (after the benchmarks' `--log-level warning`).
ACCESS_LOG_ARGS = ("--access-log", "--log-level", "info")


def gateway(
    sim_url: str,
    grpc_port: int = 0,
    config: Path | None = None,
    env: dict[str, str] | None = None,
    src: str | None = None,
    workers: int = 1,
    serve_args: tuple[str, ...] = (),
) -> Service:
    """`tokenpipe serve` in front of a sim (base URL without /v1), with its defaults or with
    `config` (its upstreams replaced by the sim); `env`: more of its environment (OTEL_*);
    `src`: run it from this src/ directory (another checkout's, `src_dir`), first on its
    PYTHONPATH, instead of this venv's; `workers`: `serve --workers` (returns once every
    worker listens); `serve_args`: more arguments, last (a `--log-level` there wins)."""
    env = _from_src(src, env)
    # The later --grpc-port wins over procs.gateway's own "0" (off).
    svc = procs.gateway(
        *(("--config", str(config)) if config else ()),
        "--grpc-port",
        str(grpc_port),
        "--upstream",
        sim_url + "/v1",
        "--log-level",
        "warning",
        *(("--workers", str(workers)) if workers > 1 else ()),
        *serve_args,
        env=env,
    )
    if workers > 1:  # Service returned on the first worker's line: wait for the others'
        deadline = time.monotonic() + 60
        while svc.output().count(f"listening on {svc.url}\n") < workers:
            if time.monotonic() > deadline or svc.proc.poll() is not None:
                svc.stop()
                raise RuntimeError(f"not all {workers} workers started:\n{svc.output()}")
            time.sleep(0.05)  # a child's start-up, polled with a deadline
    return svc


#: `--key-quotas` (request_instructions.py, relay_cost.py): the key the requests carry (the
#: relays ignore it) and the gateways' config: auth on, one key, quotas far above the load.
BENCH_KEY = "sk-bench-key"
KEY_QUOTAS = f"""auth:
  api_keys:
    - name: bench
      sha256: {hashlib.sha256(BENCH_KEY.encode()).hexdigest()}
keys:
  "*": {{rpm: 100000000, tpm: 100000000000}}
"""


def config_file(name: str, config: str) -> Path:
    """`config` (YAML) written to .cache/NAME.yaml, for a gateway's `--config`."""
    path = ROOT / ".cache" / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(config)
    return path


#: The request paths a benchmark's `--path` measures: the API the client speaks and the
#: gateway's upstream (the sim serves all three APIs; "X via Y": the gateway translates X
#: onto the sim's Y).
API_PATHS = {
    "chat": ("chat", "openai"),
    "responses": ("responses", "openai"),  # (`responses: auto`: passed on natively)
    "messages": ("messages", "anthropic"),
    "messages via chat": ("messages", "openai"),
    "responses via chat": ("responses", "openai, responses: chat"),
    "chat via messages": ("chat", "anthropic"),
}


def add_request_shape(p: argparse.ArgumentParser) -> None:
    """The options that shape the measured requests, as the counting benchmarks share them
    (request_instructions.py, calls_per_request.py)."""
    p.add_argument(
        "--path",
        choices=list(API_PATHS),
        default="chat",
        help="the client's API and the upstream's: a native path or a translation (the"
        " relays forward the client's API to the sim as it is)",
    )
    p.add_argument(
        "--messages",
        type=int,
        default=0,
        help="each request a conversation of this many turns (~250 characters each)",
    )
    p.add_argument(
        "--model",
        default="sim-model",
        help="the requests' model (one with a known context window, e.g. gpt-4o-mini, "
        "turns the context budget on; the sim lists it)",
    )
    add_deployment_options(p)


def add_deployment_options(p: argparse.ArgumentParser) -> None:
    """What a deployment adds to a request, as the CPU and counting benchmarks measure it:
    an upstream stating its limits, and auth with a quota per key."""
    p.add_argument(
        "--ratelimit-headers",
        action="store_true",
        help="the sim sends OpenAI's x-ratelimit-* headers on every answer (never limiting)",
    )
    p.add_argument(
        "--key-quotas",
        action="store_true",
        help="auth on (the requests carry its one key) and a per-key quota far above the load"
        " (keys: '*': rpm, tpm): admission reserves from the key's buckets too",
    )


def redis_limits(url: str, prefix: str) -> str:
    """Config (YAML) keeping a gateway's buckets in the redis-server at `url`, under keys
    of `prefix` (a gateway's own, so that none starts from another's levels)."""
    return f"limits: {{backend: redis, redis: {{url: '{url}', key_prefix: {prefix}}}}}\n"


def upstream_args(kind: str, sim_url: str) -> list[str]:
    """The gateway's arguments naming the sim as an upstream of `kind` (API_PATHS)."""
    if kind == "anthropic":
        return ["--upstream", "anthropic+" + sim_url]
    if kind == "openai, responses: chat":
        config = f"upstreams:\n  - {{name: sim, url: '{sim_url}/v1', responses: chat}}\n"
        return ["--config", str(config_file("responses-chat", config))]
    return ["--upstream", sim_url + "/v1"]


def _from_src(src: str | None, env: dict[str, str] | None) -> dict[str, str] | None:
    """`env`, with `src` (another checkout's src/) first on PYTHONPATH when given."""
    if not src:
        return env
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    return {**(env or {}), "PYTHONPATH": path}


def gateway_with(name: str, config: str, src: str | None = None) -> Service:
    """`tokenpipe serve` with the config `config` (YAML, written to .cache/NAME.yaml) and
    nothing of the command line's in its way (its upstreams are the config's); `src`: run
    from this src/ directory, as `gateway` does."""
    path = str(config_file(name, config))
    return procs.gateway("--config", path, "--log-level", "warning", env=_from_src(src, None))


#: tokenpipe with every optional layer off (`--features-off` of relay_cost.py and overhead.py),
#: to tell the cost of the features from that of the request path itself.
FEATURES_OFF = """\
limits: {learn_from_headers: false, adaptive_concurrency: false}
tail:
  deadlines: false
  hedging: {enabled: false}
  retries: {enabled: false}
  breaker: {enabled: false}
  recovery: {enabled: false}
context: {policy: "off"}
"""


def features_off_config() -> Path:
    """FEATURES_OFF written to a file for `gateway(config=...)`."""
    return config_file("features-off", FEATURES_OFF)


def bare_relay(sim_url: str, cpu_us: float = 0.0, read: bool = False) -> Service:
    """The byte-forwarding floor (benchmarks/bare_relay.py) in front of a sim; `cpu_us`:
    CPU it spins per request (a diagnostic); `read`: it decodes the request and each event
    it forwards (the floor for a hop that reads the stream)."""
    argv = [sys.executable, str(ROOT / "benchmarks" / "bare_relay.py"), "--upstream", sim_url]
    argv += ["--cpu-us", str(cpu_us), *(["--read"] if read else [])]
    return Service(argv=argv, name="reading-relay" if read else "bare-relay")


#: The bare aiohttp relay's stand-in for a src/ directory in `gateway_under`'s targets, and
#: the relay that decodes the request and each event it forwards (`bare_relay.py --read`).
RELAY = "bare relay"
READING_RELAY = "reading relay"


def gateway_under(
    sim_url: str,
    src: str | None,
    prefix: list[str],
    extra: dict[str, str] | None = None,
    timeout: float = 60.0,
    upstream: list[str] | None = None,
    serve_args: tuple[str, ...] = (),
) -> Service:
    """`tokenpipe serve` run from `src` (None: this tree), or the bare relay (src RELAY),
    in front of a sim, behind `prefix` (a profiler's or counter's command, ending with the
    Python to run); `extra`: environment for it; `upstream`: the gateway's arguments naming
    its upstream (default: `--upstream SIM/v1`, the sim as an OpenAI API); `serve_args`:
    more of them, last (a `--log-level` there wins over the default's)."""
    if src in (RELAY, READING_RELAY):
        argv = [*prefix, str(ROOT / "benchmarks" / "bare_relay.py"), "--upstream", sim_url]
        argv += ["--read"] if src == READING_RELAY else []
        return Service(argv=argv, env=extra, name="relay-counted", timeout=timeout)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    env.update(extra or {})
    argv = [*prefix, "-m", "tokenpipe", "serve", "--port", "0", "--grpc-port", "0"]
    argv += upstream if upstream is not None else ["--upstream", sim_url + "/v1"]
    argv += ["--log-level", "warning", "--drain-grace-seconds", "0", *serve_args]
    return Service(
        argv=argv, env=env if src or extra else None, name="gateway-counted", timeout=timeout
    )


#: A conversation's words (English-like: ~5.5 characters a word with its space).
_WORDS = (
    *("the", "model", "reads", "every", "earlier", "turn", "of", "the", "conversation"),
    *("again", "before", "it", "answers"),
)


def conversation(messages: int) -> list[dict[str, str]]:
    """A chat's history as a client resends it each turn: a system prompt, then `messages`
    turns of the user and the assistant in alternation, ~250 characters each."""
    turns = [{"role": "system", "content": "You are a helpful assistant. " * 8}]
    for i in range(messages):
        text = " ".join(_WORDS[(i + j) % len(_WORDS)] for j in range(45))
        turns.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return turns


async def one_token_requests(
    svc: Service,
    concurrency: int,
    requests: int,
    prompt_tokens: int = 32,
    api: str = "chat",
    model: str = "sim-model",
    messages: int = 0,
    api_key: str | None = None,
    tokens: int = 1,
) -> Any:
    """`requests` streamed requests of 1 token each (32-token prompts, ~4.4 bytes a token;
    `api`: chat, responses or messages) to `model` (the sim serves any name) through `svc`,
    `concurrency` at a time: the request path's load. `messages`: each request a
    `conversation` of that many turns instead of one prompt; `api_key`: sent as its key;
    `tokens`: each request asks for that many instead.
    Returns the load's result (its `records`). Raises when a request failed: a figure of
    refused requests (a model the upstream does not list is a 404) is not the request
    path's."""
    result = await run_load(
        svc.url + "/v1",
        model,
        concurrency=concurrency,
        requests=requests,
        max_tokens=tokens,
        prompt_tokens=prompt_tokens,
        prompts=[conversation(messages)] if messages else None,
        api=api,
        api_key=api_key,
    )
    failed = [r for r in result.records if not r.ok]
    if failed:
        r = failed[0]
        raise RuntimeError(
            f"{len(failed)} of {requests} requests to {svc.url} failed, the first with"
            f" status {r.status}: {r.error or 'no error text'}"
        )
    return result


async def whole_answers(
    svc: Service,
    concurrency: int,
    requests: int,
    prompt_tokens: int = 32,
    model: str = "sim-model",
    api: str = "chat",
    api_key: str | None = None,
) -> None:
    """`requests` non-streamed requests of 1 token each (`"stream": false`: the answer in
    one JSON body; 32-token prompts as `one_token_requests` sends; `api`: chat, responses or
    messages, each in its own API's shape, as the load generator writes it; `api_key`: sent
    as its key) through `svc`, `concurrency` at a time on keep-alive connections. Raises on
    an answer that is not 200."""
    wire = Wire(api, svc.url + "/v1", api_key)
    bodies = []
    for p in prompts_mod.synthetic(prompt_tokens, 64):
        obj = orjson.loads(wire.body(ChatRequest(model, p, max_tokens=1)))
        obj["stream"] = False
        obj.pop("stream_options", None)
        bodies.append(orjson.dumps(obj))
    url = wire.url
    headers = {**wire.headers, "Accept": "application/json"}
    left = iter(range(requests))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def user() -> None:
            for i in left:
                async with session.post(url, data=bodies[i % len(bodies)], headers=headers) as r:
                    body = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{r.status} from {url}: {body[:200]!r}")

        await asyncio.gather(*(user() for _ in range(concurrency)))


async def cpu_per_request(svc: Service, concurrency: int, requests: int, **shape: Any) -> float:
    """CPU seconds of `svc` (and its children) a request, over `one_token_requests(svc,
    concurrency, requests, **shape)`."""
    before = cpu_seconds(svc.pid)
    await one_token_requests(svc, concurrency, requests, **shape)
    return (cpu_seconds(svc.pid) - before) / requests


def child_figure(src: str, script: str, *args: str) -> float:
    """The one number (JSON) a Python `script` prints, run in a child process with `src` as
    its PYTHONPATH: a measurement of another checkout's code, or of this one's, alone."""
    env = {**os.environ, "PYTHONPATH": src}
    argv = [sys.executable, "-c", script, *args]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout))


def src_targets(base_src: str | None) -> dict[str, str]:
    """The src/ directories a benchmark measures in child processes (`child_figure`): this
    tree's, and another checkout's as "base" when `--base-src` gave one."""
    targets = {"this tree": str(ROOT / "src")}
    if base_src:
        targets["base"] = base_src
    return targets


def write_json(path: str, benchmark: str, args: Any, **result: Any) -> None:
    """Saves a benchmark's result with its arguments and the machine's core count."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": benchmark, "args": vars(args), "cpus": os.cpu_count(), **result}
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {path}")


def litellm(
    name: str, port: int, config: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes] | None:
    """Starts LiteLLM's proxy on 127.0.0.1:`port` with `config` (its YAML), installing it into
    .cache/litellm-venv on first use. Returns None when it cannot be installed or has not
    answered its liveness check within 180 s; its output is in .cache/litellm-{name}.log."""
    exe = LITELLM_VENV / "bin" / "litellm"
    if not exe.exists():
        print("installing LiteLLM proxy into .cache/litellm-venv (one-off) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        pip = str(LITELLM_VENV / "bin" / "pip")
        r = subprocess.run([pip, "install", "-q", "litellm[proxy]"], check=False)
        if r.returncode != 0 or not exe.exists():
            print("LiteLLM could not be installed", flush=True)
            return None
    cfg = ROOT / ".cache" / f"litellm-{name}.yaml"
    cfg.write_text(config)
    full_env = {
        **os.environ,
        "LITELLM_LOG": "ERROR",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no cost-map download: there is no network
        "LITELLM_TELEMETRY": "False",
        **(env or {}),
    }
    log = open(ROOT / ".cache" / f"litellm-{name}.log", "wb")  # noqa: SIM115 (the child's)
    argv = [str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        [*argv, "--num_workers", "1"], stdout=log, stderr=subprocess.STDOUT, env=full_env
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/liveliness", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)  # a child's start-up, polled with a deadline
    proc.kill()
    print(f"LiteLLM did not start; see .cache/litellm-{name}.log", flush=True)
    return None


@contextlib.asynccontextmanager
async def strace_counts(pid: int, follow: bool = True) -> AsyncIterator[dict[str, int]]:
    """System calls of process `pid` by name while the block runs (`strace -c` attached;
    `follow`: its threads and children too). The dict is filled when the block ends. strace
    slows what it traces; its counts are what to read, not times."""
    with tempfile.NamedTemporaryFile(suffix=".txt", delete=False) as f:
        out = f.name
    counts: dict[str, int] = {}
    try:
        argv = ["strace", "-c", *(["-f"] if follow else []), "-p", str(pid), "-o", out]
        strace = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.PIPE)
        assert strace.stderr is not None
        # It says "Process N attached" once it counts (bounded: strace's own start).
        await asyncio.wait_for(strace.stderr.readline(), 30)
        yield counts
        strace.terminate()
        await asyncio.wait_for(strace.communicate(), 30)
        counts.update(_strace_table(out))
    finally:
        os.unlink(out)


def _strace_table(path: str) -> dict[str, int]:
    """strace -c's table: calls by system call name."""
    counts: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
            counts[parts[-1]] = int(parts[3])
    return counts


@contextlib.asynccontextmanager
async def py_spy_recording(pid: int, raw: Path, rate_hz: int) -> AsyncIterator[None]:
    """py-spy sampling process `pid` while the block runs (`record --nonblocking`; it needs
    ptrace rights on it), its raw stacks written to `raw` when the block ends."""
    raw.parent.mkdir(parents=True, exist_ok=True)
    spy = await asyncio.create_subprocess_exec(
        *(py_spy_path(), "record", "--pid", str(pid), "--rate", str(rate_hz)),
        *("--format", "raw", "--output", str(raw), "--nonblocking"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    await asyncio.sleep(1.0)  # py-spy attaches
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        await asyncio.wait_for(spy.wait(), 30)
