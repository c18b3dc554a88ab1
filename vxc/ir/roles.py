"""Operand roles: the typed vocabulary every stored tensor is bound to.

A role names what a tensor *is* to a generic operator. It never names a
checkpoint spelling. The vocabulary is assembled from the operator
declarations (``vxc/ir/operators/``): each declares the roles it binds (and
a norm the roles it may take as its own), so a new operator extends it by
being declared. Never reuse a role with a different meaning.
"""

from __future__ import annotations

import enum

from .operators import OPERATORS


class _Role(str, enum.Enum):
    def __str__(self) -> str:  # printed as its bare name
        return self.value


def _vocabulary() -> list[str]:
    names: dict[str, None] = {}
    for decl in OPERATORS.values():  # registration order
        names.update(dict.fromkeys(decl.role_names()))
    return list(names)


Role = _Role("Role", [(n, n) for n in _vocabulary()], module=__name__, qualname="Role")
"""Every role an operator declaration names: ``Role.AttnQ``, ``Role("AttnQ")``, ``str(role) == "AttnQ"``."""


class Placement(str, enum.Enum):
    """Where a layer's norms sit around its sub-blocks."""

    PreOnly = "PreOnly"  # norm before the mixer and before the FFN
    PrePost = "PrePost"  # norm before and after each sub-block
    PreMixer = "PreMixer"  # a single norm before the mixer; no FFN sub-block
    PreFfn = "PreFfn"  # a single norm before the FFN; no mixer sub-block (an FFN-only layer)
    # two mixers side by side: both read the one pre-mixer norm's output, their outputs are summed into the
    # residual; then a norm before the FFN (the layer's second ``mixer`` line is ``Layer.parallel``)
    Parallel = "Parallel"

    def __str__(self) -> str:
        return self.value


# Which norm roles a placement requires, in program order, split by the
# sub-block they belong to (mixer side, FFN side).
PLACEMENT_NORMS: dict[Placement, tuple[tuple[Role, ...], tuple[Role, ...]]] = {
    Placement.PreMixer: ((Role.Mamba2PreMixerNorm,), ()),
    Placement.PreFfn: ((), (Role.PreFfnNorm,)),
    Placement.PreOnly: ((Role.PreAttentionNorm,), (Role.PreFfnNorm,)),
    Placement.Parallel: ((Role.PreAttentionNorm,), (Role.PreFfnNorm,)),
    Placement.PrePost: (
        (Role.PreAttentionNorm, Role.PostAttentionNorm),
        (Role.PreFfnNorm, Role.PostFfnNorm),
    ),
}
