"""mola's Ray Serve application, bound: the ingress over ``replicas`` replicas
(or an autoscaling range) of one mola configuration. ``app_builder`` is what
`serve run` calls with a Serve config file's application args
(docs/distributed.md, "Replicas"):

    serve run fleet.yaml    # import_path: mola.ray.app:app_builder, args: {model: ..., replicas: 2}
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
    """What `serve run` calls, with a Serve config file's application ``args``:
    ``replicas`` (default 2), ``autoscaling`` (Ray's autoscaling_config, passed
    through), ``replica_cpus``, and every other key a `mola serve` setting
    (model, max_loras, adapters as [{name, path}], ...), as in mola's config files."""
    from ..config import AdapterSpec, ServeConfig

    settings = dict(args)
    replicas = int(settings.pop("replicas", 2))
    autoscaling = settings.pop("autoscaling", None)
    replica_cpus = float(settings.pop("replica_cpus", 1))
    if "adapters" in settings:
        settings["adapters"] = tuple(AdapterSpec(a["name"], a["path"]) for a in settings["adapters"])
    return build(ServeConfig.from_settings(**settings), replicas, autoscaling=autoscaling, replica_cpus=replica_cpus)
