"""The admin API over real HTTP, beside a real gRPC server, and the dashboard in headless Chromium."""

from __future__ import annotations

import html.parser
import json
import shutil
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import ADMIN_TOKEN, TEST_SETTINGS
from service_helpers import LAYERS, make_updates, reference

from clipd.client import Client, NotFoundError
from clipd.server.admin.views import quantile_from_histogram
from clipd.server.app import create_server
from clipd.server.settings import Settings


@pytest.fixture(scope="module")
def admin_server():
    """Auth off (loopback): what the dashboard test needs. ``auth_server`` (conftest.py) has an admin token."""
    server, _ = create_server(Settings(**{**TEST_SETTINGS, "admin_port": 0}))
    yield server
    server.stop(grace=1.0)


def http(server, path, method="GET", token=None, cookie=None, body=None):
    request = urllib.request.Request(f"http://127.0.0.1:{server.admin.port}{path}", method=method, data=body)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    if cookie:
        request.add_header("Cookie", cookie)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def client_for(server):
    return Client(f"127.0.0.1:{server.port}", token=server.settings.admin_token or None, message_bytes=4096)


@pytest.fixture(scope="module")
def streamed(admin_server):
    """An aggregation with 200 examples in it (per-layer policy), and its in-process reference."""
    updates = make_updates(200, seed=11)
    with client_for(admin_server) as c:
        agg = c.create_aggregation(LAYERS, policy="per_layer_uniform", l2_norm_clip=1.0)
        c.submit(agg, updates)
    return agg, reference(updates, "per_layer_uniform", 1.0)


def test_per_layer_clip_counts_equal_the_engine(admin_server, streamed):
    agg, (_, ref_counts) = streamed
    status, body = http(admin_server, f"/api/v1/aggregations/{agg}")
    assert status == 200
    view = json.loads(body)
    assert view["examples"] == 200 and view["state"] == "open"
    assert {layer["name"]: layer["clipped"] for layer in view["layers"]} == ref_counts
    for layer in view["layers"]:
        assert layer["clip_fraction"] == pytest.approx(ref_counts[layer["name"]] / 200)
        assert sum(layer["norm_histogram"]) == 200
        assert layer["norm_ratio_quantiles"]["0.5"] > 0
    listed = json.loads(http(admin_server, "/api/v1/aggregations")[1])
    assert agg in [a["aggregation_id"] for a in listed["aggregations"]]


def test_unknown_aggregation_is_404(admin_server):
    status, body = http(admin_server, "/api/v1/aggregations/no-such-thing")
    assert status == 404 and b"no-such-thing" in body


def test_health_readiness_and_docs(admin_server):
    assert http(admin_server, "/healthz") == (200, b'{"status":"ok"}')
    assert http(admin_server, "/readyz")[0] == 200
    assert http(admin_server, "/openapi.json")[0] == 200


def test_metrics_pass_promtool_and_have_layer_labels_from_the_start(admin_server, streamed):
    with client_for(admin_server) as c:
        fresh = c.create_aggregation({"only": (3,)}, l2_norm_clip=1.0)
    status, body = http(admin_server, "/metrics")
    assert status == 200
    text = body.decode()
    agg, (_, ref_counts) = streamed
    for layer, count in ref_counts.items():
        assert f'clipd_clipped_examples_total{{aggregation="{agg}",layer="{layer}"}} {float(count)}' in text
    assert f'clipd_clipped_examples_total{{aggregation="{fresh}",layer="only"}} 0.0' in text
    assert f'clipd_layer_norm_ratio_bucket{{aggregation="{agg}",layer="w",le="+Inf"}} 200.0' in text
    for name in ("clipd_examples_total", "clipd_queue_depth", "clipd_active_streams", "clipd_device_info",
                 "clipd_non_finite_examples_total", "clipd_received_bytes_total"):
        assert name in text
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: apt-get install prometheus (.ci/run does)"
    check = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_rejections_are_counted_by_status(admin_server):
    with client_for(admin_server) as c:
        with pytest.raises(NotFoundError):
            c.stats("missing")
    text = http(admin_server, "/metrics")[1].decode()
    assert 'clipd_rejected_requests_total{code="NOT_FOUND"}' in text


def test_cancel_needs_the_token(auth_server):
    with client_for(auth_server) as c:
        agg = c.create_aggregation({"x": (2,)})
        submit_token = c.get_aggregation(agg).submit_token
    path = f"/api/v1/aggregations/{agg}"
    assert http(auth_server, path, "DELETE")[0] == 401
    assert http(auth_server, path, "DELETE", token="wrong")[0] == 403
    assert http(auth_server, path, "DELETE", token=submit_token)[0] == 403  # a submitter is no admin
    assert http(auth_server, path, "DELETE", cookie=f"clipd_admin={ADMIN_TOKEN}")[0] == 401  # writes: header only
    status, body = http(auth_server, path, "DELETE", token=ADMIN_TOKEN)
    assert status == 200 and json.loads(body)["state"] == "cancelled"
    assert http(auth_server, path, token=ADMIN_TOKEN)[0] == 404


def test_every_read_route_needs_the_admin_credential_when_auth_is_on(auth_server):
    with client_for(auth_server) as c:
        agg = c.create_aggregation({"x": (2,)})
        submit_token = c.get_aggregation(agg).submit_token
    for path in ("/api/v1/aggregations", f"/api/v1/aggregations/{agg}", "/metrics"):
        assert http(auth_server, path)[0] == 401
        assert http(auth_server, path, token="x")[0] == 403
        assert http(auth_server, path, token=submit_token)[0] == 403
        assert http(auth_server, path, token=ADMIN_TOKEN)[0] == 200
    assert http(auth_server, f"/api/v1/aggregations?token={ADMIN_TOKEN}")[0] == 401  # never a credential in a URL
    assert http(auth_server, "/healthz")[0] == 200  # probes stay open
    assert http(auth_server, "/readyz")[0] == 200


def test_the_dashboard_signs_in_with_a_cookie_not_a_url(auth_server):
    status, page = http(auth_server, "/login")
    assert status == 200 and b'name="token"' in page
    assert http(auth_server, "/login", "POST", body=b"token=nope")[0] == 403
    opener = urllib.request.build_opener(_NoRedirect)
    request = urllib.request.Request(f"http://127.0.0.1:{auth_server.admin.port}/login",
                                     data=f"token={ADMIN_TOKEN}".encode(), method="POST")
    try:
        opener.open(request, timeout=30)
        raise AssertionError("expected a redirect")
    except urllib.error.HTTPError as e:
        assert e.code == 303 and e.headers["Location"] == "/"
        cookie = e.headers["Set-Cookie"]
    assert cookie.startswith(f"clipd_admin={ADMIN_TOKEN};") and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert http(auth_server, "/api/v1/aggregations", cookie=f"clipd_admin={ADMIN_TOKEN}")[0] == 200
    assert http(auth_server, "/api/v1/aggregations", cookie="clipd_admin=nope")[0] == 403


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def test_quantiles_interpolate_within_buckets():
    # 4 examples: 2 with ratio in (1/64, 1/16], 2 in (1/16, 1/8]; the median is at 1/16.
    assert quantile_from_histogram([0, 2, 2], [1 / 64, 1 / 16, 1 / 8], 0.5) == pytest.approx(1 / 16)
    assert quantile_from_histogram([0, 0, 0], [1.0, 2.0], 0.5) is None


class _Dom(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.elements = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))


def test_dashboard_renders_the_numbers_of_the_api(admin_server, streamed, tmp_path):
    chromium = shutil.which("chromium")
    assert chromium, "chromium is missing: apt-get install chromium (.ci/run does)"
    agg, (_, ref_counts) = streamed
    url = f"http://127.0.0.1:{admin_server.admin.port}/"
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
             "--virtual-time-budget=4000", "--window-size=1280,1000"]
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    parser = _Dom()
    parser.feed(dom.stdout)
    starts = [i for i, (tag, a) in enumerate(parser.elements) if tag == "section"]
    mine = [i for i in starts if parser.elements[i][1].get("data-aggregation") == agg]
    assert mine, dom.stdout[-2000:] + dom.stderr[-2000:]
    end = next((i for i in starts if i > mine[0]), len(parser.elements))
    card = parser.elements[mine[0] : end]
    bars = {a["data-layer"]: int(a["data-clipped"]) for tag, a in card if tag == "rect" and a.get("data-layer")}
    assert bars == ref_counts
    api = json.loads(http(admin_server, f"/api/v1/aggregations/{agg}")[1])
    histogram = [int(a["data-count"]) for tag, a in card if tag == "rect" and "data-count" in a]
    assert histogram == api["example_norm_histogram"] and sum(histogram) == 200
    shot = tmp_path / "dashboard.png"
    subprocess.run([*flags, f"--screenshot={shot}", url], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000


def test_dashboard_shows_a_private_aggregation_withheld_and_warns_of_debug_mode(admin_server, tmp_path):
    """Real headless Chromium: a private card has no raw number; a debug one raises the banner."""
    from clipd.client import Privacy

    chromium = shutil.which("chromium")
    assert chromium, "chromium is missing: apt-get install chromium (.ci/run does)"
    with client_for(admin_server) as c:
        private = c.create_aggregation({"w": (4,)}, privacy=Privacy("dash", 1e-5, noise_multiplier=1.0))
        c.submit(private, {"w": np.full((5, 4), 2.0, np.float32)})
        debug = c.create_aggregation({"w": (4,)}, privacy=Privacy("dash-debug", 1e-5, noise_multiplier=1.0,
                                                                   debug_raw_statistics=True))
        c.submit(debug, {"w": np.full((5, 4), 2.0, np.float32)})
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
             "--virtual-time-budget=4000", "--window-size=1280,1000"]
    dom = subprocess.run([*flags, "--dump-dom", f"http://127.0.0.1:{admin_server.admin.port}/"],
                         capture_output=True, text=True, timeout=120).stdout
    banner = dom[dom.index('id="privacy-debug"'):].split("</p>")[0]
    assert "hidden" not in banner.split(">")[0] and "DEBUG MODE" in banner and "dash-debug" in banner
    card = dom[dom.index(f'data-aggregation="{private}"'):].split("</section>")[0]
    assert "withheld" in card and 'data-number="examples"' not in card and 'data-number="planned-epsilon"' in card
    debug_card = dom[dom.index(f'data-aggregation="{debug}"'):].split("</section>")[0]
    assert "DEBUG" in debug_card and 'data-number="examples"' in debug_card


def test_server_view_lists_the_device_and_counts_its_steps(admin_server):
    import jax

    before = json.loads(http(admin_server, "/api/v1/server")[1])["devices"]
    assert [(d["id"], d["kind"]) for d in before] == [(jax.devices()[0].id, jax.devices()[0].device_kind)]
    with client_for(admin_server) as c:
        agg = c.create_aggregation({"w": (4,)})
        c.submit(agg, {"w": np.ones((3, 4), np.float32)})
        c.finalize(agg)
    after = json.loads(http(admin_server, "/api/v1/server")[1])["devices"]
    assert after[0]["steps"] > before[0]["steps"]
