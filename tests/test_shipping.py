"""The container files agree with the CLI and the settings (no Docker engine here to build them)."""

from __future__ import annotations

import pathlib
import re

import pytest
import yaml

from clipd.server.settings import Settings

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_compose_file_parses_and_matches_the_service():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    service = compose["services"]["clipd"]
    assert service["command"] == ["clipd", "serve"]
    env = service["environment"]
    assert {"50051:50051", "8080:8080"} == set(service["ports"])
    assert env["CLIPD_GRPC_PORT"] == "50051" and env["CLIPD_ADMIN_PORT"] == "8080"
    assert "/healthz" in " ".join(service["healthcheck"]["test"])
    given = {k: v for k, v in env.items() if v and not v.startswith("$")}
    with pytest.raises(ValueError, match="without credentials"):  # 0.0.0.0 needs the admin token
        Settings.from_env(given)
    assert env["CLIPD_ADMIN_TOKEN"].startswith("${CLIPD_ADMIN_TOKEN:?")  # compose refuses to start without it
    settings = Settings.from_env({**given, "CLIPD_ADMIN_TOKEN": "x"})
    assert (settings.host, settings.grpc_port, settings.admin_port) == ("0.0.0.0", 50051, 8080)


def test_dockerfile_runs_the_same_serve_command_with_a_healthcheck():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r'^CMD \["clipd", "serve"\]$', dockerfile, re.M)
    assert "HEALTHCHECK" in dockerfile and "/healthz" in dockerfile
    assert "EXPOSE 50051 8080" in dockerfile
    for folder in ("clipd", "proto", "engine", "server", "client"):
        assert f"COPY {folder} ./{folder}" in dockerfile


def test_settings_from_environment():
    s = Settings.from_env({"CLIPD_GRPC_PORT": "1234", "CLIPD_INSECURE": "true", "CLIPD_ADMIN_TOKEN": "x"},
                          host="::1", admin_port=None)
    assert (s.grpc_port, s.insecure, s.admin_token, s.host, s.admin_port) == (1234, True, "x", "::1", 8080)


def test_the_image_and_compose_keep_state_on_a_volume():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    service = compose["services"]["clipd"]
    data_dir = service["environment"]["CLIPD_DATA_DIR"]
    assert any(v.endswith(f":{data_dir}") for v in service["volumes"])
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"CLIPD_DATA_DIR={data_dir}" in dockerfile and f"VOLUME {data_dir}" in dockerfile
