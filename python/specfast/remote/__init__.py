"""Drafting over the network: ``specfast serve-drafter`` on the drafter's
machine, :class:`RemoteDrafter` in the target's decoder. The wire format is
``drafter.proto`` (protocol version 1); ``drafter_pb2*.py`` are generated from
it with ``python -m grpc_tools.protoc -I python --python_out=python
--grpc_python_out=python python/specfast/remote/drafter.proto``.
Needs ``pip install specfast[remote]`` (grpcio, protobuf).
"""

try:
    import google.protobuf  # noqa: F401
    import grpc  # noqa: F401
except ImportError as exc:
    raise ImportError(f"specfast.remote needs grpcio and protobuf: pip install "
                      f"'specfast[remote]' ({exc})") from exc

from .client import RemoteDrafter, RemoteError, TransferStats
from .server import VERSION, serve

__all__ = ["RemoteDrafter", "RemoteError", "TransferStats", "VERSION", "serve"]
