"""serve_on_ray: what `asyncgraph serve --ray` does, from start to a draining stop.

Without an address it starts a Ray instance on this machine (the models are read from their
paths, the machine is the whole cluster); with one (`auto`, `ray://...`, `HOST:PORT`) it joins
that cluster and ships the model files through Ray's object store, since the other nodes may
not have them. It then runs the app on Serve's proxy and blocks until SIGINT or SIGTERM, when it
deletes the app: Serve stops routing to the replicas, each finishes its requests in flight
(`graceful_shutdown_timeout_s`) and closes its executors. A Ray instance it started, it stops.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from asyncgraph.ray.proxy import PROXY_CALLBACK, PROXY_CALLBACK_ENV

#: The Serve application's name for `asyncgraph serve --ray`.
APP_NAME = "asyncgraph"


def start_ray(address: str | None, *, num_cpus: int | None = None) -> bool:
    """Connect to Ray: a new local instance (address None) or a cluster. True if started here.

    The proxy callback (proxy.py) goes into the environment first, so that the proxy of a local
    instance, which inherits this process's environment, installs it.
    """
    import ray

    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    if address is None:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 log_to_driver=False)
        return True
    ray.init(address=address, log_to_driver=False)
    return False


def serve_on_ray(
    build: Callable[[bool], Any],
    *,
    address: str | None,
    host: str,
    port: int,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Run the app `build(shipped)` on Serve until SIGINT/SIGTERM (blocks).

    `build` receives True when the models must travel through the object store (a cluster
    joined by address) and returns the Serve application.
    """
    import ray
    from ray import serve

    started = start_ray(address)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build(not started), name=APP_NAME, route_prefix="/")
        if on_ready is not None:
            on_ready(f"http://{host}:{port}")
        _wait_for_signal()
        serve.delete(APP_NAME)  # drains: replicas finish what they hold, then close
    finally:
        if started:
            serve.shutdown()  # type: ignore[no-untyped-call]
            ray.shutdown()  # type: ignore[no-untyped-call]


def _wait_for_signal() -> None:
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
