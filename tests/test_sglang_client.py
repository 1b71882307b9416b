"""post_json (dspark_sgl/sglang/client.py): a /flush_cache that finds a request still in SGLang's running batch
answers 400 and is retried until the batch is empty; every other error is raised at once."""

from __future__ import annotations

import threading
import urllib.error
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dspark_sgl.sglang.client import post_json


class _Sglang(BaseHTTPRequestHandler):
    """Answers /flush_cache with 400 ("pending requests") `busy` times, then 200 in plain text; /generate with JSON;
    anything else 400."""

    busy = 0
    calls: list[str] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).calls.append(self.path)
        if self.path == "/flush_cache" and type(self).busy > 0:
            type(self).busy -= 1
            code, body = 400, b"Cache not flushed because there are pending requests. #running-req: 1"
        elif self.path == "/flush_cache":
            code, body = 200, b"Cache flushed.\n"
        elif self.path == "/generate":
            code, body = 200, b'{"text": "ok"}'
        else:
            code, body = 400, b"bad"
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Sglang)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    _Sglang.busy, _Sglang.calls = 0, []
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_flush_waits_for_the_running_batch_to_empty(server):
    _Sglang.busy = 3
    assert post_json(server, "/flush_cache", {}) == {"text": "Cache flushed.\n"}
    assert _Sglang.calls == ["/flush_cache"] * 4
    assert post_json(server, "/generate", {"input_ids": [1]}) == {"text": "ok"}


def test_other_errors_and_a_flush_that_never_clears_are_raised(server):
    with pytest.raises(urllib.error.HTTPError):
        post_json(server, "/set_internal_state", {})
    assert _Sglang.calls == ["/set_internal_state"]  # not retried
    _Sglang.busy = 10**6
    with pytest.raises(urllib.error.HTTPError):
        post_json(server, "/flush_cache", {}, flush_wait_s=0.3)
    assert 2 <= _Sglang.calls.count("/flush_cache") <= 10
