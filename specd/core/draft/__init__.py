"""Drafters: the protocol, n-gram, suffix, hybrid and model drafters, and a speculation cache's branches."""
