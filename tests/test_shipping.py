"""The container files agree with the CLI and the settings (no Docker engine here to build them)."""

from __future__ import annotations

import pathlib
import re
import tomllib

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
    assert "COPY clipd ./clipd" in dockerfile  # the one package folder, laid out as installed
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert packages["include"] == ["clipd*"]  # nothing outside clipd/ is installed, so nothing else is copied


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


def _settings_from(env: dict[str, str]) -> Settings:
    """Settings from a deployment's environment (placeholders filled in), refusing names that are no setting."""
    names = {f"CLIPD_{f.upper()}" for f in Settings.__dataclass_fields__}
    unknown = sorted(k for k in env if k.startswith("CLIPD_") and k not in names)
    assert not unknown, f"not settings: {unknown}"
    filled = {k: re.sub(r"\$\{[^}]*\}", "x", v) for k, v in env.items()}
    return Settings.from_env(filled)


def test_scale_out_compose_runs_the_server_on_postgres_and_ray():
    compose = yaml.safe_load((ROOT / "deploy" / "compose.scale.yml").read_text())
    services = compose["services"]
    assert {"postgres", "ray-head", "ray-worker", "clipd"} <= set(services)
    settings = _settings_from(services["clipd"]["environment"])
    assert settings.data_dir.startswith("postgresql://") and "@postgres:5432/" in settings.data_dir
    assert settings.ray_address == "ray-head:6379" and settings.ray_shard_hosts >= 2 and settings.processes == 0
    assert services["ray-worker"]["command"][:2] == ["ray", "start"] and "--address=ray-head:6379" in \
        services["ray-worker"]["command"]
    extras = set(services["clipd"]["build"]["args"]["CLIPD_EXTRAS"].split(","))
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert extras == {"server", "postgres", "ray"} and extras <= declared
    assert "ARG CLIPD_EXTRAS=server" in (ROOT / "Dockerfile").read_text()


def test_kuberay_example_runs_the_server_beside_the_ray_head():
    cluster, service, ingest = yaml.safe_load_all((ROOT / "deploy" / "kuberay-raycluster.yaml").read_text())
    assert (cluster["apiVersion"], cluster["kind"], service["kind"]) == ("ray.io/v1", "RayCluster", "Service")
    containers = {c["name"]: c for c in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]}
    clipd = containers["clipd"]
    env = {e["name"]: e.get("value", "${secret}") for e in clipd["env"]}
    env["CLIPD_DATA_DIR"] = "postgresql://clipd@db/clipd"  # from a Secret in the cluster
    settings = _settings_from(env)
    assert settings.ray_address == "127.0.0.1:6379" and settings.ray_gpus_per_host == 1
    workers = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert workers["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert settings.ray_shard_hosts == 2
    assert [p["containerPort"] for p in workers["ports"]] == [settings.ray_ingest_port] == \
        [p["targetPort"] for p in ingest["spec"]["ports"]]
    ports = {p["containerPort"] for p in clipd["ports"]}
    assert ports == {settings.grpc_port, settings.admin_port} == {p["targetPort"] for p in service["spec"]["ports"]}
