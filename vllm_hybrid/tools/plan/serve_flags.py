"""``vllm serve``'s command line, both ways.

A user who serves a model already has a ``vllm serve`` line. Its flags may be
pasted after ``plan MODEL`` (or ``simulate MODEL``): the options the tool
models are its own (same names, same values); every other flag is read by
vLLM's own ``vllm serve`` parser, so that vLLM decides what is a flag, how
many values it takes and whether a value is valid. A flag that changes
nothing the tools compute (where the server listens, logging, chat
templates) is accepted and named in the output; one that would change the
KV cache or the scheduler's decisions, and that the tools do not model, is
refused by name, as is anything vLLM does not know.

The other way, :func:`serve_command` writes the line a plan stands for.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_hybrid.tools.plan.errors import PlanError

#: ``vllm serve`` options (argparse destinations of vLLM 0.32's parser) that
#: change neither the KV cache plan nor what the scheduler decides: accepted
#: and ignored. A test checks that each is an option of the installed vLLM.
IGNORED_SERVE_OPTIONS = frozenset(
    {
        "allow_credentials",
        "allowed_headers",
        "allowed_methods",
        "allowed_origins",
        "api_key",
        "api_server_count",
        "chat_template",
        "chat_template_content_format",
        "code_revision",
        "default_chat_template_kwargs",
        "disable_fastapi_docs",
        "disable_log_stats",
        "disable_uvicorn_access_log",
        "download_dir",
        "enable_auto_tool_choice",
        "enable_force_include_usage",
        "enable_log_outputs",
        "enable_log_requests",
        "enable_prompt_tokens_details",
        "enable_request_id_headers",
        "enable_server_load_tracking",
        "generation_config",
        "hf_token",
        "host",
        "ignore_patterns",
        "kv_cache_metrics",
        "language_model_only",
        "load_format",
        "log_level",
        "logging_config",
        "max_log_len",
        "max_logprobs",
        "max_parallel_loading_workers",
        "middleware",
        "otlp_traces_endpoint",
        "port",
        "reasoning_parser",
        "reasoning_parser_plugin",
        "response_role",
        "return_tokens_as_token_ids",
        "revision",
        "root_path",
        "safetensors_load_strategy",
        "seed",
        "served_model_name",
        "shutdown_timeout",
        "ssl_ca_certs",
        "ssl_cert_reqs",
        "ssl_certfile",
        "ssl_keyfile",
        "tokenizer",
        "tokenizer_mode",
        "tokenizer_revision",
        "tool_call_parser",
        "tool_parser_plugin",
        "trust_remote_code",
        "uds",
        "use_tqdm_on_load",
        "uvicorn_log_level",
    }
)


def serve_parser() -> Any:
    """vLLM's own ``vllm serve`` argument parser."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def _parse(parser: Any, flags: Sequence[str]) -> tuple[Any, list[str]]:
    """``parse_known_args`` of vLLM's parser, its one-line error as a
    :class:`PlanError` (vLLM's parser prints usage and exits)."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return parser.parse_known_args(list(flags))
    except SystemExit:
        lines = [x for x in errors.getvalue().splitlines() if x.strip()]
        why = lines[-1].split("error: ", 1)[-1] if lines else "invalid"
        raise PlanError(f"vllm serve flags: {why}") from None


def _flag_name(dest: str) -> str:
    """The long flag of an argparse destination, as vLLM's engine
    arguments spell their flags (``kv_cache_dtype``: ``--kv-cache-dtype``)."""
    return "--" + dest.replace("_", "-")


def check_serve_flags(flags: Sequence[str], tool: str) -> list[str]:
    """The flags of a pasted ``vllm serve`` line that ``tool`` ignores
    (their names, to say so); :class:`PlanError` naming the first flag that
    is not an option of vLLM, or one that ``tool`` cannot ignore."""
    if not flags:
        return []
    parser = serve_parser()
    given, unknown = _parse(parser, flags)
    if unknown:
        raise PlanError(
            f"{unknown[0]}: not an option of vllm serve (vLLM 0.32) or of {tool}"
        )
    defaults, _ = _parse(parser, [])
    changed = [d for d, v in vars(given).items() if getattr(defaults, d, v) != v]
    for dest in changed:
        if dest == "model_tag":
            raise PlanError(
                f"unexpected argument {given.model_tag!r}: give MODEL once, "
                "before the flags"
            )
        if dest not in IGNORED_SERVE_OPTIONS:
            raise PlanError(
                f"{_flag_name(dest)}: a vllm serve option that {tool} does "
                "not model (it can change the KV cache or the scheduler); "
                f"leave it out (vllm-hybrid {tool} --help lists what it models)"
            )
    return [_flag_name(d) for d in changed]


@dataclass(frozen=True)
class ServeLine:
    """What a ``vllm serve`` line of a request holds."""

    model: str
    #: (flag, value or None) in the order written
    flags: tuple[tuple[str, str | None], ...] = ()
    #: pasted flags the tool ignored, as given
    passed: tuple[str, ...] = ()

    def text(self) -> str:
        parts = ["vllm", "serve", self.model]
        for flag, value in self.flags:
            parts.append(flag)
            if value is not None:
                parts.append(value)
        return shlex.join([*parts, *self.passed])


def serve_command(args: Any, serve_name: str, passed: Sequence[str] = ()) -> str:
    """The ``vllm serve`` line of parsed plan/simulate arguments: the model
    as ``vllm serve`` takes it and every option of vLLM's the user set."""
    flags: list[tuple[str, str | None]] = []

    def add(flag: str, value: Any, default: Any = None) -> None:
        if value is not None and value != default:
            flags.append((flag, str(value)))

    add("--kv-cache-dtype", args.kv_cache_dtype, "auto")
    add("--tensor-parallel-size", args.tensor_parallel_size, 1)
    add("--kv-cache-memory-bytes", args.kv_cache_memory)
    if args.kv_cache_memory is None:
        add("--gpu-memory-utilization", args.gpu_memory_utilization)
    add("--max-model-len", args.max_model_len)
    add("--max-num-seqs", args.max_num_seqs)
    add("--max-num-batched-tokens", args.max_num_batched_tokens)
    add("--block-size", args.block_size)
    if args.prefix_caching is not None:
        name = "enable-prefix-caching"
        flags.append((f"--{name}" if args.prefix_caching else f"--no-{name}", None))
    add("--mamba-cache-mode", args.mamba_cache_mode)
    add("--mamba-block-size", args.mamba_block_size)
    add("--mamba-ssm-cache-dtype", args.mamba_ssm_cache_dtype, "auto")
    if args.additional_config:
        flags.append(("--additional-config", json.dumps(args.additional_config)))
    return ServeLine(serve_name, tuple(flags), tuple(passed)).text()
