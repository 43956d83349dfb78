"""What the suffix drafter learned from finished sessions, kept apart per tenant.

A learned index answers with the continuations it holds, and how many draft
tokens a request gets (its stats, its stream's chunk sizes) tells the caller
whether, and how far, its context occurred before. Shared by every caller,
one caller could read another's text back guess by guess. So learned state
is keyed by a tenant (the caller's identity, narrowed by its cache salt; the
coordinator derives the key, specd.serving.tenancy):

- sharing "tenant" (the default): a session reads and feeds only its own
  tenant's index. A session with no tenant (no identity, no salt) learns
  nothing across requests: its own prompt and answer still draft for it.
- sharing "shared": one index for every session, whatever its tenant (a
  single-tenant deployment; every caller can probe what any other's
  requests contained).

Memory is bounded per tenant (each index evicts its oldest documents beyond
`tenant_bytes`) and overall (beyond `total_bytes`, whole tenants go, the
least recently used first), and at most `max_tenants` indexes are kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from specd.core.draft.suffix_index import SharedSuffixIndex
from specd.core.errors import InvalidArgument

PER_TENANT = "tenant"
SHARED = "shared"
SHARING_MODES = (PER_TENANT, SHARED)
NO_TENANT = ""  # a caller with neither an identity nor a cache salt
_SHARED_KEY = "*"  # the one index of sharing "shared"


class TenantIndexes:
    """Learned suffix indexes by tenant, bounded per tenant and overall; thread-safe."""

    def __init__(
        self,
        total_bytes: int,
        tenant_bytes: int,
        *,
        sharing: str = PER_TENANT,
        max_tenants: int = 1024,
        anchor: int = 2,
        max_depth: int = 24,
        max_occurrences: int = 4096,
    ) -> None:
        if sharing not in SHARING_MODES:
            raise InvalidArgument(f"suffix sharing must be one of {', '.join(SHARING_MODES)} (got {sharing!r})")
        if total_bytes < 0 or tenant_bytes < 0:
            raise InvalidArgument(f"suffix index budgets must be >= 0 bytes (got {total_bytes}, {tenant_bytes})")
        if max_tenants < 1:
            raise InvalidArgument(f"suffix max tenants must be >= 1 (got {max_tenants})")
        self.sharing = sharing
        self.total_bytes = total_bytes
        # Shared: one index with the whole budget; per tenant: no index above the total either.
        self.tenant_bytes = total_bytes if sharing == SHARED else min(tenant_bytes, total_bytes)
        self.max_tenants = 1 if sharing == SHARED else max_tenants
        self._shape = dict(anchor=anchor, max_depth=max_depth, max_occurrences=max_occurrences)
        self._indexes: OrderedDict[str, SharedSuffixIndex] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.dropped_tenants = 0  # indexes dropped whole for the overall bounds
        self.unscoped_documents = 0  # sessions with no tenant, not learnt (sharing "tenant")
        self._evicted_before = 0  # documents evicted by indexes since dropped

    def _key(self, tenant: str) -> str | None:
        if self.sharing == SHARED:
            return _SHARED_KEY
        return tenant if tenant != NO_TENANT else None

    def index_for(self, tenant: str) -> SharedSuffixIndex | None:
        """The learned index a tenant's sessions may draft from; None when there is none for it."""
        key = self._key(tenant)
        if key is None:
            return None
        with self._lock:
            index = self._indexes.get(key)
            if index is not None:
                self._indexes.move_to_end(key)
            return index

    def learn(self, tenant: str, tokens: Sequence[int]) -> None:
        """A finished session's document joins its tenant's index (nothing for a session with no tenant)."""
        if not len(tokens):
            return
        key = self._key(tenant)
        if key is None:
            with self._lock:
                self.unscoped_documents += 1
            return
        with self._lock:
            index = self._indexes.get(key)
            if index is None:
                index = SharedSuffixIndex(self.tenant_bytes, **self._shape)
                self._indexes[key] = index
            self._indexes.move_to_end(key)
        index.add(tokens)  # its own lock: evicts its oldest documents beyond tenant_bytes
        with self._lock:
            self._fit(keep=key)

    def _fit(self, keep: str) -> None:
        """Drop least recently used tenants (not `keep`) while over max_tenants or total_bytes."""
        while len(self._indexes) > 1 and (
            len(self._indexes) > self.max_tenants or sum(i.nbytes for i in self._indexes.values()) > self.total_bytes
        ):
            oldest = next(k for k in self._indexes if k != keep)
            dropped = self._indexes.pop(oldest)
            self._evicted_before += dropped.evicted_documents + dropped.documents
            self.dropped_tenants += 1

    def _all(self) -> list[SharedSuffixIndex]:
        with self._lock:
            return list(self._indexes.values())

    @property
    def tenants(self) -> int:
        with self._lock:
            return len(self._indexes)

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self._all())

    @property
    def max_bytes(self) -> int:
        return self.total_bytes

    @property
    def tokens(self) -> int:
        return sum(i.tokens for i in self._all())

    @property
    def documents(self) -> int:
        return sum(i.documents for i in self._all())

    @property
    def evicted_documents(self) -> int:
        """Documents gone: evicted within an index, or with a tenant dropped whole."""
        return self._evicted_before + sum(i.evicted_documents for i in self._all())

    def check(self) -> None:
        """Assert every index is consistent and the bounds hold (tests)."""
        indexes = self._all()
        assert len(indexes) <= self.max_tenants
        for index in indexes:
            index.check()
            assert index.nbytes <= self.tenant_bytes or index.documents == 0
        assert len(indexes) <= 1 or sum(i.nbytes for i in indexes) <= self.total_bytes
