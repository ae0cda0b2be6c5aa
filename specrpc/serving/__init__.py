"""What runs a loaded pair for the edges: the runtime, KV sessions and the device thread."""
