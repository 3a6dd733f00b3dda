#!/usr/bin/env python3
"""The tests' range-capable HTTP server (tests/remote_servers.HttpServer: single byte ranges, ETags,
If-Match, directory index pages) behind a throttled link, for bench/remote_size.py:

    python bench/throttled_http.py ROOT --rate-mb 200 --latency-ms 20 --port-file PORT

- one token bucket for every connection together (the link): bodies and headers leave at `--rate-mb`
  MB/s (10^6 bytes) in total, paced per 64 KiB, no burst beyond 50 ms of credit;
- `--latency-ms` before each response (a request's round trip to a far object store);
- every GET counted with its Range header and body bytes: `GET /__stats__` answers them as JSON,
  `GET /__reset__` clears them (not counted).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from tests.remote_servers import HttpServer  # noqa: E402

PIECE = 64 * 1024
BURST_S = 0.05


class Link:
    """A shared token bucket: `take(n)` returns once n more bytes fit in the link's rate."""

    def __init__(self, rate: float):
        self.rate = rate
        self.lock = threading.Lock()
        self.t_next = time.monotonic()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self.lock:
            now = time.monotonic()
            start = max(self.t_next, now - BURST_S)
            self.t_next = start + n / self.rate
            wait = self.t_next - now - BURST_S
        if wait > 0:
            time.sleep(wait)


class _Paced:
    def __init__(self, raw, link: Link):
        self.raw, self.link = raw, link

    def write(self, b):
        mv = memoryview(b).cast("B")
        for i in range(0, len(mv), PIECE):
            piece = mv[i:i + PIECE]
            self.link.take(len(piece))
            self.raw.write(piece)
        return len(mv)

    def __getattr__(self, name):
        return getattr(self.raw, name)


class ThrottledHttpServer(HttpServer):
    def __init__(self, root, rate_bytes: float, latency_s: float):
        self.link = Link(rate_bytes)
        self.latency_s = latency_s
        self.log: list[tuple[str, str | None, int]] = []   # (path, Range header, body bytes) of each GET
        self.log_lock = threading.Lock()
        self.last = threading.local()   # what the calling thread's last response counted
        super().__init__(root)
        done = self.counter.done   # a body's request, once its bytes (counted as they were sent) are all out

        def done_and_keep(method, path, n):
            done(method, path, n)
            self.last.n = n
        self.counter.done = done_and_keep

    def handler_base(self):
        return throttled_handler(super().handler_base())


def throttled_handler(base):
    """The tests' HTTP handler class `base`, paced by the server's link, its GETs logged."""

    class ThrottledHandler(base):
        def setup(self):
            super().setup()
            self.wfile = _Paced(self.wfile, self.server_obj.link)   # once per connection (kept alive)

        def serve(self, head):
            srv = self.server_obj
            if self.path in ("/__stats__", "/__reset__"):
                with srv.log_lock:
                    if self.path == "/__reset__":
                        srv.log.clear()
                        srv.counter.reset()
                    body = {"bytes": srv.counter.bytes, "requests": len(srv.log), "log": srv.log}
                return self.send_json(body)
            if srv.latency_s:
                time.sleep(srv.latency_s)
            srv.last.n = 0
            try:
                return super().serve(head)
            finally:
                if not head:
                    with srv.log_lock:
                        srv.log.append((self.path, self.headers.get("Range"), srv.last.n))
    return ThrottledHandler


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root")
    ap.add_argument("--rate-mb", type=float, default=200.0, help="link rate in MB/s (10^6 bytes); 0: unlimited")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--port-file", required=True)
    a = ap.parse_args(argv)
    srv = ThrottledHttpServer(a.root, a.rate_mb * 1e6, a.latency_ms / 1000)
    Path(a.port_file).write_text(str(srv.port))
    try:
        srv.thread.join()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
