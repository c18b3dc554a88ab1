"""The three rooms of an operator agree: every declared operator kind has a lowering, every kernel a
lowering emits exists as ``torch.ops.vxc.<name>``, lowerings read the geometry the declarations derive
(never their own formula), and one helper names every state region.

Lowered, in every variant: every executable miniature (the runtime families and tests/families' ones, built
with random weights from their own tests' configs; gpt-oss's is left out) and every golden witness IR (full geometry, no weights; gpt-oss-20b among them).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.conftest import GOLDEN
from vxc.codegen import kernels  # noqa: F401  (registers torch.ops.vxc.*)
from vxc.codegen.lower import LOWERINGS, VARIANTS, StateRef, lower_plan
from vxc.ir import parse
from vxc.ir.operators import OPERATORS
from vxc.passes.plan import build_plan, plan_ops, region_id, split_region_id


def _runtime_miniatures(root: Path) -> dict[str, Path]:
    from tests.runtime import parity_table as P

    return {name: P.build(f, root)[0] for name, f in P.FAMILIES.items()}


def _family_miniatures(root: Path) -> dict[str, Path]:
    from tests.runtime import parity_table as P
    from tests.families import deepseek_v3_support as DS
    from tests.families import kimi_linear_support as KL
    from tests.families import latent_support as S
    from tests.families import qwen3_moe_support as QM
    from tests.families import qwen3_next_support as Q
    from tests.families import test_hybrid as HY

    out = {
        "kimi_linear-dense": S.build(root / "kimi-dense", "kimi_linear", KL.DENSE, seed=11),
        "kimi_linear-moe": S.build(root / "kimi-moe", "kimi_linear", KL.MOE, seed=12),
        "deepseek_v3-moe": S.build(root / "dsv3-moe", "deepseek_v3", DS.MOE, seed=22),
        "deepseek_v3-direct": S.build(root / "dsv3-direct", "deepseek_v3", DS.DIRECT, seed=23),
        "qwen3_next-moe": Q.build(root / "qwen3_next-moe", Q.MOE, seed=4),
        "qwen3_moe": P.build(QM.FAMILY, root)[0],
    }
    out["hybrid"] = HY.write_container(HY.Oracle(seed=31), root / "hybrid")
    return out


def _plan_of(path: Path):
    from vxc.driver import load, run

    ctx = run(load(path), "verify,bind,closure,state,plan")
    return ctx.plan


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("lowering_registry")
    torch.manual_seed(0)
    out = {name: _plan_of(p) for name, p in {**_runtime_miniatures(root), **_family_miniatures(root)}.items()}
    for f in sorted(Path(GOLDEN).glob("*/*.vxir")):
        if "closure" not in f.name:  # the state dumps carry the regions the plan needs
            out[f"{f.parent.name}/{f.stem}"] = build_plan(parse(f.read_text()))
    return out


def test_every_declared_operator_kind_has_a_lowering():
    missing = [k for k in OPERATORS if k not in LOWERINGS]
    assert not missing, f"declared operator kinds without a registered lowering: {missing}"


def test_every_plan_op_kind_lowers_and_every_kind_is_exercised(plans):
    seen = {p.kind for g in plans.values() for p in plan_ops(g)}
    assert seen <= set(LOWERINGS)
    # every operator kind is lowered by at least one miniature or witness (norms appear as add_rmsnorm/rmsnorm)
    assert set(OPERATORS) - {"rmsnorm"} <= seen and {"add_rmsnorm", "rmsnorm"} & seen


def test_every_emitted_kernel_exists_as_a_torch_op(plans):
    emitted: dict[str, str] = {}
    for name, g in plans.items():
        for v in VARIANTS:
            for c in lower_plan(g, v).groups():
                emitted.setdefault(c.kernel, f"{name} ({v})")
    missing = {k: where for k, where in emitted.items() if not hasattr(torch.ops.vxc, k)}
    assert not missing, f"kernels emitted by a lowering but not registered as torch.ops.vxc.*: {missing}"
    assert {"linear", "add_rmsnorm", "attention", "ssd_step", "kda_step", "mla_decode", "moe_experts"} <= set(emitted)


def test_lowerings_read_the_declarations_derived_geometry(plans, monkeypatch):
    """Shift every derived value in the declarations: the lowered glue must carry the shifted values,
    so no lowering re-derives the geometry from the attributes itself."""
    shift = 100_003
    derived_kinds = [k for k, d in OPERATORS.items() if d.derive is not None]
    assert {"mamba2", "conv_qkv", "softmax", "gated_delta", "kda", "mla"} <= set(derived_kinds)
    for kind in derived_kinds:
        real = OPERATORS[kind].derive
        monkeypatch.setitem(OPERATORS, kind, dataclasses.replace(
            OPERATORS[kind], derive=lambda a, real=real: {k: v + shift for k, v in real(a).items()}))
    checked: set[tuple[str, str]] = set()
    for g in plans.values():
        ints: dict[str, set[int]] = {}  # plan op → the integers its glue reads, over every variant
        for v in VARIANTS:
            for c in lower_plan(g, v).calls:
                if c.glue is not None:
                    ints.setdefault(c.plan_op, set()).update(_ints(c.args))
        for p in plan_ops(g):
            for key, value in p.derived.items():
                assert value in ints.get(p.id, set()), f"{p.id}: the lowering does not use the declared {key}"
                checked.add((p.kind, key))
    assert {k for k, _ in checked} == set(derived_kinds)


def test_derived_geometry_matches_the_bound_shapes(plans):
    """What the declarations derive is what the shape contracts (and so the bound weights) say."""
    width = {("mamba2", "conv_dim"): "Mamba2Conv1d",
             ("conv_qkv", "qkv_rows"): "ConvQkvConv1d", ("gated_delta", "conv_dim"): "LinearAttnConv1d",
             ("kda", "channels"): "KdaQConv1d", ("softmax", "q_dim"): "AttnQ", ("conv_qkv", "q_dim"): "ConvQkvOutProj",
             ("mla", "o_dim"): "MlaOutProj"}
    seen = set()
    for g in plans.values():
        for p in plan_ops(g):
            for (kind, key), role in width.items():
                if p.kind == kind:
                    o = next(o for r, o in p.operands.items() if r == role)
                    dim = o.shape[1] if role.endswith("OutProj") else o.shape[0]
                    assert p.derived[key] == dim, (p.id, key)
                    seen.add((kind, key))
    assert seen == set(width)


def test_region_id_round_trips(plans):
    from vxc.runtime.state import StateProvider

    assert split_region_id(region_id("L3.mamba2", "conv")) == ("L3.mamba2", "conv")
    assert split_region_id(region_id("L0.a.state.b", "kv")) == ("L0.a.state.b", "kv")  # the last separator splits
    for bad in ("L0.mamba2", ".state.conv", "L0.mamba2.state."):
        with pytest.raises(ValueError):
            split_region_id(bad)
    for name, g in plans.items():
        states = [n for n, d in g.nodes(data=True) if d["type"] == "state"]
        owners = {p.id: {r.name for r in p.regions} for p in plan_ops(g)}
        for rid in states:
            op_id, region = split_region_id(rid)
            assert region in owners[op_id] and region_id(op_id, region) == rid == StateRef(op_id, region).id, (name, rid)
        if not name.startswith("test_") and states:  # the miniatures: the state buffers are keyed the same way
            st = StateProvider().allocate(g, torch.float32, 4)
            assert sorted(st.buffers) == sorted(states), name


def _ints(args) -> list[int]:
    out = []
    for a in args:
        if isinstance(a, list):
            out += _ints(a)
        elif isinstance(a, int) and not isinstance(a, bool):
            out.append(a)
    return out
