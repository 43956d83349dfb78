"""Where did the recent context occur before, and what followed it most often?

The index behind suffix speculation (SuffixDecoding, Oliaro et al., arXiv
2411.04975). SuffixDecoding keeps suffix trees; this keeps the same answers
in a flatter form that Python and numpy handle well:

- the indexed tokens in one int32 buffer, documents separated by SEP;
- posting lists: for each `anchor`-gram, the positions right after its
  occurrences, oldest first.

A query (`speculate`) takes the context's last `anchor` tokens, reads their
occurrences (the most recent `max_occurrences`), and extends each match
backwards (vectorised) to its match length L <= max_depth: the occurrences
with match length >= L are the suffix-tree node of the context's last L
tokens. From that node it walks forwards, taking at each step the
continuation that most of the node's occurrences share (ties: the earliest
occurrence's), its estimated probability being the running product of
count(child) / count(node) (occurrences that end there count in the node);
the walk stops at max_tokens, at `min(max_tokens, L * factor + offset)` and
when the probability drops under `min_prob`. The score is the sum of the
probabilities, the expected number of accepted tokens; the best-scoring
match length wins. Same rules as the paper's and vLLM's `method: suffix`.

Memory is counted in bytes from the live objects (buffer, posting arrays,
keys, the dict), so that a budget can bound it honestly.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specd.core.errors import InvalidArgument

SEP = -1  # between documents: never equal to a token, so matches and walks stop there
TOKEN_BITS = 21  # token ids < 2**21 (2,097,152): an anchor of up to 3 packs into one int key
MAX_ANCHOR = 3
# sys.getsizeof of a dict built afresh with n int keys is at most _DICT_BASE + _DICT_PER_KEY * n
# (CPython 3.11: 60.0 per key at worst, measured for n up to 300,000).
_DICT_BASE = sys.getsizeof({}) + 224
_DICT_PER_KEY = 64
LOW_WATER = 0.9  # a full learned index evicts down to this fraction of its budget
_SMALL_NODE = 48  # occurrences below which a walk steps in plain Python


@dataclass(frozen=True)
class Candidate:
    """A proposed continuation: tokens with their estimated probabilities (running products)."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0  # sum of probs: the expected number of accepted tokens
    match_len: int = 0  # context tokens the continuation was matched on

    def __len__(self) -> int:
        return len(self.token_ids)


NO_CANDIDATE = Candidate()


def pack_key(tokens: Sequence[int]) -> int:
    """anchor tokens -> one int (TOKEN_BITS each)."""
    key = 0
    for t in tokens:
        key = (key << TOKEN_BITS) | int(t)
    return key


class SuffixIndex:
    """Token documents with anchor-gram posting lists; not thread-safe (see SharedSuffixIndex).

    Positions are global and only grow (a document once evicted is never
    addressed again); the buffer holds the live ones, from `_base`.
    """

    def __init__(self, *, anchor: int = 2, max_depth: int = 24, max_occurrences: int = 4096) -> None:
        if not 1 <= anchor <= MAX_ANCHOR:
            raise InvalidArgument(f"anchor must be in 1..{MAX_ANCHOR} (got {anchor})")
        if max_depth < anchor:
            raise InvalidArgument(f"max_depth must be >= anchor ({anchor}) (got {max_depth})")
        if max_occurrences < 1:
            raise InvalidArgument(f"max_occurrences must be >= 1 (got {max_occurrences})")
        self.anchor = anchor
        self.max_depth = max_depth
        self.max_occurrences = max_occurrences
        self._buf = np.full(256, SEP, dtype=np.int32)  # [capacity] tokens from global position _base
        self._base = 0  # global position of _buf[0]
        self._live = 0  # global position of the oldest live token
        self._end = 0  # global position one past the last token
        # anchor key -> the positions right after its occurrences, oldest first (one: a bare int)
        self._postings: dict[int, int | array] = {}
        self._posting_bytes = 0  # the posting arrays and their keys, as sys.getsizeof counts them
        self._docs: deque[tuple[int, int]] = deque()  # [start, end) of each live document, oldest first
        self._open = False  # the newest document is still growing (extend / truncate)

    # ---- size ------------------------------------------------------------------------

    @property
    def tokens(self) -> int:
        """Live tokens (separators included)."""
        return self._end - self._live

    @property
    def documents(self) -> int:
        return len(self._docs)

    @property
    def nbytes(self) -> int:
        """Bytes held: the token buffer, the posting arrays with their keys, and the dict."""
        return int(self._buf.nbytes) + self._posting_bytes + sys.getsizeof(self._postings)

    # ---- writing -----------------------------------------------------------------------

    def add_document(self, tokens: Sequence[int]) -> None:
        """Index a finished document (it ends with SEP: a walk never runs into the next one)."""
        self._close_open()
        start = self._end
        self._append(tokens)
        self._append_raw([SEP])
        self._docs.append((start, self._end))

    def extend(self, tokens: Sequence[int]) -> None:
        """Grow the open document (opened by the first extend after a close)."""
        if not self._open:
            self._docs.append((self._end, self._end))
            self._open = True
        self._append(tokens)
        start, _ = self._docs[-1]
        self._docs[-1] = (start, self._end)

    def open_length(self) -> int:
        """Tokens in the open document (0 when none is open)."""
        if not self._open:
            return 0
        start, end = self._docs[-1]
        return end - start

    def truncate(self, length: int) -> None:
        """Cut the open document back to its first `length` tokens."""
        if not self._open:
            raise InvalidArgument("no open document to truncate")
        start, end = self._docs[-1]
        if not 0 <= length <= end - start:
            raise InvalidArgument(f"cannot truncate a document of {end - start} tokens to {length}")
        for g in range(end - 1, start + length - 1, -1):  # newest first: each is its key's last posting
            if g - self.anchor + 1 >= start:
                self._remove_last(self._key_at(g), g + 1)
        self._buf[start + length - self._base : end - self._base] = SEP
        self._end = start + length
        self._docs[-1] = (start, self._end)

    def evict_oldest(self) -> None:
        """Forget the oldest document and its postings (each is the oldest entry of its key's list)."""
        start, end = self._docs.popleft()
        if not self._docs:
            self._open = False
        content_end = end - 1 if self._buf[end - 1 - self._base] == SEP else end
        keys = self._keys_of(start, content_end)
        for key, n in Counter(keys).items():
            self._remove_first(key, n)
        self._live = self._docs[0][0] if self._docs else self._end

    def compact(self) -> None:
        """Drop the evicted prefix and spare capacity of the buffer, and rebuild the dict (it never shrinks)."""
        live = self._buf[self._live - self._base : self._end - self._base]
        self._buf = np.array(live, dtype=np.int32) if live.size else np.full(1, SEP, dtype=np.int32)
        self._base = self._live
        self._postings = {k: v for k, v in self._postings.items()}  # one by one: sized to its keys

    def compacted_bytes_bound(self) -> int:
        """An upper bound on nbytes right after compact()."""
        return 4 * max(1, self.tokens) + self._posting_bytes + _DICT_BASE + _DICT_PER_KEY * len(self._postings)

    def _close_open(self) -> None:
        if self._open:
            self._open = False
            # A growing document ends here: a SEP makes it a finished one.
            self._append_raw([SEP])
            start, _ = self._docs[-1]
            self._docs[-1] = (start, self._end)

    def _append(self, tokens: Sequence[int]) -> None:
        new = np.asarray(tokens, dtype=np.int64)
        if new.size == 0:
            return
        if int(new.min()) < 0 or int(new.max()) >= 1 << TOKEN_BITS:
            raise InvalidArgument(f"token ids must be in [0, {1 << TOKEN_BITS})")
        doc_start = self._docs[-1][0] if self._open else self._end
        first = self._end
        self._append_raw(new)
        # A posting for every position g whose anchor-gram ends at g inside this document: key -> g + 1.
        lo = max(first, doc_start + self.anchor - 1)
        if lo >= self._end:
            return
        keys = self._keys_of(lo - self.anchor + 1, self._end)
        for g, key in zip(range(lo, self._end), keys):
            self._add_posting(key, g + 1)

    def _append_raw(self, tokens: Sequence[int] | np.ndarray) -> None:
        n = len(tokens)
        need = self._end + n - self._base
        if need > self._buf.size:
            live = self._end - self._live
            grown = np.full(max((live + n) * 5 // 4, live + n + 256), SEP, dtype=np.int32)
            grown[:live] = self._buf[self._live - self._base : self._end - self._base]
            self._buf, self._base = grown, self._live
        at = self._end - self._base
        self._buf[at : at + n] = np.asarray(tokens, dtype=np.int32)
        self._end += n

    def _keys_of(self, start: int, end: int) -> list[int]:
        """Keys of the anchor-grams that end at positions start + anchor - 1 .. end - 1."""
        a = self.anchor
        seg = self._buf[start - self._base : end - self._base].astype(np.int64)
        if seg.size < a:
            return []
        keys = np.zeros(seg.size - a + 1, dtype=np.int64)
        for i in range(a):
            keys = (keys << TOKEN_BITS) | seg[i : seg.size - a + 1 + i]
        return keys.tolist()

    def _key_at(self, g: int) -> int:
        """Key of the anchor-gram that ends at global position g."""
        at = g - self._base
        return pack_key(self._buf[at - self.anchor + 1 : at + 1].tolist())

    def _add_posting(self, key: int, position: int) -> None:
        """A key's first occurrence is stored as a bare int (most keys of diverse text occur once), later ones
        in an array: about 80 bytes less per key that occurs once."""
        held = self._postings.get(key)
        if held is None:
            self._postings[key] = position
            self._posting_bytes += sys.getsizeof(key) + sys.getsizeof(position)
        elif isinstance(held, int):
            grown = array("q", (held, position))
            self._postings[key] = grown
            self._posting_bytes += sys.getsizeof(grown) - sys.getsizeof(held)
        else:
            before = sys.getsizeof(held)
            held.append(position)
            self._posting_bytes += sys.getsizeof(held) - before

    def _remove_last(self, key: int, position: int) -> None:
        held = self._postings[key]
        if isinstance(held, int):
            assert held == position, "postings out of order"
            self._drop_key(key, held)
            return
        assert held[-1] == position, "postings out of order"
        before = sys.getsizeof(held)
        held.pop()
        self._posting_bytes += sys.getsizeof(held) - before
        if not held:
            self._drop_key(key, held)

    def _remove_first(self, key: int, n: int) -> None:
        held = self._postings[key]
        if isinstance(held, int):
            assert n == 1, "postings out of order"
            self._drop_key(key, held)
            return
        before = sys.getsizeof(held)
        del held[:n]
        self._posting_bytes += sys.getsizeof(held) - before
        if not held:
            self._drop_key(key, held)

    def _drop_key(self, key: int, held: int | array) -> None:
        del self._postings[key]
        self._posting_bytes -= sys.getsizeof(key) + sys.getsizeof(held)

    def _positions(self, key: int) -> list[int] | array:
        held = self._postings.get(key)
        if held is None:
            return []
        return [held] if isinstance(held, int) else held

    # ---- reading -----------------------------------------------------------------------

    def speculate(
        self,
        context: Sequence[int],
        max_tokens: int,
        *,
        factor: float = 1.0,
        offset: float = 0.0,
        min_prob: float = 0.1,
    ) -> Candidate:
        """The best-scoring continuation of `context` (its last max_depth tokens matter), or NO_CANDIDATE."""
        a = self.anchor
        if max_tokens < 1 or len(context) < a:
            return NO_CANDIDATE
        held = self._postings.get(pack_key(context[-a:]))
        if held is None:
            return NO_CANDIDATE
        if isinstance(held, int):
            occ = np.array([held], dtype=np.int64)
        else:
            recent = held[-self.max_occurrences :] if len(held) > self.max_occurrences else held
            occ = np.frombuffer(recent.tobytes(), dtype=np.int64)  # [n] global positions after each match
        occ = occ[occ < self._end]  # the context itself, at the open document's end, has no continuation yet
        if occ.size == 0:
            return NO_CANDIDATE
        phys = occ - self._base  # [n] buffer index of each continuation's first token
        agree = self._match_lengths(phys, context)  # [n]
        end = self._end - self._base
        best = NO_CANDIDATE
        for length in sorted(set(agree.tolist()), reverse=True):
            cap = min(max_tokens, int(length * factor + offset + 1e-6))
            if cap <= best.score:  # no candidate of this length can score more than it proposes
                break
            cand = self._walk(phys[agree >= length], end, cap, min_prob)
            if cand.score > best.score:
                best = Candidate(cand.token_ids, cand.probs, cand.score, length)
        return best

    def _match_lengths(self, phys: np.ndarray, context: Sequence[int]) -> np.ndarray:
        """[n] how many context tokens agree, backwards from each occurrence (anchor..max_depth)."""
        a = self.anchor
        ctx = np.asarray(context[-self.max_depth :], dtype=np.int32)
        agree = np.full(phys.size, a, dtype=np.int64)
        alive = np.ones(phys.size, dtype=bool)
        lo = self._live - self._base
        for j in range(a, ctx.size):
            at = phys - 1 - j  # the token j before the continuation
            ok = at >= lo
            same = alive & ok & (self._buf[np.maximum(at, lo)] == ctx[ctx.size - 1 - j])
            if not same.any():
                break
            agree += same
            alive = same
        return agree

    def _walk(self, node: np.ndarray, end: int, cap: int, min_prob: float) -> Candidate:
        """Follow the most frequent continuation of the occurrences `node` (buffer indices), up to cap tokens.

        Large nodes step with numpy; once a node is small (the usual case after a step or two) plain
        Python is cheaper than numpy's per-call overhead.
        """
        tokens: list[int] = []
        probs: list[float] = []
        prob, depth = 1.0, 0
        buf = self._buf
        while len(tokens) < cap and node.size > _SMALL_NODE:
            at = node + depth
            nxt = np.where(at < end, buf[np.minimum(at, end - 1)], SEP)  # [n] next token (SEP: ended)
            real = nxt[nxt != SEP]
            if real.size == 0:
                return Candidate(tokens, probs, sum(probs))
            values, first, counts = np.unique(real, return_index=True, return_counts=True)
            pick = np.lexsort((first, -counts))[0]  # most frequent; ties: the earliest occurrence
            prob *= float(counts[pick]) / node.size
            if prob < min_prob:
                return Candidate(tokens, probs, sum(probs))
            token = int(values[pick])
            tokens.append(token)
            probs.append(prob)
            node = node[nxt == token]
            depth += 1
        small = [int(i) for i in node.tolist()]
        while len(tokens) < cap and small:
            if len(small) == 1:  # one occurrence left: its tokens up to a separator, all at this probability
                start = small[0] + depth
                run = buf[start : min(end, start + cap - len(tokens))].tolist()
                run = run[: run.index(SEP)] if SEP in run else run
                tokens += run
                probs += [prob] * len(run)
                break
            following = [int(buf[i + depth]) if i + depth < end else SEP for i in small]
            tally: dict[int, int] = {}
            for t in following:
                if t != SEP:
                    tally[t] = tally.get(t, 0) + 1
            if not tally:
                break
            top = max(tally.values())
            token = next(t for t in following if t != SEP and tally[t] == top)  # ties: the earliest occurrence
            prob *= top / len(small)
            if prob < min_prob:
                break
            tokens.append(token)
            probs.append(prob)
            small = [i for i, t in zip(small, following) if t == token]
            depth += 1
        return Candidate(tokens, probs, sum(probs))

    # ---- checks ---------------------------------------------------------------------

    def postings_of(self, key_tokens: Sequence[int]) -> list[int]:
        """Positions after each occurrence of an anchor-gram (for tests and debugging)."""
        return list(self._positions(pack_key(key_tokens)))

    def check(self) -> None:
        """Assert the posting lists are exactly those of the live tokens (tests)."""
        want: dict[int, list[int]] = {}
        for start, end in self._docs:
            for g in range(start + self.anchor - 1, end):
                if self._buf[g - self._base] == SEP:
                    continue
                key = self._key_at(g)
                if SEP in self._buf[g - self._base - self.anchor + 1 : g - self._base + 1].tolist():
                    continue
                want.setdefault(key, []).append(g + 1)
        got = {k: list(self._positions(k)) for k in self._postings}
        assert got == want, "posting lists differ from the live tokens"
        for arr in (self._positions(k) for k in self._postings):
            assert list(arr) == sorted(arr) and arr[0] - self.anchor >= self._live
        expect = sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in self._postings.items())
        assert expect == self._posting_bytes, f"posting bytes {self._posting_bytes} != {expect}"


class SharedSuffixIndex:
    """A learned index: one tenant's finished sessions' tokens (tenant_index), thread-safe, within max_bytes.

    Each add evicts the oldest documents until the index's bytes (SuffixIndex.nbytes)
    fit the budget again; a document larger than the budget is not kept.
    """

    def __init__(self, max_bytes: int, *, anchor: int = 2, max_depth: int = 24, max_occurrences: int = 4096) -> None:
        if max_bytes < 0:
            raise InvalidArgument(f"the suffix index budget must be >= 0 bytes (got {max_bytes})")
        self.max_bytes = max_bytes
        self._index = SuffixIndex(anchor=anchor, max_depth=max_depth, max_occurrences=max_occurrences)
        self._lock = threading.Lock()
        self.added_documents = 0
        self.evicted_documents = 0

    def add(self, tokens: Sequence[int]) -> None:
        if not len(tokens):
            return
        with self._lock:
            self._index.add_document(tokens)
            self.added_documents += 1
            self._fit()

    def _fit(self) -> None:
        """Evict oldest first down to LOW_WATER of the budget (by the compacted size's bound), then compact.

        The low-water mark spaces out compactions (each copies the live
        buffer and rebuilds the dict) instead of doing one per added document.
        """
        index = self._index
        if index.nbytes <= self.max_bytes:
            return
        low = int(self.max_bytes * LOW_WATER)
        while index.documents and index.compacted_bytes_bound() > low:
            index.evict_oldest()
            self.evicted_documents += 1
        index.compact()
        while index.documents and index.nbytes > self.max_bytes:  # only if the dict bound failed this Python
            index.evict_oldest()
            self.evicted_documents += 1
            index.compact()

    def speculate(
        self, context: Sequence[int], max_tokens: int, *, factor: float, offset: float, min_prob: float
    ) -> Candidate:
        with self._lock:
            return self._index.speculate(context, max_tokens, factor=factor, offset=offset, min_prob=min_prob)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._index.nbytes

    @property
    def tokens(self) -> int:
        with self._lock:
            return self._index.tokens

    @property
    def documents(self) -> int:
        with self._lock:
            return self._index.documents

    def check(self) -> None:
        with self._lock:
            self._index.check()
