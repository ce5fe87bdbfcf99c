"""The Grafana dashboard and the PromQL in docs/observability.md name only metrics the gateway
really exports, so the dashboard does not go blank when a metric is renamed."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenpipe.observe import metrics, runtime  # noqa: F401 (runtime registers its gauges)

DOCS = Path(__file__).parent.parent / "docs"
_NAME = re.compile(r"\btokenpipe_[a-z0-9_]+")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def _exported() -> set[str]:
    names = set()
    for family in metrics.REGISTRY.collect():
        names.add(family.name)
        names.update(s.name for s in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_count", "_sum"))
    return names


def _base(name: str) -> str:
    for s in _SUFFIXES:
        if name.endswith(s):
            return name[: -len(s)]
    return name


def test_dashboard_queries_name_only_exported_metrics():
    dash = json.loads((DOCS / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 9
    exported = {_base(n) for n in _exported()}
    used = {_base(n) for e in exprs for n in _NAME.findall(e)}
    assert {"tokenpipe_ttft_seconds", "tokenpipe_itl_seconds", "tokenpipe_tpot_seconds"} <= used
    assert used <= exported, used - exported


def test_observability_doc_names_only_exported_metrics():
    text = (DOCS / "observability.md").read_text()
    exported = {_base(n) for n in _exported()}
    # `tokenpipe_local_*` names the local engine's own family (its own /metrics, docs/local.md).
    used = {_base(n) for n in _NAME.findall(text) if not n.endswith("_")}
    assert used <= exported, used - exported
