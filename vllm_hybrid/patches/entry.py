"""The record types of the patch registry (:mod:`vllm_hybrid.patches.registry`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PatchEntry:
    """One upstream symbol replaced by the overlay.

    ``target`` and ``replacement`` are ``"module:attr"`` or
    ``"module:Class.attr"`` paths. ``bindings`` lists the modules that hold a
    module-level name binding of the target (``from home import attr``);
    they are rebound together with the home module.
    """

    target: str
    replacement: str
    bindings: tuple[str, ...]
    why: str
    how: str
    upstream_status: str
    removal: str

    @property
    def home_module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def attr_path(self) -> str:
        return self.target.split(":", 1)[1]

    @property
    def name(self) -> str:
        """The attribute name the symbol is bound under."""
        return self.attr_path.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class SubclassEntry:
    """An upstream class the overlay subclasses without replacing it.

    Nothing upstream is rebound, but each listed method is an override of an
    upstream method (often a private one) that upstream code calls on our
    objects, so a rename or signature change upstream would silently bypass
    or break it; ``tests/patches`` checks them against what is installed.
    """

    base: str
    subclass: str
    overrides: tuple[str, ...]
    why: str
    how: str
    upstream_status: str
    removal: str


@dataclass(frozen=True)
class InstanceRewrite:
    """Attributes the overlay sets on instances of an upstream class.

    Upstream builds the object; the overlay then re-points some of its
    attributes. ``attributes`` must still be instance attributes the class
    sets (a test reads the installed source).
    """

    cls: str
    attributes: tuple[str, ...]
    where: str
    why: str


@dataclass(frozen=True)
class AddedAttribute:
    """An attribute the overlay adds to instances of an upstream class.

    Upstream never reads it; the overlay sets it where the object is made and
    reads it where the object arrives. ``name`` must not be an attribute of
    the upstream class (a test checks the installed version), or the two
    would collide.
    """

    cls: str
    name: str
    where: str
    why: str


@dataclass(frozen=True)
class PrivateAttribute:
    """A private upstream attribute the overlay reads or calls.

    ``owner`` is ``module`` or ``module:Class``; ``name`` is a module or
    class attribute, or an instance attribute the class's source assigns
    (``self.name = ...``). A test fails when one disappears.
    """

    owner: str
    name: str
    where: str
