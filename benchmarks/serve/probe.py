"""Can upstream vLLM (overlay off) store a quantized KV cache dtype on CPU?

vLLM 0.32's CPU platform hands every decoder attention layer to CPU_ATTN
whatever ``--kv-cache-dtype`` says. For ``turboquant_*`` the server still
starts (the pages are sized for TurboQuant's packed slot), then CPU_ATTN
writes plain bf16 K/V into them: wrong results at best, a segfault under
load (docs/turboquant-backend.md). A failed start would be easy to report;
a server that starts and corrupts memory is not, so the benchmark asks the
platform before starting one. The question runs in a child process with
``VLLM_HYBRID_KV=0`` and vLLM's plugins loaded, i.e. in exactly the state of
an upstream server, and in parallel with the first server's start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: Run in the child: which backend upstream's CPU platform picks for a
#: decoder attention layer, and which cache dtypes that backend stores.
PROBE_SOURCE = """
import json, sys
from types import SimpleNamespace
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.platforms.cpu import CpuPlatform
from vllm.utils.import_utils import resolve_obj_by_qualname
layer = SimpleNamespace(use_sparse=False, use_mla=False)
backend = resolve_obj_by_qualname(CpuPlatform.get_attn_backend_cls(None, layer))
print("PROBE_RESULT " + json.dumps({
    "backend": backend.get_name(),
    "stores": list(backend.supported_kv_cache_dtypes),
    "supported": {d: bool(backend.supports_kv_cache_dtype(d)) for d in sys.argv[1:]},
}))
"""
MARKER = "PROBE_RESULT "


@dataclass
class DtypeVerdict:
    """Whether upstream can run ``dtype`` on CPU, and why not."""

    dtype: str
    #: None when the probe itself failed (then the server is tried).
    supported: bool | None
    reason: str = ""


def verdicts_from_output(output: str, dtypes: Sequence[str]) -> list[DtypeVerdict]:
    """Parse the child's last result line (pure, for tests)."""
    lines = [line for line in output.splitlines() if line.startswith(MARKER)]
    if not lines:
        tail = output.strip().splitlines()[-1:] or ["no output"]
        return [DtypeVerdict(d, None, f"probe failed: {tail[0][:200]}") for d in dtypes]
    data = json.loads(lines[-1][len(MARKER) :])
    out = []
    for dtype in dtypes:
        ok = bool(data["supported"].get(dtype, False))
        reason = (
            ""
            if ok
            else f"upstream's CPU platform selects {data['backend']} for decoder "
            f"attention, which stores only {', '.join(data['stores'])}; it would "
            f"write bf16 K/V into {dtype}'s packed pages"
        )
        out.append(DtypeVerdict(dtype, ok, reason))
    return out


class UpstreamDtypeProbe:
    """The child process, started at once and read when first needed."""

    def __init__(self, dtypes: Sequence[str], log_path: Path) -> None:
        self.dtypes = list(dtypes)
        self.log_path = log_path
        env = dict(os.environ, VLLM_HYBRID_KV="0")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        with open(log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", PROBE_SOURCE, *self.dtypes],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self._verdicts: dict[str, DtypeVerdict] | None = None

    def verdict(self, dtype: str, timeout: float = 300.0) -> DtypeVerdict:
        if self._verdicts is None:
            try:
                self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            output = self.log_path.read_text(errors="replace")
            found = verdicts_from_output(output, self.dtypes)
            self._verdicts = {v.dtype: v for v in found}
        return self._verdicts[dtype]

    def close(self) -> None:
        """Stop the child if nobody asked for its answer."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
