"""How workers and servers talk: messages, gRPC transport, routing and retries."""
