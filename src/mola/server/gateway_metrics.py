"""The gauges Kubernetes' LoRA-aware routers read, under vLLM's names, beside
mola's own on /metrics: so that the Gateway API Inference Extension's
endpoint picker (and llm-d's, and KServe's) can route to mola pods as it
routes to vLLM ones.

The names, labels and semantics follow the model-server protocol,
kubernetes-sigs/gateway-api-inference-extension,
docs/proposals/003-model-server-protocol/README.md:
  * ``vllm:num_requests_waiting`` (TotalQueuedRequests, a gauge);
  * ``vllm:gpu_cache_usage_perc`` (KVCacheUtilization, a gauge; a fraction
    0..1 as vLLM reports it). Newer vLLM renamed it ``vllm:kv_cache_usage_perc``
    and the pickers read either, so both are given;
  * ``vllm:lora_requests_info``, a gauge whose value is "the last updated
    timestamp (so the EPP can find the latest)", with the labels ``max_lora``
    (how many adapters can be loaded to serve a batch), ``running_lora_adapters``
    ("adapters that are currently loaded in GPU memory and ready to serve
    requests", comma-separated) and ``waiting_lora_adapters`` (comma-separated).
vLLM emits the last as (vllm/v1/metrics/loggers.py, PrometheusStatLogger)
``",".join(scheduler_stats.running_lora_adapters.keys())`` (and the same for
waiting) with ``gauge.labels(...).set_to_current_time()``: names joined by a
bare comma, the value the wall-clock time in seconds. vLLM's running set is
the adapters with requests running; mola's slots keep an adapter after its
requests end (until evicted), so mola names every adapter that holds a slot,
which is what the protocol asks and what an affinity router wants (a request
sent there needs no load). Waiting: adapters whose requests wait for a slot.
``vllm:num_requests_running`` (rows being decoded or prefilled) completes
the set vLLM exposes; the pickers read it for load.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client.core import GaugeMetricFamily

from ..registry.records import AdapterState

LORA_INFO = "vllm:lora_requests_info"
LORA_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")
READY = (AdapterState.RESIDENT, AdapterState.YIELDING)  # in a slot and taking requests (not DRAINING)


def routable(records) -> list[str]:
    """The names a router can send as ``model``, sorted: stacks are built per
    request (never a ``model``), and a name with a comma would break the list."""
    return sorted({r.name for r in records if not r.is_stack and "," not in r.name})


class GatewayCollector:
    """Read at scrape time from the default base's engine snapshot and registry."""

    def __init__(self, state_of: Callable, clock: Callable[[], float] = time.time):
        self.state_of = state_of  # () -> the default base's ServerState, or None
        self.clock = clock  # the lora gauge's value: seconds since the epoch

    def collect(self):
        s = self.state_of()
        if s is None:
            return
        snap, reg = s.engine.snapshot, s.registry
        waiting_for_slot = reg.queue.ordered()  # adapters whose requests wait for a slot
        queued = snap.num_waiting + sum(r.waiting for r in waiting_for_slot)
        g = GaugeMetricFamily
        base = [reg.base_id]
        running = g("vllm:num_requests_running", "Requests being decoded or prefilled (mola_running_requests "
                    "plus the prompts being prefilled)", labels=["model_name"])
        running.add_metric(base, snap.num_running + snap.num_prefilling)
        waiting = g("vllm:num_requests_waiting", "Requests queued: in the engine's queue, or waiting for their "
                    "adapter to get a slot", labels=["model_name"])
        waiting.add_metric(base, queued)
        kv = snap.kv
        usage = kv.used_bytes / kv.budget_bytes if kv.budget_bytes else 0.0
        yield running
        yield waiting
        for name in ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"):
            family = g(name, "KV cache usage, 0 to 1: what the batches hold of the KV budget "
                       "(--kv-cache-bytes; 0 without one)", labels=["model_name"])
            family.add_metric(base, usage)
            yield family
        info = g(LORA_INFO, "Adapters in slots (running) and waiting for one, comma-separated; "
                 "the value is when this was read (seconds since the epoch)", labels=list(LORA_LABELS))
        ready = [r for r in reg.residency.residents() if r.state in READY]
        info.add_metric([str(reg.max_loras), ",".join(routable(ready)), ",".join(routable(waiting_for_slot))],
                        self.clock())
        yield info
