"""A local HTTP reward service for the toy task, so a `--rm-type random` run can still be *evaluated* on the toy reward.

Why it exists: the control run of `bench/toy_learning.py` must train on `--rm-type random` *without*
`--custom-rm-path` (which would win over `--rm-type` for training and eval alike), yet its held-out eval must
be scored with the same partial-credit reward as every other run. slime picks a sample's grader from its
metadata before `--rm-type`, so the eval rows get `{"rm_type": "remote_rm"}` under a metadata key that the
training rows do not have; `remote_rm` then posts `{"prompt", "response", "label"}` here and this server answers
`{"reward": score_reverse(response, label)}` — the function `examples.toy.reward` uses.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from examples.toy.reward import score_reverse

logger = logging.getLogger(__name__)


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            reward = score_reverse(body.get("response") or "", str(body.get("label")))
            payload, status = json.dumps({"reward": reward}).encode(), 200
        except (ValueError, TypeError) as e:
            payload, status = json.dumps({"error": str(e)}).encode(), 400
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass  # one line per sample would drown the bench output


class _Server(ThreadingHTTPServer):
    # An eval posts one request per sample, up to remote_rm's 1024 connections at once; the default listen
    # backlog (5) reset most of them and the retries stalled the run for minutes.
    request_queue_size = 2048


class ToyRewardServer:
    """`with ToyRewardServer() as srv: ... srv.url ...` — bound to 127.0.0.1 on a free port, stopped on exit."""

    def __init__(self) -> None:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="toy-rm", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/reward"

    def __enter__(self) -> ToyRewardServer:
        self._thread.start()
        logger.info("toy reward server at %s", self.url)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)


def write_remote_eval_file(src: str | Path, dst: str | Path, metadata_key: str) -> Path:
    """Copy of `src` whose rows carry `{metadata_key: {"rm_type": "remote_rm"}}` (read with `--metadata-key`)."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, encoding="utf-8") as fin, open(dst, "w", encoding="utf-8") as fout:
        for line in fin:
            if line.strip():
                row = json.loads(line)
                row[metadata_key] = {"rm_type": "remote_rm"}
                fout.write(json.dumps(row) + "\n")
    return dst
