"""Prometheus metrics at GET /metrics, through prometheus-client, in a
registry of the app's own (no process globals).

Counted as requests happen: requests by model id and outcome, prompt and
generated tokens by model id, time to first token, inter-token latency and
end-to-end latency. Read at scrape time from the engine and the registry:
running and waiting requests, batch sizes, resident adapters and slot
occupancy, adapter loads, evictions and load time, the host tier's occupancy
and hits, adapters waiting for a slot, memory in use, the KV budget
(budget, used, reserved, free, preemptions, waits for memory) and the prompt
cache (bytes, entries, hits, misses, tokens saved). Beside them, under vLLM's
names, the gauges Kubernetes' LoRA-aware routers read (gateway_metrics.py).
"""

from __future__ import annotations

import os
import resource
import sys

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..blas import blas_in_use
from .gateway_metrics import GatewayCollector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60)


def rss_bytes() -> int:
    """Resident memory of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak is what getrusage offers
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


class StateCollector:
    """Gauges and counters read at scrape time: the process's, and those of the
    default base's engine and registry (none while it is not loaded)."""

    def __init__(self, state_of):
        self.state_of = state_of  # () -> the default base's ServerState, or None
        self.blas = blas_in_use()  # fixed for the process

    def process(self):
        """The process's: what matmuls run on, MLX's memory and the RSS (every base's together)."""
        import mlx.core as mx

        g = GaugeMetricFamily
        blas = g("mola_blas", "What CPU matmuls run on (1 for the one in use): openblas, reference (MLX's "
                 "bundled BLAS, ~30x slower), accelerate, or gpu", labels=["blas"])
        blas.add_metric([self.blas], 1)
        yield blas
        yield g("mola_memory_active_bytes", "MLX memory in use", value=mx.get_active_memory())
        yield g("mola_memory_peak_bytes", "MLX peak memory", value=mx.get_peak_memory())
        yield g("mola_process_resident_bytes", "Resident memory of the process", value=rss_bytes())

    def collect(self):
        yield from self.process()
        s = self.state_of()
        if s is None:
            return
        snap = s.engine.snapshot  # published by the engine thread after each step
        reg = s.registry
        g = GaugeMetricFamily
        yield g("mola_running_requests", "Sequences in the decode batch", value=snap.num_running)
        yield g("mola_waiting_requests", "Sequences queued or being prefilled",
                value=snap.num_waiting + snap.num_prefilling)
        yield g("mola_engine_alive", "1 while the engine thread runs", value=float(s.engine.is_alive))
        yield g("mola_adapters_known", "Adapters that can be requested", value=len(reg.adapters()))
        yield g("mola_adapters_resident", "Adapters (and stacks) in slots", value=reg.num_resident)
        yield g("mola_adapter_slots", "Adapter slots (--max-loras)", value=reg.max_loras)
        yield g("mola_adapter_slot_occupancy", "Fraction of slots in use", value=reg.num_resident / reg.max_loras)
        geometry = s.engine.geometry
        yield g("mola_expert_adapter_slots", "Slots that can carry LoRA on experts (--max-expert-loras)",
                value=geometry.expert_slots)
        packs = g("mola_lora_pack_bytes", "Device memory of the LoRA slot packs now, by kind (they grow and "
                  "shrink with the adapters loaded)", labels=["kind"])
        packs.add_metric(["dense"], s.engine.pack_stats.dense_bytes)
        packs.add_metric(["experts"], s.engine.pack_stats.expert_bytes)
        yield packs
        yield g("mola_lora_pack_max_bytes", "What the slot packs would take at the ceilings (--max-loras, "
                "--max-lora-rank, the expert slots)", value=geometry.max_pack_bytes)
        yield CounterMetricFamily("mola_lora_pack_resizes", "Slot writes, clears and idle compactions that "
                                  "resized the slot packs", value=s.engine.pack_stats.num_resizes)
        sizes = g("mola_adapter_bytes", "Bytes of each adapter's factors as read, by kind (experts: LoRA on "
                  "the experts of a mixture of experts)", labels=["adapter", "kind"])
        for record in reg.adapters():
            if record.nbytes is not None:
                experts = record.expert_nbytes or 0
                sizes.add_metric([record.name, "dense"], record.nbytes - experts)
                sizes.add_metric([record.name, "experts"], experts)
        yield sizes
        st, c = snap.stats, CounterMetricFamily
        yield c("mola_decode_steps", "Decode steps run", value=st.decode_steps)
        yield c("mola_decode_rows", "Rows decoded, summed over steps (rows / steps = mean batch size)",
                value=st.decode_rows)
        yield c("mola_mixed_decode_steps", "Decode steps whose rows used several slots", value=st.mixed_steps)
        yield c("mola_prefill_tokens", "Prompt tokens prefilled", value=st.prefill_tokens)
        yield g("mola_batch_size_max", "Largest decode batch so far", value=st.max_batch)
        yield c("mola_speculative_steps", "Decode steps that verified drafted tokens", value=st.spec_steps)
        yield c("mola_speculative_rows", "Rows that drafted, summed over those steps", value=st.spec_rows)
        yield c("mola_speculative_draft_tokens", "Tokens drafted (speculative decoding)", value=st.draft_tokens)
        yield c("mola_speculative_accepted_tokens", "Drafted tokens the model accepted",
                value=st.accepted_tokens)
        kv = snap.kv
        yield g("mola_kv_budget_bytes", "What the batches' KV caches may hold (--kv-cache-bytes; 0: no budget)",
                value=kv.budget_bytes)
        yield g("mola_kv_used_bytes", "KV cache the batches hold now, as the budget counts it", value=kv.used_bytes)
        yield g("mola_kv_reserved_bytes", "KV cache the batches may grow to, every row to its max_tokens",
                value=kv.reserved_bytes)
        yield g("mola_kv_free_bytes", "The KV budget less what the batches hold", value=kv.free_bytes)
        yield g("mola_kv_held_bytes", "KV cache arrays of the batches now, measured", value=kv.held_bytes)
        yield g("mola_kv_held_peak_bytes", "The most KV cache the batches held after any step",
                value=st.peak_kv_bytes)
        yield c("mola_kv_preemptions", "Rows sent back to the queue by the KV budget", value=kv.preemptions)
        yield c("mola_kv_waits", "Requests that waited at the queue's head for KV memory", value=kv.waits)
        pc = snap.prompt_cache
        yield g("mola_prompt_cache_bytes", "KV bytes held by the prompt cache", value=pc.bytes)
        yield g("mola_prompt_cache_max_bytes", "The prompt cache's budget (--prompt-cache-bytes)",
                value=pc.max_bytes)
        yield g("mola_prompt_cache_entries", "Prompts (with outputs) held by the prompt cache", value=pc.entries)
        yield c("mola_prompt_cache_hits", "Prompts that reused a cached prefix", value=pc.hits)
        yield c("mola_prompt_cache_misses", "Prompts that found no cached prefix", value=pc.misses)
        yield c("mola_prompt_cache_cached_tokens", "Prompt tokens served from the prompt cache, not prefilled",
                value=pc.cached_tokens)
        yield c("mola_prompt_cache_evictions", "Prompt cache entries evicted for the byte budget",
                value=pc.evictions)
        rs = reg.stats
        yield c("mola_adapter_loads", "Adapters written into a slot", value=rs.loads)
        yield c("mola_adapter_load_failures", "Adapter loads that failed", value=rs.load_failures)
        yield c("mola_adapter_evictions", "Resident adapters evicted to make room", value=rs.evictions)
        yield c("mola_adapter_unloads", "Adapters unloaded", value=rs.unloads)
        yield c("mola_adapter_load_seconds", "Time spent loading adapters", value=rs.load_seconds)
        leases = c("mola_adapter_leases", "Requests on adapters, by whether their adapter was in a slot "
                   "already (resident) or had to be loaded (loaded)", labels=["found"])
        leases.add_metric(["resident"], rs.leases_resident)
        leases.add_metric(["loaded"], rs.leases_loaded)
        yield leases
        tier, ts = reg.tier, reg.tier.stats
        yield g("mola_host_tier_entries", "Adapters prepared in host memory (the host tier)", value=len(tier))
        yield g("mola_host_tier_bytes", "Host memory the host tier's adapters take", value=tier.nbytes)
        yield c("mola_host_tier_hits", "Slot loads whose adapter was in the host tier", value=ts.hits)
        yield c("mola_host_tier_misses", "Slot loads that waited for a disk read", value=ts.misses)
        yield c("mola_host_tier_evictions", "Adapters dropped from the host tier", value=ts.evictions)
        yield c("mola_adapter_reads", "Adapter reads from disk (prefetches and checks)", value=ts.reads)
        yield c("mola_adapter_read_failures", "Adapter reads from disk that failed", value=ts.read_failures)
        q = reg.queue
        yield g("mola_adapters_waiting", "Adapters whose requests wait for a slot", value=len(q))
        yield c("mola_adapter_yields", "Residents made to yield their slot to a request that waited "
                "--max-adapter-wait", value=q.stats.yields)
        yield c("mola_adapter_starved_admissions", "Adapters admitted after waiting --max-adapter-wait",
                value=q.stats.starved)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("mola_requests", "Generation requests by model id and outcome",
                                ["model", "outcome"], registry=r)
        self.http = Counter("mola_http_requests", "HTTP requests by route and status",
                            ["method", "route", "status"], registry=r)
        self.prompt_tokens = Counter("mola_prompt_tokens", "Prompt tokens by model id", ["model"], registry=r)
        self.generation_tokens = Counter("mola_generation_tokens", "Generated tokens by model id",
                                         ["model"], registry=r)
        self.ttft = Histogram("mola_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mola_inter_token_latency_seconds", "Time between tokens of a sequence",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("mola_e2e_request_latency_seconds", "Request latency, start to end",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.rejected = Counter("mola_rejected_requests", "Requests refused for load (429) or shutdown (503)",
                                ["reason"], registry=r)

    def watch(self, state_of, bases=None) -> None:
        """Read at scrape time: the default base's state (``state_of()``), and every base's rows."""
        self.registry.register(StateCollector(state_of))
        self.registry.register(GatewayCollector(state_of))  # vllm:* names, for Kubernetes' routers
        if bases is not None:
            self.registry.register(BasesCollector(bases))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class BasesCollector:
    """Per base (label ``base``): its status, requests in flight, running and
    waiting sequences, size, loads and unloads."""

    def __init__(self, bases):
        self.bases = bases

    def collect(self):
        g, c = GaugeMetricFamily, CounterMetricFamily
        status = g("mola_base_status", "1 for each base's lifecycle status", labels=["base", "status"])
        running = g("mola_base_running_requests", "Sequences in the base's decode batch", labels=["base"])
        waiting = g("mola_base_waiting_requests", "Sequences queued or prefilled on the base", labels=["base"])
        in_flight = g("mola_base_in_flight_requests", "HTTP requests on the base not yet answered", labels=["base"])
        size = g("mola_base_bytes", "The base's weights (as measured at its last load) and its slot packs now",
                 labels=["base"])
        kv = {name: g(f"mola_base_kv_{name}_bytes", f"The base's KV budget: {what}", labels=["base"])
              for name, what in (("budget", "what its batches may hold (0: none)"), ("used", "what they hold"),
                                 ("reserved", "what they may grow to"), ("free", "the budget less used"))}
        preemptions = c("mola_base_kv_preemptions", "Rows the base's KV budget sent back to the queue",
                        labels=["base"])
        loads = c("mola_base_loads", "Times the base was loaded", labels=["base"])
        unloads = c("mola_base_unloads", "Times the base was unloaded", labels=["base"])
        for b in self.bases:
            status.add_metric([b.name, b.status.value], 1)
            snap = b.state.engine.snapshot if b.state is not None else None
            running.add_metric([b.name], snap.num_running if snap else 0)
            waiting.add_metric([b.name], snap.num_waiting + snap.num_prefilling if snap else 0)
            in_flight.add_metric([b.name], b.in_flight)
            if snap is not None:
                for name, family in kv.items():
                    family.add_metric([b.name], getattr(snap.kv, f"{name}_bytes"))
                preemptions.add_metric([b.name], snap.kv.preemptions)
            size.add_metric([b.name], b.held_bytes)
            loads.add_metric([b.name], b.num_loads)
            unloads.add_metric([b.name], b.num_unloads)
        yield from (status, running, waiting, in_flight, size, loads, unloads, *kv.values(), preemptions)
