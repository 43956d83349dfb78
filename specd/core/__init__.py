"""The pure core, in rooms: plain Python and torch; imports no gRPC, no service and no tool.

- rounds/: the round loop, its ports, the step messages, pipelining strategies, adaptive K, records;
- sampling/: the processed distribution p, coins, the rejection sampler, sparse q, proposals;
- draft/: the drafter protocol and the drafters; target/: the verifier;
- model/: the KV-cached runner, the session pool, loading, tensor parallelism, the catalog, the emulator;
- inprocess: the in-process oracle (the round loop over a Drafter and a Verifier, and its ports);
- errors, phases, transit: the vocabulary every room shares (domain exceptions, where a step's time went).
"""
