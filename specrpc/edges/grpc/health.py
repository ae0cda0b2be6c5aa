"""The gRPC server's protobuf-facing parts besides the Generator service: health (NOT_SERVING until the models are
warm), reflection, and registering the service."""

from __future__ import annotations

from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specrpc.edges.grpc.service import GeneratorService
from specrpc.v1 import generator_pb2 as pb
from specrpc.v1 import generator_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generator"].full_name
HEALTH_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class HealthStatus(Protocol):
    """The part of grpc_health's asyncio HealthServicer used here (grpc-stubs does not describe `health.aio`)."""

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        """Status of `service` ('' is the whole server)."""

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING from now on; later `set` calls are ignored."""


def add_health(server: grpc.aio.Server) -> HealthStatus:
    """A health servicer on `server`."""
    servicer: HealthStatus = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


async def set_health(servicer: HealthStatus, serving: bool) -> None:
    """The whole server and the Generator SERVING or NOT_SERVING."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status)


def add_reflection(server: grpc.aio.Server) -> None:
    """Server reflection for the Generator and health services (grpcurl and buf curl without the proto files)."""
    reflection.enable_server_reflection([SERVICE_NAME, HEALTH_NAME, reflection.SERVICE_NAME], server)


def add_generator(server: grpc.aio.Server, service: GeneratorService) -> None:
    """The Generator service on `server`."""
    pb_grpc.add_GeneratorServicer_to_server(service, server)
