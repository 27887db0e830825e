"""The record types of the patch registry (:mod:`vllm_hybrid.patches.registry`)."""

from __future__ import annotations

from dataclasses import dataclass

#: How a replacement sits in upstream's definition. The overlay binds the
#: replacement over upstream's object either way; ``vllm-hybrid fork`` writes
#: it into vLLM's own source in this shape.
PLACEMENTS: dict[str, str] = {
    "top": (
        "a dispatch at the top of upstream's body: code that may return "
        "before upstream's body runs"
    ),
    "before": "code before upstream's body that never returns early",
    "after": (
        "upstream's body first (optionally after code at the top), then code "
        "that sees its result"
    ),
    "body": (
        "the replacement is the whole body; upstream's definition stays as a "
        "private fallback that it calls"
    ),
}


@dataclass(frozen=True)
class PatchEntry:
    """One upstream symbol replaced by the overlay.

    ``target`` and ``replacement`` are ``"module:attr"`` or
    ``"module:Class.attr"`` paths. ``bindings`` lists the modules that hold a
    module-level name binding of the target (``from home import attr``);
    they are rebound together with the home module. ``placement`` is one of
    :data:`PLACEMENTS`: how the replacement sits in upstream's definition.
    """

    target: str
    replacement: str
    bindings: tuple[str, ...]
    why: str
    how: str
    upstream_status: str
    removal: str
    placement: str

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"{self.target}: placement {self.placement!r} is not one of "
                f"{sorted(PLACEMENTS)}"
            )

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
    #: The type the attribute is declared with where it becomes a field of
    #: the class (``vllm-hybrid fork``); names must resolve in the class's
    #: module.
    annotation: str
    #: The value the overlay's readers assume while it is unset (their
    #: ``getattr`` default), which a dataclass field gets as its default.
    default: str = "None"


@dataclass(frozen=True)
class AddedSymbol:
    """A name the overlay adds to an upstream module, so that it is
    reachable where vLLM would define it (``target``, ``module:name``, must
    not exist upstream); ``source`` is the overlay's object.
    """

    target: str
    source: str
    why: str

    @property
    def home_module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def name(self) -> str:
        return self.target.split(":", 1)[1]


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
