"""How much requests' acceptance differs: the weight a request's own verdicts get against the service's.

Auto rates a request at its own verdicts shrunk towards the service's acceptance,
the service's counting as m verdicts (`AutoChooser.rates`). The right m depends
on the workload: where every request drafts alike (one model pair on one kind of
text) a request's own rate differs from the service's by its coin noise alone,
and a small m turns that noise into choices (emulated h100-8b at T = 0.7,
agreement 0.8: requests at a true 0.75 read 0.42-0.5 after a few rejections and
ran target-only rounds); where requests differ (a suffix drafter on repetitive
and fresh text) a large m hides what a request is.

So m is estimated from finished requests, as a beta-binomial's prior weight by
the method of moments: with request j's x_j accepted of n_j verdicts, p the
pooled rate and J requests,

    S    = sum_j n_j (x_j / n_j - p)^2          (spread of the request rates)
    tau2 = (S - (J - 1) p (1 - p)) / (N - sum_j n_j^2 / N),   N = sum_j n_j
    m    = p (1 - p) / tau2 - 1                 (clamped; tau2 <= 0: the largest)

tau2 is the variance of the requests' true rates once the binomial noise
(J - 1) p (1 - p) is taken out. Sums forget old requests (`forget` per request).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestSpread"]


@dataclass
class RequestSpread:
    """Finished requests' (accepted, verdicts) totals, and the prior weight they imply."""

    default: float = 4.0  # m before `min_requests` requests finished
    smallest: float = 1.0  # m's bounds: a request's verdicts always count, and so does the service
    largest: float = 64.0
    min_requests: int = 3
    forget: float = 0.98  # per finished request (about 50 remembered)
    _seen: int = 0  # requests finished (not forgotten): the estimate's warm-up
    _j: float = 0.0
    _n: float = 0.0
    _x: float = 0.0
    _nn: float = 0.0
    _q: float = 0.0  # sum_j x_j^2 / n_j

    def observe(self, verdicts: float, accepted: float) -> None:
        """A finished request: `accepted` of its `verdicts` draft positions reached were accepted."""
        if verdicts <= 0:
            return
        f = self.forget
        self._seen += 1
        self._j = f * self._j + 1.0
        self._n = f * self._n + verdicts
        self._x = f * self._x + accepted
        self._nn = f * self._nn + verdicts * verdicts
        self._q = f * self._q + accepted * accepted / verdicts

    def weight(self) -> float:
        """m: how many verdicts the service's acceptance counts as in a request's estimate."""
        if self._seen < self.min_requests or self._n <= 0:
            return self.default
        p = self._x / self._n
        noise = p * (1.0 - p)
        if noise <= 0:
            return self.largest  # every verdict alike: nothing tells requests apart
        spread = self._q - 2.0 * p * self._x + p * p * self._n
        denominator = self._n - self._nn / self._n
        if denominator <= 0:
            return self.default
        tau2 = (spread - (self._j - 1.0) * noise) / denominator
        if tau2 <= 0:
            return self.largest
        return min(self.largest, max(self.smallest, noise / tau2 - 1.0))
