"""Run in a fresh process: reload a patched module, then start planning the
way an engine does, and report what the registry saw, as JSON.

A reload re-executes ``vllm.v1.core.kv_cache_utils`` and binds upstream's
functions there again; the engine core still calls the overlay's
``get_kv_cache_configs`` through its own by-name binding, which repairs the
lost sites before planning.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from vllm.plugins import load_general_plugins

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "v1" / "core" / "pooled"))
from test_planner import planner_vllm_config, qwen3_5_specs  # noqa: E402

from vllm_hybrid.patches import registry  # noqa: E402
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig  # noqa: E402

load_general_plugins()
import vllm.v1.core.kv_cache_utils as kv_cache_utils  # noqa: E402
import vllm.v1.engine.core as engine_core  # noqa: E402

report = {"lost_before_reload": registry.lost_sites()}
importlib.reload(kv_cache_utils)
report["lost_after_reload"] = registry.lost_sites()
specs = qwen3_5_specs("align")
configs = engine_core.get_kv_cache_configs(planner_vllm_config(), [specs], [48 << 20])
report["pooled_plan"] = isinstance(configs[0], PooledKVCacheConfig)
report["lost_after_engine_start"] = registry.lost_sites()
report["home_is_overlay"] = kv_cache_utils.get_kv_cache_configs is registry.load_object(
    "vllm_hybrid.v1.core.kv_cache_utils:get_kv_cache_configs"
)
print("RELOAD " + json.dumps(report))
