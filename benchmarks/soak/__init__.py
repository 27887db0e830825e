"""Soak test of a live ``vllm-hybrid serve``: bounded, seeded load with checks.

``python benchmarks/soak`` runs it; ``tests/entrypoints/test_soak.py`` runs a
small configuration of the same phases. One run per mode starts the server
of a tiny hybrid on 127.0.0.1 with a small KV budget, drives it from threads
(:mod:`.workload`: the seeded mix; :mod:`.client`: requests and their
outcomes) and checks it after every phase and at the end (:mod:`.runner`).
"""
