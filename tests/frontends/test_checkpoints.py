"""Checkpoint reading: sharded checkpoints with their index, a 20,000-tensor
header-only checkpoint, and ``vxc lower`` without torch."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import builders
from tests.conftest import REPO

VXC = Path(sys.executable).parent / "vxc"


def _header_sha(path: Path) -> str:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return hashlib.sha256(f.read(n)).hexdigest()


def test_sharded_checkpoint_lists_every_shard(tmp_path, cli):
    d = builders.build_native_mamba(tmp_path / "sharded", builders.MINI_NATIVE_MAMBA2, seed=7, shards=3)
    shards = sorted(d.glob("model-*-of-00003.safetensors"))
    assert len(shards) == 3
    out = tmp_path / "sharded.vxir"
    r = cli("lower", d, "-o", out)
    assert r.exit_code == 0, r.output
    text = out.read_text()
    files = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("file @")]
    assert len(files) == 3
    for line, shard in zip(files, shards):
        assert f'"{shard.name}" size {shard.stat().st_size} header_sha256 "{_header_sha(shard)}"' in line
    index = d / "model.safetensors.index.json"
    raw = index.read_bytes()
    want = f'index "model.safetensors.index.json" size {len(raw)} sha256 "{hashlib.sha256(raw).hexdigest()}"'
    assert sum(1 for ln in text.splitlines() if ln.strip() == want) == 1
    # every tensor of the index is in the IR, on the file symbol of its shard
    weight_map = json.loads(raw)["weight_map"]
    syms = {shard.name: line.split()[1] for line, shard in zip(files, shards)}
    tensor_lines = {ln.strip().rsplit(" ", 1)[1].strip('"'): ln.split() for ln in text.splitlines() if ln.strip().startswith("tensor $")}
    assert set(tensor_lines) == set(weight_map)
    for key, shard in weight_map.items():
        assert tensor_lines[key][3] == syms[shard], key
    # the sharded IR describes the same model as the single-file one
    single = builders.build_native_mamba(tmp_path / "single", builders.MINI_NATIVE_MAMBA2, seed=7)
    a = json.loads(cli("describe", d, "--json").stdout)
    b = json.loads(cli("describe", single, "--json").stdout)
    a.pop("name"), b.pop("name")
    assert a == b


# 2 + 2223 * 9 = 20,009 tensors: embedding, final norm, and per layer the block
# norm + in_proj, conv1d weight and bias, dt_bias, A_log, D, gated norm, out_proj.
BIG = {**builders.MINI_NATIVE_MAMBA2, "d_model": 8, "n_layer": 2223,
       "ssm_cfg": {**builders.MINI_NATIVE_MAMBA2["ssm_cfg"], "headdim": 4, "d_state": 2, "ngroups": 1}}


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    d = tmp_path_factory.mktemp("big") / "mamba2-20k"
    builders.build_native_mamba(d, BIG, header_only=True)
    return d


def _timed(args, cwd=None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    p = subprocess.run([str(VXC), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120)
    return p, time.perf_counter() - t0


def test_20k_tensor_checkpoint(big, tmp_path):
    out = tmp_path / "big.vxir"
    p, dt = _timed(["lower", big, "-o", out, "--json"])
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(p.stdout)
    assert r["tensors"] == 2 + 2223 * 9 == 20_009
    assert r["layers"] == 2223 and r["mixers"] == {"mamba2": 2223}
    print(f"\nvxc lower, 20,009-tensor header-only checkpoint: {dt:.2f} s wall (whole command)")


def test_780m_lower_wall_time(witnesses, tmp_path):
    out = tmp_path / "780m.vxir"
    p, dt = _timed(["lower", witnesses["mamba2-780m"], "-o", out])
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("lowered mamba2-780m ") and p.stdout.count("\n") == 1
    print(f"\nvxc lower, mamba2-780m header-only witness: {dt:.2f} s wall (whole command)")


_NO_TORCH = """
import sys
from vxc.cli import app
for args in ({cmds}):
    try:
        app(list(args), standalone_mode=False)
    except SystemExit as e:
        assert not e.code, (args, e.code)
bad = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.") or m == "transformers")
assert not bad, bad[:5]
print("torch-free")
"""


def test_lower_does_not_import_torch(witnesses, tmp_path):
    out = tmp_path / "nt.vxir"
    cmds = repr((["lower", str(witnesses["mamba2attn-250m.oute-dialect"]), "-o", str(out)],))
    p = subprocess.run([sys.executable, "-c", _NO_TORCH.format(cmds=cmds)], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "torch-free" in p.stdout and out.exists()


def test_describe_does_not_import_torch(witnesses):
    cmds = repr((["describe", str(witnesses["mamba2-780m"]), "--json"],))
    p = subprocess.run([sys.executable, "-c", _NO_TORCH.format(cmds=cmds)], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
