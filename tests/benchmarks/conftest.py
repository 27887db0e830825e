"""The benchmark library ``benchmarks/pooled`` importable as ``pooled``."""

from engine_utils import bench_pooled

bench_pooled()
