"""Shared fixtures: tiny models built once per session, GPU skipping, and
the hypothesis profiles the property tests run under."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from suite_order import longest_first

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

#: tests/site/sitecustomize.py: young garbage collections where vLLM asks for
#: full ones, in this process and (through PYTHONPATH) in every process a test
#: starts, pytest-xdist's workers included.
SITE = Path(__file__).resolve().parent / "site"
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(SITE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)
if str(SITE) not in sys.path:
    sys.path.insert(0, str(SITE))
import sitecustomize  # noqa: E402,F401

# "ci" (the default, and what scripts/test.sh selects): the same examples on
# every run and machine (derandomized, no example database), so a green run
# stays green. Bounded examples keep the property tests in the quick tier.
# The only suppressed health check is the one that depends on wall-clock
# time (a loaded machine generates slowly); filtering and data-size checks
# stay on and are as deterministic as the examples.
# "fuzz": random seeds, five times the examples, the local example database
# (failures are replayed first next time). For local bug hunting:
#   python -m pytest --hypothesis-profile=fuzz tests/v1/core/pooled/test_arena.py
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    max_examples=300,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz",
    max_examples=1500,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")


def _bind_engines_to_this_workers_core() -> None:
    """Under pytest-xdist, bind each worker's engines to a core of their own.

    vLLM's CPU worker binds its OpenMP threads to the last core by default
    ("auto"), so two test workers would run every forward pass on the same
    core while the other idles; a worker's own core keeps them apart. Tests
    that bind several cores themselves (tensor or pipeline parallel) set the
    variable in their own subprocess environment and are not affected.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    # An idle OpenMP thread spins for a while before it sleeps; next to the
    # other worker that spinning took its core and made engine tests 3-4x
    # slower (two engine modules side by side: 236 s each passive-less, 66-68
    # s passive, 59 s alone).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    index = int(worker.removeprefix("gw"))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[index % len(cores)])


_bind_engines_to_this_workers_core()


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


#: The kernel conformance tier runs upstream's Triton kernels in Triton's
#: interpreter, which must be switched on before any kernel module is
#: imported and stays on for the whole process. It therefore runs in its own
#: pytest process (``--kernel-tier``; tests/test_kernel_tier.py starts it from
#: the default suite) and is left out of every other collection.
KERNEL_TIER = Path(__file__).resolve().parent / "kernels"


def pytest_addoption(parser):
    parser.addoption(
        "--kernel-tier",
        action="store_true",
        help="collect tests/kernels (Triton interpreter; run it on its own)",
    )
    parser.addoption(
        "--extended",
        action="store_true",
        help="also run the extended tier (tests marked extended: more engine "
        "variants of behaviour the default run already checks)",
    )


def pytest_ignore_collect(collection_path, config):
    if config.getoption("--kernel-tier"):
        return None
    if collection_path == KERNEL_TIER or KERNEL_TIER in collection_path.parents:
        return True
    return None


def pytest_collection_modifyitems(config, items):
    longest_first(items)
    if not config.getoption("--extended"):
        extended = pytest.mark.skip(reason="extended tier: run with --extended")
        for item in items:
            if item.get_closest_marker("extended") is not None:
                item.add_marker(extended)
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present here")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """``tiny_model_dir(kind, mtp=False) -> Path``: build each tiny model
    once (``mtp``: with one MTP layer)."""
    from vllm_hybrid.tools.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    cache: dict[str, Path] = {}

    def get(kind: str, mtp: bool = False) -> Path:
        name = f"{kind}-mtp" if mtp else kind
        if name not in cache:
            cache[name] = Path(build_tiny_model(root / name, kind, mtp=mtp))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def tiny_eagle_dir(tiny_model_dir, tmp_path_factory):
    """``tiny_eagle_dir(kind) -> Path``: the EAGLE draft of the tiny model
    ``kind`` (built once, next to nothing else)."""
    from testing.tiny_eagle import build_eagle_draft

    root = tmp_path_factory.mktemp("tiny-eagle")
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = Path(build_eagle_draft(tiny_model_dir(kind), root / kind))
        return cache[kind]

    return get
