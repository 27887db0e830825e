"""Pooled mode: per-group block pools at natural page sizes in one elastic arena.

Layers, bottom to top (a module imports only from the layers below it):

``spec``        arena geometry, pool specs, the pooled KV cache config, PoolKind
``usage``       per-pool usage snapshots and their file transport to /metrics
``links``       which attention blocks each cached state checkpoint needs
``free_queue``  the free-block order that keeps the boundary movable
``block_pool``  upstream's BlockPool over one pool's movable id range
``coupling``    coordinated prefix-cache eviction across the two pools
``arena``       the two pools and the boundary between them
``planner``     pure planning: a byte budget and layer specs -> a config
``scope``       whether pooled mode applies to a VllmConfig
``coordinator`` upstream's coordinators over the arena's pools
``engine``      engine glue: configs for all workers, capacity, scheduler

The upstream-path modules (``vllm_hybrid.v1.core.kv_cache_utils``,
``kv_cache_coordinator``) dispatch to this package.
"""
