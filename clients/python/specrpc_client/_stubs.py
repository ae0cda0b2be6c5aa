"""The generated stubs: the server package's (`specrpc.v1`) when installed, else this package's own copy.

Using one copy per process keeps the proto registered once in protobuf's default descriptor pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specrpc.v1 import generator_pb2 as pb
    from specrpc.v1 import generator_pb2_grpc as pb_grpc
else:
    try:
        from specrpc.v1 import generator_pb2 as pb
        from specrpc.v1 import generator_pb2_grpc as pb_grpc
    except ImportError:
        from specrpc_client._gen import generator_pb2 as pb
        from specrpc_client._gen import generator_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]
