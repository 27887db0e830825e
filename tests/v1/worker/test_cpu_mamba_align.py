"""Launchers of align mode's speculative-decoding copy kernels: upstream's
Triton launch where Triton runs, the host version elsewhere. (The host
versions are checked byte for byte against the Triton kernels in the kernel
tier: tests/kernels/test_state_align_copy_host.py.)"""

from __future__ import annotations

import pytest
import vllm.triton_utils

from vllm_hybrid.v1.worker import cpu_mamba_align


class FakeTriton:
    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return "triton launch"


@pytest.mark.parametrize(
    "name", ["precopy_mamba_align_fused_kernel", "postprocess_mamba_fused_kernel"]
)
def test_launcher_picks_triton_where_it_runs_and_the_host_version_elsewhere(
    monkeypatch, name
):
    launcher = getattr(cpu_mamba_align, name)
    fake = FakeTriton()
    monkeypatch.setattr(launcher, "triton_kernel", fake)
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)
    assert launcher[(3, 5, 1)] == "triton launch"
    assert fake.grids == [(3, 5, 1)]
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", False)
    assert launcher[(3, 5, 1)] is launcher.host
    assert fake.grids == [(3, 5, 1)]


def test_overlay_binds_the_launchers_in_mamba_utils():
    from vllm.v1.worker import mamba_utils

    from vllm_hybrid import plugin

    plugin.register()
    for name in ("precopy_mamba_align_fused_kernel", "postprocess_mamba_fused_kernel"):
        assert getattr(mamba_utils, name) is getattr(cpu_mamba_align, name)
