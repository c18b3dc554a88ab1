"""``vxc quantize MODEL -o OUT.vxir --scheme q8_0|q4_0|q4_1 [--keep ROLE ...]``: data preparation, not execution.

Every operand whose role the operator declarations mark ``quantise=True`` (a projection, the embedding / head
table: ``vxc.ir.operators.decl.RoleSpec``) is encoded in the scheme's ggml block format, bit-exact with
``gguf.quants.quantize`` (``vxc.runtime.ggml_blocks.quantize``), unless ``--keep`` names its role or its rows
are not whole blocks (reported, kept). Every other operand keeps its stored dtype. The output is
self-contained: one safetensors file beside OUT.vxir (``OUT.safetensors``) holding each operand's logical
tensor (views applied; encoded ones as uint8 ``[rows, row_bytes]`` blocks) and the IR declaring them
(``operand %l0.AttnQ f32[576,576] = q8_0(blocks $t3) ...``), with the scheme recorded as a fact. The new module
runs verify, bind, closure and state before anything is written; both files are written atomically and a
failure leaves neither behind.

Family-agnostic: roles and declarations only. Refused by name: expert banks and already-encoded operands
(not handled yet), an unknown scheme or role.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .ir.diagnostics import VxcError
from .ir.ggml import encoding
from .ir.module import Fact, FileEntry, Module, Operand, Tensor
from .ir.operators import OPERATORS

SCHEMES = ("q8_0", "q4_0", "q4_1")


class QuantizeError(VxcError):
    pass


def quantisable_roles() -> set[str]:
    """The roles an operator declaration marks ``quantise=True``."""
    return {spec.name for decl in OPERATORS.values() for spec in decl.roles if spec.name and spec.quantise}


@dataclass
class Report:
    scheme: str
    encoded: list[str] = field(default_factory=list)  # operand syms
    kept: list[tuple[str, str]] = field(default_factory=list)  # (operand sym, why)
    bytes_before: int = 0
    bytes_after: int = 0


def _check(m: Module, scheme: str, keep: list[str]) -> set[str]:
    from .ir.roles import Role

    if scheme not in SCHEMES:
        raise QuantizeError(f"unknown scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    names = {str(r) for r in Role}
    bad = [k for k in keep if k not in names]
    if bad:
        raise QuantizeError(f"--keep {', '.join(bad)}: not a role; roles: {', '.join(sorted(names))}")
    tensors = m.tensor_table()
    problems = []
    for o in m.operands:
        if o.encoding is not None:
            problems.append(f"operand %{o.sym} is already encoded ({o.encoding})")
        elif any(tensors[s].is_bank for s in o.sources):
            problems.append(f"operand %{o.sym} reads an expert bank")
    if problems:
        raise QuantizeError(f"vxc quantize does not handle {len(problems)} operand(s) yet:\n"
                            + "\n".join(f"  - {p}" for p in problems))
    return quantisable_roles() - set(keep)


def quantize_module(m: Module, model_dir: Path, out_ir: Path, scheme: str, keep: list[str]) -> tuple[Module, dict, Report]:
    """The quantised module (not yet written), its tensors by key, and what was done."""
    from .runtime.ggml_blocks import quantize
    from .runtime.weights import TORCH_DTYPES, Weights

    roles = _check(m, scheme, keep)
    block = encoding(scheme).block_size
    weights = Weights(m, Path(model_dir))
    rep = Report(scheme)
    out_tensors: dict[str, torch.Tensor] = {}
    tensors: list[Tensor] = []
    operands: list[Operand] = []
    for i, o in enumerate(m.operands):
        tsym, key = f"t{i}", o.sym
        want = str(o.role) in roles
        why = None
        if want and (len(o.shape) != 2 or o.shape[-1] % block):
            why = f"rows of {o.shape[-1]} values are not whole {block}-value blocks" if len(o.shape) == 2 else \
                f"not a matrix ({list(o.shape)})"
        if want and why is None:
            w = weights.operand(o, torch.float32, "cpu")
            b = quantize(scheme, w.contiguous()).contiguous()
            out_tensors[key] = b
            tensors.append(Tensor(tsym, "u8", tuple(b.shape), key, file="w0"))
            operands.append(Operand(o.sym, "f32", o.shape, [tsym], o.role, layer=o.layer, encoding=scheme,
                                    part_names=["blocks"]))
            rep.encoded.append(o.sym)
            rep.bytes_before += w.numel() * TORCH_DTYPES[o.dtype].itemsize
            rep.bytes_after += b.numel()
        else:
            if want:
                rep.kept.append((o.sym, why))
            t = weights.operand(o, TORCH_DTYPES[o.dtype], "cpu").contiguous()
            out_tensors[key] = t
            tensors.append(Tensor(tsym, o.dtype, tuple(t.shape), key, file="w0"))
            operands.append(Operand(o.sym, o.dtype, o.shape, [tsym], o.role, layer=o.layer))
            rep.bytes_before += t.numel() * t.element_size()
            rep.bytes_after += t.numel() * t.element_size()
    q = copy.deepcopy(m)
    q.tensors, q.operands, q.index = tensors, operands, None
    q.source.model_dir = "."
    kept = f"; kept by --keep: {', '.join(keep)}" if keep else ""
    q.facts.append(Fact("quantized", scheme, f"vxc quantize --scheme {scheme}: {len(rep.encoded)} operands of roles "
                        f"declared quantise=True encoded (bit-exact with gguf.quants.quantize){kept}"))
    q.files = [FileEntry("w0", out_ir.with_suffix(".safetensors").name, 0, "")]
    return q, out_tensors, rep


def quantize_to_file(src: Path, out_ir: Path, scheme: str, keep: list[str]) -> Report:
    """Quantise the model at ``src`` (a .vxir, a model directory or a GGUF file) into ``out_ir`` and the
    safetensors file beside it. Both are written to temporary files and renamed into place only once the new
    module has passed verify, bind, closure and state: on any failure nothing is left behind and files already
    at those paths are untouched."""
    import os

    from .driver import load, run, save_safetensors_atomic, write_atomic
    from .frontends.common import _read_header
    from .ir.printer import print_module
    from .passes.context import Context

    out_ir = Path(out_ir)
    st = out_ir.with_suffix(".safetensors")
    if st.resolve() == Path(src).resolve() or out_ir.resolve() == Path(src).resolve():
        raise QuantizeError(f"{out_ir}: the output would overwrite the input")
    ctx = run(load(src), "verify,bind,closure", emit=lambda s: None)
    q, tensors, rep = quantize_module(ctx.module, ctx.model_dir, out_ir, scheme, keep)
    tmp_st, tmp_ir = st.with_name(f".{st.name}.part"), out_ir.with_name(f".{out_ir.name}.part")
    try:
        save_safetensors_atomic(tmp_st, tensors, {"vxc_quantized": scheme})
        _, size, digest = _read_header(tmp_st, st.name)
        # checked against the temporary file, then declared under its final name (same bytes, size, digest)
        q.files = [FileEntry("w0", tmp_st.name, size, digest)]
        checked = run(Context(q, model_dir=out_ir.resolve().parent), "verify,bind,closure,state", emit=lambda s: None)
        checked.module.files[0].path = st.name
        write_atomic(tmp_ir, print_module(checked.module))
        os.replace(tmp_st, st)
        os.replace(tmp_ir, out_ir)
    finally:
        tmp_st.unlink(missing_ok=True)
        tmp_ir.unlink(missing_ok=True)
    return rep
