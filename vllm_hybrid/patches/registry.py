"""The one registry of upstream vLLM symbols that the overlay replaces.

vLLM offers extension points (plugins, ``scheduler_cls``, ``worker_cls``,
backend and spec registries) for most of what the overlay does. Where it does
not, a symbol is replaced in its home module *and* in every module that bound
it by name with ``from ... import name`` at import time; otherwise the old
object would keep being called through those bindings.

Every such replacement is a :class:`PatchEntry` in :data:`PATCHES`
(:mod:`.entries`), with the reason, the mechanism, the upstream status and the
condition for deleting it. Subclasses of upstream classes, attributes set on
upstream instances and private upstream attributes the overlay reads are
listed in :mod:`.subclasses`. Applying and reverting go through
:func:`apply_all` and :func:`revert_all` only, so the registry is the
complete list of what differs from upstream.
"""

from __future__ import annotations

import importlib
from typing import Any

from vllm_hybrid.logger import init_logger
from vllm_hybrid.patches.capacity_entries import ADDED_SYMBOLS
from vllm_hybrid.patches.entries import CLI_PATCHES, PATCHES
from vllm_hybrid.patches.entry import AddedSymbol, PatchEntry
from vllm_hybrid.patches.subclasses import (
    ADDED_ATTRIBUTES,
    INSTANCE_REWRITES,
    PRIVATE_ATTRIBUTES,
    SUBCLASSES,
)

logger = init_logger(__name__)


def _resolve_owner(path: str) -> tuple[Any, str]:
    """Return ``(owner, attr)`` for a ``module:attr.attr`` path."""
    module_name, attr_path = path.split(":", 1)
    owner: Any = importlib.import_module(module_name)
    *parents, attr = attr_path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, attr


def _get_raw(owner: Any, attr: str) -> Any:
    """Read an attribute without triggering descriptors on classes.

    A ``staticmethod``/``classmethod`` must be saved and restored as the
    descriptor, not as the bound function, or reverting would change it.
    """
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attr in klass.__dict__:
                return klass.__dict__[attr]
        raise AttributeError(f"{owner.__qualname__} has no attribute {attr!r}")
    return getattr(owner, attr)


def load_object(path: str) -> Any:
    owner, attr = _resolve_owner(path)
    return _get_raw(owner, attr)


#: target -> upstream object, for the entries applied in this process.
_originals: dict[str, Any] = {}


def upstream(target: str) -> Any:
    """The upstream object behind ``target``, whether or not it is patched.

    Replacements that extend upstream behaviour call through this instead of
    importing the name, which would return the replacement itself.
    """
    if target in _originals:
        return _originals[target]
    return load_object(target)


def upstream_of(module: str, name: str) -> Any:
    """The upstream object that the replacement ``module:name`` stands in
    for, whether or not it is patched.

    Replacement modules call ``upstream_of(__name__, "their_name")``, so that
    each target path is written in the registry only.
    """
    name = f"{module}:{name}"
    for entry in (*PATCHES, *CLI_PATCHES):
        if entry.replacement == name:
            return upstream(entry.target)
    raise KeyError(f"{name} is no replacement in the patch registry")


def applied() -> list[PatchEntry]:
    """The entries currently applied in this process."""
    return [entry for entry in PATCHES if entry.target in _originals]


def _check_bindings(entry: PatchEntry, original: Any) -> None:
    """Refuse to patch when a listed binding is not upstream's object.

    With the exact version pin this cannot happen unless another plugin got
    there first; patching anyway would leave two different objects in use.
    """
    for module_name in entry.bindings:
        module = importlib.import_module(module_name)
        bound = getattr(module, entry.name, None)
        if bound is not original:
            raise RuntimeError(
                f"{module_name}.{entry.name} is not upstream's {entry.target}; "
                "another plugin may have replaced it. vllm-hybrid will not "
                "patch over it: uninstall the other plugin or set "
                "VLLM_HYBRID_KV=0."
            )


def _set(entry: PatchEntry, value: Any) -> None:
    owner, attr = _resolve_owner(entry.target)
    setattr(owner, attr, value)
    for module_name in entry.bindings:
        module = importlib.import_module(module_name)
        setattr(module, entry.name, value)


def apply_all(entries: list[PatchEntry] | None = None) -> list[PatchEntry]:
    """Apply every entry of ``entries`` (default :data:`PATCHES`); all or
    nothing.

    Idempotent: entries already applied are left alone.
    """
    pending: list[tuple[PatchEntry, Any, Any]] = []
    for entry in PATCHES if entries is None else entries:
        if entry.target in _originals:
            continue
        original = load_object(entry.target)
        _check_bindings(entry, original)
        pending.append((entry, original, load_object(entry.replacement)))
    for entry, original, replacement in pending:
        _originals[entry.target] = original
        _set(entry, replacement)
    if entries is None:
        _add_symbols()
    return [entry for entry, _, _ in pending]


def _add_symbols() -> None:
    """Bind every :data:`ADDED_SYMBOLS` name in its upstream module."""
    for symbol in ADDED_SYMBOLS:
        module = importlib.import_module(symbol.home_module)
        setattr(module, symbol.name, load_object(symbol.source))


def _remove_symbols() -> None:
    for symbol in ADDED_SYMBOLS:
        module = importlib.import_module(symbol.home_module)
        if symbol.name in vars(module):
            delattr(module, symbol.name)


def lost_sites() -> list[str]:
    """Sites of applied entries that no longer hold the replacement.

    ``importlib.reload`` of a patched module (test harnesses, notebook
    autoreload, some plugin loaders) re-executes it and binds upstream's
    functions again, silently; so does another plugin patching after us.
    """
    lost = []
    for entry in applied():
        replacement = load_object(entry.replacement)
        if load_object(entry.target) is not replacement:
            lost.append(entry.target)
        for module_name in entry.bindings:
            module = importlib.import_module(module_name)
            if getattr(module, entry.name, None) is not replacement:
                lost.append(f"{module_name}.{entry.name}")
    return lost


def repair() -> list[str]:
    """Bind the replacement again at every lost site; returns the sites.

    Where the home module was reloaded it now holds a fresh upstream object,
    which becomes the one :func:`upstream` and :func:`revert_all` use.
    """
    lost = lost_sites()
    if not lost:
        return []
    for entry in applied():
        replacement = load_object(entry.replacement)
        current = load_object(entry.target)
        if current is not replacement:
            _originals[entry.target] = current
        _set(entry, replacement)
    logger.warning(
        "vllm-hybrid: %d patched upstream symbol(s) had been rebound (a module "
        "reload or another plugin): %s; the overlay re-applied them",
        len(lost),
        ", ".join(lost),
    )
    return lost


def revert_all() -> None:
    """Put every upstream object back, in reverse order of application, and
    take the added names away again."""
    _remove_symbols()
    for entry in reversed([*PATCHES, *CLI_PATCHES]):
        original = _originals.pop(entry.target, None)
        if original is not None:
            _set(entry, original)


__all__ = [
    "ADDED_ATTRIBUTES",
    "ADDED_SYMBOLS",
    "AddedSymbol",
    "CLI_PATCHES",
    "INSTANCE_REWRITES",
    "PATCHES",
    "PRIVATE_ATTRIBUTES",
    "SUBCLASSES",
    "PatchEntry",
    "applied",
    "apply_all",
    "load_object",
    "lost_sites",
    "repair",
    "revert_all",
    "upstream",
    "upstream_of",
]
