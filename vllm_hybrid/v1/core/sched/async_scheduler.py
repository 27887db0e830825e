"""Async twin of :class:`~vllm_hybrid.v1.core.sched.scheduler.PooledScheduler`."""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from vllm_hybrid.v1.core.sched.scheduler import PooledSchedulerMixin


class PooledAsyncScheduler(PooledSchedulerMixin, AsyncScheduler):
    """Upstream's ``AsyncScheduler`` for pooled plans (see the mixin)."""
