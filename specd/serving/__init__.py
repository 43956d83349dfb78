"""Service plumbing: server set-up, round streams, batching, wire translation, errors, security, tracing and metrics."""
