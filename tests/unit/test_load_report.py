"""The load test's report reads each worker's held pages from the worker it just ran, and
counts requests that completed only after stalling mid-stream."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from baton.benchmarks import load_report
from baton.benchmarks.load_report import worker_metrics


class _Metrics(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"baton_worker_running 0\nbaton_worker_pages_in_use 0\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_log_kept_from_an_earlier_run_reads_the_current_worker(tmp_path: Path) -> None:
    server = HTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        (tmp_path / "decode-0.log").write_text(
            "BATON_WORKER_READY grpc=127.0.0.1:1 http=127.0.0.1:9 BATON_WORKER_PID=1\n"
            "... the earlier run stopped; this one started ...\n"
            f"BATON_WORKER_READY grpc=127.0.0.1:2 http=127.0.0.1:{port} BATON_WORKER_PID=2\n"
        )
        assert worker_metrics(tmp_path) == {"decode-0": {"running": 0.0, "pages_in_use": 0.0}}
    finally:
        server.shutdown()
        server.server_close()


def test_the_report_counts_requests_that_stalled_mid_stream(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    def request(itl: list[float], error: str | None = None) -> dict:
        return {"sent": True, "warmup": False, "success": error is None, "error": error,
                "itl_s": itl}  # fmt: skip

    run = tmp_path / "load.json"
    records = [request([0.02, 0.03]), request([0.02, 300.1, 0.02]), request([], "HTTP 429: full")]
    run.write_text(json.dumps({"requests": records, "summary": {}}))
    logs = tmp_path / "logs"
    logs.mkdir()
    args = ["--capacity", "10", "--rate", "15", "--log-dir", str(logs), "--drain-s", "0"]
    assert load_report.main([str(run), *args, "--name", "pd"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("| pd | 10.00 | 15.00 | 3 | 2 | 1 | 0 | 0 |")
    assert line.endswith("| 300.1 | 1 |")  # the longest gap, and one request stalled
    report = json.loads(run.with_suffix(".report.json").read_text())
    assert report["stalled"] == 1 and report["longest_token_gap_s"] == 300.1
