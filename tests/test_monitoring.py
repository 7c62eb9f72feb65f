"""The monitoring kit of deploy/: Prometheus' config and alert rules (promtool checks them and runs their unit
tests, deploy/prometheus/alerts_test.yml), the Grafana dashboard and its provisioning, the prometheus and grafana
services of docker-compose.yml (no Docker engine here: they are read, not run), and every clipd_* metric the
dashboard and the alerts use, against the /metrics of a real server, scraped as Prometheus does (bearer token)."""

from __future__ import annotations

import json
import math
import pathlib
import re
import shutil
import subprocess
import urllib.request
from collections import defaultdict

import yaml
from conftest import ADMIN_TOKEN
from service_helpers import LAYERS, make_updates

from clipd.client import Client, Privacy

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMETHEUS = ROOT / "deploy" / "prometheus"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "clipd.json"
ROWS = ["Server", "Aggregations", "Privacy"]
SEVERITIES = {"warning", "critical"}
# A clipd metric in a PromQL expression; recording rules' names (clipd:...) and label values don't match.
METRIC = re.compile(r"(?<![A-Za-z0-9_:])clipd_[A-Za-z0-9_]+")


# Helpers -------------------------------------------------------------------------------------------
def promtool(*args: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: apt-get install prometheus (scripts/test.sh does)"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def metric_names(expr: str) -> set[str]:
    """The clipd_* metric names a PromQL expression reads."""
    return set(METRIC.findall(expr))


def series_names(exposition: str) -> set[str]:
    """The series names a Prometheus text exposition offers, from its ``# TYPE`` lines (printed for a family
    even when it has no sample): a histogram's ``_bucket``, ``_sum`` and ``_count`` (not its bare name), a
    summary's quantiles, ``_sum`` and ``_count``, a counter's ``_total`` name, any other family's name."""
    names = set()
    for line in exposition.splitlines():
        if not line.startswith("# TYPE "):
            continue
        _, _, name, kind = line.split(maxsplit=3)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif kind == "summary":
            names |= {name, f"{name}_sum", f"{name}_count"}
        elif kind == "counter" and not name.endswith("_total"):  # OpenMetrics names the family without it
            names.add(f"{name}_total")
        else:
            names.add(name)
    return names


def unexported(used: dict[str, list[str]], exposition: str) -> dict[str, list[str]]:
    """Of ``{metric name: where it is used}``, those the exposition does not offer."""
    offered = series_names(exposition)
    return {name: where for name, where in sorted(used.items()) if name not in offered}


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(board: dict) -> list[dict]:
    """Every panel, those inside collapsed rows too."""
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def query_panels(board: dict) -> list[dict]:
    return [p for p in all_panels(board) if p["type"] != "row"]


def used_metrics() -> dict[str, list[str]]:
    """``{clipd metric name: the panels and alerts whose expressions read it}``."""
    used = defaultdict(list)
    for panel in query_panels(dashboard()):
        for target in panel["targets"]:
            for name in metric_names(target["expr"]):
                used[name].append(f"panel {panel['title']!r}")
    for rule in alert_rules():
        for name in metric_names(rule["expr"]):
            used[name].append(f"alert {rule['alert']}")
    return dict(used)


def concrete(expr: str, aggregation: str = ".*", ledger: str = ".*") -> str:
    """A dashboard expression with Grafana's variables replaced, as Grafana sends it."""
    return expr.replace("$__rate_interval", "1m").replace("$aggregation", aggregation).replace("$ledger", ledger)


def scrape(server) -> str:
    """``/metrics`` as prometheus.yml scrapes it: with the admin token."""
    request = urllib.request.Request(f"http://127.0.0.1:{server.admin.port}/metrics",
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        return response.read().decode()


def input_series(exposition: str, minutes: int) -> list[dict]:
    """promtool's input series for the clipd samples of an exposition: one target scraped each minute, the
    same values each time (rates are 0, not missing)."""
    series = []
    for line in exposition.splitlines():
        if not line.startswith("clipd_"):
            continue
        name, value = line.rsplit(" ", 1)
        name, _, labels = name.partition("{")
        labels = ",".join(filter(None, ['job="clipd"', 'instance="clipd:8080"', labels.rstrip("}")]))
        number = float(value)
        start = {math.inf: "+Inf", -math.inf: "-Inf"}.get(number, "NaN" if math.isnan(number) else repr(number))
        series.append({"series": f"{name}{{{labels}}}", "values": f"{start}+0x{minutes}"})
    series.append({"series": 'up{job="clipd", instance="clipd:8080"}', "values": f"1x{minutes}"})
    return series


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def bind_mounts(service: dict) -> dict[str, pathlib.Path]:
    """``{container path: host path}`` of a compose service's bind mounts (those from ./)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            mounts[target] = ROOT / source
    return mounts


# Prometheus: promtool --------------------------------------------------------------------------------
def test_the_alert_rules_pass_promtool_check_rules():
    check = promtool("check", "rules", "deploy/prometheus/alerts.yml")
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in check.stdout


def test_the_prometheus_config_scrapes_clipd_with_the_token_and_passes_promtool_check_config(tmp_path):
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "clipd" and job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": ["clipd:8080"]}]
    auth = job["authorization"]
    assert auth.get("type", "Bearer") == "Bearer" and auth["credentials_file"] == "/run/secrets/clipd_admin_token"
    # promtool reads the credentials file, which only the container has: the same config, its file here.
    token = tmp_path / "clipd_admin_token"
    token.write_text("a-token\n")
    job["authorization"]["credentials_file"] = str(token)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(PROMETHEUS / "alerts.yml", tmp_path / "alerts.yml")
    check = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 1 rule files found" in check.stdout + check.stderr


def test_the_alert_rules_unit_tests_pass():
    run = promtool("test", "rules", "deploy/prometheus/alerts_test.yml")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_every_alert_is_fired_by_a_test_and_quiet_on_the_healthy_server():
    rules = alert_rules()
    names = {rule["alert"] for rule in rules}
    assert len(names) == len(rules), "two alerts of one name"
    for rule in rules:
        assert "for" in rule, rule["alert"]
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())
    assert tests["rule_files"] == ["alerts.yml"]
    fired, tested = set(), set()
    quiet_together = []  # per test and evaluation time, the alerts expected not to fire
    for case in tests["tests"]:
        quiet = defaultdict(set)
        for check in case.get("alert_rule_test", []):
            tested.add(check["alertname"])
            if check.get("exp_alerts"):
                fired.add(check["alertname"])
            else:
                quiet[check["eval_time"]].add(check["alertname"])
        quiet_together.extend(quiet.values())
    # promtool passes a test of an alert that does not exist when it expects nothing: no misspelt name.
    assert tested <= names, f"tests of no alert in alerts.yml: {sorted(tested - names)}"
    assert names <= fired, f"alerts no test fires: {sorted(names - fired)}"
    assert any(names <= quiet for quiet in quiet_together), "no healthy test in which every alert stays quiet"


def test_the_metric_name_helpers_report_a_name_the_server_does_not_export():
    expr = ('rate(clipd_refused_batches_total[5m]) > 0 and clipd_made_up_total / on (job) clipd:budget:ratio'
            ' + histogram_quantile(0.9, clipd_layer_norm_ratio_bucket{job="clipd"})')
    assert metric_names(expr) == {"clipd_refused_batches_total", "clipd_made_up_total",
                                  "clipd_layer_norm_ratio_bucket"}
    exposition = "\n".join([
        "# HELP clipd_refused_batches_total Batches refused.", "# TYPE clipd_refused_batches_total counter",
        "clipd_refused_batches_total 0.0",
        "# HELP clipd_layer_norm_ratio Norm / bound.", "# TYPE clipd_layer_norm_ratio histogram",
        "# HELP clipd_queue_depth Items waiting.", "# TYPE clipd_queue_depth gauge",
    ])
    used = {name: ["test"] for name in ["clipd_refused_batches_total", "clipd_made_up_total",
                                        "clipd_layer_norm_ratio_bucket", "clipd_layer_norm_ratio_count",
                                        "clipd_layer_norm_ratio", "clipd_refused_batches", "clipd_queue_depth",
                                        "clipd_queue_depth_total"]}
    # A histogram has no series of its bare name; a counter's is its _total name; a gauge has no _total.
    assert set(unexported(used, exposition)) == {"clipd_made_up_total", "clipd_layer_norm_ratio",
                                                 "clipd_refused_batches", "clipd_queue_depth_total"}
    assert "clipd_examples_total" in series_names("# TYPE clipd_examples counter")  # OpenMetrics' family name


def test_every_metric_of_the_dashboard_and_the_alerts_is_on_a_real_servers_metrics(auth_server):
    exposition = scrape(auth_server)
    used = used_metrics()
    # Every family is printed (HELP and TYPE) whether it has samples or not: a fresh server's /metrics will do.
    for name in ("clipd_ledger_epsilon", "clipd_ledger_budget_left", "clipd_layer_norm_ratio_bucket",
                 "clipd_refused_streams_total", "clipd_aggregations", "clipd_ledger_stream_releases_left"):
        assert name in used
    missing = unexported(used, exposition)
    assert not missing, "metrics the server does not export:\n" + "\n".join(
        f"  {name}: {', '.join(where)}" for name, where in missing.items())


# Grafana -------------------------------------------------------------------------------------------------
def test_the_dashboard_is_valid_and_every_panel_has_a_query_a_data_source_and_labelled_axes():
    board = dashboard()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    panels = all_panels(board)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    assert [p["title"] for p in panels if p["type"] == "row"] == ROWS
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    cells = set()
    for panel in query_panels(board):
        where = f"panel {panel['id']} {panel.get('title')!r}"
        assert panel.get("title") and panel.get("description"), where
        assert panel["type"] in {"timeseries", "stat"}, where
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert panel["targets"], where
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), where
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"] == panel["datasource"], where
        defaults = panel["fieldConfig"]["defaults"]
        assert defaults.get("unit"), f"{where}: no unit"
        if panel["type"] == "timeseries":
            assert defaults["custom"].get("axisLabel"), f"{where}: no axis label"
            assert len(panel["targets"]) == 1 or all(t.get("legendFormat") for t in panel["targets"]), where
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, where
        mine = {(pos["x"] + i, pos["y"] + j) for i in range(pos["w"]) for j in range(pos["h"])}
        assert not cells & mine, f"{where} overlaps another panel"
        cells |= mine
    for name in ("aggregation", "ledger"):
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert any(f"${name}" in t["expr"] for p in query_panels(board) for t in p["targets"]), name


def test_the_dashboards_queries_are_promql_that_promtool_parses(tmp_path):
    """Each panel's expressions, variables filled in as Grafana does, as recording rules: promtool parses them."""
    rules = [{"record": f"dashboard:panel_{panel['id']}_{target['refId']}", "expr": concrete(target["expr"])}
             for panel in query_panels(dashboard()) for target in panel["targets"]]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    check = promtool("check", "rules", str(path))
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(rules)} rules found" in check.stdout


def test_the_dashboards_queries_show_a_real_servers_aggregation_and_ledger_and_no_alert_fires(auth_server,
                                                                                               tmp_path):
    """A real server with an aggregation (64 examples, clipped per layer) and a private ledger with a budget, its
    /metrics as 12 minutes of scrapes: each panel's query whose metrics have samples returns series (those of
    the aggregation and ledger panels for that aggregation and that ledger), and no alert fires."""
    ledger = "monitoring-ledger"
    with Client(f"127.0.0.1:{auth_server.port}", token=ADMIN_TOKEN, message_bytes=4096) as client:
        aggregation = client.create_aggregation(LAYERS, policy="per_layer_uniform", l2_norm_clip=1.0)
        client.submit(aggregation, make_updates(64, seed=5))
        private = client.create_aggregation({"w": (3,)}, l2_norm_clip=1.0, privacy=Privacy(
            ledger_id=ledger, delta=1e-5, noise_multiplier=2.0, max_epsilon=100.0))
        client.finalize(private)
    exposition = scrape(auth_server)
    sampled = {line.split("{")[0].split(" ")[0] for line in exposition.splitlines() if line.startswith("clipd_")}
    checks, skipped = [], []
    for panel in query_panels(dashboard()):
        for target in panel["targets"]:
            if not metric_names(target["expr"]) <= sampled:  # e.g. shard processes: none on this server
                skipped.append(panel["title"])
                continue
            # absent(q) is empty exactly when q returns series.
            checks.append({"expr": f"absent({concrete(target['expr'], aggregation, ledger)})", "eval_time": "10m",
                           "exp_samples": []})
    assert {"Layer norm / bound, quantiles", "Clip fraction per layer", "Budget used"} <= {
        panel["title"] for panel in query_panels(dashboard())} - set(skipped)
    quiet = [{"alertname": rule["alert"], "eval_time": "10m", "exp_alerts": []} for rule in alert_rules()]
    shutil.copy(PROMETHEUS / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "real_server_test.yml").write_text(yaml.safe_dump({
        "rule_files": ["alerts.yml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": input_series(exposition, 12), "promql_expr_test": checks,
                   "alert_rule_test": quiet}]}))
    run = promtool("test", "rules", "real_server_test.yml", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr


def test_grafana_provisioning_finds_prometheus_and_the_dashboard():
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    variable = next(v for v in dashboard()["templating"]["list"] if v["name"] == "datasource")
    assert variable["current"]["value"] == source["uid"]  # the dashboard's default data source
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert source["jsonData"]["timeInterval"] == config["global"]["scrape_interval"]
    (provider,) = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "clipd.yml").read_text())["providers"]
    assert provider["type"] == "file"
    grafana = compose()["services"]["grafana"]
    mounts = bind_mounts(grafana)
    assert mounts[provider["options"]["path"]] == GRAFANA / "dashboards"
    assert mounts["/etc/grafana/provisioning"] == GRAFANA / "provisioning"
    home = pathlib.PurePosixPath(grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert mounts[str(home.parent)] / home.name == DASHBOARD


# docker-compose.yml --------------------------------------------------------------------------------------
def test_compose_runs_prometheus_and_grafana_beside_clipd_with_mounts_that_exist():
    spec = compose()
    services = spec["services"]
    assert {"clipd", "prometheus", "grafana"} <= set(services)
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")
    for name, service in services.items():
        for target, source in bind_mounts(service).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) is not in the repository"
    prometheus = bind_mounts(services["prometheus"])
    assert prometheus["/etc/prometheus"] == PROMETHEUS  # prometheus.yml, alerts.yml: the image's config path
    for volume in services["prometheus"]["volumes"] + services["grafana"]["volumes"]:
        if volume.startswith("./"):
            assert volume.endswith(":ro"), volume
    # The token: clipd's CLIPD_ADMIN_TOKEN, a secret file in the prometheus container, prometheus.yml's
    # credentials_file; the target: the clipd service on its admin port.
    clipd_env = services["clipd"]["environment"]
    assert clipd_env["CLIPD_ADMIN_TOKEN"].startswith("${CLIPD_ADMIN_TOKEN:?")
    (secret,) = services["prometheus"]["secrets"]
    assert spec["secrets"][secret] == {"environment": "CLIPD_ADMIN_TOKEN"}
    job = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())["scrape_configs"][0]
    assert job["authorization"]["credentials_file"] == f"/run/secrets/{secret}"
    assert job["static_configs"][0]["targets"] == [f"clipd:{clipd_env['CLIPD_ADMIN_PORT']}"]
    named = {v.split(":")[0] for s in services.values() for v in s.get("volumes", []) if not v.startswith("./")}
    assert named <= set(spec["volumes"])

