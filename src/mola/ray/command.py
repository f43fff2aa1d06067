"""`mola serve --replicas N`: Ray started (or joined), mola's application
deployed on it, its HTTP proxy on --host/--port, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading


def serve_replicas(config, replicas: int, address: str | None = None, autoscaling: dict | None = None) -> int:
    try:
        import ray  # the ray extra
        from ray import serve
    except ImportError as e:
        print(f"[mola] error: --replicas needs Ray Serve: pip install 'mola[ray]' ({e})", file=sys.stderr)
        return 1

    from .launch import RayStart, RayStartFailed, run_app, start_ray
    from ..serve import setup_logging, with_demo

    setup_logging(config.log_level)
    if config.distributed or config.bases.models:
        print("[mola] error: --replicas serves one base per replica; it cannot go with --distributed or "
              "--model NAME=PATH", file=sys.stderr)
        return 1
    config = with_demo(config)  # (the demo's own second base stays out: one base a replica)
    config = dataclasses.replace(config, bases=dataclasses.replace(config.bases, models=()))
    try:
        # a local cluster's logical CPUs: room for every replica (each takes one) on any machine
        wanted = max(replicas, int((autoscaling or {}).get("max_replicas", 0)), os.cpu_count() or 1)
        seconds = start_ray(RayStart(address=address, num_cpus=wanted))
        print(f"[mola] Ray {'joined' if address else 'started'} in {seconds:.1f} s; deploying "
              f"{autoscaling or replicas} replica(s) of {config.model} ...", file=sys.stderr, flush=True)
        url = run_app(config, replicas, autoscaling=autoscaling, host=config.http.host or "0.0.0.0",
                      port=config.http.port)
        print(f"[mola] serving on {url} through Ray Serve", file=sys.stderr, flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    except RayStartFailed as e:
        print(f"[mola] error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # stopped while starting
        pass
    finally:
        if ray.is_initialized():
            if address is not None:  # a cluster of others': take mola's application off it
                serve.delete("mola")
            ray.shutdown()  # (a local cluster goes with it, replicas and all, at once)
    return 0
