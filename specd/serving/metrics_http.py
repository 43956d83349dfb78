"""The metrics endpoint: a service's registry as Prometheus text over HTTP, in a thread of its own.

What is exported is specd.serving.metrics; this serves it.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app


class _TextOnlyServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a hanging scrape never holds up exit


class _TextOnlyServer6(_TextOnlyServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log line per scrape."""


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


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> tuple[Any, int]:
    """Serve `registry` as Prometheus text on http://host:port/metrics (port 0 picks one).

    Returns (server, port); call server.shutdown() to stop. The server runs
    in its own daemon thread, so scrapes never touch the event loop.
    """
    server_class = _TextOnlyServer6 if ":" in host else _TextOnlyServer
    server = make_server(host, port, text_format_app(registry), server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="specd-metrics", daemon=True).start()
    return server, int(server.server_port)
