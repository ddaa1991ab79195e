"""toolkit.daemon_metrics' counter scrape: what bench.compare_policies reports as an engine's preemptions."""

from __future__ import annotations

import http.server
import threading

import pytest

from toolkit.daemon_metrics import counter_total_from_metrics

EXPOSITION = b"""# HELP dualpace_preemptions_total Requests preempted.
# TYPE dualpace_preemptions_total counter
dualpace_preemptions_total{engine="gpu"} 3.0
dualpace_preemptions_total{engine="gpu2"} 2.0
dualpace_preemptions_created{engine="gpu"} 1.7e+09
dualpace_migrations_total{direction="gpu_to_cpu",outcome="ok"} 9.0
"""


@pytest.fixture()
def metrics_address():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(EXPOSITION)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_sums_the_counter_over_its_labels_and_ignores_other_series(metrics_address):
    assert counter_total_from_metrics(metrics_address, "dualpace_preemptions_total") == 5
    assert counter_total_from_metrics(metrics_address, "dualpace_migrations_total") == 9
    assert counter_total_from_metrics(metrics_address, "dualpace_absent_total") == 0


def test_unreadable_endpoint_is_none():
    assert counter_total_from_metrics(None, "dualpace_preemptions_total") is None
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    address = f"127.0.0.1:{server.server_address[1]}"
    server.server_close()  # nothing listens there now
    assert counter_total_from_metrics(address, "dualpace_preemptions_total") is None
