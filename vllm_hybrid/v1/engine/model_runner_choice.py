"""Model-runner choice for pooled mode.

Pooled mode's worker-side code is the V1 model runner (which vLLM's CPU
runner inherits), so the code CPU tests run is the code CUDA runs. On CUDA,
vLLM 0.32 defaults to Model Runner V2 and falls back to V1 for features V2
does not support; pooled mode registers itself as one of those features.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.v1.core.pooled.scope import pooled_mode_decision

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: How pooled mode appears in vLLM's "Model Runner V2 does not yet support"
#: log line.
FEATURE_NAME = "vllm-hybrid pooled KV mode"


def _v2_unsupported_features(self: VllmConfig) -> list[str]:
    unsupported = list(
        upstream_of(__name__, "get_v2_model_runner_unsupported_features")(self)
    )
    if pooled_mode_decision(self).enabled:
        unsupported.append(FEATURE_NAME)
    return unsupported


get_v2_model_runner_unsupported_features = _v2_unsupported_features
