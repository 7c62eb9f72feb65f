"""Operability: reflection v1 and v1alpha, offline API docs, config file and precedence, CLI errors, logs."""

from __future__ import annotations

import html.parser
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from clipd.cli import build_parser
from clipd.server import logs
from clipd.server.admin.apidocs import openapi_30
from clipd.server.rpc.reflection import V1_FILE_NAME, v1_file_descriptor_proto
from clipd.server.settings import Settings, SettingsError

V1_METHOD = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
EXPECTED_SERVICES = {"clipd.v1.Clipd", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                     "grpc.reflection.v1alpha.ServerReflection"}


@pytest.fixture()
def channel(auth_server):
    """A channel to a real server with the admin API on, and auth on (reflection and docs must stay open)."""
    with grpc.insecure_channel(f"127.0.0.1:{auth_server.port}") as channel:
        yield channel


# -- reflection ---------------------------------------------------------------------------------------


def ask_v1alpha(channel, request):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    (response,) = stub.ServerReflectionInfo(iter([request]), timeout=30)
    return response


def ask_v1(channel, request):
    """v1 over the wire, with v1alpha's message classes (the two protocols are wire-identical)."""
    call = channel.stream_stream(V1_METHOD, request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    (response,) = call(iter([request]), timeout=30)
    return response


ASKERS = pytest.mark.parametrize("ask", [ask_v1alpha, ask_v1], ids=["v1alpha", "v1"])


@ASKERS
def test_reflection_lists_every_service(channel, ask):
    response = ask(channel, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in response.list_services_response.service}
    assert EXPECTED_SERVICES <= names, names


@ASKERS
def test_reflection_describes_the_clipd_service(channel, ask):
    response = ask(channel, reflection_pb2.ServerReflectionRequest(file_containing_symbol="clipd.v1.Clipd"))
    assert response.WhichOneof("message_response") == "file_descriptor_response", response
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in response.file_descriptor_response.file_descriptor_proto]
    (clipd_file,) = [f for f in files if any(s.name == "Clipd" for s in f.service)]
    assert clipd_file.package == "clipd.v1"
    methods = {m.name for s in clipd_file.service for m in s.method}
    assert {"CreateAggregation", "Submit"} <= methods
    pool = descriptor_pool.DescriptorPool()  # the answer is complete: it builds with its dependencies
    added = set()
    while len(added) < len(files):
        for f in files:
            if f.name not in added and all(d in added for d in f.dependency):
                pool.Add(f)
                added.add(f.name)
    assert pool.FindServiceByName("clipd.v1.Clipd").methods_by_name["Submit"].client_streaming


@ASKERS
def test_reflection_describes_reflection_v1_itself(channel, ask):
    response = ask(channel, reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="grpc.reflection.v1.ServerReflection"))
    (proto,) = [descriptor_pb2.FileDescriptorProto.FromString(b)
                for b in response.file_descriptor_response.file_descriptor_proto]
    assert (proto.name, proto.package) == (V1_FILE_NAME, "grpc.reflection.v1")
    (method,) = proto.service[0].method
    assert method.input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    assert method.client_streaming and method.server_streaming


def test_reflection_v1_answers_unknown_symbols_with_not_found(channel):
    response = ask_v1(channel, reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.such.Service"))
    assert response.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert response.original_request.file_containing_symbol == "no.such.Service"


def test_v1_descriptor_is_v1alpha_renamed_field_for_field():
    v1 = v1_file_descriptor_proto()
    v1alpha = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(v1alpha)
    assert [m.name for m in v1.message_type] == [m.name for m in v1alpha.message_type]
    for new, old in zip(v1.message_type, v1alpha.message_type):
        for a, b in zip(new.field, old.field, strict=True):
            assert (a.name, a.number, a.type, a.label, a.oneof_index) == (b.name, b.number, b.type, b.label,
                                                                        b.oneof_index)
            assert a.type_name == b.type_name.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
    assert "v1alpha" not in v1.SerializeToString().decode("latin-1")


# -- offline API docs -----------------------------------------------------------------------------------


def http(server, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.admin.port}{path}", timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class _Refs(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script" and attrs.get("src"):
            self.refs.append(attrs["src"])
        if tag == "link" and attrs.get("href"):
            self.refs.append(attrs["href"])


def test_docs_load_nothing_from_outside_the_server(auth_server):
    status, body = http(auth_server, "/docs")  # no credentials: the docs hold no data
    assert status == 200
    page = body.decode()
    assert re.findall(r"https?://", page) == [], page
    parser = _Refs()
    parser.feed(page)
    assert len(parser.refs) >= 2, page  # the script and the stylesheet at least
    for ref in parser.refs:
        assert ref.startswith("/"), ref
        status, content = http(auth_server, ref)
        assert status == 200 and content, ref
    spec = re.search(r"url: '([^']+)'", page).group(1)
    status, body = http(auth_server, spec)
    document = json.loads(body)
    assert status == 200 and document["openapi"].startswith("3.0")
    assert "/api/v1/aggregations" in document["paths"]
    status, body = http(auth_server, "/openapi.json")
    assert status == 200 and "/api/v1/aggregations" in json.loads(body)["paths"]
    assert http(auth_server, "/redoc")[0] == 404


def test_openapi_30_turns_null_unions_into_nullable():
    document = {"openapi": "3.1.0", "components": {"schemas": {"X": {"properties": {
        "a": {"anyOf": [{"type": "string"}, {"type": "null"}], "title": "A"},
        "b": {"anyOf": [{"$ref": "#/components/schemas/Y"}, {"type": "null"}]},
        "c": {"type": ["integer", "null"]},
        "d": {"const": "x", "examples": [{"type": "null"}]},
    }}}}}
    out = openapi_30(document)
    props = out["components"]["schemas"]["X"]["properties"]
    assert out["openapi"] == "3.0.3"
    assert props["a"] == {"type": "string", "title": "A", "nullable": True}
    assert props["b"] == {"anyOf": [{"$ref": "#/components/schemas/Y"}], "nullable": True}
    assert props["c"] == {"type": "integer", "nullable": True}
    assert props["d"] == {"enum": ["x"], "examples": [{"type": "null"}]}
    assert document["openapi"] == "3.1.0"  # the input is left alone


def test_docs_render_in_chromium_with_only_loopback_reachable(auth_server, tmp_path):
    """Swagger UI draws the operations with every address but 127.0.0.1 sent to a dead proxy."""
    chromium = shutil.which("chromium")
    assert chromium, "chromium is missing: apt-get install chromium (.ci/run does)"
    with socket.socket() as dead:  # a port that nothing listens on
        dead.bind(("127.0.0.1", 0))
        dead_port = dead.getsockname()[1]
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
             "--virtual-time-budget=5000", "--window-size=1280,1000",
             f"--proxy-server=http://127.0.0.1:{dead_port}", "--proxy-bypass-list=127.0.0.1"]
    url = f"http://127.0.0.1:{auth_server.admin.port}/docs"
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    paths = set(re.findall(r'data-path="([^"]+)"', dom.stdout))
    assert {"/api/v1/aggregations", "/api/v1/aggregations/{aggregation_id}", "/metrics"} <= paths, \
        dom.stdout[-2000:] + dom.stderr[-2000:]


# -- settings: file, environment, flags ------------------------------------------------------------------


def write(path, text):
    path.write_text(text)
    return path


def test_precedence_is_flags_then_environment_then_file_then_defaults(tmp_path):
    config = write(tmp_path / "clipd.toml", 'grpc_port = 1111\nmax_streams = 7\nadmin_token = "from-file"\n'
                                            "buffer_wait = 2\ninsecure = true\n")
    env = {"CLIPD_MAX_STREAMS": "9", "CLIPD_ADMIN_TOKEN": "from-env"}
    s = Settings.load({"grpc_port": 2222, "admin_token": None, "host": None}, environ=env, config_file=config)
    assert (s.grpc_port, s.max_streams, s.admin_token) == (2222, 9, "from-env")
    assert (s.buffer_wait, s.insecure) == (2.0, True) and isinstance(s.buffer_wait, float)  # from the file
    assert (s.host, s.unary_workers) == ("127.0.0.1", 16)  # defaults
    assert Settings.load({}, environ={}, config_file=config).max_streams == 7
    assert Settings.load({"insecure": False}, environ={}, config_file=config).insecure is False


def test_clipd_config_names_the_file(tmp_path):
    config = write(tmp_path / "c.toml", "max_streams = 5\n")
    assert Settings.load({}, environ={"CLIPD_CONFIG": str(config)}).max_streams == 5
    assert Settings.load({}, environ={}).max_streams == 256


@pytest.mark.parametrize("text, words", [
    ("grpc_prot = 1\n", ["grpc_prot", "grpc_port"]),  # unknown key, with a suggestion
    ('grpc_port = "50051"\n', ["grpc_port", "integer"]),
    ("insecure = 1\n", ["insecure", "boolean"]),
    ("buffer_wait = true\n", ["buffer_wait", "number"]),
    ("admin_token = 5\n", ["admin_token", "string"]),
    ("grpc_port = \n", ["not valid TOML"]),
])
def test_bad_files_name_the_key_and_the_file(tmp_path, text, words):
    config = write(tmp_path / "bad.toml", text)
    with pytest.raises(SettingsError) as raised:
        Settings.load({}, environ={}, config_file=config)
    for word in [*words, str(config)]:
        assert word in str(raised.value)


@pytest.mark.parametrize("variable, value", [("CLIPD_GRPC_PORT", "abc"), ("CLIPD_BUFFER_WAIT", "soon"),
                                             ("CLIPD_INSECURE", "maybe")])
def test_bad_environment_values_name_the_variable(variable, value):
    for load in (lambda env: Settings.load({}, environ=env), Settings.from_env):
        with pytest.raises(SettingsError, match=f"{variable}.*{value}"):
            load({variable: value})


def test_invalid_combinations_are_settings_errors_that_name_their_source(tmp_path):
    with pytest.raises(SettingsError, match="max_streams.*CLIPD_MAX_STREAMS"):
        Settings.load({}, environ={"CLIPD_MAX_STREAMS": "0"})
    with pytest.raises(SettingsError, match="log_level.*--log-level"):
        Settings.load({"log_level": "loud"}, environ={})
    assert issubclass(SettingsError, ValueError)
    with pytest.raises(SettingsError, match="postgresql:// URL.*got mysql://.*--data-dir"):  # no other database
        Settings.load({"data_dir": "mysql://127.0.0.1/clipd"}, environ={})
    assert Settings.load({"data_dir": "postgresql://127.0.0.1/clipd"}, environ={}).data_dir.startswith("postgresql")


def test_empty_numbers_in_the_environment_count_as_unset():
    assert Settings.from_env({"CLIPD_GRPC_PORT": "", "CLIPD_ADMIN_TOKEN": ""}).grpc_port == 50051


def test_serve_has_one_flag_per_setting_with_the_old_spellings():
    import dataclasses

    parser = build_parser()
    args = parser.parse_args(["serve", "--token", "t", "--insecure", "--grpc-port", "5", "--buffer-wait", "1.5",
                              "--log-format", "json"])
    assert (args.admin_token, args.insecure, args.grpc_port, args.buffer_wait, args.log_format) == \
        ("t", True, 5, 1.5, "json")
    assert set(args.setting_names) == {f.name for f in dataclasses.fields(Settings)}
    defaults = parser.parse_args(["serve"])
    assert all(getattr(defaults, name) is None for name in defaults.setting_names)  # not given: not a flag
    assert parser.parse_args(["serve", "--admin-token", "u"]).admin_token == "u"
    scaled = parser.parse_args(["serve", "--ray", "head:6379", "--processes", "4", "--shards", "8"])
    assert (scaled.ray_address, scaled.processes, scaled.shards) == ("head:6379", 4, 8)
    with pytest.raises(SettingsError, match="ray_address.*postgresql://"):  # hosts elsewhere need the shared store
        Settings.load({"ray_address": "head:6379", "data_dir": "/tmp/x"}, environ={})
    with pytest.raises(SettingsError, match="ray_shard_hosts.*set ray_address"):
        Settings.load({"ray_shard_hosts": 2}, environ={})
    with pytest.raises(SettingsError, match="processes or ray_address, not both"):
        Settings.load({"processes": 2, "ray_address": "h:1", "data_dir": "postgresql://h/d"}, environ={})
    with pytest.raises(SettingsError, match="tls_peer_ca_file and tls_peer_name are for TLS"):
        Settings.load({"tls_peer_name": "clipd.internal"}, environ={})
    for field in ("processes", "shards", "ray_gpus_per_host", "ray_shard_hosts"):
        with pytest.raises(SettingsError, match=f"{field} must be >= 0"):
            Settings.load({field: -1}, environ={})
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--log-level", "loud"])


# -- logs ---------------------------------------------------------------------------------------------


@pytest.fixture()
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_events_as_text_and_as_json(restore_logging):
    log = logging.getLogger("clipd.test")
    text = io.StringIO()
    logs.configure("info", "text", stream=text)
    logs.event(log, "aggregation.created", aggregation="abc", layers=3, note="two words")
    logs.event(log, "debug.only", level=logging.DEBUG)
    (line,) = text.getvalue().splitlines()
    assert line.endswith('INFO clipd.test: aggregation.created aggregation=abc layers=3 note="two words"'), line

    out = io.StringIO()
    logs.configure("debug", "json", stream=out)
    logs.event(log, "aggregation.created", aggregation="abc", layers=3, message="clash")
    log.warning("plain %s", "message")
    log.info("stopping", extra={"event": "server.stopping"})
    first, second, third = map(json.loads, out.getvalue().splitlines())
    assert first["event"] == "aggregation.created" and first["aggregation"] == "abc" and first["layers"] == 3
    assert (first["level"], first["logger"], first["message_"]) == ("info", "clipd.test", "clash")
    assert first["message"].startswith("aggregation.created aggregation=abc") and first["ts"].endswith("Z")
    assert second["message"] == "plain message" and second["level"] == "warning" and "event" not in second
    assert (third["message"], third["event"]) == ("stopping", "server.stopping")


# -- clipd serve as a real process ------------------------------------------------------------------------


def clipd(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "clipd.cli", "serve", "--data-dir", "memory", *args],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("clipd: error:")]


@pytest.mark.parametrize("which", ["grpc", "admin"])
def test_a_busy_port_is_one_error_line_and_status_1(which):
    with socket.socket() as busy:  # listening, without SO_REUSEADDR: nobody else can bind it
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ports = {"grpc": port, "admin": 0} if which == "grpc" else {"grpc": 0, "admin": port}
        out = clipd("--admin-port", str(ports["admin"]), "--grpc-port", str(ports["grpc"]))
    assert out.returncode == 1, out.stderr
    (line,) = error_lines(out.stderr)
    assert f"127.0.0.1:{port}" in line and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == line


@pytest.mark.parametrize("args, env, words", [
    ((), {"CLIPD_GRPC_PORT": "abc"}, ["CLIPD_GRPC_PORT", "abc"]),
    (("--max-streams", "0"), {}, ["max_streams", "--max-streams"]),
    (("--config", "/nonexistent/clipd.toml"), {}, ["/nonexistent/clipd.toml"]),
])
def test_bad_settings_are_one_error_line_and_status_2(args, env, words):
    out = clipd("--admin-port", "-1", *args, env=env, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and error_lines(out.stderr) == [out.stderr.rstrip("\n")], out.stderr
    for word in words:
        assert word in out.stderr


def test_serve_from_a_config_file_with_json_logs(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = write(tmp_path / "clipd.toml", f'grpc_port = {port}\nadmin_port = -1\nmax_streams = 3\n'
                                            'log_format = "json"\n')
    # stderr (debug logs: more than a pipe holds) to a file: a pipe nobody reads until the end would block the
    # server's logging, and with it its shutdown.
    log_path = tmp_path / "stderr.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "clipd.cli", "serve", "--data-dir", "memory", "--config",
                                 str(config)], stdout=subprocess.PIPE, stderr=log_file, text=True,
                                env={**os.environ, "CLIPD_LOG_LEVEL": "debug"})
    try:
        line = proc.stdout.readline()
        if f"gRPC on 127.0.0.1:{port}" not in line:
            proc.kill()
            proc.wait(timeout=30)
            pytest.fail(line + log_path.read_text())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    records = [json.loads(line) for line in log_path.read_text().splitlines()]  # every line is JSON
    started = [r for r in records if r["logger"] == "clipd.server.app" and "gRPC on" in r["message"]]
    assert started and set(started[0]) >= {"ts", "level", "logger", "message"}
    assert any(r["level"] == "debug" for r in records), records  # CLIPD_LOG_LEVEL=debug took effect
