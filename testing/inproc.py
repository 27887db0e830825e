"""An in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) for the
tests and benchmarks: how to open and release one, its engine core, and the
token ids random prompts may use. How two greedy completions compare is the
product's rule, :mod:`vllm_hybrid.tools.greedy`.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from vllm_hybrid.tools.workloads import allowed_token_ids

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.v1.engine.core import EngineCore


@contextlib.contextmanager
def open_llm(
    kwargs: Mapping[str, Any], collect: Callable[[], object] | None = None
) -> Iterator[LLM]:
    """A ``vllm.LLM`` of ``kwargs`` with its engine core in this process,
    released however the body (or the start) ends: the core shut down, the
    last reference dropped and collected (``collect``, default
    ``gc.collect``), vLLM's distributed state cleaned up. Several engines
    run one after another in one process (a benchmark worker, a test) only
    when nothing of the previous one survives."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory

    llm = None
    try:
        llm = LLM(**kwargs)
        yield llm
    finally:
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
        del llm
        (collect or gc.collect)()
        with contextlib.suppress(Exception):
            cleanup_dist_env_and_memory()


def engine_core(llm: LLM) -> EngineCore:
    """The in-process ``EngineCore`` (needs multiprocessing off):
    ``LLMEngine.engine_core`` is an ``InprocClient``, whose ``engine_core``
    is the core."""
    return llm.llm_engine.engine_core.engine_core


def llm_vocab(llm: LLM) -> list[int]:
    """Token ids random prompts may use (tokenizer and model agree on)."""
    tokenizer = llm.get_tokenizer()
    model_size = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    return allowed_token_ids(min(len(tokenizer), model_size), tokenizer.all_special_ids)
