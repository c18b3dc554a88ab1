"""The batched decode step: one token for each of B sequences, each in its own state slot at its own position.

It is generated from the ``prefill`` lowering (every value keeps its leading token dimension; here row b is
sequence b's one token), with three differences made by :func:`build_batch_graph_module`:

* the placeholders are the B tokens, their positions (a list of ints and the same as an int64 tensor) and
  their state slots (a list of ints);
* a rotary table is read at each row's own position (``index_select`` instead of ``narrow``);
* a fused group that reads or writes a state region — the only kind of group through which rows of a prefill
  see each other — runs once per row (:func:`per_row`), on that row's slices, the region buffers of that row's
  slot and that row's position, as the kernel the single-sequence decode step runs for that group
  (:data:`STEP_FORMS`). Every other group (projections, norms, FFNs, MoE routing, the head) is row-wise and runs
  once over all B rows, so the weights are read once per step for the whole batch.

So each sequence's state evolves exactly as in its single-sequence decode (the same step kernel on the same
buffers); only the row-wise GEMMs see B rows instead of one.

The graph runs eagerly (never traced), so its groups call each kernel's dispatch (:meth:`Kernel._run`: the
same checks, backend selection and implementations as ``torch.ops.vxc.<kernel>``) directly, without the custom
op's wrapper: at batch 1 the wrapper cost about as much as the kernels of a 0.6B model's step.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import Tensor, fx

from .kernels.registry import NotCovered
from .lower import START, TOKENS, Lowered, RopeRef, StateRef, Val, Weight

# prefill kernel of a stateful group -> (the kernel the decode step runs for it, whether the decode step drops the
# token dimension of its per-row operands (and returns the row without it), how many trailing arguments the
# prefill form has that the step form does not (the chunk size of the chunked scans))
STEP_FORMS: dict[str, tuple[str, bool, int]] = {
    "attention": ("attention", False, 0),
    "mla_prefill": ("mla_decode", False, 0),
    "conv1d_prefill": ("conv1d_step", True, 0),
    "ssd_prefill": ("ssd_step", True, 1),
    "gated_delta_prefill": ("gated_delta_step", True, 1),
    "kda_prefill": ("kda_step", True, 1),
}

ROW, SLOT, POS, CONST = "row", "slot", "pos", "const"


class BatchUnsupported(Exception):
    pass


def _rows_forms() -> dict:
    """step kernel -> its native form over all B rows at once (``kernels.*.<name>_rows_native``), with an adapter
    from the per-row argument list (row tensors [B, ...], state buffers [S, ...])."""
    from .kernels import attention, conv, delta, mla, ssd
    from .kernels import native as N

    def conv_rows(a, slots_t, pos_t):
        x, w, b, act, states = a
        return conv.conv1d_step_rows_native(N.dense_rows(x), w, b, act, states, slots_t)

    def ssd_rows(a, slots_t, pos_t):
        x, dt, A_log, B, C, D, dt_bias, dt_min, dt_max, states = a
        return ssd.ssd_step_rows_native(N.dense_rows(x), N.dense_rows(dt), A_log, N.dense_rows(B), N.dense_rows(C), D,
                                        dt_bias, dt_min, dt_max, states, slots_t)

    def attention_rows(a, slots_t, pos_t):
        q, k, v, kv, kv2, _, scale, window, sinks = (list(a) + [0, None])[:9]
        if kv is not kv2:
            raise NotCovered("K and V rows in different buffers")
        return attention.attention_rows_native(N.dense_rows(q), N.dense_rows(k), N.dense_rows(v), kv, pos_t, scale,
                                               window or 0, sinks, slots_t)

    def delta_rows(kda):
        def rows(a, slots_t, pos_t):
            q, k, v, g, b, A_log, dt_bias, states, scale, l2_eps = a
            return delta.delta_step_rows_native(kda, N.dense_rows(q), N.dense_rows(k), N.dense_rows(v), N.dense_rows(g),
                                                N.dense_rows(b), A_log, dt_bias, states, scale, l2_eps, slots_t)
        return rows

    def mla_rows(a, slots_t, pos_t):
        q, kv, norm_w, eps, w_kvb, cos, sin, caches, _, scale, nope, interleaved, split_out = a
        return mla.mla_decode_rows_native(N.dense_rows(q), N.dense_rows(kv), norm_w, eps, w_kvb, cos, sin, caches,
                                          pos_t, scale, nope, interleaved, split_out, slots_t)

    return {"conv1d_step": conv_rows, "ssd_step": ssd_rows, "attention": attention_rows,
            "gated_delta_step": delta_rows(False), "kda_step": delta_rows(True), "mla_decode": mla_rows}


_ROWS: dict | None = None


def per_row(kernel: str, spec: tuple, args: tuple, slots: list[int], positions: list[int],
            slots_t: Tensor | None = None, positions_t: Tensor | None = None) -> Tensor:
    """Run the stateful group ``kernel`` (its prefill name) once per row, in the form the decode step runs it.

    ``spec[i]`` says what ``args[i]`` is: ``row`` (a tensor whose dim 0 is the batch row), ``slot`` (a state
    region buffer ``[S, ...]``, with the K/V part to take when ``spec[i]`` is ``("slot", part)``), ``pos`` (the
    row's position), or ``const``. Where the native backend is selected and the step has a native form over all
    rows (conv, SSD and attention steps), that form runs: one native call that runs each row's single-row step.
    """
    global _ROWS
    step, squeeze, drop = STEP_FORMS[kernel]
    n = len(args) - drop
    if slots_t is not None:
        from .kernels.registry import NotCovered as _NC, select

        if _ROWS is None:
            _ROWS = _rows_forms()
        rows_fn = _ROWS.get(step)
        first = next(a for s, a in zip(spec, args) if s == ROW)
        if rows_fn is not None and select(first) == "native":
            try:
                return rows_fn(args[:n], slots_t, positions_t)
            except _NC:
                pass
    fn = direct(step)
    # the row loop takes each row's slot and position from the Python lists: a captured batched step (which reads
    # them only through the step's int64 buffers) cannot repeat it for another set of slots
    from .kernels import native as N

    N.refuse_capture(f"vxc.{step} runs row by row (no native form over all rows)")
    outs = []
    for b, (slot, pos) in enumerate(zip(slots, positions)):
        row_args = []
        for s, a in zip(spec[:n], args[:n]):
            if s == ROW:
                row_args.append(a[b] if squeeze else a[b:b + 1])
            elif s == POS:
                row_args.append(pos)
            elif isinstance(s, tuple):  # a state region: this row's slot (and its K or V rows)
                buf = a[slot]
                row_args.append(buf if s[1] is None else buf[s[1]])
            else:
                row_args.append(a)
        y = fn(*row_args)
        outs.append(y.unsqueeze(0) if squeeze else y)
    return outs[0] if len(outs) == 1 else torch.cat(outs, 0)


def table_rows(table: Tensor, index: Tensor) -> Tensor:
    """Rows ``index`` (int64 [B]) of a rotary table: the native embedding gather (a recorded call) where the native
    backend runs and covers the operands, else ``index_select`` (both copy the rows exactly)."""
    from .kernels.dense import embedding_native
    from .kernels.registry import select

    if select(table) == "native":
        try:
            return embedding_native(index, table)
        except NotCovered:
            pass
    return torch.index_select(table, 0, index)


def direct(kernel: str):
    """The dispatch of ``torch.ops.vxc.<kernel>`` without the custom op's wrapper (eager use only)."""
    from .kernels.registry import KERNELS

    return KERNELS[kernel]._run


def build_batch_graph_module(lw: Lowered, root: torch.nn.Module, buffer_name) -> fx.GraphModule:
    """The batched decode step as an fx graph over ``root``'s buffers (state buffers: all slots, ``[S, ...]``).
    Placeholders: ``tokens`` (int64 [B]), ``positions`` (list of B ints), ``positions_t`` (the same, int64 [B]),
    ``slots`` (list of B ints), ``slots_t`` (the same, int64 [B])."""
    if lw.variant != "prefill":
        raise BatchUnsupported(f"the batched decode step is generated from the prefill lowering, not {lw.variant}")
    g = fx.Graph()
    env: dict[str, fx.Node] = {TOKENS.name: g.placeholder("tokens")}
    positions, positions_t, slots = g.placeholder("positions"), g.placeholder("positions_t"), g.placeholder("slots")
    slots_t = g.placeholder("slots_t")
    attrs: dict[str, fx.Node] = {}
    rope_rows: dict[str, fx.Node] = {}

    def get(name: str) -> fx.Node:
        if name not in attrs:
            attrs[name] = g.get_attr(name)
        return attrs[name]

    def rope(a: RopeRef) -> fx.Node:
        name = buffer_name(a)
        if name not in rope_rows:
            rope_rows[name] = g.call_function(table_rows, (get(name), positions_t))
        return rope_rows[name]

    def plain(a: Any) -> Any:
        if isinstance(a, Val):
            if a is START or a.name == START.name:
                raise BatchUnsupported("a group reads the position but no state region: not row-wise")
            return env[a.name]
        if isinstance(a, Weight):
            return get(buffer_name(a))
        if isinstance(a, RopeRef):
            return rope(a)
        if isinstance(a, StateRef):
            raise BatchUnsupported("state outside a stateful group")
        return list(a) if isinstance(a, list) else a

    for c in lw.calls:
        stateful = c.kernel is not None and any(isinstance(a, StateRef) for a in c.args)
        if stateful:
            if c.kernel not in STEP_FORMS:
                raise BatchUnsupported(f"{c.plan_op}: stateful group vxc.{c.kernel} has no decode-step form")
            spec, args = [], []
            for a in c.args:
                if isinstance(a, StateRef):
                    spec.append((SLOT, a.part))
                    args.append(get(buffer_name(StateRef(a.op_id, a.region))))
                elif isinstance(a, Val) and a.name == START.name:
                    spec.append(POS)
                    args.append(None)
                elif isinstance(a, Val) or isinstance(a, RopeRef):
                    spec.append(ROW)
                    args.append(plain(a))
                else:
                    spec.append(CONST)
                    args.append(plain(a))
            node = g.call_function(per_row, (c.kernel, tuple(spec), tuple(args), slots, positions, slots_t, positions_t))
        elif c.kernel is not None:
            node = g.call_function(direct(c.kernel), tuple(plain(a) for a in c.args))
        else:
            node = g.call_method(c.glue, tuple(plain(a) for a in c.args))
        if len(c.outs) == 1:
            env[c.outs[0]] = node
        else:
            if stateful:
                raise BatchUnsupported(f"{c.plan_op}: stateful group vxc.{c.kernel} has {len(c.outs)} outputs")
            for i, o in enumerate(c.outs):
                env[o] = g.call_function(operator.getitem, (node, i))
    g.output(env[lw.output])
    g.lint()
    return fx.GraphModule(root, g, class_name="vxc_decode_batch")
