"""The target's side of a round: the verifier."""
