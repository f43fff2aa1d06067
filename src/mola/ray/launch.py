"""Starting a local Ray cluster (or joining one) and the mola application on
it, for `mola serve --replicas N`, the slow tests and the benchmark.

Ray's start-up can stall on a loaded machine, so it is bounded: each try of
``ray.init`` runs on a thread given ``timeout`` seconds, a failed or stalled
try is shut down and retried, and after ``attempts`` tries the error says
what happened each time. Never a hang.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

MIB = 2**20


class RayStartFailed(RuntimeError):
    """Ray could not be started (or reached) within the tries given."""


@dataclass(frozen=True)
class RayStart:
    """How to start (or join) Ray, and how long to give it."""

    address: str | None = None  # None: a local cluster of this process's own
    num_cpus: int = 2  # logical CPUs of a local cluster: replicas each take replica_cpus of them
    object_store_bytes: int = 128 * MIB  # mola passes no tensors through it: a small store
    attempts: int = 3
    timeout: float = 90.0  # seconds per try
    env: dict = field(default_factory=dict)  # runtime_env env_vars for the workers

    def __post_init__(self):
        if self.attempts < 1 or self.timeout <= 0:
            raise ValueError(f"RayStart needs attempts >= 1 and timeout > 0, got {self.attempts}, {self.timeout}")


def start_ray(start: RayStart) -> float:
    """Start or join Ray; the seconds the successful try took. Raises
    RayStartFailed naming each try's failure."""
    import ray

    failures = []
    for attempt in range(1, start.attempts + 1):
        box: dict = {}
        started = threading.Event()
        t0 = time.perf_counter()

        def init():
            try:
                kwargs = dict(include_dashboard=False, log_to_driver=False, configure_logging=False,
                              runtime_env={"env_vars": start.env} if start.env else None)
                if start.address is None:
                    kwargs.update(num_cpus=start.num_cpus, object_store_memory=start.object_store_bytes)
                ray.init(start.address, **kwargs)
            except BaseException as e:  # reported below
                box["error"] = e
                started.set()
                return
            box["ok"] = True
            started.set()
            # Ray's processes die with the thread that started them (their
            # parent-death signal), so this thread stays for the process's life.
            threading.Event().wait()

        thread = threading.Thread(target=init, daemon=True, name="ray-init")
        thread.start()
        started.wait(start.timeout)
        if box.get("ok"):
            return time.perf_counter() - t0
        why = repr(box["error"]) if "error" in box else f"no answer within {start.timeout:g} s"
        failures.append(f"try {attempt}: {why}")
        try:
            ray.shutdown()
        except Exception as e:  # a stalled init may not shut down cleanly; the next try says so
            failures.append(f"shutdown after try {attempt}: {e!r}")
    raise RayStartFailed("Ray did not start: " + "; ".join(failures))


def run_app(config, replicas: int = 2, *, autoscaling: dict | None = None, replica_cpus: float = 1.0,
            host: str = "127.0.0.1", port: int = 8000, timeout: float = 600.0) -> str:
    """Deploy mola's application on the running Ray (its HTTP proxy on
    ``host``:``port``); its URL once every replica has loaded its base.
    Raises RayStartFailed when that takes more than ``timeout`` seconds or fails."""
    from ray import serve

    from .app import build

    app = build(config, replicas, autoscaling=autoscaling, replica_cpus=replica_cpus)
    box: dict = {}

    def deploy():
        try:
            serve.start(http_options={"host": host, "port": port})
            serve.run(app, name="mola", route_prefix="/")
            box["ok"] = True
        except BaseException as e:  # reported below
            box["error"] = e

    thread = threading.Thread(target=deploy, daemon=True, name="serve-run")
    thread.start()
    thread.join(timeout)
    if not box.get("ok"):
        why = repr(box["error"]) if "error" in box else f"not running within {timeout:g} s"
        raise RayStartFailed(f"mola's Serve application did not start: {why}")
    return f"http://{host}:{port}"
