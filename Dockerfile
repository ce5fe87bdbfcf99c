# tokenpipe gateway image. Written with care but not built on the development machines (no
# container engine runs there); tests/test_packaging_deploy.py checks what it can without one:
# the command it runs and the config it ships are valid.
#
#   docker build -t tokenpipe .
#   docker run --rm -p 8000:8000 -v $PWD/deploy/tokenpipe.yaml:/etc/tokenpipe/config.yaml:ro tokenpipe
#
# Two stages: wheels are built (with a compiler, for any dependency without a binary wheel)
# in the first; the runtime stage installs only those wheels, has no compiler, runs as an
# unprivileged user, and needs no network at start.

ARG PYTHON=3.11

FROM python:${PYTHON}-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# The package and every dependency as wheels; the `local` extra (llama.cpp, a model) is left
# out: an image is for fronting real upstreams.
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:${PYTHON}-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links=/wheels tokenpipe \
 && rm -rf /wheels \
 && useradd --system --uid 10001 --no-create-home tokenpipe
USER 10001
# HTTP (OpenAI API, /metrics, /healthz, /readyz) and gRPC.
EXPOSE 8000 50051
# Liveness without curl (not in the slim image): the stdlib's HTTP client.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status != 200)"]
# SIGTERM starts the graceful drain (server.drain_seconds); give the container runtime a stop
# timeout longer than that (compose.yaml: stop_grace_period).
STOPSIGNAL SIGTERM
ENTRYPOINT ["tokenpipe"]
CMD ["serve", "--config", "/etc/tokenpipe/config.yaml", "--host", "0.0.0.0", "--log-format", "json"]
