"""Sampling: the processed distribution p, counter-based coins, the rejection sampler, sparse q, proposals."""
