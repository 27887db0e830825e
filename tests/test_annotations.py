"""Parameters that hold one of vLLM's objects are typed with vLLM's class.

vLLM annotates its own functions (``request: Request``,
``vllm_config: VllmConfig``, ...). A replacement or helper that takes the same
object as ``Any`` hides from a reader (and a type checker) what it may do
with it. ``Any`` stays where the type is open: config stand-ins that carry
only ``additional_config``, registry code over arbitrary objects, shims of
the Triton interpreter. This test finds parameters whose name says which of
vLLM's objects they hold and that are still typed ``Any``; the files where
that is allowed for now are listed with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_hybrid"

#: Parameter name -> the class vLLM annotates it with.
NAMED = {
    "self": "the class whose method is replaced",
    "request": "Request",
    "manager": "SingleTypeKVCacheManager",
    "kv_cache_manager": "KVCacheManager",
    "scheduler": "Scheduler",
    "scheduler_output": "SchedulerOutput",
    "core": "EngineCore",
    "llm": "LLM",
    "pool": "BlockPool",
    "vllm_config": "VllmConfig",
    "kv_cache_config": "KVCacheConfig",
    "attn_selector_config": "AttentionSelectorConfig",
    "backend_cls": "type[AttentionBackend]",
    "metrics_collector": "KVCacheMetricsCollector",
}

#: Files (relative to the package) where such a parameter may stay ``Any``.
ALLOWED = {
    # Open by design: options_error parses a stand-in that carries only
    # additional_config, and the plugin parses the environment with None.
    "config/hybrid_kv.py": "takes any object with additional_config",
    "tools/simulate/clock.py": "typed with the one engine harness",
    "tools/simulate/drive.py": "typed with the one engine harness",
    "tools/simulate/executor.py": "typed with the one engine harness",
    "tools/simulate/probes.py": "typed with the one engine harness",
    "tools/simulate/steps.py": "typed with the one engine harness",
}


def untyped_objects(root: Path = PACKAGE) -> dict[str, list[str]]:
    """file -> ``function(parameter)`` of every parameter named in
    :data:`NAMED` and annotated ``Any``."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            args = node.args
            for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):
                annotation = arg.annotation
                if arg.arg in NAMED and annotation and ast.unparse(annotation) == "Any":
                    rel = str(path.relative_to(root))
                    found.setdefault(rel, []).append(f"{node.name}({arg.arg})")
    return found


def test_vllm_objects_are_typed_outside_the_allowed_files():
    found = untyped_objects()
    assert {f: v for f, v in found.items() if f not in ALLOWED} == {}


def test_each_allowed_file_still_has_one():
    """A listed file without such a parameter is done: delete its entry."""
    assert sorted(set(ALLOWED) - set(untyped_objects())) == []


def test_the_check_finds_a_parameter_by_name(tmp_path):
    (tmp_path / "a.py").write_text(
        "from typing import Any\n"
        "def f(request: Any, value: Any, vllm_config: 'VllmConfig'): ...\n"
        "class C:\n"
        "    async def g(self, manager: Any = None): ...\n"
    )
    assert untyped_objects(tmp_path) == {"a.py": ["f(request)", "g(manager)"]}
