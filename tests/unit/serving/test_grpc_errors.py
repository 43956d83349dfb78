"""The error mapper's abort: the status a handler's error maps to, and a call that ended first."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specd.core.errors import DeadlineExceeded, InvalidArgument
from specd.serving.grpc_errors import abort_with


class _Context:
    """The one call abort_with makes on a servicer context; `fails` stands for the call having ended."""

    def __init__(self, fails: Exception | None = None) -> None:
        self.fails = fails
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        if self.fails is not None:
            raise self.fails
        raise grpc.aio.AbortError()  # what grpc raises once the status went out


def test_a_domain_error_aborts_with_its_code_and_message() -> None:
    context = _Context()
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(abort_with(context, InvalidArgument("max_new_tokens must be at least 1")))  # type: ignore[arg-type]
    assert context.aborted == (grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens must be at least 1")


def test_an_internal_error_sends_the_generic_message_only() -> None:
    context = _Context()
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(abort_with(context, ValueError("a tensor of shape [3, 7]")))  # type: ignore[arg-type]
    assert context.aborted is not None and context.aborted[0] == grpc.StatusCode.INTERNAL
    assert "shape" not in context.aborted[1]


def test_a_call_that_ended_first_ends_the_handler_as_cancelled() -> None:
    # grpc's own batch error when the status cannot be sent (the deadline passed at the same moment)
    context = _Context(fails=RuntimeError('Failed "execute_batch"'))
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(abort_with(context, DeadlineExceeded("the request's deadline passed")))  # type: ignore[arg-type]
    assert context.aborted is not None and context.aborted[0] == grpc.StatusCode.DEADLINE_EXCEEDED
