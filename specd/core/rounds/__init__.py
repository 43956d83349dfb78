"""The round loop and what it talks to: ports, the step messages, pipelining strategies, adaptive K, records.

Imports no drafter, verifier or model module (an import-linter contract)."""
