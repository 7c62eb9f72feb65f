"""The dashboard in real headless Chromium against a real server holding real aggregations (open, finalized,
failed, private), every number it shows compared with the admin API's JSON; and the throughput series behind it.
A buffered stream lives on a second server, with auth on (its participation limits need client ids from
credentials), whose dashboard a browser signs in to.

One server and one set of aggregations serve the whole module; the pages are loaded once, in parallel.
Screenshots land in ``tests/.artifacts/dashboard/`` (git-ignored) for a person to look at; they are not compared.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import html.parser
import json
import pathlib
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import ADMIN_TOKEN, TEST_SETTINGS
from helpers import wait_until
from service_helpers import LAYERS, make_updates

from clipd.client import Audit, Buffer, Client, FailedPreconditionError, NotFoundError, Privacy
from clipd.server.aggregations import Aggregation, AggregationSpec
from clipd.server.app import create_server
from clipd.server.progress import THROUGHPUT_SECONDS
from clipd.server.settings import Settings

ARTIFACTS = pathlib.Path(__file__).resolve().parent / ".artifacts" / "dashboard"
NASTY = '<img src=x id="pwned" onerror="document.title=1">&amp;'  # a layer name: clients choose them
PRIVACY = Privacy("dashboard-ledger", 1e-5, noise_multiplier=0.5, max_epsilon=20.0, metrics_noise_multiplier=5.0,
                  audit=Audit(canaries=2))


STREAM_PRIVACY = Privacy("dashboard-stream", 1e-5, noise_multiplier=1.0, max_participations=10, min_separation=1)


def http_json(server, path, token=None):
    request = urllib.request.Request(f"http://127.0.0.1:{server.admin.port}{path}",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """A server (SQLite store) with a failed, an open, a finalized and two private aggregations, and a rejection."""
    data_dir = tmp_path_factory.mktemp("clipd-dashboard")
    server, _ = create_server(Settings(**{**TEST_SETTINGS, "admin_port": 0, "data_dir": str(data_dir)}))
    ids = {}
    try:
        with Client(f"127.0.0.1:{server.port}", message_bytes=4096) as c:
            # Failed, by a real fault: checkpoints can't be written (states/ is a file), then they can again.
            ids["failed"] = c.create_aggregation(LAYERS)
            states = data_dir / "states"
            shutil.rmtree(states)
            states.write_text("not a directory")
            with pytest.raises(FailedPreconditionError, match="checkpoint failed"):
                c.submit(ids["failed"], make_updates(5), client_id="frank")
            states.unlink()
            states.mkdir()
            # Open: three clients, each in a second of its own (the throughput series has points in three
            # seconds): the next starts once the clock has passed into the next whole second (the series' unit),
            # not a fixed 1 s later.
            ids["open"] = c.create_aggregation(LAYERS, policy="per_layer_uniform", l2_norm_clip=1.0)
            for k in range(3):
                if k:
                    second = int(time.time())
                    wait_until(lambda second=second: int(time.time()) > second, 2, "the next second")
                c.submit(ids["open"], make_updates(40 + 20 * k, seed=k), client_id=f"site-{k}")
            ids["finalized"] = c.create_aggregation({NASTY: (3,), "b": (2,)}, l2_norm_clip=2.0)
            c.submit(ids["finalized"], {NASTY: np.full((6, 3), 1.5, np.float32), "b": np.ones((6, 2), np.float32)})
            c.finalize(ids["finalized"])
            # Private, per client (a server without auth: its client ids are self-asserted, and shown so).
            ids["private"] = c.create_aggregation({"w": (4,)}, privacy=PRIVACY, unit="client")
            c.submit(ids["private"], {"w": np.full((8, 4), 2.0, np.float32)})
            c.finalize(ids["private"])
            c.close_audit(PRIVACY.ledger_id)  # its bound beside the claim, on the ledger's panel
            ids["private_open"] = c.create_aggregation({"w": (4,)}, privacy=PRIVACY, unit="client")
            with pytest.raises(NotFoundError):
                c.stats("no-such-aggregation")  # a rejection, counted by code
        yield server, ids
    finally:
        server.stop(grace=1.0)


@pytest.fixture(scope="module")
def streaming(auth_server):
    """A buffered stream (K = 2) on the server with auth on: version 1 released from two fresh contributions, then
    one a version stale in version 2's buffer (1 of 2)."""
    update = {"w": np.ones(8, np.float32) * 0.1}
    with Client(f"127.0.0.1:{auth_server.port}", token=ADMIN_TOKEN) as admin:
        sid = admin.create_stream({"w": (8,)}, l2_norm_clip=1.0, privacy=STREAM_PRIVACY,
                                  buffer=Buffer(size=2, staleness_exponent=0.5, max_staleness=10))
        admin.submit_to_stream(sid, update, trained_from=0, client_id="s0")
        admin.submit_to_stream(sid, update, trained_from=0, client_id="s1")
        with contextlib.closing(admin.watch_releases(sid, after=0, timeout=30)) as releases:
            assert next(releases).version == 1
        assert admin.submit_to_stream(sid, update, trained_from=0, client_id="s2").staleness == 1
    return auth_server, sid


def signed_in(server) -> str:
    """A page whose form signs in with the admin token (POST /login: a session cookie), landing on the overview."""
    return (f"data:text/html,<form method=post action='http://127.0.0.1:{server.admin.port}/login'>"
            f"<input name=token value={ADMIN_TOKEN}></form><script>document.forms[0].submit()</script>")


def chromium_flags(profile: pathlib.Path) -> list[str]:
    chromium = shutil.which("chromium")
    assert chromium, "chromium is missing: apt-get install chromium (.ci/run does)"
    return [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--no-first-run", f"--user-data-dir={profile}",
            "--virtual-time-budget=4000", "--window-size=1280,2000"]


def load(url: str, profile: pathlib.Path, screenshot: pathlib.Path | None = None) -> str:
    """The page's DOM after its first refreshes (or, with ``screenshot``, a PNG of it)."""
    what = [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    done = subprocess.run([*chromium_flags(profile), *what, url], capture_output=True, text=True, timeout=120)
    assert screenshot or 'data-loaded="true"' in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def pages(deployment, streaming, tmp_path_factory):
    """Every view the tests read, loaded at once (three browsers at a time), and three screenshots."""
    server, ids = deployment
    stream_server, _ = streaming
    base = f"http://127.0.0.1:{server.admin.port}/"
    profiles = tmp_path_factory.mktemp("chromium")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    views = {
        "overview": (base, None),
        "failed": (base + "#filter=failed", None),
        "detail": (base + f"#/aggregations/{ids['open']}", None),
        "detail again": (base + f"#/aggregations/{ids['open']}", None),
        "private": (base + f"#/aggregations/{ids['private']}", None),
        "finalized": (base + f"#/aggregations/{ids['finalized']}", None),
        "overview.png": (base, ARTIFACTS / "overview.png"),
        "detail.png": (base + f"#/aggregations/{ids['open']}", ARTIFACTS / "detail.png"),
        "streams": (signed_in(stream_server), None),
        "streams.png": (signed_in(stream_server), ARTIFACTS / "streams.png"),
    }
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(load, url, profiles / str(i), shot)
                   for i, (name, (url, shot)) in enumerate(views.items())}
        return {name: future.result() for name, future in futures.items()}


class Dom(html.parser.HTMLParser):
    """The elements of a page as a tree: (tag, attributes, children, text)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.root = Node("root", {})
        self._stack = [self.root]
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs))
        self._stack[-1].children.append(node)
        if tag not in ("meta", "link", "br", "img", "input"):
            self._stack.append(node)

    def handle_endtag(self, tag):
        for i in range(len(self._stack) - 1, 0, -1):
            if self._stack[i].tag == tag:
                del self._stack[i:]
                return

    def handle_data(self, data):
        self._stack[-1].children.append(data)


class Node:
    def __init__(self, tag, attrs):
        self.tag, self.attrs, self.children = tag, attrs, []

    @property
    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text for c in self.children)

    def all(self, tag: str | None = None, **attrs) -> list[Node]:
        """Every element below of this tag with these attributes (``data_value``: data-value; ``class_``: one of
        its classes; a value of True: present with any value)."""
        found = []
        for child in self.children:
            if isinstance(child, Node):
                if (tag is None or child.tag == tag) and all(child.has(k, v) for k, v in attrs.items()):
                    found.append(child)
                found.extend(child.all(tag, **attrs))
        return found

    def has(self, key: str, value) -> bool:
        name = key.rstrip("_").replace("_", "-")
        if name not in self.attrs:
            return False
        if value is True:
            return True
        return value in self.attrs[name].split() if name == "class" else self.attrs[name] == value

    def one(self, tag: str | None = None, **attrs) -> Node:
        found = self.all(tag, **attrs)
        assert len(found) == 1, (tag, attrs, [f.attrs for f in found])
        return found[0]


def dom(pages, name) -> Node:
    return Dom(pages[name]).root


def shown(node: Node, api_value) -> None:
    """``node`` shows the API's value: its data-value is the value and its text has the number; "—" if absent."""
    if api_value is None:
        assert node.text == "—" and "data-value" not in node.attrs, (node.attrs, node.text)
        return
    if isinstance(api_value, bool):
        assert node.attrs["data-value"] == str(api_value).lower() and node.text == ("yes" if api_value else "no")
    elif isinstance(api_value, str):
        assert node.attrs["data-value"] == api_value
    else:
        assert float(node.attrs["data-value"]) == pytest.approx(api_value, rel=1e-12, abs=0), node.attrs


def count_text(node: Node) -> int:
    return int(node.text.replace(",", ""))


def test_the_server_panel_shows_the_api_s_numbers(deployment, pages):
    server, _ = deployment
    panel = dom(pages, "overview").one(id="server")
    api = http_json(server, "/api/v1/server")
    paths = ("serving", "streams.active", "streams.limit", "streams.refused", "buffered_bytes.used",
             "buffered_bytes.limit", "refused_batches", "restarts", "payload_bytes_received", "shard_payload_bytes",
             "started_unix_seconds", "queue_depth")
    for path in paths:
        value = api
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        shown(panel.one(data_server=path), value)
        if isinstance(value, int) and not isinstance(value, bool) and "bytes" not in path:
            assert count_text(panel.one(data_server=path)) == value  # what a person reads
    if "uptime_seconds" in api:  # read a little after the page: the page's is at most that
        assert 0 <= float(panel.one(data_server="uptime_seconds").attrs["data-value"]) <= api["uptime_seconds"]
    assert api["rejections"].get("NOT_FOUND", 0) >= 1
    for code, count in api["rejections"].items():
        assert count_text(panel.one(data_rejection=code)) == count
    for device in api["devices"]:
        row = panel.one(data_device=str(device["id"]))
        assert count_text(row.one(data_col="steps")) == device["steps"] > 0
        assert device["kind"] in row.text
    assert api["shard_processes"] == [] and not panel.all(data_process=True)  # one process: no such table


def test_the_ledger_panel_shows_epsilon_budget_and_releases(deployment, pages):
    server, _ = deployment
    panel = dom(pages, "overview").one(id="ledgers")
    (ledger,) = [x for x in http_json(server, "/api/v1/ledgers")["ledgers"] if x["ledger_id"] == PRIVACY.ledger_id]
    assert ledger["epsilon"] > 0
    row = panel.one(data_ledger=PRIVACY.ledger_id)
    shown(row.one(data_ledger_field="epsilon"), ledger["epsilon"])
    shown(row.one(data_ledger_field="max_epsilon"), ledger["max_epsilon"])
    shown(row.one(data_ledger_field="delta"), ledger["delta"])
    shown(row.one(data_ledger_field="entries"), len(ledger["entries"]))
    assert len(ledger["entries"]) == 1
    shown(row.one(data_ledger_field="mechanism"), "independent")
    shown(row.one(data_ledger_field="unit"), "client")
    shown(row.one(data_ledger_field="client_ids"), "self_asserted")
    assert "self-asserted" in row.one(data_ledger_field="client_ids").text and ledger["client_ids"] == "self_asserted"
    shown(row.one(data_ledger_field="participation_refusals"), ledger["participation_refusals"])
    audit = ledger["audit"]  # closed: the audit's lower bound beside the claim, at its confidence
    assert audit["closed"] and audit["releases"] == 1 and audit["canaries"] == 2 and not audit["refuted"]
    assert row.one(data_audit="closed").text.startswith("audit: ε ≥ ")
    for key in ("epsilon_lower", "epsilon_claimed", "epsilon_ceiling", "canaries", "releases"):
        shown(row.one(data_ledger_field=f"audit.{key}"), audit[key])
    assert row.one(data_ledger_field="audit.confidence").text == "95%"
    assert row.all(class_="gauge")  # spent against the budget
    shown(row.one(data_ledger_field="budget_left"), ledger["budget_left"])
    assert f"{ledger['epsilon']:.4g}" in row.one(data_ledger_field="epsilon").text


def test_the_streams_panel_shows_each_stream_as_the_api_does(streaming, pages):
    server, sid = streaming
    listed = http_json(server, "/api/v1/streams", ADMIN_TOKEN)["streams"]
    (api,) = [s for s in listed if s["stream_id"] == sid]
    assert http_json(server, f"/api/v1/streams/{sid}", ADMIN_TOKEN) == api
    # What the fixture made: version 1 released, a contribution one version stale in version 2's buffer.
    assert (api["state"], api["version"], api["filling_version"]) == ("open", 1, 2)
    assert (api["buffer"]["filled"], api["buffer"]["size"]) == (1, 2)
    assert api["staleness"]["by_staleness"] == {"0": 2, "1": 1} and api["staleness"]["contributions"] == 3
    assert api["staleness"]["mean"] == pytest.approx(1 / 3) and api["ledger_id"] == STREAM_PRIVACY.ledger_id
    ledger = http_json(server, f"/api/v1/ledgers/{STREAM_PRIVACY.ledger_id}", ADMIN_TOKEN)
    assert api["ledger_epsilon"] == ledger["epsilon"] > 0
    panel = dom(pages, "streams").one(id="streams")
    assert [b.attrs["data-stream"] for b in panel.all(data_stream=True)] == [s["stream_id"] for s in listed]
    block = panel.one(data_stream=sid)
    assert block.one("h4").text.startswith(sid)
    counts = ("version", "filling_version", "buffer.filled", "buffer.size", "staleness.contributions", "staleness.max",
              "participation.max_participations", "participation.min_separation")
    for path in ("state", "mechanism", "ledger_id", "releases_per_minute", "staleness.mean", "staleness.exponent",
                 "ledger_epsilon", "max_epsilon", "created_unix_seconds", *counts):
        value = api
        for key in path.split("."):
            value = value[key]
        shown(block.one(data_stream_field=path), value)
        if path in counts:
            assert count_text(block.one(data_stream_field=path)) == value  # what a person reads
    assert block.one(data_stream_field="state").text == "open" and not block.all(class_="error")  # no reason
    assert api["max_epsilon"] == "inf" and block.one(data_stream_field="max_epsilon").text == "no budget"
    assert f"{api['ledger_epsilon']:.4g}" in block.one(data_stream_field="ledger_epsilon").text
    assert block.one(data_stream_field="staleness.mean").text == "0.3333"
    by_staleness = api["staleness"]["by_staleness"]
    assert {n.attrs["data-staleness"] for n in block.all(data_staleness=True)} == set(by_staleness)
    for tau, n in by_staleness.items():
        shown(block.one(data_staleness=tau), n)
        assert count_text(block.one(data_staleness=tau)) == n
    assert block.all(class_="gauge")  # the open buffer's fill


def test_without_a_stream_the_panel_says_how_to_make_one(deployment, pages):
    server, _ = deployment
    assert http_json(server, "/api/v1/streams") == {"streams": []}
    panel = dom(pages, "overview").one(id="streams")
    assert not panel.all(data_stream=True)
    assert panel.one(class_="muted").text == "No buffered stream: Client.create_stream makes one."


def test_every_aggregation_has_a_card_with_what_a_person_recognises(deployment, pages):
    server, ids = deployment
    page = dom(pages, "overview")
    listed = http_json(server, "/api/v1/aggregations")
    assert abs(listed["now_unix_seconds"] - time.time()) < 5
    cards = {c.attrs["data-aggregation"]: c for c in page.all(data_aggregation=True)}
    assert set(cards) == {a["aggregation_id"] for a in listed["aggregations"]} == set(ids.values())
    for agg in listed["aggregations"]:
        card = cards[agg["aggregation_id"]]
        assert card.attrs["data-state"] == agg["state"]
        assert card.one(href=f"#/aggregations/{agg['aggregation_id']}").text == agg["aggregation_id"]
        shown(card.one(data_field="created"), agg["created_unix_seconds"])
        assert time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(agg["created_unix_seconds"])) == \
            card.one(data_field="created").text  # local time
        age = float(card.one(data_field="age").attrs["data-value"])
        assert 0 <= age <= listed["now_unix_seconds"] - agg["created_unix_seconds"]  # the page's clock: a bit earlier
        if agg.get("privacy"):
            shown(card.one(data_field="ledger"), agg["privacy"]["ledger_id"])
        shown(card.one(data_field="unit"), agg["unit"])
        assert agg["unit"] == ("client" if agg.get("privacy") else "example")
        if agg["client_ids"]:  # (where identities count: the private ones, per client, on a server without auth)
            shown(card.one(data_field="client_ids"), agg["client_ids"])
            assert "self-asserted" in card.one(data_field="client_ids").text
        else:
            assert not card.all(data_field="client_ids")
        if agg["examples"] is None:  # withheld: no raw number at all
            assert agg["clients"] is None and not card.all(data_number="clients") and not card.all(data_number="examples")
            continue
        for key in ("clients", "examples", "batches", "non_finite"):
            node = card.one(data_number=key.replace("_", "-"))
            shown(node, agg[key])
            assert count_text(_bold(node)) == agg[key]  # what a person reads
    by_id = {a["aggregation_id"]: a for a in listed["aggregations"]}
    assert by_id[ids["open"]]["clients"] == 3 and by_id[ids["open"]]["examples"] == 40 + 60 + 80
    assert by_id[ids["finalized"]]["clients"] == 1
    assert "checkpoint failed" in by_id[ids["failed"]]["failure_reason"]
    assert "checkpoint failed" in cards[ids["failed"]].one(data_field="failure").text
    states = [a["state"] for a in listed["aggregations"]]
    filters = page.one(id="filters")
    for name, count in (("all", len(states)), ("open", sum(s in ("warming_up", "open", "finalizing") for s in states)),
                        ("finalized", states.count("finalized")), ("failed", states.count("failed"))):
        assert filters.one(data_count=name).text == str(count)
    assert (states.count("failed"), states.count("finalized")) == (1, 2)


def _bold(node: Node) -> Node:
    return next(c for c in node.children if isinstance(c, Node) and c.tag == "b")


def test_a_filter_in_the_address_shows_only_its_cards(deployment, pages):
    _, ids = deployment
    page = dom(pages, "failed")
    assert [c.attrs["data-aggregation"] for c in page.all(data_aggregation=True)] == [ids["failed"]]
    assert page.one(id="filters").one(data_filter="failed").attrs.get("class") == "active"


def test_the_detail_view_has_the_api_s_per_layer_numbers_and_its_charts(deployment, pages):
    server, ids = deployment
    view = dom(pages, "detail").one(id="detail")
    api = http_json(server, f"/api/v1/aggregations/{ids['open']}")
    assert view.attrs["data-detail"] == ids["open"]
    for layer in api["layers"]:
        row = _row(view, layer["name"])
        shown(row.one(data_col="bound"), layer["bound"])
        shown(row.one(data_col="clipped"), layer["clipped"])
        assert count_text(row.one(data_col="clipped")) == layer["clipped"]
        shown(row.one(data_col="clip_fraction"), layer["clip_fraction"])
        assert row.one(data_col="clip_fraction").text == f"{100 * layer['clip_fraction']:.1f}%"
        for key in ("norm_mean", "norm_max"):
            shown(row.one(data_col=key), layer[key])
        for q, key in (("0.5", "p50"), ("0.9", "p90"), ("0.99", "p99")):
            shown(row.one(data_col=key), layer["norm_ratio_quantiles"][q])
        histogram = view.one(data_label=f"layer:{layer['name']}")
        assert [int(r.attrs["data-count"]) for r in histogram.all(data_count=True)] == layer["norm_histogram"]
    example = view.one(data_label="example")
    assert [int(r.attrs["data-count"]) for r in example.all(data_count=True)] == api["example_norm_histogram"]
    ticks = [t.text for t in example.all(class_="tick")]
    assert ["0", "1/64", "1/16"] == ticks[-17:-14] and "1" in ticks and ticks[-1] == "∞"  # x: norm / bound
    assert "0" in ticks[:-17] and len(ticks) - 17 >= 2  # y: counts, with ticks
    assert "norm / bound" in example.text and "examples" in example.text


def _row(view: Node, layer: str) -> Node:
    return view.one(tag="tr", data_layer=layer)


def test_the_throughput_is_the_server_s_and_the_same_on_every_load(deployment, pages):
    server, ids = deployment
    first = http_json(server, f"/api/v1/aggregations/{ids['open']}/throughput")
    assert http_json(server, f"/api/v1/aggregations/{ids['open']}/throughput") == first
    points = first["points"]
    assert sum(p["examples_per_second"] for p in points) == 180  # every example, in the second it was summed
    assert points[0]["examples_per_second"] == 0 and not first["truncated"]
    assert [p["t"] for p in points] == sorted({p["t"] for p in points})
    assert first["peak_examples_per_second"] == max(p["examples_per_second"] for p in points) >= 60
    charts = [dom(pages, name).one(class_="throughput") for name in ("detail", "detail again")]
    for chart in charts:
        assert int(chart.attrs["data-points"]) == len(points)
        assert float(chart.attrs["data-peak"]) == first["peak_examples_per_second"]
        assert "examples/s" in chart.text and "server time" in chart.text  # both axes are labelled
    assert charts[0].attrs == charts[1].attrs
    assert charts[0].one(tag="path").attrs["d"] == charts[1].one(tag="path").attrs["d"]


def test_a_private_aggregation_s_detail_shows_its_release_and_no_raw_number(deployment, pages):
    server, ids = deployment
    throughput = http_json(server, f"/api/v1/aggregations/{ids['private']}/throughput")
    assert throughput["points"] is None and "withheld" in throughput["withheld"]
    api = http_json(server, f"/api/v1/aggregations/{ids['private']}")
    view = dom(pages, "private").one(id="detail")
    assert "withheld" in view.one(data_throughput="withheld").text and not view.all(class_="throughput")
    release = api["privacy"]["release"]
    for key in ("epsilon", "ledger_epsilon", "noise_stddev", "bound", "examples"):
        shown(view.one(data_release=key), release[key])
    row = _row(view, "w")
    shown(row.one(data_col="clipped"), release["layer_clipped"][0])
    for key in ("norm_mean", "norm_max", "p50", "clip_fraction"):
        shown(row.one(data_col=key), None)
    assert not view.all(data_number="examples") and not view.all(data_number="clients")


def test_strings_from_clients_are_text_never_markup(deployment, pages):
    _, ids = deployment
    for name in ("overview", "finalized"):
        page = dom(pages, name)
        assert not page.all(id="pwned") and not page.all("img")
        assert NASTY in page.text  # shown as it is, escaped
    assert _row(dom(pages, "finalized").one(id="detail"), NASTY)


def test_screenshots_for_a_person_to_look_at(pages):
    for name in ("overview.png", "detail.png", "streams.png"):
        shot = ARTIFACTS / name
        assert shot.exists() and shot.stat().st_size > 20_000, shot
    print(f"screenshots: {ARTIFACTS}")


def test_with_an_admin_token_the_page_asks_a_stranger_to_sign_in(auth_server, tmp_path):
    """No session cookie: no number, and the sign-in form that posts to /login (which sets the cookie)."""
    page = subprocess.run([*chromium_flags(tmp_path / "profile"), "--dump-dom",
                           f"http://127.0.0.1:{auth_server.admin.port}/"], capture_output=True, text=True, timeout=120)
    page = page.stdout
    form = Dom(page).root.one(id="sign-in").one("form")
    assert form.attrs["action"] == "/login" and form.attrs["method"] == "post" and form.one("input", name="token")
    assert not Dom(page).root.all(id="server") and not Dom(page).root.all(data_aggregation=True)
    assert not Dom(page).root.all(id="streams") and not Dom(page).root.all(data_stream=True)


def test_the_series_is_bounded_and_marks_idle_gaps(monkeypatch):
    """Sampled where the worker records a step: one point a second in which examples arrived, at most
    THROUGHPUT_SECONDS of them, a 0 on each side of a gap; exact sums of examples per second."""
    from clipd.engine import ClipPolicy, LayerSpec

    aggregation = Aggregation("a", AggregationSpec((LayerSpec("w", (2,)),), ClipPolicy()), 8, 1 << 20)
    clock = [1000.25]
    monkeypatch.setattr("clipd.server.aggregations.time.time", lambda: clock[0])

    def step(rows, at):
        clock[0] = at
        aggregation.record([("c", "", 1, rows, 8 * rows)], None)

    step(3, 1000.25)
    step(4, 1000.75)  # the same second
    step(5, 1001.5)
    step(2, 1005.1)  # after an idle gap of three seconds
    points, truncated = aggregation.throughput()
    assert points == [(999, 0), (1000, 7), (1001, 5), (1002, 0), (1004, 0), (1005, 2)] and not truncated
    for k in range(THROUGHPUT_SECONDS + 10):
        step(1, 2000 + k)
    points, truncated = aggregation.throughput()
    assert truncated and len(points) == THROUGHPUT_SECONDS and {n for _, n in points} == {1}
    assert points[-1][0] == 2000 + THROUGHPUT_SECONDS + 9
