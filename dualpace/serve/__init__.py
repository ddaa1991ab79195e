"""gRPC server plumbing shared by the daemons (gpu_service, cpu_service, router).

- address: parse `--listen HOST:PORT`, `is_loopback`;
- status: the one exception -> status code mapping (`status_for`);
- interceptor: applies it to every handler, so servicers stay thin;
- server: `start_server` (interceptor, health, reflection, bind), `print_listening`;
- event_loop: `install_uvloop`, `serve_forever` (SIGINT/SIGTERM -> a stop event);
- grpcurl: `grpcurl_path` for tests and operators;
- security: loopback unless TLS (`--tls-cert/--tls-key/--tls-client-ca`); auth: the optional
  shared bearer token (`--auth-token-file`), server interceptor and client metadata;
- sd_notify: READY/STATUS/STOPPING/WATCHDOG to systemd, by hand (docs/operations.md).
"""

from dualpace.serve.address import ListenAddress, is_loopback, parse_listen
from dualpace.serve.grpcurl import grpcurl_path
from dualpace.serve.interceptor import StatusInterceptor
from dualpace.serve.event_loop import install_uvloop, serve_forever
from dualpace.serve.server import DEFAULT_MAX_MESSAGE_BYTES, RunningServer, print_listening, start_server
from dualpace.serve.status import status_for

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ListenAddress",
    "RunningServer",
    "StatusInterceptor",
    "grpcurl_path",
    "install_uvloop",
    "is_loopback",
    "parse_listen",
    "print_listening",
    "serve_forever",
    "start_server",
    "status_for",
]
