"""The target service: a gRPC front over the verifier (forward pass + rejection sampler)."""
