"""The README demo: serve the tiny Qwen3.5-shaped hybrid and ask it once.

Builds the tiny random-weight ``qwen3_5`` model (offline, seconds), serves it
with ``vllm-hybrid serve --kv-cache-dtype turboquant_k8v4`` on loopback
(through :mod:`testing.loopback`, as the tests do), sends one chat
completion, prints the answer (random weights: expect word salad) and the
engine's KV cache plan lines, then shuts the server down and reports what its
exit code and log say about the shutdown. ``bash scripts/demo.sh`` sets up
the environment and runs it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as a script: the repository root takes the folder's place on sys.path,
# so the checkout's vllm_hybrid is the one imported.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from testing.loopback import serve, shutdown_report, stop  # noqa: E402
from vllm_hybrid.tools.tiny_models import build_tiny_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", default=".tiny-models/qwen3_5")
    # The project's headline command: packed TurboQuant KV on CPU_TURBOQUANT.
    parser.add_argument("--kv-cache-dtype", default="turboquant_k8v4")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=48 * 2**20)
    parser.add_argument("--prompt", default="Hello! What can a hybrid model do?")
    args = parser.parse_args(argv)

    model_dir = build_tiny_model(Path(args.model_dir), "qwen3_5")
    print(f"[demo] tiny qwen3_5 model at {model_dir}", flush=True)
    serve_args = [
        "--max-model-len=4096",
        f"--kv-cache-memory-bytes={args.kv_cache_memory_bytes}",
        f"--kv-cache-dtype={args.kv_cache_dtype}",
    ]
    with serve(model_dir, serve_args) as server:
        print(f"[demo] server ready at {server.url} (log: {server.log_path})")
        reply = server.chat(args.prompt, max_tokens=24)
        answer = reply["choices"][0]["message"]["content"]
        print(f"[demo] prompt: {args.prompt!r}")
        print(f"[demo] answer (random weights): {answer!r}")
        print("[demo] KV cache plan lines from the engine log:")
        plan_lines = server.plan_lines()
        for line in plan_lines:
            print(f"    {line}")
        if not any("KV cache size" in line for line in plan_lines):
            print("[demo] error: the engine log has no KV cache plan line")
            return 1
        report = shutdown_report(server, stop(server))
    if not report.clean:
        print(f"[demo] error: the server exited with code {report.exit_code}")
        for line in report.problems:
            print(f"    {line}")
        return 1
    print(f"[demo] server stopped cleanly (exit code {report.exit_code})")
    if report.harmless_lines:
        print(
            f"[demo] its log ends with {report.harmless_lines} lines of upstream's "
            "harmless exit-time messages (Triton's nanobind leak report, "
            "multiprocessing resource_tracker cleanup warnings, and sometimes an "
            "EngineDeadError from the output handler of the engine vLLM's "
            "abort-mode shutdown just stopped)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
