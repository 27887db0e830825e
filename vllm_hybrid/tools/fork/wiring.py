"""What the plugin and the registry's records do at run time, written as
vLLM would have it in its own files.

* ``config_field``: the ``hybrid_kv`` options become ``HybridKVConfig``
  (:mod:`.options` has the fields), a field of ``VllmConfig`` and the engine
  argument ``--hybrid-kv-config``, wired like vLLM's other configs.
* ``environment``: the variables that stay are declared in ``vllm/envs.py``.
* ``attention_backend``: ``CPU_TURBOQUANT`` is a member of vLLM's
  ``AttentionBackendEnum`` instead of being registered by the plugin.
* ``cpu_kernel``: the TurboQuant kernel joins ``csrc/cpu`` and vLLM's CPU
  extension instead of the overlay's own CMake project.
* added attributes become declared fields of their classes.

Anchors are lines of vLLM's source (pinned exactly); a missing anchor stops
the generator with the file and the line it looked for.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from vllm_hybrid.patches.entry import AddedAttribute
from vllm_hybrid.tools.fork.code import ForkError, Origin
from vllm_hybrid.tools.fork.options import (
    CONFIG_CLASS,
    CONFIG_FIELD,
    ENGINE_ARG,
    option_rows,
    variable_rows,
)
from vllm_hybrid.tools.fork.source import Edit, find_function
from vllm_hybrid.tools.fork.upstream import UpstreamModule

#: The kernel's sources in this repository -> their path in vLLM's tree.
CPU_KERNEL_FILES = {
    "csrc/turboquant_common.h": "csrc/cpu/turboquant_common.h",
    "csrc/turboquant_cpu.cpp": "csrc/cpu/turboquant_attn.cpp",
    "csrc/turboquant_store.cpp": "csrc/cpu/turboquant_store.cpp",
}
#: The operator namespace of the kernel: the overlay's own library, vLLM's.
OP_NAMESPACE = ("vllm_hybrid_tq", "_C_turboquant")

#: vLLM's modules the options' wiring edits.
CONFIG_MODULES = ("vllm.config.vllm", "vllm.config", "vllm.engine.arg_utils")

#: Function bodies the fork writes differently from the overlay, because
#: what they read is vLLM's own in the fork.
FORK_BODIES: dict[str, dict[str, str]] = {
    "vllm_hybrid.config.hybrid_kv": {
        "_raw_options": f'''\
"""The options ``vllm_config.{CONFIG_FIELD}`` sets (``{ENGINE_ARG}``);
unset ones (None) are left to their defaults."""
config = getattr(vllm_config, "{CONFIG_FIELD}", None)
if config is None:
    return {{}}
values = {{f.name: getattr(config, f.name) for f in dataclasses.fields(config)}}
return {{name: value for name, value in values.items() if value is not None}}
''',
    },
    "vllm_hybrid.ops.turboquant.native": {
        "available": f'''\
"""Whether vLLM's CPU extension has the kernel (built with vLLM's CMake);
False (and one log line) where it does not."""
try:
    import vllm._C  # noqa: F401 - registers the extension's operators

    torch.ops.{OP_NAMESPACE[1]}.build_info()
except (ImportError, OSError, RuntimeError, AttributeError):
    logger.info("TurboQuant native kernel not built; using the torch path")
    return False
return True
''',
    },
}

#: Module docstrings the fork words differently.
FORK_DOCSTRINGS: dict[str, str] = {
    "vllm_hybrid.ops.turboquant.native": (
        "Wrappers for the TurboQuant CPU kernel of vLLM's CPU extension\n"
        "(``csrc/cpu/turboquant_*.cpp``); without it the torch implementation\n"
        "runs.\n\n"
        "The wrappers keep the parts whose floating-point result depends on\n"
        "summation order (key norms, Hadamard rotations) in torch, shared with the\n"
        "reference, so store() writes the same bytes on both paths.\n"
    ),
    "vllm_hybrid.envs": (
        "Environment variables of hybrid models' KV caches (declared in\n"
        "``vllm/envs.py``) and the parsers that read them: a bad value is one\n"
        "error naming the variable and the values it takes.\n"
    ),
}

#: Names of the overlay the fork has no use for, and why.
FORK_DROPS: dict[str, dict[str, str]] = {
    "vllm_hybrid.envs": {
        "declare_to_vllm": "the fork declares its variables in vllm/envs.py",
    },
    "vllm_hybrid.platforms.cpu": {
        "register_backend": "CPU_TURBOQUANT is a member of AttentionBackendEnum",
    },
    "vllm_hybrid.ops.turboquant.native": {
        "library_path": "the kernel is part of vLLM's CPU extension",
        "try_load": "the kernel is part of vLLM's CPU extension",
        "BUILD_INFO": "the kernel is part of vLLM's CPU extension",
        "_HERE": "the kernel is part of vLLM's CPU extension",
    },
}

#: Imports the fork's versions of a module need beyond the overlay's.
FORK_IMPORTS: dict[str, list[str]] = {
    "vllm_hybrid.config.hybrid_kv": [
        "import dataclasses",
        "from vllm.config.utils import config",
    ],
}


def insert_after(
    module: UpstreamModule, anchor: str, text: str, times: int = 1
) -> None:
    """Insert ``text`` after each of the ``times`` occurrences of the
    line(s) ``anchor``."""
    source = module.source.text
    count = source.count(anchor)
    if count != times:
        raise ForkError(
            f"{module.path}: expected the line {anchor.strip()!r} {times} time(s), "
            f"found {count} (vLLM's source changed?)"
        )
    at = 0
    for _ in range(times):
        at = source.index(anchor, at) + len(anchor)
        module.edits.append(Edit(at, at, text))


def config_class() -> str:
    """``HybridKVConfig``: one field per ``hybrid_kv`` option."""
    lines = [
        "",
        "",
        "@config",
        f"class {CONFIG_CLASS}:",
        '    """KV cache options of hybrid models (attention layers next to',
        '    Mamba/GDN state layers), checked by the one parser of them all."""',
        "",
    ]
    for row in option_rows():
        lines.append(f"    {row.field}: {row.annotation} = {row.default}")
        lines += _docstring(row.doc, "    ")
        lines.append("")
    lines += [
        "    def __post_init__(self) -> None:",
        "        # one parser for every option: its error names the option",
        "        HybridKVOptions.from_vllm_config(_Holding(self))",
        "",
        "    def compute_hash(self) -> str:",
        '        """The options shape the KV cache, not the forward graph."""',
        "        from vllm.config.utils import hash_factors",
        "",
        "        return hash_factors({})",
        "",
        "",
        "@dataclasses.dataclass(frozen=True)",
        "class _Holding:",
        f'    """A stand-in carrying only ``{CONFIG_FIELD}``."""',
        "",
        f"    {CONFIG_FIELD}: {CONFIG_CLASS}",
    ]
    return "\n".join(lines) + "\n"


def _docstring(text: str, indent: str) -> list[str]:
    wrapped = textwrap.wrap(text, width=80 - len(indent))
    if len(wrapped) == 1:
        return [f'{indent}"""{wrapped[0]}"""']
    return [
        f'{indent}"""{wrapped[0]}',
        *(indent + w for w in wrapped[1:]),
        f'{indent}"""',
    ]


def wire_config(modules: dict[str, UpstreamModule]) -> None:
    """``VllmConfig.hybrid_kv_config`` and ``--hybrid-kv-config``."""
    vllm_cfg = modules["vllm.config.vllm"]
    insert_after(
        vllm_cfg,
        "from .aux_output import AuxOutputConfig\n",
        f"from .hybrid_kv import {CONFIG_CLASS}\n",
    )
    insert_after(
        vllm_cfg,
        '    """Execution auxiliary output configuration."""\n',
        f"    {CONFIG_FIELD}: {CONFIG_CLASS} = Field(default_factory={CONFIG_CLASS})\n"
        '    """KV cache options of hybrid models."""\n',
    )
    init = modules["vllm.config"]
    insert_after(
        init,
        "from vllm.config.aux_output import AuxOutputConfig\n",
        f"from vllm.config.hybrid_kv import {CONFIG_CLASS}\n",
    )
    insert_after(init, '    "AuxOutputConfig",\n', f'    "{CONFIG_CLASS}",\n')
    args = modules["vllm.engine.arg_utils"]
    insert_after(args, "    AuxOutputConfig,\n", f"    {CONFIG_CLASS},\n")
    insert_after(
        args,
        "    aux_output_config: AuxOutputConfig = "
        'get_field(VllmConfig, "aux_output_config")\n',
        f"    {CONFIG_FIELD}: {CONFIG_CLASS} = "
        f'get_field(VllmConfig, "{CONFIG_FIELD}")\n',
    )
    insert_after(
        args,
        "            self.aux_output_config = "
        "AuxOutputConfig(**self.aux_output_config)\n",
        f"        if isinstance(self.{CONFIG_FIELD}, dict):\n"
        f"            self.{CONFIG_FIELD} = {CONFIG_CLASS}(**self.{CONFIG_FIELD})\n",
    )
    insert_after(
        args,
        '            "--aux-output-config", '
        '**vllm_kwargs["aux_output_config"]\n        )\n',
        f'        vllm_group.add_argument("{ENGINE_ARG}", '
        f'**vllm_kwargs["{CONFIG_FIELD}"])\n',
    )
    insert_after(
        args,
        "            aux_output_config=self.aux_output_config,\n",
        f"            {CONFIG_FIELD}=self.{CONFIG_FIELD},\n",
    )


def wire_environment(envs: UpstreamModule) -> None:
    """Declare the fork's variables where vLLM declares its own."""
    rows = [row for row in variable_rows() if row.env is not None]
    tree = envs.source.tree
    checking = next(
        s
        for s in tree.body
        if isinstance(s, ast.If) and ast.unparse(s.test) == "TYPE_CHECKING"
    )
    at = envs.source.line_end(checking.end_lineno)
    declared = "".join(f"    {row.env}: str | None = None\n" for row in rows)
    envs.edits.append(Edit(at, at, declared))
    table = next(
        s
        for s in tree.body
        if isinstance(s, ast.AnnAssign)
        and isinstance(s.target, ast.Name)
        and s.target.id == "environment_variables"
    )
    _, end = envs.source.span(table.value)
    entries = ""
    for row in rows:
        entries += "".join(f"{line}\n" for line in _comment(row.doc, "    "))
        entries += f'    "{row.env}": lambda: os.getenv("{row.env}"),\n'
    envs.edits.append(Edit(end - 1, end - 1, entries))


def _comment(text: str, indent: str) -> list[str]:
    return [f"{indent}# {line}" for line in textwrap.wrap(text, width=80 - len(indent))]


def wire_backend(registry: UpstreamModule, name: str, path: str) -> None:
    insert_after(
        registry,
        '    TURBOQUANT = "vllm.v1.attention.backends.turboquant_attn.'
        'TurboQuantAttentionBackend"\n',
        f'    {name} = "{path}"\n',
    )


def wire_cpu_kernel(cmake: UpstreamModule) -> None:
    """The kernel's sources in vLLM's CPU extension (the store never fuses a
    multiply-add, to stay bit-identical with the torch implementation)."""
    for indent in ("    ", "        "):
        insert_after(
            cmake,
            f'\n{indent}"csrc/cpu/sampling_kernels.cpp"\n',
            f'{indent}"csrc/cpu/turboquant_attn.cpp"\n'
            f'{indent}"csrc/cpu/turboquant_store.cpp"\n',
            times=1 if indent == "    " else 2,
        )
    insert_after(
        cmake,
        '    "csrc/cpu/torch_bindings.cpp")\n',
        "\n# TurboQuant KV cache: the store stays bit-identical to the torch\n"
        "# implementation, so no multiply-add is contracted into an FMA.\n"
        'set_source_files_properties("csrc/cpu/turboquant_store.cpp"\n'
        "    PROPERTIES COMPILE_OPTIONS -ffp-contract=off)\n",
    )


def kernel_sources(repo_root: Path) -> dict[str, str]:
    """The kernel's files as the fork has them (operator namespace renamed)."""
    old, new = OP_NAMESPACE
    return {
        dest: (repo_root / src).read_text().replace(old, new)
        for src, dest in CPU_KERNEL_FILES.items()
    }


def declare_attribute(module: UpstreamModule, attribute: AddedAttribute) -> None:
    """The attribute as a declared field of its class: a dataclass field
    (keyword-only, defaulting to what its readers assume while it is unset)
    or, for other classes, an annotation."""
    cls_name = attribute.cls.split(":", 1)[1]
    tree = module.source.tree
    cls = next(
        (s for s in tree.body if isinstance(s, ast.ClassDef) and s.name == cls_name),
        None,
    )
    if cls is None:
        raise ForkError(f"{module.path}: class {cls_name} not found")
    decorator = next(
        (ast.unparse(d) for d in cls.decorator_list if "dataclass" in ast.unparse(d)),
        None,
    )
    indent = module.source.indentation(cls.body[0])
    why = _docstring(attribute.why, indent)
    if decorator is not None:
        prefix = "dataclasses." if decorator.startswith("dataclasses.") else ""
        if not prefix and "field" not in module.runtime_names():
            module.imports.append("from dataclasses import field")
        line = (
            f"{indent}{attribute.name}: {attribute.annotation} = "
            f"{prefix}field(default={attribute.default}, kw_only=True)"
        )
        fields = [s for s in cls.body if isinstance(s, ast.AnnAssign) and s.simple]
        anchor = fields[-1] if fields else cls.body[0]
        after = _with_docstring(cls, anchor)
    else:
        line = f"{indent}{attribute.name}: {attribute.annotation}"
        after = _with_docstring(cls, cls.body[0]) if _is_doc(cls.body[0]) else None
    text = line + "\n" + "\n".join(why) + "\n"
    if after is None:
        at = module.source.statement_lines(cls.body[0])[0]
        module.edits.append(Edit(at, at, text + "\n"))
        return
    at = module.source.line_end(after.end_lineno)
    module.edits.append(Edit(at, at, ("\n" if decorator is None else "") + text))


def _is_doc(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


def _with_docstring(cls: ast.ClassDef, stmt: ast.stmt) -> ast.stmt:
    """``stmt``, or the attribute docstring that follows it."""
    index = cls.body.index(stmt)
    if index + 1 < len(cls.body) and _is_doc(cls.body[index + 1]) and index > 0:
        return cls.body[index + 1]
    return stmt


def function_exists(module: UpstreamModule, attr_path: str) -> bool:
    try:
        find_function(module.source.tree, attr_path)
    except LookupError:
        return False
    return True


def wire(build, step: str, touch, out: dict[str, str]) -> None:
    """Run the wiring step ``step`` of :data:`.plan.COMMITS` for ``build``:
    ``touch(name)`` gives vLLM's module ``name`` to change, ``out`` takes
    files written whole."""
    if step == "config_field":
        modules = {name: touch(name) for name in CONFIG_MODULES}
        wire_config(modules)
    elif step == "environment":
        wire_environment(touch("vllm.envs"))
    elif step == "attention_backend":
        module = "vllm_hybrid.v1.attention.backends.cpu_turboquant_attn"
        name = _constant(build.origins[module], "BACKEND_NAME")
        home = build.table.home(module, "CPUTurboQuantAttentionBackend")
        wire_backend(
            touch("vllm.v1.attention.backends.registry"),
            name,
            f"{home.module}.{home.name}",
        )
    elif step == "cpu_kernel":
        for path, text in kernel_sources(build.repo_root).items():
            out[path] = build.text(text)
        cmake_path = "cmake/cpu_extension.cmake"
        module = UpstreamModule("cmake", cmake_path, _Text(build._text(cmake_path)))
        wire_cpu_kernel(module)
        out[cmake_path] = module.render(build.text)
    else:
        raise ForkError(f"unknown wiring step {step!r}")


class _Text:
    """A non-Python file for :class:`UpstreamModule`'s text edits."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tree = ast.Module(body=[], type_ignores=[])


def _constant(origin: Origin, name: str) -> str:
    """The string a module binds ``name`` to at top level."""
    stmt = origin.source.top_level_bindings[name]
    return ast.literal_eval(stmt.value)


def _constant(origin, name: str) -> str:
    """The string a module binds ``name`` to at top level."""
    stmt = origin.source.top_level_bindings[name]
    return ast.literal_eval(stmt.value)
