"""The draft service: a gRPC front over a drafter (a model or n-gram lookup)."""
