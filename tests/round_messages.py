"""Round-stream messages for tests that talk to a draft or target service directly (no coordinator).

A round stream carries requests in batches (DraftRequests / TargetRequests) and answers in
batches (DraftResponses / TargetResponses); these tests send each request as its own stream
message and read the answers one by one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from specd.v1 import draft_pb2, target_pb2


def one_per_message(requests: Iterable[Any]) -> Iterator[Any]:
    """Each DraftRequest / TargetRequest as a stream message of its own (None ends the stream, as iter(get, None))."""
    for req in requests:
        if req is None:
            return
        batch = draft_pb2.DraftRequests() if isinstance(req, draft_pb2.DraftRequest) else target_pb2.TargetRequests()
        batch.requests.append(req)
        yield batch


def answers(messages: Iterable[Any]) -> Iterator[Any]:
    """The responses of a stream's answer messages, one by one."""
    for message in messages:
        yield from message.responses
