"""Prometheus metrics, served over HTTP on --metrics-port."""

from __future__ import annotations

from collections.abc import Sized
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class SlotUsage(Protocol):
    """What the gauges read live: the session registry."""

    @property
    def in_use(self) -> int:
        """KV slots with a stream in flight."""
        ...

    @property
    def total(self) -> int:
        """KV slots preallocated."""
        ...

    @property
    def sessions(self) -> Sized:
        """Sessions holding a slot."""
        ...


class Metrics:
    """All server metrics in one registry (one per server, so tests can run several)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specrpc_requests", "Requests by method, final status (gRPC code name) and protocol "
                                "(grpc, http)", ["rpc", "code", "protocol"], registry=r)
        self.prompt_tokens = Counter("specrpc_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_prompt_tokens = Counter("specrpc_cached_prompt_tokens", "Prompt tokens reused from KV cache",
                                            registry=r)
        self.completion_tokens = Counter("specrpc_completion_tokens", "Tokens generated", registry=r)
        self.draft_proposed = Counter("specrpc_draft_tokens_proposed", "Draft tokens proposed", registry=r)
        self.draft_accepted = Counter("specrpc_draft_tokens_accepted", "Draft tokens accepted", registry=r)
        self.verify_steps = Counter("specrpc_verify_steps", "Target verify/decode steps", registry=r)
        self.ttft = Histogram("specrpc_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.inter_token = Histogram("specrpc_inter_token_latency_seconds",
                                     "Time between streamed chunks divided by their tokens", buckets=LATENCY_BUCKETS,
                                     registry=r)
        self.active_sessions = Gauge("specrpc_active_sessions", "Sessions holding a KV slot", registry=r)
        self.kv_slots_in_use = Gauge("specrpc_kv_slots_in_use", "KV slots with a stream in flight", registry=r)
        self.kv_slots_total = Gauge("specrpc_kv_slots_total", "KV slots preallocated", registry=r)
        self._http: WSGIServer | None = None

    def track(self, slots: SlotUsage) -> None:
        """Read the slot and session gauges from `slots` at each scrape (never stale)."""
        self.kv_slots_in_use.set_function(lambda: slots.in_use)
        self.kv_slots_total.set_function(lambda: slots.total)
        self.active_sessions.set_function(lambda: len(slots.sessions))

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the HTTP exporter; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return int(server.server_port)

    def close(self) -> None:
        """Stop the HTTP exporter (if started) and free its port."""
        server, self._http = self._http, None
        if server is not None:
            server.shutdown()
            server.server_close()
