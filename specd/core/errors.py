"""Domain exceptions shared by the core and the services.

The core raises these; exactly one mapper (``specd.serving.grpc_errors``) turns them
into gRPC status codes at the service edge. Messages are written for the
caller: they say what was wrong and what to do about it.
"""


class SpecdError(Exception):
    """Base class of every error specd raises on purpose."""


class InvalidArgument(SpecdError):
    """The caller sent something that can never work; fix the request."""


class SessionNotFound(SpecdError):
    """A service does not know a session (restart, eviction, expiry)."""


class SessionOutOfSync(SpecdError):
    """A service's view of a session disagrees with the caller's committed length."""


class ResourceExhausted(SpecdError):
    """An admission or memory limit was reached; retry later or elsewhere."""


class Unavailable(SpecdError):
    """A dependency (draft, target, worker) cannot serve right now."""


class DeadlineExceeded(SpecdError):
    """The request's deadline passed before it could finish."""


class FailedPrecondition(SpecdError):
    """The system is not in a state that allows this (e.g. models disagree)."""


class ProposalRefused(SpecdError):
    """The target refused a draft's proposal that the coordinator relayed to it undecoded (its q was
    malformed): the draft lied, so the round is verified again without it and speculation pauses."""


class Internal(SpecdError):
    """Something failed inside a service for this request alone (e.g. the model's numbers
    for its row were not finite). Retrying gives the same result, so nobody retries it;
    the message is for logs, and clients see a generic one."""


# Errors that belong to one request: retrying gives the same answer, and they say
# nothing about the health of the service that reported them. Callers fail (or
# degrade) that request alone and neither retry nor mark the peer unhealthy.
REQUEST_ERRORS: tuple[type[SpecdError], ...] = (InvalidArgument, Internal)
