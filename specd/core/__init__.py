"""The pure core: sampling, the runner and its KV cache, drafters, the verifier, adaptive K and the round loop. Imports no gRPC, no service and no tool."""
