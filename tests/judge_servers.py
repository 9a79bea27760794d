"""Real servers for the judge's tests: a scripted OpenAI-style server of the tests' own (faults on demand) and
`transformers serve` on a tiny local model. Both bind 127.0.0.1 on a free port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def chat_completion(content: str, logprobs=None) -> dict:
    choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}
    if logprobs is not None:
        choice["logprobs"] = {"content": logprobs}
    return {"id": "x", "object": "chat.completion", "created": 0, "model": "judge", "choices": [choice]}


class ScriptedServer:
    """An HTTP server answering ``POST /v1/chat/completions`` as ``plan(index, body)`` says: ``("ok", text)``,
    ``("ok", text, logprobs)``, ``("status", code)``, ``("garbage",)``, ``("close",)`` (drop the connection),
    ``("delay", seconds, text)``. Counts requests, the most in flight at once, and records each body and header."""

    def __init__(self, plan):
        self.plan = plan
        self.bodies: list[dict] = []
        self.auth: list[str] = []
        self.retry_counts: list[str | None] = []  # each request's x-stainless-retry-count (the openai client's)
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, code: int, payload: bytes, kind="application/json"):
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                self._send(200, json.dumps({"object": "list", "data": [{"id": "judge", "object": "model"}]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with server._lock:
                    index = len(server.bodies)
                    server.bodies.append(body)
                    server.auth.append(self.headers.get("Authorization", ""))
                    server.retry_counts.append(self.headers.get("x-stainless-retry-count"))
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    action = server.plan(index, body)
                    if action[0] == "delay":
                        time.sleep(action[1])
                        action = ("ok", action[2])
                    if action[0] == "ok":
                        self._send(200, json.dumps(chat_completion(*action[1:])).encode())
                    elif action[0] == "status":
                        self._send(action[1], json.dumps({"error": {"message": f"scripted {action[1]}"}}).encode())
                    elif action[0] == "garbage":
                        self._send(200, b"<html>not json at all", kind="text/html")
                    elif action[0] == "close":
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                finally:
                    with server._lock:
                        server.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TransformersServe:
    """`transformers serve MODEL_DIR` on 127.0.0.1 in its own process group, waited for (``/health``) at most
    `timeout` seconds, stopped on exit."""

    def __init__(self, model_dir: str, timeout: float = 120.0, log_path: str | None = None, extra_args=()):
        self.model_dir = str(model_dir)
        self.extra_args = list(extra_args)  # more `transformers serve` flags (e.g. --continuous-batching)
        self.port = free_port()
        self.timeout = timeout
        self.log_path = log_path or os.devnull
        self.process = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
        exe = os.path.join(os.path.dirname(sys.executable), "transformers")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in __exit__
        self.process = subprocess.Popen(
            [
                exe,
                "serve",
                self.model_dir,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--device",
                "cpu",
                *self.extra_args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.__exit__()
                raise RuntimeError(f"transformers serve exited with {self.process.returncode} (log: {self.log_path})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"transformers serve did not answer within {self.timeout:.0f} s (log: {self.log_path})")

    def __exit__(self, *exc):
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()
