"""The metrics endpoint: a service's registry as Prometheus text over HTTP, off the event loop.

What is exported is specd.serving.metrics; this serves it with waitress (a
maintained pure-Python WSGI server): one I/O thread reads requests for every
connection, and a fixed pool of worker threads runs the app on complete
requests only. So a client that connects and sends nothing holds a socket, not
a thread, until the idle timeout closes it; sockets are capped too.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, make_wsgi_app
from waitress import wasyncore
from waitress.server import BaseWSGIServer, create_server

# A scrape is one small GET answered in milliseconds: two workers serve a Prometheus
# HA pair at once; connections past the cap wait in the listen backlog.
WORKER_THREADS = 2
CONNECTION_LIMIT = 100
# A connection with no request in progress this long is closed (Prometheus reconnects
# on its next scrape). waitress takes whole seconds.
IDLE_TIMEOUT_S = 10
MAX_REQUEST_HEADER_BYTES = 16 * 1024  # a scrape's headers are a few hundred bytes
MAX_REQUEST_BODY_BYTES = 64 * 1024  # a scrape has no body


def text_format_app(registry: CollectorRegistry) -> Callable[..., Any]:
    """The registry as Prometheus text format (0.0.4), whatever the scraper's Accept header asks.

    prometheus_client answers an OpenMetrics request that names no escaping
    scheme (Prometheus 2.x sends none) with escaping=underscores, which turns
    the colons of sample names into underscores (specd:generation_tokens_total
    becomes specd_generation_tokens_total) while its HELP/TYPE lines keep them
    (prometheus/client_python#1177). The text format keeps every name as
    documented, for Prometheus 2 and 3 alike; specd uses nothing that only
    OpenMetrics carries (exemplars).
    """
    app = make_wsgi_app(registry)

    def text_only(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        return app({**environ, "HTTP_ACCEPT": "text/plain; version=0.0.4"}, start_response)

    return text_only


class MetricsServer:
    """A running metrics endpoint: its I/O loop thread and worker pool; shutdown() stops both."""

    def __init__(self, server: BaseWSGIServer, sockets: dict[int, Any]) -> None:
        self._server = server
        self._sockets = sockets  # waitress's socket map: the listener, its wake-up pipe, each connection
        self._stopped = False
        self._thread = threading.Thread(target=server.run, name="specd-metrics", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.effective_port)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Close the listener and every connection, then stop the workers (each wait bounded by timeout_s)."""
        if self._stopped:
            return
        self._stopped = True
        # The socket map belongs to the I/O thread: close it there; the loop ends once it is empty.
        closed = threading.Event()

        def close_all() -> None:
            wasyncore.close_all(self._sockets)
            closed.set()

        try:
            self._server.trigger.pull_trigger(close_all)
        except OSError:
            # waitress queues the callback before it writes the wake-up byte: an I/O thread a worker
            # had just woken can run it in between, closing the trigger under that write (EBADF).
            if not closed.wait(timeout_s):
                raise
        self._thread.join(timeout_s)
        self._server.task_dispatcher.shutdown(timeout=timeout_s)


def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    *,
    idle_timeout_s: int = IDLE_TIMEOUT_S,
    threads: int = WORKER_THREADS,
    connection_limit: int = CONNECTION_LIMIT,
) -> tuple[MetricsServer, int]:
    """Serve `registry` as Prometheus text on http://host:port/metrics (port 0 picks one).

    Returns (server, port); call server.shutdown() to stop. The server runs in
    threads of its own (daemons: a hanging scrape never holds up exit), so
    scrapes never touch the event loop. Threads: `threads` workers and one I/O
    thread, however many clients connect; at most `connection_limit`
    connections are open at once, and one idle for `idle_timeout_s` is closed.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family)  # bound here: host may be a name
    sockets: dict[int, Any] = {}
    server = create_server(
        text_format_app(registry),
        map=sockets,
        sockets=[listener],
        threads=threads,
        connection_limit=connection_limit,
        channel_timeout=idle_timeout_s,
        cleanup_interval=1,  # look for idle connections every second (the I/O loop wakes at least that often)
        asyncore_loop_timeout=1,
        max_request_header_size=MAX_REQUEST_HEADER_BYTES,
        max_request_body_size=MAX_REQUEST_BODY_BYTES,
        ident="specd",
    )
    assert isinstance(server, BaseWSGIServer)  # one socket: one server, not waitress's MultiSocketServer
    metrics = MetricsServer(server, sockets)
    return metrics, metrics.port
