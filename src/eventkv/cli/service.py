"""``eventkv serve``: EventMemory as an HTTP service (:mod:`eventkv.service`). Option
errors print one line and exit 2 before the model loads."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from eventkv.cli.common import DEVICE_OPTION, DTYPE_OPTION, THREADS_OPTION, model_option, user_errors
from eventkv.options import check_int


def serve(
    model: str = model_option(...),
    store: Path = typer.Option(..., "--store", help="root directory of the memories (one folder per namespace)"),
    host: str = typer.Option("127.0.0.1", "--host", help="bind address (non-loopback needs --token-file)"),
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free port)"),
    token_file: Optional[Path] = typer.Option(
        None, "--token-file", help="bearer tokens, one per line: 'TOKEN' or 'TOKEN ns1,ns2'"
    ),
    max_queue: int = typer.Option(64, "--max-queue", help="model jobs waiting at most (503 + Retry-After beyond)"),
    max_body: int = typer.Option(4 * 1024 * 1024, "--max-body", help="request body bytes at most (413 beyond)"),
    max_open: int = typer.Option(16, "--max-open", help="memories kept open (rows in RAM)"),
    max_batch: int = typer.Option(
        8, "--max-batch", help="queued queries answered in one batched readout at most (1: one at a time)"
    ),
    max_hot: Optional[int] = typer.Option(
        None,
        "--max-hot",
        help="open memories of int8/int4 stores that keep dequantized rows (the rest keep packed rows; default: all)",
    ),
    header_timeout: float = typer.Option(
        10.0, "--header-timeout", help="seconds for a request's headers to arrive (the connection is closed beyond)"
    ),
    body_timeout: float = typer.Option(
        30.0, "--body-timeout", help="seconds for a request's body to arrive (408 beyond)"
    ),
    keep_alive: float = typer.Option(5.0, "--keep-alive", help="seconds an idle keep-alive connection stays open"),
    limit_concurrency: int = typer.Option(
        256, "--limit-concurrency", help="open connections and running requests at most (503 beyond)"
    ),
    backend: str = typer.Option(
        "process", "--backend", help="process: this process serves; ray: replicas on a Ray cluster (Ray Serve)"
    ),
    ray_address: Optional[str] = typer.Option(
        None, "--ray-address", help="--backend ray: the cluster (auto, or ray://host:10001; default: a local one)"
    ),
    replicas: int = typer.Option(2, "--replicas", help="--backend ray: replicas, each with its own model"),
    memories_per_replica: int = typer.Option(
        16, "--memories-per-replica", help="--backend ray: memories kept open per replica (instead of --max-open)"
    ),
    report: list[Path] = typer.Option(
        [],
        "--report",
        help="a run folder or contract folder whose summary and figures /ui/reports shows (repeatable)",
    ),
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    threads: Optional[int] = THREADS_OPTION,
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level"),
) -> None:
    """Serve EventMemory over HTTP (FastAPI + uvicorn; needs the server extra: pip install 'eventkv\\[server]').

    API docs at /docs; the memory inspector at /ui; Prometheus metrics at /metrics.

    --backend ray: the same app as Ray Serve replicas, each memory's requests routed to its replica (the ray extra).
    """
    with user_errors():
        from eventkv.errors import EventKVError, OptionError
        from eventkv.models import load, resolve_device, resolve_dtype
        from eventkv.options import check_threads

        try:
            import fastapi  # noqa: F401
            import prometheus_client  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError as exc:
            raise EventKVError(
                f"eventkv serve needs the server extra ({exc.name} is not installed): pip install 'eventkv[server]'."
            ) from None
        from eventkv.service.app import Settings
        from eventkv.service.server import (
            Connections,
            check_bind,
            check_port,
            read_tokens,
            serve_forever,
            stops_cleanly,
        )

        check_int("port", port, "give a TCP port, 0-65535 (0: any free port).", minimum=0, flag="--port")
        if port > 65535:
            raise OptionError("port", port, "give a TCP port, 0-65535 (0: any free port).", flag="--port")
        check_int("max_queue", max_queue, "allow at least 1 waiting job.", flag="--max-queue")
        check_int("max_body", max_body, "allow at least 1 KiB.", minimum=1024, flag="--max-body")
        check_int("max_open", max_open, "keep at least 1 memory open.", flag="--max-open")
        if max_hot is not None:
            check_int(
                "max_hot", max_hot, "give 0 or more memories, or leave --max-hot out.", flag="--max-hot", minimum=0
            )
        check_int("max_batch", max_batch, "batch at least 1 query (1: one at a time).", flag="--max-batch")
        check_int("limit_concurrency", limit_concurrency, "allow at least 1 connection.", flag="--limit-concurrency")
        for name, value in (
            ("header_timeout", header_timeout),
            ("body_timeout", body_timeout),
            ("keep_alive", keep_alive),
        ):
            if not value > 0:
                raise OptionError(name, value, "give a number of seconds > 0.")
        if backend not in ("process", "ray"):
            raise OptionError("backend", backend, "use process or ray.")
        if backend == "process":
            for flag, given, default in (
                ("--ray-address", ray_address, None),
                ("--replicas", replicas, 2),
                ("--memories-per-replica", memories_per_replica, 16),
            ):
                if given != default:
                    raise OptionError(flag[2:].replace("-", "_"), given, "only --backend ray takes it.", flag=flag)
        elif max_open != 16:
            raise OptionError(
                "max_open", max_open, "--backend ray keeps --memories-per-replica open per replica.", flag="--max-open"
            )
        check_int("replicas", replicas, "run at least 1 replica.", flag="--replicas")
        check_int(
            "memories_per_replica", memories_per_replica, "keep at least 1 memory open.", flag="--memories-per-replica"
        )
        if store.exists() and not store.is_dir():
            raise OptionError("store", str(store), "the store is a file: give a directory.", flag="--store")
        for folder in report:
            if not folder.is_dir():
                raise OptionError(
                    "report", str(folder), "give a run folder or a contract's folder (a directory).", flag="--report"
                )
        tokens = read_tokens(token_file) if token_file is not None else {}
        check_bind(host, tokens)  # before the model loads
        check_port(host, port)
        resolve_dtype(dtype, resolve_device(device)[0])
        threads = check_threads(threads)
        connections = Connections(header_timeout, keep_alive, limit_concurrency)
        settings = Settings(  # the model is loaded below, or by each Ray Serve replica
            None,
            store,
            tokens,
            max_queue=max_queue,
            max_body=max_body,
            max_open=max_open,
            body_timeout=body_timeout,
            max_batch=max_batch,
            max_hot=max_hot,
            reports=tuple(folder.resolve() for folder in report),
        )
        # SIGTERM or Ctrl-C, even while the model loads: exit 0 once every memory is closed
        with stops_cleanly():
            if backend == "ray":
                from eventkv.service.cluster.deploy import serve_cluster
                from eventkv.service.cluster.replica import ReplicaSpec

                spec = ReplicaSpec(
                    model,
                    replace(settings, store=store.resolve()),
                    dtype,
                    device,
                    threads or 1,
                    memories=memories_per_replica,
                )
                typer.echo(f"eventkv serve: starting {replicas} Ray Serve replicas of {model} ...", err=True)
                serve_cluster(
                    spec,
                    host,
                    port,
                    address=ray_address,
                    replicas=replicas,
                    max_ongoing=limit_concurrency,
                    log_level=log_level,
                    connections=connections,
                )
                return
            if threads is not None:
                import torch

                torch.set_num_threads(threads)
            # the model loads before the server listens (seconds to minutes): say so, on stderr as uvicorn's log
            typer.echo(f"eventkv serve: loading {model} ...", err=True)
            settings.lm = load(model, dtype=dtype, device=device)
            serve_forever(settings, host, port, log_level=log_level, connections=connections)
