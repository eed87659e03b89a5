"""The service tests' helpers: a real ``eventkv serve`` in a subprocess on
127.0.0.1 and a port uvicorn picks (:class:`eventkv.service.server.ServerProcess`, float32, one
thread), and the sharpened tiny model it serves."""

from __future__ import annotations

from pathlib import Path

from eventkv.service.server import ServerProcess
from eventkv.testing import save_sharp_model  # noqa: F401 - the service tests' model, imported from here

#: headless Chromium's flags for the browser tests: as root, no background traffic, and offline (no host but
#: 127.0.0.1 resolves, so a page renders only with what the server sends)
CHROMIUM_OFFLINE = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
)


def Server(model, store, *args: str, cluster: "RayCluster | None" = None) -> ServerProcess:  # noqa: N802
    """A server on ``model`` and ``store`` (float32, one torch thread, uvicorn info log); with ``cluster``,
    the Ray Serve backend on it (2 replicas: :class:`ClusterServer`)."""
    common = ("--dtype", "float32", "--threads", "1", "--log-level", "info", *args)
    if cluster is not None:
        return ClusterServer(cluster, model, store, *cluster.args(), *common)
    return ServerProcess(model, store, *common)


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


class RayCluster:
    """A local Ray cluster of 2 CPUs started by the test (``ray.init`` in this process, on 127.0.0.1),
    for ``eventkv serve --backend ray --ray-address`` servers: :meth:`args` are their flags (2 replicas
    of 1 thread), :meth:`replicas` the live replica actors, :meth:`crash` kills every replica at once
    (no shutdown) and removes the application, :meth:`shutdown` stops the cluster.

    Ray waits a fixed 30 s for its raylet to register at start-up, which a loaded machine can miss:
    a failed start is shut down and tried again, up to three times."""

    def __init__(self) -> None:
        import ray

        for attempt in range(3):
            try:
                ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
                break
            except Exception as exc:  # Ray raises a bare Exception for this time-out
                ray.shutdown()
                if attempt == 2 or "timed out during startup" not in str(exc):
                    raise
        self.ray = ray
        self.address = ray.get_runtime_context().gcs_address
        self.deployed: ClusterServer | None = None  # the server whose application is on the cluster

    def serve_logs(self) -> Path:
        """The folder of the replicas' Serve logs (``replica_eventkv_MemoryReplica_<replica id>.log``)."""
        node = self.ray._private.worker.global_worker.node  # the session of the cluster this process started
        return Path(node.get_logs_dir_path()) / "serve"

    def args(self, replicas: int = 2) -> list[str]:
        return ["--backend", "ray", "--ray-address", self.address, "--replicas", str(replicas)]

    def replicas(self) -> dict[str, tuple[object, int]]:
        """Replica id -> (its actor handle, its process id), for the live replicas of the application."""
        import os

        found = {}
        for a in self.ray.util.list_named_actors(all_namespaces=True):
            if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::eventkv#MemoryReplica#"):
                try:
                    actor = self.ray.get_actor(a["name"], namespace="serve")
                    pid = self.ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
                except Exception:  # dead or stopping: not a live replica
                    continue
                found[a["name"].split("#")[-1]] = (actor, pid)
        return found

    def crash(self) -> None:
        """Kill every replica (as SIGKILL would: no shutdown), then remove the application."""
        from ray import serve

        for actor, _ in self.replicas().values():
            self.ray.kill(actor, no_restart=True)
        try:
            serve.delete("eventkv")
        except Exception:  # no Serve instance (the server never deployed): nothing to remove
            pass

    def shutdown(self) -> None:
        from ray import serve

        try:
            serve.shutdown()
        finally:
            self.ray.shutdown()


class ClusterServer(ServerProcess):
    """``eventkv serve --backend ray`` on a :class:`RayCluster`; :meth:`kill` is a crash of the whole
    server: the gateway SIGKILLed and every replica killed."""

    def __init__(self, cluster: RayCluster, model, store, *args: str) -> None:
        self.cluster = cluster
        super().__init__(model, store, *args, timeout=300.0)
        cluster.deployed = self

    def kill(self) -> None:
        super().kill()
        self.cluster.crash()
