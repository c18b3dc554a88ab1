"""A model directory in the Hugging Face cache's layout (snapshots/<rev>/NAME -> ../../blobs/<sha>) lowers and runs
like the same files in a plain directory; an index entry naming a path outside the directory is still refused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from tests import builders as B
from tests.runtime.conftest import read_json_line


def _to_hub(src, root, rev="0123abcd"):
    """Move every file of ``src`` into root/blobs/<sha256> and link it from root/snapshots/<rev>/<name>."""
    snap = root / "snapshots" / rev
    blobs = root / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir(exist_ok=True)
    for f in sorted(src.iterdir()):
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.move(str(f), blobs / sha)
        os.symlink(os.path.join("..", "..", "blobs", sha), snap / f.name)
    return snap


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return B.build_hf(tmp_path_factory.mktemp("plain") / "llama", "llama", B.MINI_HF["llama"], seed=31)


def _run(vxc_inproc, ir):
    r = vxc_inproc("exec", ir, "--tokens", "3,14,15,92,65", "--max-new-tokens", 8, "--ignore-eos", "--json")
    assert r.exit_code == 0, r.output
    return read_json_line(r.stdout)["generated_ids"]


@pytest.mark.parametrize("with_index", [False, True])
def test_hub_cache_layout_lowers_and_runs(plain, vxc_inproc, tmp_path, with_index):
    from safetensors import safe_open

    want = None
    ir0 = tmp_path / "plain.vxir"
    assert vxc_inproc("lower", plain, "-o", ir0).exit_code == 0
    want = _run(vxc_inproc, ir0)
    src = tmp_path / "src"
    shutil.copytree(plain, src)
    if with_index:  # an index naming the one shard, as sharded checkpoints spell it
        with safe_open(str(src / "model.safetensors"), framework="pt") as f:
            keys = list(f.keys())
        (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {k: "model.safetensors" for k in keys}}))
    snap = _to_hub(src, tmp_path / "models--tiny--llama")
    assert (snap / "model.safetensors").is_symlink() and not (snap / "model.safetensors").resolve().is_relative_to(snap)
    ir = tmp_path / "hub.vxir"
    r = vxc_inproc("lower", snap, "-o", ir)
    assert r.exit_code == 0, r.output
    assert _run(vxc_inproc, ir) == want


def test_index_entry_outside_the_directory_is_refused(plain, vxc_inproc, tmp_path):
    from safetensors import safe_open

    d = tmp_path / "m"
    shutil.copytree(plain, d)
    shutil.move(str(d / "model.safetensors"), tmp_path / "outside.safetensors")  # a real file, outside
    with safe_open(str(tmp_path / "outside.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    for entry in ("../outside.safetensors", str(tmp_path / "outside.safetensors"), "sub/../../outside.safetensors"):
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: entry for k in keys}}))
        out = tmp_path / "x.vxir"
        r = vxc_inproc("lower", d, "-o", out)
        assert r.exit_code != 0 and "a path outside the model directory" in r.output and entry in r.output
        assert not out.exists()
