"""The one mapper from domain exceptions to gRPC status codes (and, from those, HTTP statuses).

Unary handlers get it through `ErrorMappingInterceptor`; stream handlers that
report per-session errors in-band use `session_error`. Internal errors are
logged with their traceback and the caller only sees a generic message.

Whether to retry follows from the code: UNAVAILABLE / DEADLINE_EXCEEDED (and
in-band UNAVAILABLE) may be retried; INVALID_ARGUMENT and INTERNAL belong to
one request (errors.REQUEST_ERRORS) and are never retried, and never mark the
peer that reported them unhealthy.

The coordinator's OpenAI-compatible HTTP port maps the same way: the gRPC
code `status_for` gives, then `HTTP_STATUS` (`http_status_for`), so both
ports tell a caller the same thing with the same message.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from specd.core import errors
from specd.v1 import session_pb2

log = logging.getLogger(__name__)

_STATUS: dict[type[errors.SpecdError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.SessionNotFound: grpc.StatusCode.NOT_FOUND,
    errors.SessionOutOfSync: grpc.StatusCode.ABORTED,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ProposalRefused: grpc.StatusCode.UNAVAILABLE,  # a peer's fault; the loop handles it before any edge
    errors.Internal: grpc.StatusCode.INTERNAL,
}

_SESSION_CODE: dict[type[errors.SpecdError], session_pb2.SessionError.Code] = {
    errors.InvalidArgument: session_pb2.SessionError.CODE_INVALID_ARGUMENT,
    errors.SessionNotFound: session_pb2.SessionError.CODE_SESSION_NOT_FOUND,
    errors.SessionOutOfSync: session_pb2.SessionError.CODE_OUT_OF_SYNC,
    errors.ResourceExhausted: session_pb2.SessionError.CODE_RESOURCE_EXHAUSTED,
    errors.Unavailable: session_pb2.SessionError.CODE_UNAVAILABLE,
    errors.Internal: session_pb2.SessionError.CODE_INTERNAL,
}

# An unknown code (a newer peer) reads as UNAVAILABLE: retried, like a broken stream.
_FROM_SESSION_CODE: dict[int, type[errors.SpecdError]] = {v: k for k, v in _SESSION_CODE.items()}

INTERNAL_MESSAGE = "internal error; the server logged the details"
# Errors about the service's own peers (addresses, stream errors, exception reprs): the
# details are logged; the client learns only what happened and what to do.
_GENERIC: dict[type[errors.SpecdError], str] = {
    errors.Unavailable: "the model service is unavailable right now; retry later (the server logged the details)",
    errors.DeadlineExceeded: "the request did not finish before its deadline (the server logged the details)",
}


def status_code(exc: BaseException) -> grpc.StatusCode:
    """The status code a caller sees for `exc` (CANCELLED for a cancellation); logs nothing (for metrics)."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    for kind in type(exc).__mro__:
        if kind in _STATUS:
            return _STATUS[kind]
    return grpc.StatusCode.INTERNAL


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Status code and client-safe message for an exception."""
    if isinstance(exc, errors.Internal):  # its message may name internals: logged, not sent
        log.error("internal error: %s", exc)
        return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE
    for kind in type(exc).__mro__:
        if kind in _GENERIC:
            log.warning("%s: %s", _STATUS[kind].name, exc)
            return _STATUS[kind], _GENERIC[kind]
        if kind in _STATUS:
            return _STATUS[kind], str(exc)
    log.exception("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE


# The HTTP status a gRPC code stands for (what OpenAI's clients expect: 429 retries later, 503 and 504
# are the server's or the deadline's, 4xx are the request's). 499: the client went away (nginx's code).
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def http_status_for(exc: BaseException) -> tuple[int, grpc.StatusCode, str]:
    """HTTP status, the gRPC code it comes from, and the client-safe message (logged as status_for logs)."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return HTTP_STATUS[grpc.StatusCode.CANCELLED], grpc.StatusCode.CANCELLED, "the request was cancelled"
    code, message = status_for(exc)
    return HTTP_STATUS.get(code, 500), code, message


def session_error(exc: BaseException) -> session_pb2.SessionError:
    """The in-band SessionError for an exception raised while serving a session."""
    for kind in type(exc).__mro__:
        if kind in _SESSION_CODE:
            return session_pb2.SessionError(code=_SESSION_CODE[kind], message=str(exc))
    log.exception("internal error in a session", exc_info=exc)
    return session_pb2.SessionError(code=session_pb2.SessionError.CODE_INTERNAL, message=INTERNAL_MESSAGE)


def exception_from_session_error(err: session_pb2.SessionError) -> errors.SpecdError:
    """The domain exception a peer's in-band SessionError stands for."""
    kind = _FROM_SESSION_CODE.get(err.code, errors.Unavailable)
    return kind(err.message or "peer reported an error")


async def abort_with(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """End the call with exc's status (status_for); raises grpc.aio.AbortError as context.abort does.

    A call can end before its handler's error reaches this: its deadline passed at the same
    moment (the coordinator raises DeadlineExceeded when the request's deadline does), or the
    client went away. Then the status cannot be sent, and grpc logged the failed send as an
    ERROR with two tracebacks; this ends the handler as a cancelled call instead (logged at debug).
    """
    code, message = status_for(exc)
    try:
        await context.abort(code, message)
    except grpc.aio.AbortError:
        raise
    except Exception as failed:  # noqa: BLE001 - grpc's own batch error: the call is already over
        log.debug("the call ended before its status (%s) could be sent: %s", code.name, failed)
        raise asyncio.CancelledError from None


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns domain exceptions raised by handlers into status codes (unary and streaming)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if handler.unary_unary is not None and inspect.iscoroutinefunction(handler.unary_unary):
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await inner_uu(request, context)
                except (grpc.aio.AbortError, grpc.RpcError):
                    raise
                except Exception as exc:  # noqa: BLE001 - a domain error's code; anything else INTERNAL, logged
                    await abort_with(context, exc)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    async for item in inner_us(request, context):
                        yield item
                except (grpc.aio.AbortError, grpc.RpcError):
                    raise
                except Exception as exc:  # noqa: BLE001 - a domain error's code; anything else INTERNAL, logged
                    await abort_with(context, exc)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler
