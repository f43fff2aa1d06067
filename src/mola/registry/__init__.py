"""The control plane of adapter slots: which adapters a model id names, which
are resident, who waits for a slot and who gets the next one. Plain Python on
the event loop; the arrays are the engine's.

    registry.py    AdapterRegistry (model id -> a Lease on a slot; load, unload)
    catalog.py     what a name or a path names (AdapterRef: a request's entry)
    names.py       the grammar of adapter ids
    sources.py     where adapters may come from: the path policy, adapter directories, the hub
    paths.py       adapters named by path in requests
    resolvers.py   where an unknown id may still be found (--adapter-resolver)
    records.py     one version of one adapter, and its lifecycle (one table of transitions)
    stacks.py      several adapters applied together, in one slot of their own
    slots.py       which slot holds what (the slot allocator)
    residency.py   moving records in and out of slots; RegistryStats
    waiters.py     requests waiting for a slot: their queue, their wake-ups, the admission pass
    admission.py   who gets the next slot, and when a busy resident must yield
    host_tier.py   adapters kept prepared in host memory, and the reads that fill it

Imports run one way: registry -> residency -> waiters -> admission -> records.
It reads adapters through mola.adapters and knows mola.lora only by the
geometry and rows those carry.
"""
