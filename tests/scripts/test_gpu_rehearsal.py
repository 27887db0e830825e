"""The GPU device run's import step, rehearsed on CPU (scripts/gpu).

A device run imports vLLM from a Python-only tree with stand-ins for the
compiled extensions, in an interpreter that has only the GPU machine's image
packages plus the carried wheels. These tests build that situation here
without the network: vLLM's tree linked from this venv without its ``*.so``,
the stand-ins and metadata the run writes, and a fresh interpreter that sees
only the image's distributions (``device_image.txt``) and the carried ones
(``carried.txt``), both linked from this venv. Then the run's import step
must import every module the device parts use from that tree.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_SCRIPTS = ROOT / "scripts" / "gpu"
sys.path.insert(0, str(GPU_SCRIPTS))

import bundle  # noqa: E402
import sitedir  # noqa: E402

PURELIB = Path(sysconfig.get_path("purelib"))


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """``(python, env, site)`` of an isolated interpreter with the device
    run's site directory (module-scoped: building it takes seconds)."""
    work = tmp_path_factory.mktemp("gpu-rehearsal")
    python, _ = sitedir.image_twin(work, PURELIB)
    site = sitedir.fresh(work / "site")
    package = sitedir.link_vllm_tree(PURELIB / "vllm", site)
    carried = [
        spec.split("==")[0] for spec in sitedir.read_list(GPU_SCRIPTS / "carried.txt")
    ]
    not_here = sitedir.link_image(PURELIB, carried, site)
    assert not_here == []
    sitedir.write_metadata(site)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(site), str(ROOT), str(GPU_SCRIPTS)]),
        GPU_RUN_SITE=str(site),
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
    )
    env.pop("PYTHONHOME", None)
    return python, env, site, package


def run(python: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_without_the_stand_ins_the_cuda_platform_does_not_import(rehearsal):
    python, env, _, package = rehearsal
    for name in sitedir.STANDIN_MODULES:
        (package / f"{name.replace('.', '/')}.py").unlink(missing_ok=True)
    proc = run(python, env, "-c", "import vllm.platforms.cuda")
    assert proc.returncode == 1
    assert "No module named 'vllm._C_stable_libtorch'" in proc.stderr


def test_import_step_imports_every_module_from_the_python_only_tree(
    rehearsal, tmp_path
):
    python, env, site, package = rehearsal
    assert sitedir.write_standins(package) == [
        f"vllm.{name}" for name in sitedir.STANDIN_MODULES
    ]
    out = tmp_path / "imports.json"
    proc = run(python, env, str(GPU_SCRIPTS / "imports.py"), "--out", str(out))
    report = json.loads(out.read_text())
    assert proc.returncode == 0, report["failed"] or proc.stderr[-3000:]
    assert report["checks"] == {
        "cuda_import_kernels": True,
        "vllm_from_site": True,
        "stand_in_used": True,
        "imports_as_cuda": True,
    }
    # imported as on CUDA, with device-capability queries answered as a card
    # would: every module imports, none is left for the device (the CUTLASS
    # support query w8a8_utils makes at import is answered by the stand-in)
    assert report["as_cuda"] == {"failed": [], "needs_gpu": []}
    modules = {m["module"]: m for m in report["modules"]}
    import imports

    assert list(modules) == list(imports.MODULES)
    assert all(m["ok"] for m in modules.values())
    # the interpreter saw this venv's vLLM nowhere: every vLLM module came
    # from the run's site directory
    assert modules["vllm.platforms.cuda"]["file"].startswith(str(site))
    assert report["environment"]["kernels"] == "interpreter"
    assert report["environment"]["platform"] == "CpuPlatform"


def test_the_isolated_interpreter_sees_only_the_image_and_the_site(rehearsal):
    python, env, _, _ = rehearsal
    script = "import importlib.util as u; print(u.find_spec('ruff'));"
    script += "print(u.find_spec('vllm_hybrid').origin)"
    proc = run(python, env, "-c", script)
    ruff, overlay = proc.stdout.split()
    # ruff is installed in this venv but is not on the device image
    assert ruff == "None"
    assert overlay == str(ROOT / "vllm_hybrid" / "__init__.py")


def test_carried_wheels_are_pinned_at_this_venvs_versions():
    for spec in sitedir.read_list(GPU_SCRIPTS / "carried.txt"):
        name, version = spec.split("==")
        assert md.version(name) == version, spec
    image = {
        sitedir.normalize(n)
        for n in sitedir.read_list(GPU_SCRIPTS / "device_image.txt")
    }
    carried = {
        sitedir.normalize(s.split("==")[0])
        for s in sitedir.read_list(GPU_SCRIPTS / "carried.txt")
    }
    # typing-extensions is carried on purpose (a newer one than the image's)
    assert image & carried == {"typing-extensions"}


def test_packed_tree_leaves_out_compiled_extensions_and_caches(tmp_path):
    source = tmp_path / "src"
    (source / "sub" / "__pycache__").mkdir(parents=True)
    (source / "__init__.py").write_text("")
    (source / "_C.abi3.so").write_bytes(b"\x7fELF")
    (source / "sub" / "mod.py").write_text("X = 1\n")
    (source / "sub" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"")
    archive = tmp_path / "tree.tar.gz"
    assert bundle.pack_tree(source, archive) == 2
    with tarfile.open(archive) as tar:
        names = sorted(m.name for m in tar.getmembers() if m.isfile())
    assert names == ["vllm/__init__.py", "vllm/sub/mod.py"]


def test_overlay_metadata_names_the_installed_entry_points(tmp_path):
    sitedir.write_metadata(tmp_path)
    dists = {d.metadata["Name"]: d for d in md.distributions(path=[str(tmp_path)])}
    assert dists["vllm"].version == sitedir.VLLM_VERSION
    written = {(e.group, e.name, e.value) for e in dists["vllm-hybrid"].entry_points}
    installed = {
        (e.group, e.name, e.value) for e in md.distribution("vllm-hybrid").entry_points
    }
    assert written == installed
    assert (
        "vllm.general_plugins",
        "vllm_hybrid",
        "vllm_hybrid.plugin:register",
    ) in written


def test_stand_in_declares_the_ops_layers_look_up_and_each_raises(rehearsal):
    python, env, _, package = rehearsal
    sitedir.write_standins(package)
    script = (
        "import torch, vllm._C_stable_libtorch as s\n"
        "print(sum(hasattr(torch.ops._C, n) for n in s.DECLARED))\n"
        "print(sorted({getattr(torch.ops._C, n)(90) for n in s.QUERIES}))\n"
        "print(hasattr(torch.ops._C, 'rms_norm'))\n"
        "print(','.join(s.IMPLEMENTED))\n"
        "x = torch.tensor([[0.0, 1.0, 2.0, 3.0]]); out = torch.empty(1, 2)\n"
        "torch.ops._C.silu_and_mul(out, x); print(out.tolist())\n"
        "torch.ops._C.gelu_fast(torch.empty(2), torch.empty(4))\n"
    )
    proc = run(python, env, "-c", script)
    declared, answers, other, implemented, silu = proc.stdout.split("\n")[:5]
    assert int(declared) == len(sitedir.DECLARED_OPS) == 14
    # CUTLASS support queries (asked at import on CUDA) all answer no
    assert len(sitedir.SUPPORT_QUERIES) == 5
    assert answers == "[False]"
    # everything else stays undeclared, so vLLM's hasattr checks see no op
    assert other == "False"
    # the ops a served MoE model calls run their PyTorch forms (standin_ops):
    # silu(0) * 2 = 0, silu(1) * 3 = 2.193...
    assert implemented.split(",") == [
        "_C::silu_and_mul",
        "_C::mul_and_silu",
        "_C::gelu_and_mul",
        "_C::gelu_tanh_and_mul",
        "_C::get_cuda_view_from_cpu_tensor",
        "_moe_C::topk_softmax",
        "_moe_C::moe_align_block_size",
        "_moe_C::moe_sum",
    ]
    assert silu.startswith("[[0.0, 2.19317")
    # the others still raise, naming themselves
    assert "NotImplementedError: _C::gelu_fast is a stand-in" in proc.stderr


def test_run_edits_change_the_runs_tree_and_never_the_source(rehearsal):
    _, _, _, package = rehearsal
    relative = sitedir.RUN_EDITS[0][0]
    source = PURELIB / "vllm" / relative
    before = source.read_text()
    assert sitedir.apply_edits(package) == [
        "v1/attention/backends/turboquant_attn.py: TurboQuant prefill without "
        "vLLM's compiled flash attention"
    ]
    edited = (package / relative).read_text()
    assert "_HAS_FLASH_ATTN = False" in edited
    assert not (package / relative).is_symlink()
    assert source.read_text() == before
    # a second application finds no shipped line left and says so
    with pytest.raises(RuntimeError, match="expected one line"):
        sitedir.apply_edits(package)
