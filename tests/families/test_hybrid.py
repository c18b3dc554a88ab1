"""The three-state-kind hybrid: one stack with a KDA layer (fixed recurrent matrix + conv histories), an
MLA layer (growing latent rows), a plain softmax layer (growing K/V rows) and another KDA layer.

The IR is a public interface: this test writes the safetensors (under opaque keys of its own) and the
``.vxir`` text itself, then executes it and checks the logits against a composite oracle assembled from
the references' own layer modules — transformers 5.24's ``KimiLinearDeltaAttention`` (KDA),
``DeepseekV3Attention`` (MLA with q-LoRA and interleaved rotary), ``LlamaAttention`` (GQA softmax with
half rotary), with ``LlamaRMSNorm`` / ``LlamaMLP`` around them — at the numerical floor (VINDEX3.md), and
that describe reports all three region species.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path

import pytest
import torch
from torch import nn

from tests import references as R
from tests.families import latent_support as S

# Geometry, written out: hidden 40, vocab 97, SwiGLU ffn 56, rmsnorm eps 1e-5.
#   layers 0, 3 KDA: 2 heads × 12 (C = 24), short conv 3        → matrix [2,12,12] f32, histories [24,3] ×3
#   layer 1 MLA: 3 heads, q-LoRA 22, kv_lora 18, nope 10, rope 8, v 14, rotary interleaved (theta 1000)
#                                                                → latent row 18 + 8 = 26 per token
#   layer 2 softmax: 4 q heads, 2 kv heads × 10, rotary half over all 10 dims (theta 5000)
#                                                                → K/V rows [2, 2, 10] = 40 per token
D, VOCAB, FFN, EPS = 40, 97, 56, 1e-5
KDA_H, KDA_D, KDA_K = 2, 12, 3
MLA = dict(H=3, QL=22, KVL=18, N=10, P=8, V=14, THETA=1000.0)
ATT = dict(H=4, KV=2, HD=10, THETA=5000.0)
KINDS = ["kda", "mla", "softmax", "kda"]
PROMPT, SPLIT = 70, 41


# ---------------------------------------------------------------- the composite oracle


class Oracle(nn.Module):
    def __init__(self, seed: int):
        import transformers
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

        super().__init__()
        kimi = transformers.KimiLinearConfig(hidden_size=D, linear_head_dim=KDA_D, linear_num_heads=KDA_H,
                                             linear_conv_kernel_dim=KDA_K, rms_norm_eps=EPS, num_hidden_layers=4,
                                             layer_types=["linear_attention"] * 4, hidden_act="silu")
        ds = transformers.DeepseekV3Config(hidden_size=D, num_attention_heads=MLA["H"], num_key_value_heads=MLA["H"],
                                           q_lora_rank=MLA["QL"], kv_lora_rank=MLA["KVL"], qk_nope_head_dim=MLA["N"],
                                           qk_rope_head_dim=MLA["P"], v_head_dim=MLA["V"], rope_interleave=True,
                                           rope_parameters={"rope_type": "default", "rope_theta": MLA["THETA"]},
                                           max_position_embeddings=256, num_hidden_layers=4)
        llama = transformers.LlamaConfig(hidden_size=D, num_attention_heads=ATT["H"], num_key_value_heads=ATT["KV"],
                                         head_dim=ATT["HD"], intermediate_size=FFN, rms_norm_eps=EPS, attention_bias=False,
                                         rope_parameters={"rope_type": "default", "rope_theta": ATT["THETA"]},
                                         max_position_embeddings=256, num_hidden_layers=4, hidden_act="silu")
        for c in (ds, llama):
            c._attn_implementation = "eager"
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, D)
        self.mixers = nn.ModuleList([KimiLinearDeltaAttention(kimi, 0), DeepseekV3Attention(ds, 1), LlamaAttention(llama, 2),
                                     KimiLinearDeltaAttention(kimi, 3)])
        self.norm1 = nn.ModuleList([LlamaRMSNorm(D, EPS) for _ in KINDS])
        self.norm2 = nn.ModuleList([LlamaRMSNorm(D, EPS) for _ in KINDS])
        self.mlps = nn.ModuleList([LlamaMLP(llama) for _ in KINDS])
        self.final = LlamaRMSNorm(D, EPS)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.rope_mla, self.rope_att = DeepseekV3RotaryEmbedding(ds), LlamaRotaryEmbedding(llama)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("A_log"):
                    p.copy_(torch.empty(p.shape).uniform_(math.log(0.05), math.log(2.0), generator=g))
                elif name.endswith("dt_bias"):
                    p.copy_(0.5 * torch.randn(p.shape, generator=g))
                elif "norm" in name.split(".")[-2] or name.split(".")[0] in ("norm1", "norm2", "final"):
                    p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(0.25 * torch.randn(p.shape, generator=g))
        self.eval()

    @torch.no_grad()
    def forward(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids).reshape(1, -1)
        T = ids.shape[1]
        h = self.embed(ids)
        dt = h.dtype
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), -math.inf, dtype=dt).triu(1)[None, None]
        for i, kind in enumerate(KINDS):
            x = self.norm1[i](h)
            if kind == "kda":
                x = self.mixers[i](x)
            elif kind == "mla":
                x = self.mixers[i](x, self.rope_mla(x, pos), mask)[0]
            else:
                x = self.mixers[i](x, self.rope_att(x, pos), mask)[0]
            h = h + x
            h = h + self.mlps[i](self.norm2[i](h))
        return self.head(self.final(h))[0]


# ---------------------------------------------------------------- the container, written by hand


def _role_table(o: Oracle) -> list[tuple[str, int | None, torch.Tensor, list[str]]]:
    """(role, layer, stored tensor, view transforms) for every operand."""
    out = [("Embedding", None, o.embed.weight, []), ("FinalNorm", None, o.final.weight, []), ("LmHead", None, o.head.weight, [])]
    C = KDA_H * KDA_D
    for i, kind in enumerate(KINDS):
        m = o.mixers[i]
        out += [("PreAttentionNorm", i, o.norm1[i].weight, []), ("PreFfnNorm", i, o.norm2[i].weight, []),
                ("FfnGate", i, o.mlps[i].gate_proj.weight, []), ("FfnUp", i, o.mlps[i].up_proj.weight, []),
                ("FfnDown", i, o.mlps[i].down_proj.weight, [])]
        if kind == "kda":
            fg = m.forget_gate
            out += [("KdaQProj", i, m.q_proj.weight, []), ("KdaKProj", i, m.k_proj.weight, []), ("KdaVProj", i, m.v_proj.weight, []),
                    ("KdaFAProj", i, fg.f_a_proj.weight, []), ("KdaFBProj", i, fg.f_b_proj.weight, []),
                    ("KdaBProj", i, m.b_proj.weight, []), ("KdaGAProj", i, m.g_a_proj.weight, []),
                    ("KdaGBProj", i, m.g_b_proj.weight, []), ("KdaONorm", i, m.o_norm.weight, []),
                    ("KdaOutProj", i, m.o_proj.weight, []), ("KdaDtBias", i, fg.dt_bias, []),
                    ("KdaALog", i, fg.A_log, [f"reshape [{KDA_H}]"])]
            # one stored conv [3C, 1, k] (q | k | v channels) feeding three roles through views
            for j, role in enumerate(("KdaQConv1d", "KdaKConv1d", "KdaVConv1d")):
                out.append((role, i, m.conv1d.weight, [f"slice 0 [{j * C}:{(j + 1) * C}]", f"reshape [{C},{KDA_K}]"]))
        elif kind == "mla":
            out += [("MlaQAProj", i, m.q_a_proj.weight, []), ("MlaQANorm", i, m.q_a_layernorm.weight, []),
                    ("MlaQBProj", i, m.q_b_proj.weight, []), ("MlaKvAProj", i, m.kv_a_proj_with_mqa.weight, []),
                    ("MlaKvANorm", i, m.kv_a_layernorm.weight, []), ("MlaKvBProj", i, m.kv_b_proj.weight, []),
                    ("MlaOutProj", i, m.o_proj.weight, [])]
        else:
            out += [("AttnQ", i, m.q_proj.weight, []), ("AttnK", i, m.k_proj.weight, []), ("AttnV", i, m.v_proj.weight, []),
                    ("AttnO", i, m.o_proj.weight, [])]
    return out


def _mixer_line(kind: str) -> str:
    if kind == "kda":
        return (f"mixer kda d_model={D} heads={KDA_H} head_dim={KDA_D} conv_kernel={KDA_K} conv_act=silu norm_eps={EPS!r} "
                f"l2_eps=1e-06 scale={KDA_D ** -0.5!r} out_gate_act=sigmoid chunk_size=16")
    if kind == "mla":
        m = MLA
        return (f"mixer mla d_model={D} heads={m['H']} q_lora=true q_lora_rank={m['QL']} kv_lora_rank={m['KVL']} "
                f"qk_nope_head_dim={m['N']} qk_rope_head_dim={m['P']} v_head_dim={m['V']} norm_eps=1e-06 "
                f"scale={(m['N'] + m['P']) ** -0.5!r} rotary_dim={m['P']} rotary_base={m['THETA']!r} rotary_layout=interleaved "
                f"rope_type=default rotary_output=split")
    a = ATT
    return (f"mixer softmax d_model={D} heads={a['H']} kv_heads={a['KV']} head_dim={a['HD']} q_bias=false k_bias=false "
            f"v_bias=false o_bias=false qk_norm=false sinks=false output_gate=false window=0 scale={a['HD'] ** -0.5!r} "
            f"rotary_dim={a['HD']} rotary_base={a['THETA']!r} rotary_layout=half rope_type=default")


STATE = {
    "kda": [f"state delta recurrent [{KDA_H},{KDA_D},{KDA_D}] f32 fixed"]
           + [f"state conv_{x} conv_history [{KDA_H * KDA_D},{KDA_K}] compute fixed" for x in "qkv"],
    "mla": [f"state latent latent_rows [{MLA['KVL'] + MLA['P']}] compute per_token"],
    "softmax": [f"state kv kv_rows [2,{ATT['KV']},{ATT['HD']}] compute per_token"],
}


def write_container(o: Oracle, out: Path) -> Path:
    """weights.safetensors under opaque keys, and hybrid.vxir naming them."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    table = _role_table(o)
    stored: dict[int, tuple[str, torch.Tensor]] = {}
    for _, _, t, _ in table:
        if id(t) not in stored:
            stored[id(t)] = (f"blob/{len(stored):03d}", t.detach().float().contiguous())
    f = out / "weights.safetensors"
    save_file({k: v for k, v in stored.values()}, str(f))
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    lines = ["vindex3 schema 6", 'module "hybrid" {',
             '  source frontend "hand-written" dialect "test_hybrid" model_dir "." config_sha256 "none"',
             "  compute f32", f'  file @w0 "weights.safetensors" size {len(raw)} header_sha256 "{hashlib.sha256(raw[8:8 + n]).hexdigest()}"', ""]
    sym = {}
    for j, (key, t) in enumerate(stored.values()):
        sym[key] = f"$t{j}"
        lines.append(f"  tensor $t{j} f32[{','.join(map(str, t.shape))}] @w0 {json.dumps(key)}")
    lines.append("")
    key_of = {tid: key for tid, (key, _) in stored.items()}
    for role, layer, t, views in table:
        shape = list(t.shape)
        for v in views:  # the view's result shape, as the test computes it
            if v.startswith("slice"):
                a, b = map(int, v.split("[")[1].rstrip("]").split(":"))
                shape = [b - a] + shape[1:]
            else:
                shape = json.loads(v.split(" ", 1)[1])
        where = f" layer {layer}" if layer is not None else ""
        xs = "".join(f" | {v}" for v in views)
        name = f"l{layer}.{role}" if layer is not None else role
        lines.append(f"  operand %{name} f32[{','.join(map(str, shape))}] = {sym[key_of[id(t)]]}{xs}{where} role {role}")
    lines.append("")
    lines.append(f"  embedding embedding vocab={VOCAB} padded_vocab={VOCAB} dim={D}")
    for i, kind in enumerate(KINDS):
        lines += [f"  layer {i} {{", "    residual compute", "    placement PreOnly",
                  f"    norm PreAttentionNorm rmsnorm dim={D} eps={EPS!r} zero_centred=false",
                  f"    norm PreFfnNorm rmsnorm dim={D} eps={EPS!r} zero_centred=false",
                  f"    {_mixer_line(kind)}", f"    ffn swiglu d_model={D} intermediate={FFN} act=silu",
                  *[f"    {s}" for s in STATE[kind]], "  }"]
    lines += [f"  final_norm FinalNorm rmsnorm dim={D} eps={EPS!r} zero_centred=false",
              f"  head head tied=false padded_vocab={VOCAB} dim={D}", "}"]
    ir = out / "hybrid.vxir"
    ir.write_text("\n".join(lines) + "\n")
    return ir


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    o = Oracle(seed=31)
    ir = write_container(o, tmp_path_factory.mktemp("hybrid"))
    return o, ir


def _engine(ir: Path):
    from vxc.driver import load
    from vxc.runtime.engine import Engine

    ctx = load(ir)
    return Engine(ctx.module, ctx.model_dir, max_context=128)


def test_describe_shows_three_state_species(hybrid, describe_json):
    _, ir = hybrid
    d = describe_json(ir)
    assert {k: v["layers"] for k, v in d["operators"].items()} == {"kda": [0, 3], "mla": [1], "softmax": [2], "swiglu": [0, 1, 2, 3]}
    s = d["state"]
    assert (s["recurrent_layers"], s["growing_layers"]) == (2, 2)
    kinds = {(r["layer"], r["kind"], tuple(r["shape"]), r["growth"]) for r in s["regions"]}
    assert kinds == {(i, "recurrent", (2, 12, 12), "fixed") for i in (0, 3)} | {(i, "conv_history", (24, 3), "fixed") for i in (0, 3)} \
        | {(1, "latent_rows", (26,), "per_token"), (2, "kv_rows", (2, 2, 10), "per_token")}
    assert s["per_token_elements"] == 26 + 2 * 2 * 10
    assert s["fixed_elements"] == 2 * (2 * 12 * 12 + 3 * 24 * 3)
    assert d["surfaces"]["attention"] == 2  # MLA and softmax; KDA is no attention surface


def test_hybrid_against_composite_oracle(hybrid):
    from vxc.runtime.sampling import Sampler
    from vxc.runtime.session import Session

    o, ir = hybrid
    ids = S.prompt(VOCAB, PROMPT, seed=7)
    ref32 = o(ids)
    ref64 = o.double()(ids)
    o.float()
    fp = S.maxabs(ref32, ref64)
    tol = max(2 * fp, 1e-5 * float(ref64.abs().max()))
    sess = Session(_engine(ir))
    full = sess.prefill(ids)
    sess.reset()
    stepped = torch.cat([sess.prefill(ids[:SPLIT])] + [sess.step(t)[None] for t in ids[SPLIT:]])
    err = S.maxabs(full, ref32)
    agree, excluded = R.argmax_agreement(ref32, full, tol)
    print(f"| hybrid kda+mla+softmax | {err:.2e} | {fp:.2e} | {tol:.2e} | {100 * agree:.1f}% | {excluded} |")
    assert err <= tol, (err, tol)
    assert S.maxabs(stepped, full) <= tol
    assert agree == 1.0 and excluded <= PROMPT // 10
    # greedy: the oracle recomputes the whole sequence for every new token
    sess.reset()
    got = sess.generate(ids[:20], 24, Sampler(vocab=VOCAB))
    seq, want = list(ids[:20]), []
    for _ in range(24):
        want.append(int(o(seq)[-1].argmax()))
        seq.append(want[-1])
    assert got == want and len(set(want)) >= 6, (got, want)
