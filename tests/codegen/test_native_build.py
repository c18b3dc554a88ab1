"""How the native library is built (``vxc.native_build``), with a stand-in compiler that logs each invocation, takes a
while, and copies the library this process already loaded to the output (so a built library loads and passes the ABI
check without compiling anything here):

- processes needing the same library at once (the test suite's workers) compile it once: the others wait for it;
- on more than one CPU GCC code-generates in parallel (``-flto=N``), and a toolchain refusing LTO gets the plain
  command, still a working library;
- ``python -m vxc.native_build`` builds it ahead of first use without torch (CI runs it while pip installs), into
  the cache entry a later load finds.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vxc.codegen.kernels import native as N

pytestmark = pytest.mark.native

LOAD = "from vxc.codegen.kernels import native as N; assert N.available(), N.status(); print(N.status())"


def _fake_cc(tmp: Path, lib: str, refuse_lto: bool) -> Path:
    cc = tmp / "fake-cc"
    cc.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, shutil, sys, time
        args = sys.argv[1:]
        if args == ["--version"]:
            print("gcc (stand-in) 12.2.0"); sys.exit(0)
        with open({str(tmp / "log")!r}, "a") as f:
            f.write(" ".join(args) + "\\n")
        if {refuse_lto!r} and any(a.startswith("-flto") for a in args):
            print("lto1: fatal error: no LTO plugin", file=sys.stderr); sys.exit(1)
        time.sleep(1.5)
        shutil.copyfile({lib!r}, args[args.index("-o") + 1])
        """))
    cc.chmod(0o755)
    return cc


def _env(tmp: Path, cc: Path) -> dict:
    root = Path(__file__).resolve().parents[2]
    return dict(os.environ, CC=str(cc), VXC_CACHE_DIR=str(tmp / "cache"), PYTHONPATH=str(root), VXC_NATIVE="1")


def _run(env: dict, cpus: str, n: int) -> list[subprocess.CompletedProcess]:
    # taskset pins the process's CPUs (what the job count reads); without it, the CPUs this test runs on
    pre = ["taskset", "-c", cpus] if cpus and _has_taskset() else []
    ps = [subprocess.Popen([*pre, sys.executable, "-c", LOAD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True) for _ in range(n)]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=120), p.stdout.read(), p.stderr.read()) for p in ps]


def _cpus(n: int) -> str:
    """The first n CPUs this process may run on, as taskset lists them."""
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:n])


def _has_taskset() -> bool:
    return subprocess.run(["sh", "-c", "command -v taskset"], capture_output=True).returncode == 0


@pytest.fixture
def lib() -> str:
    assert N.available(), N.status()
    return N.load()._name


def test_concurrent_loads_compile_once_in_parallel(tmp_path, lib):
    if len(os.sched_getaffinity(0)) < 2 or not _has_taskset():
        pytest.skip("needs two CPUs and taskset")
    cc = _fake_cc(tmp_path, lib, refuse_lto=False)
    done = _run(_env(tmp_path, cc), _cpus(2), 3)
    for r in done:
        assert r.returncode == 0 and r.stdout.startswith("loaded"), r.stderr
    log = (tmp_path / "log").read_text().splitlines()
    assert len(log) == 1, log  # three processes at once, one compile
    assert "-flto=2" in log[0].split() and "-O3" in log[0].split(), log
    built = list((tmp_path / "cache").glob("vxc_cpu-*.so"))
    assert len(built) == 1 and not list((tmp_path / "cache").glob("tmp*"))
    # the process that compiled said so (a first run waits there), the two that waited for it did not
    said = [r for r in done if "compiling the native CPU kernels" in r.stderr]
    assert len(said) == 1, [r.stderr for r in done]
    # a later process finds it built, and says nothing
    later = _run(_env(tmp_path, cc), _cpus(2), 1)[0]
    assert later.returncode == 0 and "compiling" not in later.stderr, later.stderr
    assert len((tmp_path / "log").read_text().splitlines()) == 1


def test_one_cpu_compiles_without_lto_and_a_refused_lto_falls_back(tmp_path, lib):
    if not _has_taskset():
        pytest.skip("needs taskset")
    cc = _fake_cc(tmp_path, lib, refuse_lto=False)
    assert _run(_env(tmp_path, cc), _cpus(1), 1)[0].returncode == 0
    (one,) = (tmp_path / "log").read_text().splitlines()
    assert not any(a.startswith("-flto") for a in one.split()), one
    if len(os.sched_getaffinity(0)) < 2:
        return
    (tmp_path / "log").unlink()
    cc = _fake_cc(tmp_path, lib, refuse_lto=True)
    env = _env(tmp_path, cc)
    env["VXC_CACHE_DIR"] = str(tmp_path / "cache2")
    r = _run(env, _cpus(2), 1)[0]
    assert r.returncode == 0 and r.stdout.startswith("loaded"), r.stderr
    tried = (tmp_path / "log").read_text().splitlines()
    assert len(tried) == 2 and "-flto=2" in tried[0].split(), tried
    assert not any(a.startswith("-flto") for a in tried[1].split()), tried


def test_prebuild_without_torch_is_what_a_load_finds(tmp_path, lib):
    cc = _fake_cc(tmp_path, lib, refuse_lto=False)
    env = _env(tmp_path, cc)
    (tmp_path / "no-torch").mkdir()
    (tmp_path / "no-torch" / "torch.py").write_text("raise ImportError('the prebuild must not import torch')\n")
    pre = dict(env, PYTHONPATH=f"{tmp_path / 'no-torch'}{os.pathsep}{env['PYTHONPATH']}")
    r = subprocess.run([sys.executable, "-m", "vxc.native_build"], env=pre, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    built = Path(r.stdout.strip())
    assert built.exists() and built.parent == tmp_path / "cache", r.stdout
    assert len((tmp_path / "log").read_text().splitlines()) == 1
    r = _run(env, _cpus(len(os.sched_getaffinity(0))), 1)[0]  # a load in a process with torch: no second compile
    assert r.returncode == 0 and r.stdout.startswith("loaded"), r.stderr
    assert len((tmp_path / "log").read_text().splitlines()) == 1
    # no compiler: a non-zero exit, saying so
    r = subprocess.run([sys.executable, "-m", "vxc.native_build"], env=dict(pre, CC=str(tmp_path / "missing-cc")),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stderr.strip(), (r.returncode, r.stderr)


def test_gcc_is_recognised_by_its_version_text():
    """The parallel (-flto=N) build is for GCC: Debian's ``cc`` names itself ``cc`` on its first line and GCC only
    in its copyright line; clang is neither."""
    from vxc.native_build import _is_gcc

    assert _is_gcc(["cc (Debian 12.2.0-14+deb12u1) 12.2.0", "Copyright (C) 2022 Free Software Foundation, Inc."])
    assert _is_gcc(["gcc (GCC) 13.2.1 20231011 (Red Hat 13.2.1-4)", "Copyright (C) 2023 Free Software Foundation, Inc."])
    assert not _is_gcc(["Debian clang version 14.0.6", "Target: x86_64-pc-linux-gnu"])
    assert not _is_gcc([])
