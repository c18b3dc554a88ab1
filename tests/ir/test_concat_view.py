"""``concat DIM (part, part, …)`` operands: several stored tensors, each through its own view, joined along one dim
(a container that stores one logical matrix as several tensors: GGUF's latent-attention ``attn_k_b`` transposed and
``attn_v_b``). Shapes (vxc.ir.views), the text form (parse / print, diagnostics), the bind pass's refusals and the
runtime's read (vxc.runtime.weights) — expected values written by hand or by explicit numpy indexing."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
import torch

from vxc.ir.diagnostics import IRSyntaxError
from vxc.ir.module import Operand, Tensor, Transform
from vxc.ir.parser import parse
from vxc.ir.printer import print_module
from vxc.ir.roles import Role
from vxc.ir.views import ViewError, concat_shape, operand_shape


def test_concat_shape_by_hand():
    assert concat_shape([(2, 3, 4), (2, 5, 4)], 1) == (2, 8, 4)
    assert concat_shape([(3,), (1,), (2,)], 0) == (6,)
    assert concat_shape([(2, 3)], 1) == (2, 3)


@pytest.mark.parametrize("shapes,dim,message", [
    ([(2, 3, 4), (2, 5)], 1, "part 1 [2,5] does not fit part 0 [2,3,4]"),
    ([(2, 3, 4), (3, 5, 4)], 1, "part 1 [3,5,4] does not fit part 0 [2,3,4]"),
    ([(2, 3)], 2, "concat dim 2 is out of range for rank 2"),
    ([], 0, "concat needs at least one part"),
])
def test_concat_shape_errors(shapes, dim, message):
    with pytest.raises(ViewError, match=message.replace("[", r"\[").replace("]", r"\]")):
        concat_shape(shapes, dim)


def _kv_operand(kb_shape=(2, 6, 3), vb_shape=(2, 4, 6)):
    tensors = {"kb": Tensor("kb", "f32", kb_shape, "k_b"), "vb": Tensor("vb", "f32", vb_shape, "v_b")}
    parts = [Operand("o#0", "f32", (), ["kb"], Role.MlaKvBProj, transforms=[Transform("transpose", dim=1, dim2=2)]),
             Operand("o#1", "f32", (), ["vb"], Role.MlaKvBProj)]
    o = Operand("o", "f32", (14, 6), ["kb", "vb"], Role.MlaKvBProj, concat_dim=1, parts=parts,
                transforms=[Transform("reshape", shape=(14, 6))])
    return o, tensors


def test_operand_shape_through_parts():
    # k_b [H=2, R=6, N=3] -> transpose -> [2, 3, 6]; v_b [2, V=4, 6]; concat 1 -> [2, 7, 6]; reshape [14, 6]
    o, tensors = _kv_operand()
    assert operand_shape(o, tensors) == (14, 6)
    bad, tensors = _kv_operand(vb_shape=(2, 4, 5))
    with pytest.raises(ViewError, match=r"concat 1: part 1 \[2,4,5\] does not fit part 0 \[2,3,6\]"):
        operand_shape(bad, tensors)


TEXT = """\
vindex3 schema 6
module "cat" {{
  source frontend "f" dialect "d" model_dir "." config_sha256 "abc"
  compute f32
  file @w0 "model.safetensors" size {size} header_sha256 "{sha}"

  tensor $emb f32[8,4] @w0 "embed.weight"
  tensor $kb f32[2,6,3] @w0 "k_b.weight"
  tensor $vb f32[2,4,6] @w0 "v_b.weight"

  operand %emb f32[8,4] = $emb role Embedding
  operand %kvb f32[14,6] = concat 1 ($kb | transpose 1 2, $vb) | reshape [14,6] layer 0 role MlaKvBProj

  embedding embedding vocab=8 padded_vocab=8 dim=4
  layer 0 {{
    residual fp32
    placement PreOnly
    norm PreAttentionNorm rmsnorm dim=4 eps=1e-05 zero_centred=false
    mixer softmax heads=1 kv_heads=1 head_dim=4 window=0 scale=0.5 (default)
  }}
  final_norm FinalNorm rmsnorm dim=4 eps=1e-05 zero_centred=false
  head head tied=true padded_vocab=8 dim=4
}}
"""


def test_text_round_trip_and_parts():
    text = TEXT.format(size=1, sha="00")
    m = parse(text, "cat.vxir")
    assert print_module(m) == text
    o = m.operand_table()["kvb"]
    assert o.concat_dim == 1 and o.sources == ["kb", "vb"] and o.encoding is None
    assert [p.sources for p in o.parts] == [["kb"], ["vb"]]
    assert [[(t.kind, t.dim, t.dim2) for t in p.transforms] for p in o.parts] == [[("transpose", 1, 2)], []]
    assert [(t.kind, t.shape) for t in o.transforms] == [("reshape", (14, 6))]
    assert operand_shape(o, m.tensor_table()) == (14, 6)


@pytest.mark.parametrize("old,new,col,message", [
    ("$vb) | reshape", "$vb | reshape", 80, "unexpected LAYER"),  # no closing parenthesis: the view runs on
    ("concat 1 (", "concat (", 35, "unexpected"),  # no dim
    ("concat 1 ($kb", "concat 1 (%kb", 38, "unexpected OSYM"),  # an operand symbol is not a stored tensor
])
def test_malformed_concat_points_at_the_spot(old, new, col, message):
    text = TEXT.format(size=1, sha="00").replace(old, new)
    with pytest.raises(IRSyntaxError) as info:
        parse(text, "cat.vxir")
    first, line, caret = str(info.value).split("\n")[:3]
    assert first.startswith(f"cat.vxir:12:{col}: error: ") and message in first, first
    assert caret == "  " + " " * (col - 1) + "^"


def _safetensors(path, tensors: dict[str, np.ndarray]) -> tuple[int, str]:
    """A safetensors file written by hand (f32, in key order); returns (size, header sha256)."""
    header, blobs, off = {}, [], 0
    for k, a in tensors.items():
        b = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[k] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    data = struct.pack("<Q", len(h)) + h + b"".join(blobs)
    path.write_bytes(data)
    return len(data), hashlib.sha256(h).hexdigest()


def test_weights_read_the_concatenation(tmp_path):
    from vxc.runtime.weights import Weights

    rng = np.random.default_rng(0)
    kb, vb = rng.standard_normal((2, 6, 3)).astype(np.float32), rng.standard_normal((2, 4, 6)).astype(np.float32)
    size, sha = _safetensors(tmp_path / "model.safetensors",
                             {"embed.weight": np.zeros((8, 4), np.float32), "k_b.weight": kb, "v_b.weight": vb})
    m = parse(TEXT.format(size=size, sha=sha), "cat.vxir")
    w = Weights(m, tmp_path)
    got = w.operand(m.operand_table()["kvb"], torch.float32, "cpu")
    # row h*7 + j: j < 3 is k_b[h, :, j] (the transposed key rows), else v_b[h, j - 3, :]
    want = np.zeros((14, 6), np.float32)
    for h in range(2):
        for j in range(7):
            want[h * 7 + j] = kb[h, :, j] if j < 3 else vb[h, j - 3, :]
    assert torch.equal(got, torch.from_numpy(want))
    assert w.operand(m.operand_table()["kvb"], torch.bfloat16, "cpu").dtype == torch.bfloat16


def test_bind_refuses_parts_that_do_not_fit():
    from vxc.passes.bind import Bind
    from vxc.passes.context import Context

    text = TEXT.format(size=1, sha="00").replace("$vb f32[2,4,6]", "$vb f32[2,4,5]")
    m = parse(text, "cat.vxir")
    findings = [f for f in Bind().run(Context(m)) if f.code == "bad-view"]
    assert len(findings) == 1 and "concat 1: part 1 [2,4,5] does not fit part 0 [2,3,6]" in findings[0].message, findings
