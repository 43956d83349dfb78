"""Generated gRPC code for the specd.v1 contract (scripts/gen-protos)."""
