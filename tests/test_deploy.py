"""deploy/: the Kubernetes manifests and the Envoy config parse and agree with each other and with the server (ports,
health service name, drain time, affinity header); the nginx health sidecar renders and debounces as documented.
Schema-level checks (Kubernetes OpenAPI, Envoy protos, nginx -t) live in deploy/check.py."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from specrpc.v1 import generator_pb2 as pb

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
SERVICE = pb.DESCRIPTOR.services_by_name["Generator"].full_name
AFFINITY_HEADER = "x-session-id"  # what the clients send; nginx reads it as $http_x_session_id


def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    docs: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                for key in ("apiVersion", "kind", "metadata"):
                    assert key in doc, f"{path.name}: a document without {key}"
                docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def flags(container: dict[str, Any]) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])


def test_manifests_are_namespaced_and_complete() -> None:
    docs = manifests()
    assert set(docs) >= {("Namespace", "specrpc"), ("Deployment", "specrpc"), ("Service", "specrpc-headless"),
                         ("ConfigMap", "specrpc-envoy"), ("Deployment", "specrpc-envoy"), ("Service", "specrpc")}
    for (kind, name), doc in docs.items():
        if kind != "Namespace":
            assert doc["metadata"].get("namespace") == "specrpc", f"{kind}/{name} has no namespace"
    for kind, name in docs:
        if kind == "Deployment":
            spec = docs[(kind, name)]["spec"]
            assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()


def test_replica_deployment_probes_ports_and_drain() -> None:
    docs = manifests()
    pod = docs[("Deployment", "specrpc")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = flags(container)
    port = int(args["port"])
    assert args["host"] == "0.0.0.0"
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"] == port
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == port, f"{probe} must use the native gRPC probe on {port}"
    assert container["startupProbe"]["grpc"]["service"] == SERVICE
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > float(args["grace-s"]), \
        "a draining pod (NOT_SERVING) must not be restarted by its liveness probe"
    assert pod["terminationGracePeriodSeconds"] > float(args["grace-s"]), "SIGKILL must come after --grace-s"
    assert float(args["threads"]) == float(container["resources"]["requests"]["cpu"])
    headless = docs[("Service", "specrpc-headless")]["spec"]
    assert headless["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in headless["ports"]}["grpc"] == port


def test_replica_deployment_exposes_the_http_edge_ready_on_health() -> None:
    docs = manifests()
    pod = docs[("Deployment", "specrpc")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = flags(container)
    http_port = int(args["http-port"])
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["http"] == http_port
    # /health answers 503 while loading and from the first moment of a drain: the pod leaves the Service at once
    ready = container["readinessProbe"]
    assert ready["httpGet"] == {"port": "http", "path": "/health"}
    assert ready["failureThreshold"] == 1
    # HTTP streams drain with --grace-s too (uvicorn's graceful shutdown follows it): SIGKILL only after it
    assert pod["terminationGracePeriodSeconds"] >= float(args["grace-s"])
    headless = docs[("Service", "specrpc-headless")]["spec"]
    assert {p["name"]: p["port"] for p in headless["ports"]}["http"] == http_port


def envoy_config() -> dict[str, Any]:
    docs = manifests()
    config: dict[str, Any] = yaml.safe_load(docs[("ConfigMap", "specrpc-envoy")]["data"]["envoy.yaml"])
    return config


def envoy_part(envoy: dict[str, Any], kind: str, name: str) -> dict[str, Any]:
    (part,) = [p for p in envoy["static_resources"][kind] if p["name"] == name]
    return part


def test_envoy_routes_sessions_by_ring_hash_to_the_headless_service() -> None:
    docs = manifests()
    envoy = envoy_config()
    listener = envoy_part(envoy, "listeners", "grpc")
    (hcm,) = listener["filter_chains"][0]["filters"]
    manager = hcm["typed_config"]
    (route,) = manager["route_config"]["virtual_hosts"][0]["routes"]
    action = route["route"]
    assert action["hash_policy"] == [{"header": {"header_name": AFFINITY_HEADER}}]
    assert action["timeout"] == "0s", "the default 15 s route timeout would cut long generations"
    assert "unavailable" in action["retry_policy"]["retry_on"].split(",")
    assert re.fullmatch(r"\d+s", manager["stream_idle_timeout"]) and int(manager["stream_idle_timeout"][:-1]) >= 600
    cluster = envoy_part(envoy, "clusters", action["cluster"])
    assert (cluster["type"], cluster["lb_policy"]) == ("STRICT_DNS", "RING_HASH")
    options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in options["explicit_http_config"], "gRPC needs HTTP/2 to the replicas"
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    headless = docs[("Service", "specrpc-headless")]["metadata"]
    assert address["address"] == f"{headless['name']}.{headless['namespace']}.svc.cluster.local"
    port = int(flags(docs[("Deployment", "specrpc")]["spec"]["template"]["spec"]["containers"][0])["port"])
    assert address["port_value"] == port
    assert cluster["health_checks"][0]["grpc_health_check"]["service_name"] == SERVICE
    envoy_pod = docs[("Deployment", "specrpc-envoy")]["spec"]["template"]["spec"]
    mounted = envoy_pod["volumes"][0]["configMap"]["name"]
    assert mounted == "specrpc-envoy" and "/etc/envoy/envoy.yaml" in envoy_pod["containers"][0]["args"]
    assert listener["address"]["socket_address"]["port_value"] == envoy_pod["containers"][0]["ports"][0][
        "containerPort"]


HTTP_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/rewrite", "/v1/models", "/infill", "/completion",
               "/health")
"""Every route of specrpc/edges/http/api.py."""


def test_http_routes_are_the_apis() -> None:
    source = (Path(__file__).resolve().parents[1] / "specrpc" / "edges" / "http" / "api.py").read_text()
    assert set(re.findall(r'Route\("([^"]+)"', source)) == set(HTTP_ROUTES), "HTTP_ROUTES must list api.py's routes"


def test_envoy_routes_the_http_edge_by_session_then_client_address() -> None:
    docs = manifests()
    envoy = envoy_config()
    listener = envoy_part(envoy, "listeners", "http")
    (hcm,) = listener["filter_chains"][0]["filters"]
    manager = hcm["typed_config"]
    (route,) = manager["route_config"]["virtual_hosts"][0]["routes"]
    pattern = re.compile(route["match"]["safe_regex"]["regex"])
    assert all(pattern.fullmatch(path) for path in HTTP_ROUTES)
    assert not pattern.fullmatch("/metrics") and not pattern.fullmatch("/v1")
    action = route["route"]
    assert action["hash_policy"] == [{"header": {"header_name": AFFINITY_HEADER}, "terminal": True},
                                     {"connection_properties": {"source_ip": True}}]
    assert action["timeout"] == "0s", "a route timeout would cut long streams"
    retry = action["retry_policy"]
    assert "retriable-status-codes" in retry["retry_on"].split(",") and 503 in retry["retriable_status_codes"]
    cluster = envoy_part(envoy, "clusters", action["cluster"])
    assert (cluster["type"], cluster["lb_policy"]) == ("STRICT_DNS", "RING_HASH")
    assert cluster["health_checks"][0]["http_health_check"]["path"] == "/health"
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    headless = docs[("Service", "specrpc-headless")]["metadata"]
    assert address["address"] == f"{headless['name']}.{headless['namespace']}.svc.cluster.local"
    http_port = int(flags(docs[("Deployment", "specrpc")]["spec"]["template"]["spec"]["containers"][0])["http-port"])
    assert address["port_value"] == http_port
    envoy_ports = {p["name"]: p["containerPort"] for p in
                   docs[("Deployment", "specrpc-envoy")]["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert listener["address"]["socket_address"]["port_value"] == envoy_ports["http"]
    front = {p["name"]: p["targetPort"] for p in docs[("Service", "specrpc")]["spec"]["ports"]}
    assert front["http"] == "http"


def test_nginx_config_hashes_on_the_session_header() -> None:
    conf = (DEPLOY / "nginx" / "specrpc.conf").read_text()
    variable = "$http_" + AFFINITY_HEADER.replace("-", "_")
    assert re.search(r"map \$http_x_session_id \$specrpc_affinity \{\s*\"\"\s+\$request_id;\s*default\s+"
                     + re.escape(variable) + ";", conf)
    assert "hash $specrpc_affinity consistent;" in conf
    assert "include specrpc-upstream.inc;" in conf
    assert re.search(r"grpc_next_upstream error timeout non_idempotent;", conf)


def nginx_http_server(conf: str) -> str:
    """The `server { … }` block of the HTTP edge (the one listening on 8081)."""
    start = conf.index("server {", conf.index("upstream specrpc_http"))
    return conf[start:]


def test_nginx_routes_the_http_edge() -> None:
    conf = (DEPLOY / "nginx" / "specrpc.conf").read_text()
    variable = "$http_" + AFFINITY_HEADER.replace("-", "_")
    # the session header, then the client address
    assert re.search(r"map \$http_x_session_id \$specrpc_http_affinity \{\s*\"\"\s+\$remote_addr;\s*default\s+"
                     + re.escape(variable) + ";", conf)
    upstream = conf[conf.index("upstream specrpc_http {"):]
    upstream = upstream[:upstream.index("}")]
    assert "hash $specrpc_http_affinity consistent;" in upstream
    assert "include specrpc-http-upstream.inc;" in upstream
    server = nginx_http_server(conf)
    assert "listen 8081;" in server
    # every route of the HTTP edge goes to the replicas, and nothing else does
    routed = re.findall(r"location (=\s)?(\S+) \{\s*proxy_pass http://specrpc_http;", server)
    prefixes = {path for exact, path in routed if not exact}
    exact = {path for eq, path in routed if eq}
    assert all(path in exact or any(path.startswith(p) for p in prefixes) for path in HTTP_ROUTES), routed
    assert prefixes == {"/v1/"}
    # streams: SSE unbuffered, long reads, keep-alive upstream
    for directive in ("proxy_buffering off;", "proxy_http_version 1.1;", 'proxy_set_header Connection "";'):
        assert directive in server, directive
    read = re.search(r"proxy_read_timeout (\d+)s;", server)
    assert read and int(read.group(1)) >= 300, "a prefill or a wait for a KV slot must not cut a stream"
    # a draining replica answers 503: nginx passes the POST on to the next replica
    assert re.search(r"proxy_next_upstream error timeout http_503 non_idempotent;", server)
    assert "proxy_request_buffering off" not in server, "a request must be buffered to be resent"


@pytest.fixture(scope="module")
def upstream() -> ModuleType:
    spec = importlib.util.spec_from_file_location("specrpc_nginx_upstream", DEPLOY / "nginx" / "upstream.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_upstream_render_marks_down_and_fails_open(upstream: ModuleType) -> None:
    text = upstream.render([("a:1", True), ("b:2", False)], 2, "10s")
    assert "server a:1 max_fails=2 fail_timeout=10s;" in text
    assert "server b:2 max_fails=2 fail_timeout=10s down;" in text
    panic = upstream.render([("a:1", False), ("b:2", False)], 2, "10s")
    assert " down;" not in panic and "panic" in panic, "with no replica SERVING, list all (passive checks decide)"


def test_upstream_hysteresis(upstream: ModuleType) -> None:
    replica = upstream.Replica("a:1")
    assert upstream.update(replica, True, "SERVING", rise=2, fall=2) and replica.up
    assert upstream.update(replica, False, "NOT_SERVING", rise=2, fall=2) and not replica.up  # it says so: out
    assert not upstream.update(replica, True, "SERVING", rise=2, fall=2) and not replica.up
    assert upstream.update(replica, True, "SERVING", rise=2, fall=2) and replica.up  # back after two
    assert not upstream.update(replica, None, "no answer", rise=2, fall=2) and replica.up  # one timeout: stays
    assert not upstream.update(replica, True, "SERVING", rise=2, fall=2) and replica.up
    assert not upstream.update(replica, None, "no answer", rise=2, fall=2)
    assert upstream.update(replica, None, "no answer", rise=2, fall=2) and not replica.up  # two in a row: out


def test_upstream_writes_atomically_and_only_on_change(upstream: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "specrpc-upstream.inc"
    assert upstream.write_if_changed(str(out), "x\n")
    assert not upstream.write_if_changed(str(out), "x\n")
    assert upstream.write_if_changed(str(out), "y\n") and out.read_text() == "y\n"
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_upstream_writes_the_http_include_with_the_same_health(upstream: ModuleType, tmp_path: Path) -> None:
    replicas = [upstream.parse_replica("10.0.0.1:50051,8000"), upstream.parse_replica("10.0.0.2:50051,8000"),
                upstream.parse_replica("10.0.0.3:50051")]
    assert (replicas[0].address, replicas[0].http_address) == ("10.0.0.1:50051", "10.0.0.1:8000")
    assert replicas[2].http_address == ""
    replicas[0].up, replicas[1].up, replicas[2].up = True, False, True
    args = argparse.Namespace(out=str(tmp_path / "grpc.inc"), http_out=str(tmp_path / "http.inc"), max_fails=2,
                              fail_timeout="10s")
    assert upstream.write_all(replicas, args)
    http = (tmp_path / "http.inc").read_text()
    assert "server 10.0.0.1:8000 max_fails=2 fail_timeout=10s;" in http
    assert "server 10.0.0.2:8000 max_fails=2 fail_timeout=10s down;" in http
    assert "10.0.0.3" not in http, "a replica without an HTTP port is not in the HTTP upstream"
    assert not upstream.write_all(replicas, args)
    with pytest.raises(argparse.ArgumentTypeError):
        upstream.parse_replica("10.0.0.1:50051,http")
