"""The bad-input corpus of issue 11, as a user meets it: each case runs ``vxc`` in a subprocess under an
address-space cap, and must exit non-zero (or, where a warning is the right answer, zero) with a message naming
the problem, no ``Traceback`` on stderr, and every file it was given or asked to write left as it was (no
partial output, no temporary file beside it).

The cases build their own broken inputs from one header-only and one runnable miniature; the expected
messages are written out here, not derived from the code under test."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from tests import builders
from tests.conftest import PYTHON

AS_CAP = 8 << 30  # address space per command: a regression that allocates without bound fails, the machine stays up
PRECIOUS = b"an output the user wants to keep\n"


@dataclass
class Case:
    args: Callable[["Env"], list]  # the command line, built in the case's own directory
    message: str  # a substring of stderr (or the JSON error) naming the problem
    code: str = "nonzero"  # or "zero" (a warning, the work done)
    env: dict = field(default_factory=dict)
    fsize: int | None = None  # RLIMIT_FSIZE for the command (a write that fails part-way)


class Env:
    """One case's directory: copies of the miniatures, the lowered IR, a precious file at each output path."""

    def __init__(self, root: Path, sources: dict[str, Path]):
        self.root = root
        self.sources = sources
        self.outputs: list[Path] = []

    def copy(self, name: str) -> Path:
        dst = self.root / name
        if not dst.exists():
            shutil.copytree(self.sources[name], dst)
        return dst

    def output(self, name: str) -> Path:
        """A path the command writes; it holds a precious file that must survive the failure."""
        p = self.root / "out" / name
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(PRECIOUS)
        self.outputs.append(p)
        return p

    def ir(self) -> Path:
        """The runnable miniature's lowered IR (a copy, with its model directory beside it)."""
        self.copy("run")
        dst = self.root / "run.vxir"
        if not dst.exists():
            text = self.sources["run.vxir"].read_text()
            dst.write_text(text)
        return dst

    def write(self, name: str, data: bytes | str) -> Path:
        p = self.root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)
        return p


# ---------------------------------------------------------------- breaking a checkpoint's header


def _rewrite_header(st: Path, edit) -> None:
    raw = st.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    st.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


def _tensors(header: dict) -> list[str]:
    """Keys in data-offset order."""
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _same_size_overlap(h):
    """Two tensors of one size pointed at the same bytes (the second's bytes become unused: a gap too)."""
    keys = _tensors(h)
    sizes: dict[int, list[str]] = {}
    for k in keys:
        a, b = h[k]["data_offsets"]
        sizes.setdefault(b - a, []).append(k)
    pair = next(v for v in sizes.values() if len(v) >= 2)
    h[pair[1]]["data_offsets"] = list(h[pair[0]]["data_offsets"])


def _partial_overlap(h):
    """Every tensor after the first shifted 4 bytes back: each overlaps its predecessor by 4 bytes."""
    keys = _tensors(h)
    for k in keys[1:]:
        a, b = h[k]["data_offsets"]
        h[k]["data_offsets"] = [a - 4, b - 4]


def _gap(h):
    """A middle tensor dropped from the header: its bytes lie unclaimed between its neighbours."""
    keys = _tensors(h)
    del h[keys[len(keys) // 2]]


def _shape_not_ints(h):
    k = _tensors(h)[0]
    h[k]["shape"] = ["a"] + h[k]["shape"][1:]


def _offsets_not_pair(h):
    k = _tensors(h)[0]
    h[k]["data_offsets"] = "0..8"


def _header_case(edit) -> Callable[[Env], list]:
    def args(env: Env) -> list:
        d = env.copy("mamba")
        (st,) = d.glob("*.safetensors")
        _rewrite_header(st, edit)
        return ["lower", d, "-o", env.output("m.vxir")]
    return args


def _config_case(edit, name: str = "mamba") -> Callable[[Env], list]:
    def args(env: Env) -> list:
        d = env.copy(name)
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
        return ["lower", d, "-o", env.output("m.vxir")]
    return args


def _ir_case(old: str, new: str, *extra) -> Callable[[Env], list]:
    def args(env: Env) -> list:
        ir = env.ir()
        text = ir.read_text()
        assert old in text, f"the miniature's IR no longer spells {old!r}"
        ir.write_text(text.replace(old, new, 1))
        return ["passes", ir, *extra]
    return args


# ---------------------------------------------------------------- breaking a saved state


def _state_case(edit, message_dtype: str | None = None) -> Callable[[Env], list]:
    """Save a real state from the miniature (sampling, so it carries an RNG state), break it, resume from it."""
    def args(env: Env) -> list:
        ir = env.ir()
        good = env.sources["good.state"]  # saved once per module from the same miniature
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(good), framework="pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = edit(tensors, meta) or meta
        bad = env.root / "bad.state"
        save_file(tensors, str(bad), metadata=meta)
        return ["exec", ir, "--tokens", "4", "--max-new-tokens", "2", "--temperature", "0.8", "--resume-state", bad,
                "--save-state", env.output("next.state")]
    return args


def _empty_position(t, meta):
    import torch
    t["position"] = torch.zeros(0, dtype=torch.int64)


def _matrix_position(t, meta):
    import torch
    t["position"] = torch.tensor([[3, 3]], dtype=torch.int64)


def _negative_position(t, meta):
    import torch
    t["position"] = torch.tensor([-7], dtype=torch.int64)


def _float_position(t, meta):
    import torch
    t["position"] = torch.tensor([3.0])


def _garbage_rng(t, meta):
    import torch
    t["rng_state"] = torch.randint(0, 255, (17,), dtype=torch.uint8)


def _rng_wrong_dtype(t, meta):
    t["rng_state"] = t["rng_state"].float()


def _region_wrong_dtype(t, meta):
    import torch
    k = next(k for k in sorted(t) if k not in ("position", "rng_state"))
    t[k] = t[k].to(torch.bfloat16)


def _not_vxc(t, meta):
    return {"format": "pt"}


def _exec(*args, ir_needed=True) -> Callable[[Env], list]:
    return lambda env: ["exec", env.ir(), *args]


def _context_past_memory(env: Env) -> list:
    d = env.copy("llama")
    ir = env.root / "llama.vxir"
    r = subprocess.run([PYTHON, "-m", "vxc.cli", "lower", str(d), "-o", str(ir)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return ["exec", ir, "--tokens", "1,2", "--max-context", str(2**24)]


def _corrupt_tokenizer(*args) -> Callable[[Env], list]:
    def f(env: Env) -> list:
        ir = env.ir()
        (env.root / "run" / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
        return ["exec", ir, *args]
    return f


def _logits_out_fails(env: Env) -> list:
    return ["exec", env.ir(), "--tokens", ",".join(["1"] * 48), "--max-new-tokens", "1",
            "--logits-out", env.output("logits.safetensors")]


def _save_state_fails(env: Env) -> list:
    return ["exec", env.ir(), "--tokens", ",".join(["1"] * 48), "--max-new-tokens", "1",
            "--save-state", env.output("s.state")]


CASES: dict[str, Case] = {
    # lower: checkpoints
    "st same-size overlap": Case(_header_case(_same_size_overlap), "invalid offsets"),
    "st partial overlap": Case(_header_case(_partial_overlap), "overlaps"),
    "st gap": Case(_header_case(_gap), "leaves a gap of"),
    "st shape not ints": Case(_header_case(_shape_not_ints), "model.safetensors: safetensors header entry"),
    "st offsets not a pair": Case(_header_case(_offsets_not_pair), "data_offsets '0..8' is not a pair"),
    # lower: configs
    "n_layer 10**12": Case(_config_case(lambda c: c.update(n_layer=10**12)), "n_layer=1000000000000 is out of range"),
    "d_model 10**30": Case(_config_case(lambda c: c.update(d_model=10**30)), "d_model=10000000...(31 digits) is out of range"),
    "headdim 0": Case(_config_case(lambda c: c["ssm_cfg"].update(headdim=0)), "headdim"),
    "ngroups 0": Case(_config_case(lambda c: c["ssm_cfg"].update(ngroups=0)), "ngroups"),
    "kv heads 0": Case(_config_case(lambda c: c.update(num_key_value_heads=0), "llama"), "attribute kv_heads=0 is not an int >= 1"),
    "negative qk_nope_head_dim": Case(_config_case(lambda c: c.update(qk_nope_head_dim=-4), "deepseek"),
                                      "qk_nope_head_dim=-4 must be >= 0"),
    "mla kv_lora_rank 0": Case(_config_case(lambda c: c.update(kv_lora_rank=0), "deepseek"), "attribute kv_lora_rank=0 is not an int >= 1"),
    "moe top_k 0": Case(_config_case(lambda c: c.update(num_experts_per_tok=0), "deepseek"), "attribute top_k=0 is not an int >= 1"),
    "negative rms eps": Case(_config_case(lambda c: c.update(rms_norm_eps=-1), "llama"), "attribute eps=-1.0 is not a float >= 0"),
    "unknown family": Case(_config_case(lambda c: c.update(model_type="rwkv7")), "unknown model_type 'rwkv7'"),
    "-o is a directory": Case(lambda env: ["lower", env.copy("mamba"), "-o", env.root], "is a directory"),
    # passes / describe
    "missing vxir (passes)": Case(lambda env: ["passes", env.root / "nope.vxir"], "no such IR file"),
    "missing vxir (describe)": Case(lambda env: ["describe", env.root / "nope.vxir"], "no such IR file"),
    "missing vxir (exec)": Case(lambda env: ["exec", env.root / "nope.vxir", "--tokens", "1"], "no such IR file"),
    "exec a directory": Case(lambda env: ["exec", env.copy("run"), "--tokens", "1"], "is a directory, not an IR file"),
    "non-utf8 IR": Case(lambda env: ["describe", env.write("b.vxir", env.ir().read_bytes().replace(b"module \"", b"module \"\xff", 1))],
                        "the file is not UTF-8 text"),
    "IR vocab -100": Case(_ir_case(" vocab=101 ", " vocab=-100 "), "attribute vocab=-100"),
    "IR groups 0": Case(_ir_case(" groups=2 ", " groups=0 "), "attribute groups=0"),
    "describe --context -5": Case(lambda env: ["describe", env.ir(), "--context", "-5"], "--context"),
    "describe --dot under a file": Case(lambda env: ["describe", env.ir(), "--dot", env.output("plain") / "g.dot"],
                                        "is not a directory"),
    # exec: options
    "tokens 10**30": Case(_exec("--tokens", str(10**30)), "is not a token id"),
    "tokens garbage": Case(_exec("--tokens", "1,x,3"), "'x' is not a token id"),
    "tokens negative": Case(_exec("--tokens", "-3"), "-3 is not a token id"),
    "tokens in padding rows": Case(_exec("--tokens", "1,105"), "token ids outside the vocabulary 0..100"),
    "no input": Case(_exec(), "nothing to run"),
    "empty prompt": Case(_exec("--prompt", ""), "--prompt is empty"),
    "seed 2**70": Case(_exec("--tokens", "1", "--seed", str(2**70)), "--seed"),
    "max-context -5": Case(_exec("--tokens", "1", "--max-context", "-5"), "--max-context"),
    "max-context 10**12": Case(_exec("--tokens", "1", "--max-context", str(10**12)), "--max-context"),
    "temperature nan": Case(_exec("--tokens", "1", "--temperature", "nan"), "--temperature"),
    "top-k -5": Case(_exec("--tokens", "1", "--top-k", "-5"), "--top-k"),
    "max-new-tokens -1": Case(_exec("--tokens", "1", "--max-new-tokens", "-1"), "--max-new-tokens"),
    "device tpu": Case(_exec("--tokens", "1", "--device", "tpu"), "--device tpu: expected cpu, cuda or cuda:N"),
    "dtype fp8": Case(_exec("--tokens", "1", "--dtype", "fp8"), "--dtype fp8: expected one of fp32 | bf16 | fp16"),
    "kernels bogus": Case(_exec("--tokens", "1", "--kernels", "fast"), "--kernels fast"),
    "max-context past memory": Case(_context_past_memory, "--max-context 16777216: the state and rotary tables need 13."),
    "context full": Case(_exec("--tokens", "1,2,3", "--max-context", "2"), "context full"),
    # exec: tokenizer
    "corrupt tokenizer, --prompt": Case(_corrupt_tokenizer("--prompt", "hi"), "tokenizer.json: not a readable tokenizer"),
    "corrupt tokenizer, --tokens": Case(_corrupt_tokenizer("--tokens", "1,2", "--max-new-tokens", "2"),
                                        "tokenizer.json: not a readable tokenizer", code="zero"),
    # exec: resumed state
    "state empty position": Case(_state_case(_empty_position), "position must be one int64, found int64[0]"),
    "state 2-D position": Case(_state_case(_matrix_position), "position must be one int64, found int64[1, 2]"),
    "state negative position": Case(_state_case(_negative_position), "position -7 is negative"),
    "state float position": Case(_state_case(_float_position), "position must be one int64, found float32[1]"),
    "state garbage rng": Case(_state_case(_garbage_rng), "rng_state is not a generator state"),
    "state rng as floats": Case(_state_case(_rng_wrong_dtype), "rng_state is not a generator state"),
    "state region at another dtype": Case(_state_case(_region_wrong_dtype), "is stored as bfloat16, this model holds it as float32"),
    "state of another format": Case(_state_case(_not_vxc), "not a vxc state file"),
    "state not safetensors": Case(lambda env: ["exec", env.ir(), "--tokens", "1", "--resume-state",
                                               env.write("junk.state", b"\x00" * 40)], "not a readable state file"),
    # exec: an output write that fails part-way (file size limit): no partial file, the old one kept
    "logits-out write fails": Case(_logits_out_fails, "File too large", fsize=8 << 10, env={"VXC_NATIVE": "0"}),
    "save-state write fails": Case(_save_state_fails, "File too large", fsize=1 << 10, env={"VXC_NATIVE": "0"}),
}


@pytest.fixture(scope="module")
def corpus_sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corpus-src")
    mamba = builders.build_native_mamba(root / "mamba", builders.MINI_NATIVE_MAMBA2, header_only=True)
    run = builders.build_native_mamba(root / "run", builders.MINI_NATIVE_MAMBA2, seed=5)
    _write_tokenizer(run)
    ir = root / "run.vxir"
    r = subprocess.run([PYTHON, "-m", "vxc.cli", "lower", str(run), "-o", str(ir)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    src = {"mamba": mamba, "run": run, "run.vxir": ir}
    good = root / "good.state"  # a real state (sampling: it carries an RNG state), broken by the state cases
    r = subprocess.run([PYTHON, "-m", "vxc.cli", "exec", str(ir), "--tokens", "1,2,3", "--max-new-tokens", "2",
                        "--temperature", "0.8", "--save-state", str(good), "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    src["good.state"] = good
    # 4 kv heads x 12 x (K, V) x 2 layers x 4 bytes + rotary tables: 848 bytes per position, 13 GiB at 2**24
    src["llama"] = builders.hf_header_only(root / "llama", {"model_type": "llama", **builders.MINI_HF["llama"],
                                                            "num_key_value_heads": 4}, dtype="F32")
    src["deepseek"] = builders.hf_header_only(root / "deepseek", DEEPSEEK)
    return src


DEEPSEEK = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
            "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
            "n_group": 2, "topk_group": 1}


def _write_tokenizer(d: Path) -> None:
    """A small byte-level BPE tokenizer (tokenizers' own trainer) whose ids fit the miniature's vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=101, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:90], show_progress=False)
    tok.train_from_iterator(["hello world " * 4, "the state of the art"], trainer)
    tok.save(str(d / "tokenizer.json"))


def _limits(fsize: int | None):
    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (AS_CAP, AS_CAP))
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    return apply


@pytest.mark.parametrize("name", list(CASES))
def test_cli_bad_input(name, corpus_sources, tmp_path):
    case = CASES[name]
    env = Env(tmp_path, corpus_sources)
    args = [str(a) for a in case.args(env)]
    before = {p: p.read_bytes() for p in _files(tmp_path)}
    p = subprocess.run([PYTHON, "-m", "vxc.cli", *args], capture_output=True, text=True, timeout=300,
                       preexec_fn=_limits(case.fsize), env={**os.environ, "COLUMNS": "200", **case.env})
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out
    if case.code == "zero":
        assert p.returncode == 0, out
    else:
        assert p.returncode != 0, out
        assert p.returncode != -signal.SIGKILL and p.returncode > 0, f"killed: {p.returncode}"
    assert case.message in " ".join(out.split()), f"{case.message!r} not in:\n{out}"
    for f in env.outputs:
        if f.exists() or f in before:
            assert f.read_bytes() == PRECIOUS, f"{f} was changed"
    after = {p: p.read_bytes() for p in _files(tmp_path)}
    created = sorted(str(p.relative_to(tmp_path)) for p in set(after) - set(before))
    assert created == [] or case.code == "zero" and all(not c.startswith("out/") for c in created), created
    changed = sorted(str(p.relative_to(tmp_path)) for p in before if after.get(p) != before[p])
    assert changed == [], f"inputs changed: {changed}"


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]
