"""The service tests' helpers (issue 12, point 6): a real ``eventkv serve`` in a subprocess on
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
