"""Real processes for tests (see tokenpipe.bench.procs)."""

from tokenpipe.bench.procs import Service, gateway, sim

__all__ = ["Service", "gateway", "sim"]
