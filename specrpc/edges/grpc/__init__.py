"""The gRPC edge: the only code that touches protobuf."""
