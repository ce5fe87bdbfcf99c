"""nginx as a mock upstream that costs next to nothing: every POST gets the same recorded SSE
answer, `GET /v1/models` the recorded model list (`return 200 '...'`, no file, no proxy).
A benchmark that wants the gateway's own CPU puts this behind it instead of the sim, whose
Python would share the 2 cores with it. `proxy` is nginx as a streaming reverse proxy: a
compiled hop measured on this machine beside the Python ones. Debian: `apt-get install
nginx-light`."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from _common import free_port, stop, wait_listening


def binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
    )


def record(sim_url: str, max_tokens: int = 1, stream: bool = True) -> tuple[bytes, bytes]:
    """(the sim's streamed answer to a chat request as the gateway sends it, usage asked
    for, or with `stream` False its whole answer; its /v1/models), as bytes to replay."""
    body: dict[str, object] = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hello " * 24}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(
        sim_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        answer = r.read()
    with urllib.request.urlopen(sim_url + "/v1/models", timeout=30) as r:
        models = r.read()
    return answer, models


def _quoted(data: bytes) -> str:
    """`data` as an nginx quoted string. `$` would be read as a variable: refused."""
    text = data.decode()
    if "$" in text:
        raise ValueError("the recorded answer holds a '$', which nginx would expand")
    escaped = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
    return "'" + escaped.replace("\r", "\\r") + "'"


class Nginx:
    """A running one-process nginx: its base URL (no /v1) and pid (for CPU and pinning)."""

    def __init__(self, url: str, pid: int) -> None:
        self.url = url
        self.pid = pid


@contextlib.contextmanager
def _running(server_block: str, http_extra: str = "", scheme: str = "http") -> Iterator[Nginx]:
    """nginx (one process, no daemon) with one `server {...}` listening on a free loopback
    port, which `server_block` names as `{port}` (`scheme`: the URL's, https when the block
    listens with `ssl`)."""
    exe = binary()
    if exe is None:
        raise RuntimeError("nginx is not installed (Debian: apt-get install nginx-light)")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tokenpipe-nginx-") as tmp:
        conf = Path(tmp) / "nginx.conf"
        temps = " ".join(
            f"{kind}_temp_path {tmp}/{kind};"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        conf.write_text(
            f"""daemon off; master_process off; worker_processes 1;
pid {tmp}/nginx.pid; error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off; keepalive_requests 10000000; keepalive_timeout 300s; {temps}
  {http_extra}
  {server_block.replace("{port}", str(port))}
}}
"""
        )
        proc = subprocess.Popen([exe, "-p", tmp, "-c", str(conf)], stderr=subprocess.PIPE)
        try:
            try:
                wait_listening(port, 10, proc)
            except RuntimeError:
                err = proc.stderr.read().decode() if proc.poll() is not None and proc.stderr else ""
                raise RuntimeError(f"nginx did not start: {err}") from None
            yield Nginx(f"{scheme}://127.0.0.1:{port}", proc.pid)
        finally:
            stop(proc, 5)


@contextlib.contextmanager
def mock_upstream(
    answer: bytes, models: bytes, content_type: str = "text/event-stream"
) -> Iterator[str]:
    """A one-process nginx on loopback serving `answer` (`content_type`) to every request
    but `GET /v1/models` (`models`, JSON). Yields its base URL (no /v1)."""
    server = f"""server {{
    listen 127.0.0.1:{{port}};
    location = /v1/models {{ default_type application/json; return 200 {_quoted(models)}; }}
    location / {{ default_type {content_type}; return 200 {_quoted(answer)}; }}
  }}"""
    with _running(server) as n:
        yield n.url


@contextlib.contextmanager
def tls_proxy(upstream_url: str) -> Iterator[tuple[Nginx, Path]]:
    """nginx terminating TLS in front of `upstream_url` (http://host:port), with a
    certificate for 127.0.0.1 from a throw-away CA (trustme): an https upstream, as every
    provider's is, for the gateway's side of TLS. Yields the proxy (an https URL) and the
    CA's certificate, which its clients trust through `SSL_CERT_FILE`. Kept-alive
    connections both ways; TLS as nginx negotiates it by default (1.3 with OpenSSL 3)."""
    import trustme  # (a dev dependency: the TLS tests use it too)

    host_port = upstream_url.split("//", 1)[1].rstrip("/")
    upstream = f"upstream up {{ server {host_port}; keepalive 256; keepalive_requests 10000000; }}"
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="tokenpipe-tls-") as tmp:
        cert, key, ca_file = (Path(tmp) / name for name in ("cert.pem", "key.pem", "ca.pem"))
        cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
        key.write_bytes(leaf.private_key_pem.bytes())
        ca.cert_pem.write_to_path(str(ca_file))
        server = f"""server {{
    listen 127.0.0.1:{{port}} ssl;
    ssl_certificate {cert}; ssl_certificate_key {key};
    location / {{
      proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_buffering off; proxy_read_timeout 300s;
    }}
  }}"""
        with _running(server, upstream, scheme="https") as n:
            yield n, ca_file


@contextlib.contextmanager
def proxy(upstream_url: str) -> Iterator[Nginx]:
    """A one-process nginx on loopback as a streaming reverse proxy to `upstream_url` (a
    base URL, http://host:port): what a compiled hop with no features costs on this
    machine, beside the Python ones. HTTP/1.1 and kept-alive connections both ways (as
    tokenpipe and the bare relay keep theirs), each upstream read sent on at once
    (`proxy_buffering off`: an SSE proxy's setting), the request body read whole first
    (nginx's default; a chat request is one read)."""
    host_port = upstream_url.split("//", 1)[1].rstrip("/")
    upstream = f"upstream up {{ server {host_port}; keepalive 256; keepalive_requests 10000000; }}"
    server = """server {
    listen 127.0.0.1:{port};
    location / {
      proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_buffering off; proxy_read_timeout 300s;
    }
  }"""
    with _running(server, upstream) as n:
        yield n
