"""Registry records of token block moves, the worker's half
(:mod:`vllm_hybrid.v1.worker.token_moves`): the entry that applies a step's
moves before the model runner sees the step, and the attribute that carries
them. Part of :data:`vllm_hybrid.patches.entries.PATCHES` and
:data:`vllm_hybrid.patches.subclasses.ADDED_ATTRIBUTES`."""

from __future__ import annotations

from vllm_hybrid.patches.entry import AddedAttribute, PatchEntry

TOKEN_MOVE_PATCHES: list[PatchEntry] = [
    PatchEntry(
        target="vllm.v1.worker.gpu_worker:Worker.execute_model",
        replacement="vllm_hybrid.v1.worker.token_moves:execute_model",
        bindings=(),
        why=(
            "Pooled mode's boundary between the token and state pools moves "
            "only over free token ids, so the scheduler may relocate live "
            "token blocks to other ids within a step. Every worker must copy "
            "those blocks and rename them in the block ids its model runner "
            "kept from earlier steps before the runner's own update of the "
            "step: that update appends the step's new ids (already renamed), "
            "zeroes new blocks (a moved-from id may be one) and runs align "
            "mode's state pre-copies. Neither runner has a hook at that "
            "point, and the worker class is chosen by the platform (a "
            "--worker-cls subclass would cover one platform and only when "
            "the user selects it)."
        ),
        how=(
            "Class attribute on Worker replaced (CPUWorker and the overlay's "
            "worker subclasses inherit it; the engine calls it on the "
            "instance). When the step's SchedulerOutput carries a non-empty "
            "hybrid_token_moves, the replacement copies the moved token "
            "blocks within the arena (one row of token-block bytes per block "
            "covers every layer, torch ops on the device, every source read "
            "before any destination is written) and rewrites the token "
            "groups' block ids: V1's request states and persistent batch "
            "rows on the host, V2's block tables on the device. It raises "
            "for moves on a config that is not PooledKVCacheConfig. Then it "
            "calls upstream's method unchanged; steps without moves go "
            "straight to it."
        ),
        upstream_status=(
            "none (upstream never renumbers a live block; its block ids are "
            "fixed for a block's lifetime)"
        ),
        removal=(
            "When pooled mode stops moving live token blocks, or upstream "
            "offers a worker or model-runner hook that runs before the step's "
            "state update."
        ),
        placement="before",
    ),
]

TOKEN_MOVE_ATTRIBUTES: list[AddedAttribute] = [
    AddedAttribute(
        cls="vllm.v1.core.sched.output:SchedulerOutput",
        name="hybrid_token_moves",
        where=(
            "set by vllm_hybrid.v1.core.sched.scheduler (PooledSchedulerMixin."
            "schedule); read by vllm_hybrid.v1.worker.token_moves "
            "(execute_model)"
        ),
        why=(
            "The token blocks the step moved, {old token id: new token id}; "
            "pickled with the output to multiprocess workers (a dataclass "
            "without slots keeps its instance dict)."
        ),
        annotation="dict[int, int] | None",
    ),
]
