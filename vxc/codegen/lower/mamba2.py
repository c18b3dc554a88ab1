"""Lowering of the ``mamba2`` mixer: in_proj, the causal conv + SiLU + conv-state write, the selective
scan (chunked SSD in prefill, one state step in decode), the gated grouped rmsnorm (or, declared without it,
the plain gate y·act(z)), and out_proj; in_proj's segments times their declared scales when declared."""

from __future__ import annotations

from ...ir.operators.mamba2 import SEGMENTS
from ...ir.roles import Role
from ...passes.plan import PlanOp
from .emitter import Emitter, StateRef, Val, lowering, weight


@lowering("mamba2")
def lower_mamba2(e: Emitter, p: PlanOp, x: Val) -> Val:
    a, d = p.attrs, p.derived
    di, H, P, N, G = a["d_inner"], a["heads"], a["head_dim"], a["state_size"], a["groups"]
    conv_dim, bc = d["conv_dim"], d["bc_dim"]
    (zxbcdt,) = e.kernel(p, "linear", [x, weight(p, Role.Mamba2InProj), weight(p, Role.Mamba2InProjBias)], "in_proj")
    if "z_scale" in a:  # the declared multipliers of in_proj's five segments
        scales = [a[f"{seg}_scale"] for seg in SEGMENTS]
        (zxbcdt,) = e.kernel(p, "scale_segments", [zxbcdt, [di, di, bc, bc, H], scales],
                             "z | x | B | C | dt segments · " + ", ".join(f"{s:g}" for s in scales))
    z, xbc, dt = e.glue(p, "split", [zxbcdt, [di, conv_dim, H], -1], 3)
    conv_state, ssm_state = StateRef(p.id, "conv"), StateRef(p.id, "ssm")
    w_conv, b_conv = weight(p, Role.Mamba2Conv1d), weight(p, Role.Mamba2Conv1dBias)
    a_log, skip, dt_bias = weight(p, Role.Mamba2ALog), weight(p, Role.Mamba2D), weight(p, Role.Mamba2DtBias)
    if e.decode:
        (xbc1,) = e.glue(p, "reshape", [xbc, [conv_dim]])
        (xbc2,) = e.kernel(p, "conv1d_step", [xbc1, w_conv, b_conv, "silu", conv_state], "conv + silu + conv-state roll/write")
        xs, B, C = e.glue(p, "split", [xbc2, [di, bc, bc], -1], 3)
        (xh,) = e.glue(p, "reshape", [xs, [H, P]])
        (Bh,) = e.glue(p, "reshape", [B, [G, N]])
        (Ch,) = e.glue(p, "reshape", [C, [G, N]])
        (dt1,) = e.glue(p, "reshape", [dt, [H]])
        (y,) = e.kernel(p, "ssd_step", [xh, dt1, a_log, Bh, Ch, skip, dt_bias, a["dt_min"], a["dt_max"], ssm_state],
                        "softplus(dt) + state update + readout + D skip")
    else:
        (xbc2,) = e.kernel(p, "conv1d_prefill", [xbc, w_conv, b_conv, "silu", conv_state], "causal conv + silu + conv-state write")
        xs, B, C = e.glue(p, "split", [xbc2, [di, bc, bc], -1], 3)
        (xh,) = e.glue(p, "reshape", [xs, [-1, H, P]])
        (Bh,) = e.glue(p, "reshape", [B, [-1, G, N]])
        (Ch,) = e.glue(p, "reshape", [C, [-1, G, N]])
        (y,) = e.kernel(p, "ssd_prefill", [xh, dt, a_log, Bh, Ch, skip, dt_bias, a["dt_min"], a["dt_max"], ssm_state, a["chunk_size"]],
                        "softplus(dt) + chunked SSD scan + D skip + final-state write")
    (y2,) = e.glue(p, "reshape", [y, [-1, di]])
    (z2,) = e.glue(p, "reshape", [z, [-1, di]])
    if a.get("gated_norm") is False:
        (yn,) = e.kernel(p, "gated_act", [z2, y2, a["norm_act"]], f"y · {a['norm_act']}(z) (no norm)")
    elif "norm_ranks" in a:  # one RMS group over the ranks' d_inner (tensor parallel): its sum of squares all-reduced
        nr, before = a["norm_ranks"], a["norm_order"] == "norm_then_gate"
        (ss,) = e.kernel(p, "gated_rms_sumsq", [y2, z2, before, a["norm_act"]], "this rank's sum of squares of the group")
        (ss,) = e.kernel(p, "all_reduce", [ss, nr], f"the group's sum of squares over {nr} ranks")
        (yn,) = e.kernel(p, "gated_rmsnorm_total", [y2, z2, weight(p, Role.Mamba2GatedNorm), ss, a["norm_group"] * nr,
                                                     a["norm_eps"], before, a["norm_act"]], "gate + rmsnorm of the whole group")
    else:
        (yn,) = e.kernel(p, "gated_rmsnorm", [y2, z2, weight(p, Role.Mamba2GatedNorm), a["norm_eps"], a["norm_group"],
                                               a["norm_order"] == "norm_then_gate", a["norm_act"]], "gate + grouped rmsnorm")
    (out,) = e.kernel(p, "linear", [yn, weight(p, Role.Mamba2OutProj), weight(p, Role.Mamba2OutProjBias)], "out_proj")
    return out
