"""A real ``eventkv serve`` in a subprocess for the service tests (issue 12, point 6): started on
127.0.0.1 with ``--port 0`` (the port uvicorn picked is read from its log line), stopped by the test
(SIGTERM, or SIGKILL for the crash test) and always killed at teardown."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from eventkv.testing import tiny_lm

RUNNING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")
START = "from eventkv.cli import main; import sys; sys.argv[0] = 'eventkv'; main()"


def save_sharp_model(directory: Path) -> Path:
    """The tiny random Llama with its output layer scaled by 30 (logits spread like a trained
    model's, so greedy steps have clear top-two margins), saved as a local model directory."""
    lm = tiny_lm("llama")
    with torch.no_grad():
        lm.model.lm_head.weight.mul_(30.0)
    lm.model.save_pretrained(directory)
    lm.tokenizer.save_pretrained(directory)
    return directory


class Server:
    """``eventkv serve --model MODEL --store STORE --port 0 ARGS`` in a subprocess."""

    def __init__(self, model: Path | str, store: Path, *args: str, timeout: float = 120.0) -> None:
        cmd = [sys.executable, "-c", START, "serve", "--model", str(model), "--store", str(store), "--port", "0"]
        cmd += ["--dtype", "float32", "--threads", "1", "--log-level", "info", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        found = threading.Event()
        self.port = None

        def pump():
            for line in self.proc.stdout:
                self.lines.append(line)
                m = RUNNING.search(line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    found.set()
            found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(timeout) or self.port is None:
            self.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines[-30:]))
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait: the exit code (0 after a graceful shutdown)."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def log(self) -> str:
        time.sleep(0.1)
        return "".join(self.lines)
