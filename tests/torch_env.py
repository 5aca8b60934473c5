"""A cached venv with another torch release, for the CI tiers (``tests/run_torch_tiers.sh``).

``python3 tests/torch_env.py 2.9.1`` prints the path of a Python whose torch is 2.9.1, building
its venv on first use under ``$DISTMON_CI_CACHE`` (default ``~/.cache/distmon-ci``, outside the
clone): the wheel is downloaded once into ``wheels/``, the venv lives in ``torch-2.9.1/``. The
system Python's torch is never touched. Exit status 1 (and the reason on stderr) when it cannot
be built.

Only one torch release is a CPU build on PyPI's side of this machine; the others are CUDA
builds whose ``import torch`` needs the ``nvidia-*`` packages (3.8 GB of wheels and 6.7 GB
installed for torch 2.9.1, where torch alone is 0.9 GB and 1.9 GB). ``pip install --no-deps``
alone does not import: torch's shared libraries are linked against ``libcudart.so.12``,
``libcublas.so.12``, ... and the dynamic loader refuses a library whose dependencies are missing
(``OSError: libcudart.so.12: cannot open shared object file``). So the venv gets the torch wheel
alone (``--no-deps``) and, in torch's own ``lib/`` (on its ``$ORIGIN`` search path), a small
stub for each missing CUDA library: a library of that name exporting the symbols torch imports
from it, each a function returning an error code (100, ``cudaErrorNoDevice``) or, for the
``*String`` functions, a message. On a CPU nothing calls them but the device count, which
reads "no device" as a machine without a GPU does: ``torch.cuda.is_available()`` is False.
The venv sees the system Python's packages (``--system-site-packages``: pytest, the frameworks,
prometheus-client, torch's pure-Python dependencies) with its own torch in front of them.
"""

from __future__ import annotations

import collections
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile

CACHE = os.environ.get("DISTMON_CI_CACHE") or os.path.expanduser("~/.cache/distmon-ci")
STUB_RETURN = 100  # cudaErrorNoDevice: what a stub function returns


def _out(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def _needed(lib: str) -> list[str]:
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", _out("readelf", "-d", "-W", lib))


def _dynsyms(lib: str) -> tuple[list[tuple[str, str, str]], set[str]]:
    """``lib``'s undefined (name, version, type) symbols (weak ones apart) and its defined names."""
    undefined, defined = [], set()
    for line in _out("readelf", "--dyn-syms", "-W", lib).splitlines():
        f = line.split()
        if len(f) < 8 or not f[0].endswith(":"):
            continue
        kind, bind, ndx, full = f[3], f[4], f[6], f[7]
        name, _, version = full.partition("@")
        if ndx != "UND":
            defined.add(name)
        elif name and bind != "WEAK":
            undefined.append((name, version.lstrip("@"), kind))
    return undefined, defined


def _version_files(lib: str) -> dict[str, str]:
    """Each symbol version ``lib`` needs -> the library that defines it (``readelf -V``)."""
    files, current = {}, None
    for line in _out("readelf", "-V", "-W", lib).splitlines():
        if m := re.search(r"File: (\S+)", line):
            current = m.group(1)
        elif (m := re.search(r"Name: (\S+)", line)) and current:
            files[m.group(1)] = current
    return files


def _system_libs() -> dict[str, str]:
    """soname -> path of the libraries the dynamic loader finds without torch's own search path."""
    found = {}
    for line in _out("ldconfig", "-p").splitlines()[1:]:
        if m := re.match(r"\s*(\S+) \(libc6,x86-64[^)]*\) => (\S+)", line):
            found.setdefault(m.group(1), m.group(2))
    return found


def write_cuda_stubs(torch_dir: str) -> list[str]:
    """Build a stub for each shared library torch's own libraries need and the loader cannot find.

    Returns the stubs' names (none for a CPU build). Every symbol a torch library imports from a
    missing library is exported by its stub under the version it asks for; an unversioned import
    defined nowhere (NCCL's, say) goes to a stub of a missing library the importer needs.
    """
    lib_dir = os.path.join(torch_dir, "lib")
    libs = sorted(
        os.path.join(d, f)
        for d in (lib_dir, torch_dir)
        for f in os.listdir(d)
        if ".so" in f and os.path.isfile(os.path.join(d, f))
    )
    system, here = _system_libs(), set(os.listdir(lib_dir))
    info = {lib: (_needed(lib), *_dynsyms(lib), _version_files(lib)) for lib in libs}
    missing = sorted({n for needed, *_ in info.values() for n in needed if n not in here and n not in system})
    if not missing:
        return []
    # what the process defines besides torch: the system libraries torch needs, Python's own
    python = os.path.realpath(sys.executable)
    provided = [system[n] for needed, *_ in info.values() for n in needed if n in system]
    provided += [python] + re.findall(r"=> (/\S+)", _out("ldd", python))
    defined = set().union(*(d for _, _, d, _ in info.values()), *(_dynsyms(p)[1] for p in set(provided)))
    stubs: dict[str, dict[str, str]] = collections.defaultdict(dict)  # soname -> symbol -> version
    kinds: dict[str, str] = {}
    for needed, undefined, _, versions in info.values():
        for name, version, kind in undefined:
            home = versions.get(version) if version else None
            if not version and name not in defined:
                home = next((n for n in needed if n in missing), None)
            if home in missing:
                stubs[home].setdefault(name, version)
                kinds[name] = kind
    with tempfile.TemporaryDirectory() as tmp:
        for so in missing:
            syms = stubs.get(so, {})
            src = ['static const char why[] = "no CUDA: a CPU-only stub of distmon\'s CI";']
            for name in sorted(syms):
                if kinds[name] == "OBJECT":
                    src.append(f"char {name}[1024];")
                elif re.search(r"String$|Name$", name):
                    src.append(f"const char *{name}(void) {{ return why; }}")
                else:
                    src.append(f"int {name}(void) {{ return {STUB_RETURN}; }}")
            c_file = os.path.join(tmp, so + ".c")
            with open(c_file, "w") as f:
                f.write("\n".join(src) + "\n")
            stub = os.path.join(lib_dir, so)
            cmd = ["cc", "-shared", "-fPIC", "-w", f"-Wl,-soname,{so}", "-o", stub, c_file]
            by_version = collections.defaultdict(list)
            for name, version in syms.items():
                if version:  # unversioned ones stay exported without a node (no "local: *")
                    by_version[version].append(name)
            # one version node per version the importers ask for: "libcudart.so.12 { global: a; b; };"
            nodes = [f"{v} {{ global: {' '.join(n + ';' for n in ns)} }};" for v, ns in by_version.items()]
            if nodes:
                script = os.path.join(tmp, so + ".map")
                with open(script, "w") as f:
                    f.write("\n".join(nodes) + "\n")
                cmd.append(f"-Wl,--version-script={script}")
            subprocess.run(cmd, check=True)
    return missing


def ensure(version: str) -> str:
    """The Python of a venv whose torch is ``version`` (built and cached on first use; two runs
    building the same one take turns)."""
    os.makedirs(CACHE, exist_ok=True)
    with open(os.path.join(CACHE, f"torch-{version}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _ensure(version)


def _ensure(version: str) -> str:
    venv = os.path.join(CACHE, f"torch-{version}")
    python = os.path.join(venv, "bin", "python")
    stamp = os.path.join(venv, "distmon-ready")
    if os.path.exists(stamp) and _imports(python, version):
        return python
    wheels = os.path.join(CACHE, "wheels")
    os.makedirs(wheels, exist_ok=True)
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheel = [f for f in os.listdir(wheels) if f.startswith(f"torch-{version}-") and f"-{tag}-" in f]
    if not wheel:
        print(f"[torch {version}] downloading the wheel (no dependencies) into {wheels}", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
             f"torch=={version}", "-d", wheels],
            check=True,
        )  # fmt: skip
        wheel = [f for f in os.listdir(wheels) if f.startswith(f"torch-{version}-") and f"-{tag}-" in f]
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
    pip = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    subprocess.run([*pip, os.path.join(wheels, wheel[0])], check=True)
    find = "import importlib.util as u; print(u.find_spec('torch').submodule_search_locations[0])"
    stubbed = write_cuda_stubs(_out(python, "-c", find).strip())
    if stubbed:
        print(f"[torch {version}] CUDA stubs: {' '.join(stubbed)}", file=sys.stderr)
    if not _imports(python, version):
        raise RuntimeError(f"torch {version} was installed in {venv} but does not import")
    with open(stamp, "w") as f:
        f.write(version + "\n")
    return python


def _imports(python: str, version: str) -> bool:
    probe = "import torch; print(torch.__version__.split('+')[0], torch.cuda.is_available())"
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    return done.returncode == 0 and done.stdout.split() == [version, "False"]


if __name__ == "__main__":
    try:
        print(ensure(sys.argv[1]))
    except Exception as e:  # the tier's script decides whether that fails the run
        print(f"[torch {sys.argv[1]}] cannot be installed: {e}", file=sys.stderr)
        sys.exit(1)
