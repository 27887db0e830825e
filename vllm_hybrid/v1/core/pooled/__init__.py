"""Pooled mode: per-group block pools at natural page sizes in one elastic arena.

Layers, bottom to top (a module imports only from the layers below it):

``spec``        arena geometry, pool specs, the pooled KV cache config, PoolKind
``usage``       per-pool usage snapshots, handed to the publisher the metrics
                side installs
``links``       which attention blocks each cached state checkpoint needs
``policy``      the checkpoint policy (a package): ``eviction`` the
                eviction order (segments, protection, ranked entries, what
                an entry is worth, admission attempts), ``positions`` where
                states are kept and how freed ones rank, ``steps`` where
                prefill chunks end and what a step admits (retention, the
                scheduler and the pools ask it)
``free_queue``  one pool's free blocks, kept in that order
``events``      the prefix-cache events a pool records for the coupling
``block_pool``  upstream's BlockPool over one pool's movable id range
``coupling``    coordinated prefix-cache eviction across the two pools
``moves``       live token blocks moved out of the state pool's way, and the
                record of the moves the workers must apply
``boundary``    the boundary: initial split, floors, moves, admission
``arena``       the two pools and their boundary, built and checked together
``admission``   how the arena serves one allocation, decided as a value
``capacity``    every capacity figure: one request, concurrency, states held
                (both plan kinds: the arena and the single shared pool)
``planner``     pure planning: a byte budget and layer specs -> a config
``scope``       whether pooled mode applies to a VllmConfig
``retention``   turn-end and prefill checkpoints kept in the prefix cache (a
                mixin of these coordinators and of the single pool's)
``coordinator`` upstream's coordinators over the arena's pools
``engine``      engine glue: configs for all workers, capacity

The upstream-path modules (``vllm_hybrid.v1.core.kv_cache_utils``,
``kv_cache_coordinator``) dispatch to this package.
"""
