"""The attention conformance checker catches wrong pooled addressing.

Each test runs a kernel correctly on the twins and with a deliberate fault on
the pooled views, and asserts that :func:`attention_check.compare` reports
it. The faults are the mistakes a pooled layout invites:

* ``shifted``: the layer's view starts one page late (a wrong layer offset);
* ``stride``: the block stride is one layer page short (with two attention
  layers, the stride of a dense per-layer tensor: a kernel that ignored the
  pooled block stride);
* ``id+1``: every block id in the slot mapping / block table is one too
  high (an off-by-one between pool-local and arena block ids).

A store fault leaves the requests' pages unwritten and writes other pages; a
read fault reads other bytes, so the outputs differ.
"""

from __future__ import annotations

import pytest
from attention_check import Setup, Verdict
from attention_harness import (
    BF16,
    TURBOQUANT,
    Batch,
    Case,
    block_stride_off_by_a_page,
    shifted_by_a_page,
    worker_workspace,
)
from interpreter_numerics import interpreter_fixes

#: numpy's warnings from the interpreter's masked lanes (see the kernels module)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

SEQ_LENS = (18, 3)
STORE = Batch(query_lens=SEQ_LENS)
READS = {"decode": Batch(query_lens=(1, 1)), "prefill": Batch(query_lens=(4, 3))}


def case(flavor) -> Case:
    return Case(flavor, 16, "min", seed=11)


def fault_kwargs(setup: Setup, fault: str) -> dict:
    """How ``Setup.store``/``attend`` inject ``fault`` into the pooled run."""
    if fault == "shifted":
        return {"fault": shifted_by_a_page}
    if fault == "stride":
        return {"fault": block_stride_off_by_a_page}
    assert fault == "id+1"
    return {"requests": setup.requests.shifted(1)}


@pytest.fixture(scope="module", autouse=True)
def _worker():
    with interpreter_fixes(), worker_workspace():
        yield


def faulty_store(flavor, fault: str) -> Verdict:
    """Store the read layer's K/V: twins right, pooled views with ``fault``."""
    setup = Setup.build(case(flavor), SEQ_LENS)
    layers = (setup.read_layer,)
    setup.store(STORE, pooled=False, layers=layers)
    setup.store(STORE, pooled=True, layers=layers, **fault_kwargs(setup, fault))
    return setup.compare()


@pytest.mark.parametrize(
    "flavor, fault",
    [(BF16, "shifted"), (BF16, "stride"), (BF16, "id+1"), (TURBOQUANT, "id+1")],
    ids=lambda x: getattr(x, "cache_dtype", x),
)
def test_store_faults_are_reported(flavor, fault):
    verdict = faulty_store(flavor, fault)
    assert verdict.pages_unequal, verdict
    assert verdict.problems()


@pytest.fixture(scope="module")
def stored(request) -> Setup:
    """Read layer stored correctly on both sides; twin outputs cached."""
    setup = Setup.build(case(request.param), SEQ_LENS)
    for pooled in (True, False):
        setup.store(STORE, pooled, layers=(setup.read_layer,))
    return setup


def twin_output(setup: Setup, read: str):
    """The twin run's output, computed once per read step."""
    if read not in setup.twin_outputs:
        setup.twin_outputs[read] = setup.attend(READS[read], pooled=False)
    return setup.twin_outputs[read]


@pytest.mark.parametrize("stored", [BF16], indirect=True, ids=["bf16"])
@pytest.mark.parametrize(
    "read, fault",
    [("decode", "stride"), ("prefill", "shifted"), ("prefill", "id+1")],
)
def test_bf16_read_faults_are_reported(stored, read, fault):
    check_read_fault(stored, read, fault)


@pytest.mark.parametrize("stored", [TURBOQUANT], indirect=True, ids=["tq_k8v4"])
@pytest.mark.parametrize("fault", ["stride"])
def test_turboquant_read_faults_are_reported(stored, fault):
    check_read_fault(stored, "decode", fault)


def check_read_fault(setup: Setup, read: str, fault: str) -> None:
    pooled = setup.attend(READS[read], pooled=True, **fault_kwargs(setup, fault))
    verdict = setup.compare(pooled, twin_output(setup, read))
    assert verdict.output_mismatches > 0, verdict
    # a read writes nothing: only the outputs may disagree
    assert not verdict.pages_unequal and not verdict.bytes_outside, verdict
