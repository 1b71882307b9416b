"""A JSON POST to an SGLang server, shared by `dspark profile-costs` (profile.py) and the test and benchmark harness.

SGLang's `/flush_cache` answers 400 while its scheduler still holds a request, and a request that has just answered
its `/generate` can still be in the running batch until the scheduler's next loop (the served test stage caught a
flush 400 with `#running-req: 1` a few milliseconds after the last `/generate` returned). So a flush that finds
requests pending is retried until `flush_wait_s` has passed; any other error is raised at once.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request


def post_json(url: str, path: str, body: dict, timeout: float = 300.0, flush_wait_s: float = 30.0) -> dict:
    """POST body as JSON to url + path; the reply as JSON, or {"text": ...} where it is plain text (/flush_cache)."""
    deadline = time.monotonic() + flush_wait_s
    while True:
        req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
            break
        except urllib.error.HTTPError as e:
            if not (path == "/flush_cache" and e.code == 400 and time.monotonic() < deadline):
                raise
            time.sleep(0.1)
    try:
        return json.loads(raw or b"{}")
    except json.JSONDecodeError:
        return {"text": raw.decode(errors="replace")}
