"""The two edges (gRPC and HTTP) and what they share per request: admission, validation, auth, metrics."""
