"""The service tests' helpers: a real ``eventkv serve`` in a subprocess on
127.0.0.1 and a port uvicorn picks (:class:`eventkv.service.server.ServerProcess`, float32, one
thread), and the sharpened tiny model it serves."""

from __future__ import annotations

from pathlib import Path

import torch

from eventkv.service.server import ServerProcess
from eventkv.testing import tiny_lm


def save_sharp_model(directory: Path) -> Path:
    """The tiny random Llama with its output layer scaled by 30 (logits spread like a trained
    model's, so greedy steps have clear top-two margins), saved as a local model directory."""
    lm = tiny_lm("llama")
    with torch.no_grad():
        lm.model.lm_head.weight.mul_(30.0)
    lm.model.save_pretrained(directory)
    lm.tokenizer.save_pretrained(directory)
    return directory


def Server(model, store, *args: str) -> ServerProcess:  # noqa: N802 - reads as the class it builds
    """A server on ``model`` and ``store`` (float32, one torch thread, uvicorn info log)."""
    return ServerProcess(model, store, "--dtype", "float32", "--threads", "1", "--log-level", "info", *args)


class LiveApp:
    """An app (:func:`eventkv.service.app.create_app`) under a real uvicorn server in a thread of this
    process, on 127.0.0.1 and a port the OS picks: tests reach its worker (``app.state.worker``) and
    talk to it over real sockets. ``options``: more ``uvicorn.Config`` options (timeouts). Stops on
    leaving the ``with`` block (the lifespan closes every memory)."""

    def __init__(self, app, **options) -> None:
        import socket
        import threading

        import uvicorn

        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **options))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveApp":
        import time

        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            self.thread.join(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()
