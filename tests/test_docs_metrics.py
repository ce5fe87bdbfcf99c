"""docs/observability.md's metrics table equals what a real gateway exposes on /metrics.

"Exposed" is read from a running gateway's text exposition: every registered family prints a
`# TYPE` line even before it has children, so the `# TYPE` names are the families that the
gateway process really registered (lazily imported modules included once the process runs).
A few requests (stream, unary, completions, an error) create labelled children, whose sample
labels are checked against the table's labels column.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

from tests import procs

DOC = Path(__file__).parent.parent / "docs" / "observability.md"
_ROW = re.compile(r"^\| `(tokenpipe_[a-z0-9_]+)` \| (\w+) \| ([^|]*) \|", re.M)


def _doc_table() -> dict[str, tuple[str, set[str]]]:
    rows = {}
    for name, kind, labels in _ROW.findall(DOC.read_text()):
        rows[name] = (kind, set(re.findall(r"`([a-z_]+)`", labels)))
    return rows


def _post(url: str, body: dict[str, object]) -> None:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        urllib.request.urlopen(req, timeout=30).read()
    except urllib.error.HTTPError as e:
        e.read()


def test_docs_metrics_table_matches_gateway_exposition() -> None:
    msg = [{"role": "user", "content": "hi"}]
    sim = procs.sim("--ttft-ms", "1", "--itl-ms", "1", "--output-tokens", "5")
    with sim as s, procs.gateway("--upstream", s.url + "/v1") as g:
        v1 = g.url + "/v1"
        _post(v1 + "/chat/completions", {"model": "sim-model", "messages": msg, "stream": True})
        _post(v1 + "/chat/completions", {"model": "sim-model", "messages": msg})
        _post(v1 + "/completions", {"model": "sim-model", "prompt": "hi", "max_tokens": 3})
        _post(v1 + "/chat/completions", {"model": "sim-model", "messages": []})
        text = urllib.request.urlopen(g.url + "/metrics", timeout=30).read().decode()
    types = dict(re.findall(r"^# TYPE (tokenpipe_\S+) (\w+)", text, re.M))
    # Counters are shown as Prometheus exposes them, with `_total`.
    exposed = {
        n if t != "counter" or n.endswith("_total") else n + "_total": t for n, t in types.items()
    }
    doc = _doc_table()
    gateway_doc = {n: v for n, v in doc.items() if not n.startswith("tokenpipe_local_")}
    missing_in_doc = sorted(set(exposed) - set(gateway_doc))
    not_exposed = sorted(set(gateway_doc) - set(exposed))
    assert not missing_in_doc and not not_exposed, (
        f"exposed by /metrics but missing from docs/observability.md: {missing_in_doc}; "
        f"in docs/observability.md but not exposed: {not_exposed}"
    )
    wrong_type = {n: (doc[n][0], t) for n, t in exposed.items() if doc[n][0] != t}
    assert not wrong_type, f"type in docs vs /metrics: {wrong_type}"
    seen: dict[str, set[str]] = {}
    for name, labels in re.findall(r"^(tokenpipe_\w+)\{([^}]*)\}", text, re.M):
        fam = re.sub(r"_(bucket|sum|count|created)$", "", name)
        fam = fam if fam in exposed else name
        seen.setdefault(fam, set()).update(re.findall(r'(\w+)="', labels))
    wrong_labels = {
        n: (sorted(doc[n][1]), sorted(ls - {"le"}))
        for n, ls in seen.items()
        if n in doc and ls - {"le"} != doc[n][1]
    }
    assert not wrong_labels, f"labels in docs vs /metrics: {wrong_labels}"
    assert "tokenpipe_requests_total" in seen  # the requests above did create children
