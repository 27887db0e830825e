"""Run in a fresh process: load vLLM's plugins, report every binding as JSON.

Usage: python probe_bindings.py [FAKE_VLLM_VERSION]
For each registry entry and each place it is bound, prints whether that place
holds upstream's object, the overlay's, or something else.
"""

from __future__ import annotations

import importlib
import json
import sys

import vllm

if len(sys.argv) > 1:
    vllm.__version__ = sys.argv[1]

from vllm.plugins import load_general_plugins  # noqa: E402

from vllm_hybrid import plugin  # noqa: E402
from vllm_hybrid.patches.registry import PATCHES, load_object, upstream  # noqa: E402

load_general_plugins()
report = {"active": plugin.state().active, "entries": {}}
for entry in PATCHES:
    original = upstream(entry.target)
    replacement = load_object(entry.replacement)
    places = {"<home>": load_object(entry.target)}
    for module_name in entry.bindings:
        places[module_name] = getattr(importlib.import_module(module_name), entry.name)
    report["entries"][entry.target] = {
        where: "overlay"
        if obj is replacement
        else "upstream"
        if obj is original
        else "other"
        for where, obj in places.items()
    }
print("PROBE " + json.dumps(report))
