"""``eventkv serve --backend ray``: deploy the replicas on a Ray cluster and run the gateway in front.

The cluster is ``address`` (``auto``: the one ``ray start --head`` began on this machine; ``ray://...``:
a remote one through Ray Client), or, without one, a local Ray instance started here on this machine's
cores and stopped with the server. The Serve application :data:`APP` is deployed with Ray Serve's
own HTTP proxy disabled: the gateway (:mod:`eventkv.service.cluster.gateway`) is the only front.
"""

from __future__ import annotations

import os
from pathlib import Path

from eventkv.errors import EventKVError
from eventkv.service.cluster.replica import ReplicaSpec

#: the name of the Serve application (one per cluster: a second ``eventkv serve`` on the same cluster
#: replaces the first's)
APP = "eventkv"


def import_serve():
    """``(ray, ray.serve)``.

    Raises:
        EventKVError: Ray Serve is not installed (says how to install it).
    """
    try:
        import ray
        from ray import serve
    except ImportError:
        raise EventKVError(
            "--backend ray: Ray Serve is not installed: pip install 'eventkv[ray]' (or use --backend process)."
        ) from None
    return ray, serve


def connect(address: str | None) -> bool:
    """Join the Ray cluster at ``address`` (None: start a local one); True when this process started it.

    Raises:
        EventKVError: the cluster cannot be started or reached.
    """
    ray, _ = import_serve()
    if ray.is_initialized():
        return False
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise EventKVError(
            f"--ray-address {address!r}: cannot start or reach a Ray cluster ({exc}): give the address of a "
            "running cluster (auto: the one `ray start --head` began on this machine), or leave --ray-address "
            "out to start a local one."
        ) from None
    return address is None


def check_capacity(replicas: int, threads: int, cpus: float, where: str) -> None:
    """Refuse a deployment that ``cpus`` CPUs cannot place (Serve would wait for CPUs forever).

    Raises:
        EventKVError: ``replicas`` x ``threads`` is more than ``cpus`` (``where``: whose CPUs, for the message).
    """
    if replicas * threads > cpus:
        raise EventKVError(
            f"--replicas {replicas} of --threads {threads}: {where} has {cpus:g} CPUs, the replicas need "
            f"{replicas * threads}: give fewer replicas or threads, or a larger cluster."
        )


def serve_cluster(
    spec: ReplicaSpec,
    host: str,
    port: int,
    *,
    address: str | None,
    replicas: int,
    max_ongoing: int,
    log_level: str = "info",
    connections=None,
    graceful_s: float = 30.0,
) -> None:
    """Deploy ``replicas`` replicas of ``spec`` on the cluster at ``address`` and serve the gateway
    on ``host:port`` until SIGINT/SIGTERM; then the gateway lets running requests finish (at most
    ``graceful_s`` seconds), the application is deleted (each replica's lifespan finishes its queued
    jobs and closes its memories), a local cluster started here is stopped, and the process exits 0
    (:func:`eventkv.service.server.stops_cleanly`; a signal while the replicas start stops the same way).

    Raises:
        EventKVError: Ray Serve missing, the cluster unreachable or too small, or a replica that fails
            to start (its error in the message).
    """
    from eventkv.service.app import clean_leftovers
    from eventkv.service.cluster.gateway import gateway_app
    from eventkv.service.cluster.replica import replica_deployment
    from eventkv.service.server import Connections, check_bind, run_uvicorn, stops_cleanly

    settings = spec.settings
    check_bind(host, settings.tokens)
    ray, serve = import_serve()
    if address is None and not ray.is_initialized():  # a local instance would have this machine's cores
        check_capacity(replicas, spec.threads, len(os.sched_getaffinity(0)), "this machine")
    started = connect(address)
    # why again: ray.init replaced the server's SIGTERM handler with its own (sys.exit(15)); a signal from
    # here on exits 0 through the finally blocks below (the application deleted, a local cluster stopped)
    with stops_cleanly():
        try:
            check_capacity(replicas, spec.threads, ray.cluster_resources().get("CPU", 0), "the Ray cluster")
            root = Path(settings.store)
            root.mkdir(parents=True, exist_ok=True)
            clean_leftovers(root)  # once, before any replica writes under the root
            serve.start(proxy_location="Disabled")
            try:
                handle = serve.run(
                    replica_deployment(spec, replicas, max_ongoing), name=APP, route_prefix=None, blocking=False
                )
            except RuntimeError as exc:  # Serve's report of a deployment that failed (a replica's constructor raised)
                raise EventKVError(f"the replicas did not start: {exc}") from None
            app = gateway_app(handle, settings.tokens, settings.max_body, settings.body_timeout)
            try:
                run_uvicorn(
                    app,
                    host,
                    port,
                    log_level=log_level,
                    graceful_s=graceful_s,
                    connections=connections or Connections(),
                )
            finally:
                serve.delete(APP)
        finally:
            if started:
                serve.shutdown()
                ray.shutdown()
