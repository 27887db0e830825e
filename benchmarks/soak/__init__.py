"""Soak test of a live ``vllm-hybrid serve``: bounded, seeded load with checks.

The command line is ``python benchmarks/soak`` (this folder's ``__main__``);
``tests/entrypoints/test_soak.py`` runs a small configuration of the same
phases. One run per mode starts the server of a built-in tiny hybrid on
127.0.0.1 with a small KV budget, drives it from threads over loopback HTTP,
and checks it after every phase. In layers:

* :mod:`.config`: the settings of a run (``SoakConfig``) and the phase plan;
* :mod:`.workload`: the seeded request mix (``RequestSpec``, ``Job``);
* :mod:`.client`: sending one request, conversations, phases of jobs, and a
  ``/metrics`` monitor; every request ends in an ``Outcome``;
* :mod:`.checks`: health, idle KV pools, server RSS, greedy probes;
* :mod:`.runner`: one mode (server start, phases, checks, shutdown);
* :mod:`.report`: the one-screen summary per mode;
* :mod:`.cli`: the options.
"""

from .config import MODES, SoakConfig, phase_plan
from .runner import ModeReport, run_mode

__all__ = ["MODES", "ModeReport", "SoakConfig", "phase_plan", "run_mode"]
