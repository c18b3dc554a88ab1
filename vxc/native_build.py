"""Building the native CPU library (``vxc/codegen/kernels/native/vxc_cpu.c``) into the cache, without torch:
``vxc.codegen.kernels.native`` loads what this builds, and ``python -m vxc.native_build`` builds it ahead of first use
(CI starts it while pip installs the packages, on the core pip leaves idle). The library is keyed in the cache by the
source, the compile command, the compiler and the CPU's flags; ``VXC_NATIVE_CFLAGS`` adds compiler flags."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).parent / "codegen" / "kernels" / "native" / "vxc_cpu.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", *os.environ.get("VXC_NATIVE_CFLAGS", "").split()]


def _cache_dir() -> Path:
    from .cache import cache_dir

    return cache_dir()


def _cpu_key() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler() -> Optional[str]:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _jobs() -> int:
    """CPUs this process may run on (the parallel code generation's job count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _is_gcc(version: list[str]) -> bool:
    """Whether ``cc --version``'s lines name GCC: "gcc" / "GCC" in them, or the Free Software Foundation's copyright
    (Debian's ``cc`` prints ``cc (Debian 12.2.0-14) 12.2.0`` first: before 2026-12-08 only that first line was read,
    so the parallel build never ran there — 60 s instead of 37 s on the 2-CPU VM)."""
    return any("GCC" in v or "gcc" in v or "Free Software Foundation" in v for v in version)


def _command(cc: str, version: list[str], src: Path, out: str) -> list[str]:
    """The compile command. With GCC on more than one CPU the source is compiled as link-time-optimised partitions
    code-generated in parallel (``-flto=N``): the single-threaded -O3 build took 69 s on the 2-CPU Zen 4 VM, this
    one 42 s (the front end and the inlining decisions stay serial, ~7 s; since the packed tiles' kernels are a
    function per encoding, 2026-12-08: 65-69 s and 36 s), with the same kernel speeds and results (the bf16 and
    packed q4_0 GEMVs of 28 0.6B-model-shaped layers at 1 and 8 rows, interleaved in one process: within 1 %,
    bit-equal). Without ``make`` GCC runs the partitions one after another, as before."""
    lto = [f"-flto={_jobs()}"] if _jobs() > 1 and _is_gcc(version) else []
    return [cc, *FLAGS, *lto, str(src), "-o", out, "-lm"]


@contextlib.contextmanager
def _build_lock(path: Path):
    """Held while one process builds ``path``: two processes needing the same library at once (the test suite's
    workers) build it once, the second waiting for the first's, rather than each compiling it in full."""
    try:
        import fcntl
    except ImportError:  # (no POSIX locks: each process builds, the atomic rename keeps the result whole)
        yield
        return
    with open(str(path) + ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:2]
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(_command(cc, version, SOURCE, "")), cc, *version, _cpu_key()]).encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"vxc_cpu-{key}.so"
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(out.parent, os.W_OK):
            raise PermissionError(str(out.parent))
    except OSError:  # an unwritable cache (read-only home): a per-user temporary directory
        out = Path(tempfile.gettempdir()) / f"vxc-{os.getuid()}" / out.name
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out):
        if out.exists():  # built by the process that held the lock before
            return out
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        # a first run waits here (~40 s on 2 CPUs): say so, rather than sit silent
        print(f"vxc: compiling the native CPU kernels for this machine (once; kept in {out.parent}) ...",
              file=sys.stderr, flush=True)
        try:
            cmd = _command(cc, version, SOURCE, tmp)
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode and any(a.startswith("-flto") for a in cmd):  # a toolchain without LTO: the plain build
                r = subprocess.run([a for a in cmd if not a.startswith("-flto")], capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-800:]}")
            os.replace(tmp, out)  # atomic: concurrent builders never see a partial library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def main() -> int:
    cc = _compiler()
    if cc is None:
        print("no C compiler found (set CC)", file=sys.stderr)
        return 1
    try:
        print(_build(cc))
    except Exception as e:  # (a prebuild: the first use reports the same failure)
        print(f"native build failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
