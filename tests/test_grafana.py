"""configs/grafana/minisgl.json, the Grafana dashboard of docs/metrics.md: its JSON model (the data-source
and dp_rank variables, every panel with a PromQL target on the data-source variable, every dp_rank filter a
regex match), every metric it names exported by `minisgl-run serve` (the `# TYPE` lines of a live
/metrics), and every panel's expression evaluated by a real Prometheus server scraping the server with
`--dp 2` and with one engine: each yields a finite value. Everything runs on 127.0.0.1; the servers and
Prometheus are stopped at the end."""

from __future__ import annotations

import json
import math
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import pytest
from test_metrics import NO_PROMETHEUS, Prometheus, prometheus  # noqa: F401  (the fixture)
from test_server import MODEL, PROMPTS, Server

DASHBOARD = Path(__file__).resolve().parents[1] / "configs" / "grafana" / "minisgl.json"
DATASOURCE = "${datasource}"
DP_FILTER = 'dp_rank=~"$dp_rank"'
METRIC = re.compile(r"\bminisgl_\w+")
# a metric and its label matchers, if any: `name{...}`
SELECTOR = re.compile(r"\b(minisgl_\w+)(\{[^}]*\})?")
# the front end's own series: no dp_rank label, so no dp_rank filter
FRONT_END_ONLY = {"minisgl_token_delivery_seconds"}
# Grafana's $__rate_interval here: Prometheus scrapes every second (test_metrics' fixture), and every
# expression is evaluated within this window of the requests
RATE_WINDOW = "2m"
# a prefix the requests share (prefix-cache hits), then each its own ending
SHARED = "You are a helpful assistant. Answer briefly and to the point, in plain words. " * 3
REQUESTS = 6
EVALUATE_TIMEOUT_S = 90


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, the rows' nested ones (a collapsed row keeps its panels) included."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found += panel.get("panels", [])
    return found


def graph_panels(dashboard: dict) -> list[dict]:
    return [p for p in all_panels(dashboard) if p["type"] != "row"]


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    return [(p["title"], t["expr"]) for p in graph_panels(dashboard) for t in p["targets"]]


def variable(dashboard: dict, name: str) -> dict:
    found = [v for v in dashboard["templating"]["list"] if v["name"] == name]
    assert len(found) == 1, f"templating variable {name!r}: {found}"
    return found[0]


def variable_query(var: dict) -> str:
    """A query variable's query: a string, or (Grafana 10's Prometheus editor) an object with `query`."""
    query = var["query"]
    return query["query"] if isinstance(query, dict) else query


def label_values_metric(dashboard: dict) -> str:
    """The metric whose dp_rank values the dp_rank variable lists."""
    query = variable_query(variable(dashboard, "dp_rank"))
    match = re.fullmatch(r"label_values\(\s*(minisgl_\w+)\s*,\s*dp_rank\s*\)", query)
    assert match, query
    return match.group(1)


def for_prometheus(expr: str) -> str:
    """A panel's expression as Grafana sends it with every replica selected ("All")."""
    promql = expr.replace("$dp_rank", ".*").replace("$__rate_interval", RATE_WINDOW)
    assert "$" not in promql, f"a Grafana variable this test does not substitute: {expr}"
    return promql


# -- the JSON model -----------------------------------------------------------------------------


def test_dashboard_model() -> None:
    dashboard = load_dashboard()
    assert dashboard["title"] and dashboard["uid"]
    assert dashboard["schemaVersion"] >= 36  # Grafana 9.x/10's model
    assert dashboard.get("id") is None  # importable as new

    source = variable(dashboard, "datasource")
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    ranks = variable(dashboard, "dp_rank")
    assert ranks["type"] == "query" and ranks["datasource"]["uid"] == DATASOURCE
    assert ranks["multi"] is True and ranks["includeAll"] is True and ranks["allValue"] == ".*"
    label_values_metric(dashboard)

    # one way of naming the data source throughout: the variable (no import-time ${DS_...} input)
    text = DASHBOARD.read_text()
    assert set(re.findall(r"\$\{[^}]*\}", text)) == {DATASOURCE}

    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in panels:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
    graphs = graph_panels(dashboard)
    assert graphs
    for panel in graphs:
        title = panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE}, title
        assert panel["targets"], f"{title}: no target"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), title
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], title
            expr = target["expr"]
            assert METRIC.search(expr), f"{title}: names no minisgl metric: {expr}"
            assert not re.search(r"dp_rank\s*(=[^~]|!)", expr), f"{title}: not a regex match: {expr}"
            # every replica series filtered by the variable, as a regex: `.*` also matches the series
            # of a one-engine server, which carry no dp_rank label
            for name, matchers in SELECTOR.findall(expr):
                family = re.sub(r"_(bucket|sum|count)$", "", name)
                if family in FRONT_END_ONLY:
                    assert "dp_rank" not in matchers, f"{title}: {expr}"
                else:
                    assert DP_FILTER in matchers, f"{title}: {name} without {DP_FILTER}: {expr}"


# -- a live server: the metrics exist, and Prometheus evaluates every panel ----------------------


def send_requests(server: Server, count: int) -> None:
    """`count` completions at once (half streamed), each 6 tokens; all must succeed."""

    def one(i: int) -> None:
        stream = i % 2 == 0
        body = {
            "model": MODEL,
            "prompt": SHARED + PROMPTS[i % len(PROMPTS)],
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
        response = httpx.post(server.url + "/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        if stream:
            assert response.text.rstrip().endswith("data: [DONE]"), response.text[-500:]

    with ThreadPoolExecutor(count) as pool:
        list(pool.map(one, range(count)))


@pytest.fixture(scope="module", params=["2", "1"], ids=["dp2", "dp1"])
def server(request, tiny_server_args: list[str]) -> Iterator[Server]:
    """`minisgl-run serve --dp N`, with every family's series present: one round of requests served
    before the tests look. The metrics are the front end's and the schedulers', whatever the model: a
    tiny one served as the default one (conftest.py)."""
    srv = Server(*tiny_server_args, "--dp", request.param, "--max-running-req", "8")
    try:
        send_requests(srv, 4)
        yield srv
    finally:
        assert srv.stop() == 0, srv.output()


def server_dp(server: Server) -> str:
    """The --dp the server was started with."""
    args = server.proc.args
    return args[args.index("--dp") + 1]


@pytest.fixture
def metrics_port(server: Server) -> int:
    """The port test_metrics' `prometheus` fixture scrapes: the server's own (its /metrics)."""
    return server.port


def exported(text: str) -> tuple[set[str], set[str]]:
    """The series names a Prometheus exposition declares in its `# TYPE` lines (a histogram as its
    _bucket, _sum and _count series, a counter by its _total name) and those it has samples of."""
    declared, sampled = set(), set()
    for line in text.splitlines():
        words = line.split()
        if len(words) == 4 and words[:2] == ["#", "TYPE"]:
            name, kind = words[2], words[3]
            if kind in ("histogram", "summary"):
                declared |= {f"{name}_sum", f"{name}_count"}
                declared.add(f"{name}_bucket" if kind == "histogram" else name)
            elif kind == "counter":
                declared.add(name if name.endswith("_total") else f"{name}_total")
            else:
                declared.add(name)
        elif line and not line.startswith("#"):
            sampled.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return declared, sampled


@pytest.mark.slow
def test_every_metric_the_dashboard_names_is_exported(server: Server) -> None:
    dashboard = load_dashboard()
    text = httpx.get(server.base + "/metrics", timeout=30).text
    declared, sampled = exported(text)
    used = {name for _, expr in expressions(dashboard) for name in METRIC.findall(expr)}
    used.add(label_values_metric(dashboard))
    assert used - declared == set(), f"not in the server's # TYPE lines: {sorted(used - declared)}"
    assert used - sampled == set(), f"declared but without a sample: {sorted(used - sampled)}"


def evaluate(prom: Prometheus, promql: str) -> list[dict] | None:
    """An instant query's result; None where Prometheus did not answer (it fails the test on an
    expression it rejects)."""
    url = f"http://127.0.0.1:{prom.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            reply = json.loads(response.read())
    except urllib.error.HTTPError as e:
        if e.code in (400, 422):  # bad_data, execution: the expression itself
            pytest.fail(f"Prometheus rejects {promql!r}: {e.read().decode(errors='replace')}")
        return None
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def label_values(prom: Prometheus, label: str, metric: str) -> list[str]:
    """What Grafana's `label_values(metric, label)` lists."""
    query = urllib.parse.urlencode({"match[]": metric})
    url = f"http://127.0.0.1:{prom.port}/api/v1/label/{label}/values?{query}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())["data"]


def finite(result: list[dict] | None) -> bool:
    return bool(result) and any(math.isfinite(float(series["value"][1])) for series in result)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason=NO_PROMETHEUS)
def test_prometheus_evaluates_every_panel(server: Server, prometheus: Prometheus) -> None:  # noqa: F811
    dashboard = load_dashboard()
    # a scrape from before the requests, so that every rate sees them as an increase
    baseline = 'minisgl_e2e_request_latency_seconds_count{job="minisgl"}'
    deadline = time.monotonic() + 30
    while not evaluate(prometheus, baseline):
        assert time.monotonic() < deadline, f"no scrape of the server in 30 s:\n{prometheus.log_tail()}"
        time.sleep(0.5)
    send_requests(server, REQUESTS)

    queries = {for_prometheus(expr): title for title, expr in expressions(dashboard)}
    last: dict[str, list[dict] | None] = {}
    deadline = time.monotonic() + EVALUATE_TIMEOUT_S
    while True:
        for promql in queries:
            if not finite(last.get(promql)):
                last[promql] = evaluate(prometheus, promql)
        missing = [q for q in queries if not finite(last[q])]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not missing, (
        f"{len(missing)} of {len(queries)} panel expressions without a finite value in "
        f"{EVALUATE_TIMEOUT_S} s:\n"
        + "\n".join(f"  [{queries[q]}] {q} -> {last[q]}" for q in missing)
        + f"\nPrometheus log:\n{prometheus.log_tail()}"
    )

    # the dp_rank variable lists each replica; a one-engine server's series carry no dp_rank, so the
    # variable offers only "All" (.*), which the filters above matched
    dp = int(server_dp(server))
    ranks = label_values(prometheus, "dp_rank", label_values_metric(dashboard))
    assert ranks == ([str(rank) for rank in range(dp)] if dp > 1 else [])
