"""mola's Ray Serve application, bound: the ingress over ``replicas`` replicas
(or an autoscaling range) of one mola configuration. ``app_builder`` is what
`serve run` calls from a Serve config file or the command line:

    serve run mola.ray.app:app_builder config=mola.toml replicas=2
"""

from __future__ import annotations

from ray import serve

from .deployments import MolaIngress, replica_class


def build(config, replicas: int = 2, *, autoscaling: dict | None = None, replica_cpus: float = 1.0,
          max_ongoing_requests: int | None = None):
    """The application: ``config`` (a ServeConfig) served by each replica.
    ``autoscaling``: Ray Serve's autoscaling_config (min_replicas,
    max_replicas, target_ongoing_requests, ...), passed through as given."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    scale = {"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": replicas}
    ongoing = max_ongoing_requests or config.engine.max_num_seqs + config.max_queue  # what one `mola serve` takes
    replica = serve.deployment(replica_class(config.engine.max_loras), name="MolaReplica").options(
        **scale, ray_actor_options={"num_cpus": replica_cpus}, max_ongoing_requests=ongoing,
        health_check_period_s=5, health_check_timeout_s=60)
    return MolaIngress.options(ray_actor_options={"num_cpus": 0}).bind(replica.bind(config))


def app_builder(args: dict):
    """`serve run mola.ray.app:app_builder config=FILE replicas=N [min_replicas=..
    max_replicas=.. target_ongoing_requests=..]`: a mola config file (as
    `mola serve --config`) served by N replicas, or autoscaled."""
    from ..cli.config_file import load_config_file
    from ..config import ServeConfig

    if "config" not in args:
        raise ValueError(f"serve run needs config=FILE (a mola config file); got {sorted(args)}")
    config = ServeConfig.from_settings(**load_config_file(args["config"]))
    auto = {k: int(args[k]) if k != "target_ongoing_requests" else float(args[k])
            for k in ("min_replicas", "max_replicas", "target_ongoing_requests") if k in args}
    return build(config, int(args.get("replicas", 2)), autoscaling=auto or None,
                 replica_cpus=float(args.get("replica_cpus", 1)))
