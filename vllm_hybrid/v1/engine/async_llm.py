"""Requests in flight when the API server shuts down end with an error.

On SIGTERM or SIGINT, vLLM's API server stops the engine (abort mode kills the
engine core at once), cancels ``AsyncLLM``'s output handler and then lets the
HTTP server wait for open connections. A request that was still generating
waits on its output queue, which nothing fills any more: the HTTP server
waits for it, and the process never exits (seen with four long completions:
still running 30 s after SIGTERM, until SIGKILL). Putting an error into every
open queue once the engine is stopped ends each request with an error
response (a final error chunk when streaming), so the server exits.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from vllm.v1.engine.exceptions import EngineDeadError

from vllm_hybrid.patches.registry import upstream_of

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

SHUTDOWN_MESSAGE = (
    "The server is shutting down; this request was stopped before it "
    "finished. Retry it on a running server."
)


class EngineShutDownError(EngineDeadError):
    """The engine was stopped on purpose (server shutdown), not by a fault.

    A subclass of ``EngineDeadError`` so that every path upstream has for a
    stopped engine (no abort sent to it, the API's error response) applies.
    """

    def __str__(self) -> str:
        return SHUTDOWN_MESSAGE


def shutdown(self: AsyncLLM, timeout: float | None = None) -> None:
    """Upstream's ``AsyncLLM.shutdown``, then an error for every request
    still waiting for output."""
    upstream_of(__name__, "shutdown")(self, timeout)
    fail_requests_in_flight(self)


def fail_requests_in_flight(llm: AsyncLLM) -> int:
    """Put :class:`EngineShutDownError` into each open request queue of
    ``llm``; returns how many requests were open. Queues belong to the event
    loop of the output handler, so the error is handed to that loop when
    called from another thread (the API server runs shutdown in an executor).
    """
    processor = getattr(llm, "output_processor", None)
    if processor is None or not processor.request_states:
        return 0
    count = len(processor.request_states)
    error = EngineShutDownError()
    loop = _handler_loop(getattr(llm, "output_handler", None))
    if loop is not None and loop.is_running() and not _runs_in(loop):
        loop.call_soon_threadsafe(processor.propagate_error, error)
    else:
        processor.propagate_error(error)
    return count


def _handler_loop(handler: asyncio.Task | None) -> asyncio.AbstractEventLoop | None:
    get_loop = getattr(handler, "get_loop", None)
    return get_loop() if callable(get_loop) else None


def _runs_in(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
