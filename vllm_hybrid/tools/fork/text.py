"""Words of the overlay in docstrings, comments and messages, as the fork
says them: module paths and dotted names point at the fork's modules,
environment variables carry the fork's names, and the overlay's own name
leaves the messages (the fork is vLLM).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_hybrid.tools.fork.modules import PACKAGE, OverlayModule
from vllm_hybrid.tools.fork.options import ENGINE_ARG, fork_variable_names
from vllm_hybrid.tools.fork.wiring import OP_NAMESPACE

#: Phrases of the overlay's messages and docstrings, as the fork words them
#: (applied in order, before the names below).
PHRASES: tuple[tuple[str, str], ...] = (
    (rf":mod:`~?{PACKAGE}\.v1\.metrics\.[a-z_.]+`", "a metrics module"),
    (r"vllm-hybrid pooled KV mode: ", "Pooled KV cache: "),
    (r"vllm-hybrid pooled KV mode", "pooled KV cache mode"),
    (r"vllm-hybrid: ", ""),
    (r"vllm-hybrid's ", ""),
    (r"in vllm-hybrid ", "in "),
    (r"vllm-hybrid", "vLLM"),
    (
        r"--additional-config\s+'\{\"hybrid_kv\":\s*(\{[^}]*\})\}'",
        ENGINE_ARG + r" '\1'",
    ),
    (r"--additional-config \{ADDITIONAL_CONFIG_KEY\}\.", ENGINE_ARG + "."),
    (r"--additional-config \{ADDITIONAL_CONFIG_KEY\}", ENGINE_ARG),
    (r"--additional-config hybrid_kv\.", ENGINE_ARG + "."),
    (r"--additional-config hybrid_kv\b", ENGINE_ARG),
    (r"\bOverlayConfigError\b", "HybridKVConfigError"),
    (r"--additional-config", ENGINE_ARG),
    (r"the overlay's ", "the "),
    (r"The overlay's ", "The "),
)

_DOTTED = re.compile(rf"\b{PACKAGE}((?:\.[A-Za-z_][A-Za-z0-9_]*)*)")
_PATH = re.compile(rf"\b{PACKAGE}/([A-Za-z0-9_/]+(?:\.py)?)")
_VARIABLE = re.compile(r"\bVLLM_HYBRID_[A-Z0-9_]+\b")


@dataclass
class TextRules:
    modules: list[OverlayModule]

    def __post_init__(self) -> None:
        self._dotted = {m.name: m.fork_name for m in self.modules}
        self._paths = {m.path: m.fork_path for m in self.modules}
        self._variables = fork_variable_names()

    def __call__(self, text: str) -> str:
        for pattern, new in PHRASES:
            text = re.sub(pattern, new, text)
        text = _PATH.sub(self._path, text)
        text = _DOTTED.sub(self._name, text)
        text = _VARIABLE.sub(self._variable, text)
        text = text.replace(*OP_NAMESPACE)
        return re.sub(rf"\b{PACKAGE}_(?=[a-z])", "", text)

    def _path(self, match: re.Match) -> str:
        path = match.group(1)
        slash = "/" if path.endswith("/") else ""
        path = path.rstrip("/")
        for candidate in (path, f"{path}.py", f"{path}/__init__.py"):
            fork = self._paths.get(candidate)
            if fork is not None:
                if candidate.endswith("__init__.py"):
                    fork = fork.removesuffix("__init__.py").rstrip("/")
                return "vllm/" + fork + slash
        return match.group(0)

    def _name(self, match: re.Match) -> str:
        parts = (PACKAGE + match.group(1)).split(".")
        for i in range(len(parts), 0, -1):
            module = ".".join(parts[:i])
            fork = self._dotted.get(module)
            if fork is not None:
                return ".".join([fork, *parts[i:]])
        return match.group(0)

    def _variable(self, match: re.Match) -> str:
        name = match.group(0)
        fork = self._variables.get(name)
        return fork if fork is not None else name
