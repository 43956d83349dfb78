"""The emulated pair's rows at random contexts, for the scripts that study draws at T > 0.

emulated_rows(spec, contexts, temperature) -> (p [C, V] float64 numpy: the target's processed
distribution, ids and weights [C, W]: the sparse q a model draft sends there).
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from specd.core.model.sim import parse_sim_spec
from specd.core.sampling import sparse_q
from specd.core.sampling.sampler import SamplingParams, processed_probs


def emulated_rows(spec: str, contexts: int, temperature: float) -> tuple[np.ndarray, Tensor, Tensor]:
    """p and the draft's sparse q after `contexts` random 3-token contexts (the same ones for a spec)."""
    profile = parse_sim_spec(spec)
    target, draft = profile.runner("target").lm, profile.runner("draft").lm
    rng = np.random.default_rng(0)
    ctx = [[int(x) for x in rng.integers(0, target.vocab_size, 3)] for _ in range(contexts)]
    params = [SamplingParams(temperature=temperature)] * contexts
    p = processed_probs(target.logits(ctx)[:, None], params)[:, 0].double().numpy()  # [C, V]
    q = processed_probs(draft.logits(ctx)[:, None], params)[:, 0]  # [C, V]
    ids, weights = sparse_q.build(q, sparse_q.QSettings())  # [C, W] the chain drafter's q
    return p, ids, weights
