"""Every port the compose files publish is bound to 127.0.0.1 unless the operator overrides it: the Dagster
webserver has no authentication, so it is reached through an authenticating proxy on the host, never on all
interfaces. Read from the YAML with Compose's `${VAR:-default}` interpolation, so no Compose binary is needed
(tests/integration/test_deploy.py validates the files with one)."""

from __future__ import annotations

import re
from typing import Any

import yaml

from tests.conftest import REPO

COMPOSE_FILES = sorted((REPO / "docker").glob("compose*.yaml"))
VARIABLE = re.compile(r"\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<default>[^}]*))?\}")


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's rules: `${V:-d}` is d when V is unset or empty, `${V-d}` when unset; `${V:?e}` and `${V?e}`
    stop Compose when V is unset (or empty), as they stop this reading."""

    def value(match: re.Match[str]) -> str:
        name, op, default = match["name"], match["op"] or "", match["default"] or ""
        unset = name not in env or (op.startswith(":") and not env[name])
        if unset and op.endswith("?"):
            raise AssertionError(f"${{{name}}} is required: {default}")
        return default if unset and op.endswith("-") else env.get(name, "")

    return VARIABLE.sub(value, text)


def _host_ip(port: Any, env: dict[str, str]) -> str | None:
    """The host address of a published port (None: all interfaces); short syntax is [IP:]HOST:CONTAINER."""
    if isinstance(port, dict):
        return port.get("host_ip")
    parts = _interpolate(str(port), env).rsplit(":", 2)
    return parts[0] if len(parts) == 3 else None


def _published(env: dict[str, str]) -> dict[tuple[str, str], list[str | None]]:
    out: dict[tuple[str, str], list[str | None]] = {}
    for path in COMPOSE_FILES:
        for name, service in (yaml.safe_load(path.read_text()).get("services") or {}).items():
            assert service.get("network_mode") != "host", f"{path.name}: {name} shares the host's network"
            if service.get("ports"):
                out[(path.name, name)] = [_host_ip(p, env) for p in service["ports"]]
    return out


def test_every_published_port_is_bound_to_loopback_by_default() -> None:
    assert {p.name for p in COMPOSE_FILES} >= {"compose.yaml", "compose.gpu.yaml"}
    published = _published({})
    assert ("compose.yaml", "webserver") in published  # not vacuous: the UI is published
    assert {key: ips for key, ips in published.items() if ips != ["127.0.0.1"] * len(ips)} == {}


def test_the_ui_address_is_the_operators_to_override() -> None:
    published = _published({"EAGLE3_UI_BIND": "10.0.0.5", "EAGLE3_UI_PORT": "8080"})
    assert published[("compose.yaml", "webserver")] == ["10.0.0.5"]
    assert _published({"EAGLE3_UI_BIND": ""})[("compose.yaml", "webserver")] == ["127.0.0.1"]


def test_port_syntax_is_read_as_compose_reads_it() -> None:
    assert _host_ip("3000:3000", {}) is None  # all interfaces
    assert _host_ip("3000", {}) is None
    assert _host_ip("[::1]:3000:3000/tcp", {}) == "[::1]"
    assert _host_ip({"target": 3000, "published": 3000, "host_ip": "127.0.0.1"}, {}) == "127.0.0.1"
    assert _host_ip("${B-0.0.0.0}:1:1", {}) == "0.0.0.0"
    assert _host_ip("${B:-127.0.0.1}:1:1", {"B": ""}) == "127.0.0.1"
    assert _host_ip("${B:-127.0.0.1}:1:1", {"B": "::"}) == "::"
