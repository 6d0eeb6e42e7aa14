"""Where the Triton server comes from: the `tritonserver` binary and Python backend of the
`nvidia-pytriton` wheel, and the Python environment its backend stub runs the models in.

The stub runs an isolated interpreter (no PYTHONPATH) whose prefix follows the first `python3`
on PATH, and it reads tensors correctly only with numpy 1.x (the wheel pins numpy<2). So that the
project's own environment keeps whatever numpy it has, the wheel and numpy<2 live in a side
virtual environment of this interpreter (under the samples' cache, prepared once); the models
then append this checkout and this interpreter's site-packages (torch, tokenizers) to sys.path.
An environment that itself holds nvidia-pytriton and numpy<2 (the `triton` extra) is used as is.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import site
import subprocess
import sys
import sysconfig

from samples.default_model import _cache_dir

logger = logging.getLogger(__name__)

PYTRITON_REQUIREMENT = "nvidia-pytriton==0.7.0"
STUB_NUMPY_REQUIREMENT = "numpy>=1.21,<2"
MIN_GLIBC = (2, 35)   # the wheel is manylinux_2_35_x86_64
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READY_MARKER = "ready"


class TritonUnavailableError(RuntimeError):
    """The Triton wheel cannot run here, or could not be installed."""


@dataclasses.dataclass(frozen=True)
class ServerEnvironment:
    server_binary: str
    python_bin_dir: str              # first on the server's PATH: the stub's interpreter prefix follows it
    backend_dir: str                 # holds python/ (libtriton_python.so, the stub of this interpreter)
    library_dirs: tuple[str, ...]    # LD_LIBRARY_PATH: this interpreter's LIBDIR, the wheel's libraries
    python_path: tuple[str, ...]     # appended to the stub's sys.path by the models, in order

    def process_env(self) -> dict[str, str]:
        """The server's environment: the stub links the system libpython, so the running
        interpreter's LIBDIR goes first (another build's standard library breaks inside the stub)."""
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*self.library_dirs, env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
        env["PATH"] = os.pathsep.join([self.python_bin_dir, env.get("PATH", "")])
        env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        return env


def unsupported_reason() -> str | None:
    """Why the wheel's binary cannot run on this machine, or None."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the nvidia-pytriton wheel runs on Linux x86_64 only, not {platform.system()} {platform.machine()}"
    name, version = platform.libc_ver()
    if name != "glibc":
        return f"the nvidia-pytriton wheel needs glibc, this is {name or 'an unknown libc'}"
    if tuple(int(part) for part in version.split(".")[:2]) < MIN_GLIBC:
        return f"the nvidia-pytriton wheel needs glibc >= {'.'.join(map(str, MIN_GLIBC))}, this is {version}"
    return None


def side_directory(cache_dir: str | None = None) -> str:
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    name = PYTRITON_REQUIREMENT.replace("==", "-")
    return os.path.join(_cache_dir(cache_dir), "triton", f"{name}-py{version}")


def _site_packages(prefix: str) -> str:
    return os.path.join(prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages")


def _own_packages_dir() -> str | None:
    """This interpreter's site directory holding pytriton, when its numpy is 1.x too."""
    spec = importlib.util.find_spec("pytriton")
    numpy_spec = importlib.util.find_spec("numpy")
    if spec is None or numpy_spec is None or not spec.submodule_search_locations:
        return None
    import numpy
    if int(numpy.__version__.split(".")[0]) >= 2:
        return None
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def prepare(cache_dir: str | None = None, install: bool = True) -> ServerEnvironment:
    """The server environment, installing the side directory on first use (`install`)."""
    reason = unsupported_reason()
    if reason:
        raise TritonUnavailableError(reason)
    packages_dir = _own_packages_dir()
    root = side_directory(cache_dir)
    python_bin_dir = os.path.join(sys.prefix, "bin")
    if packages_dir is None:
        venv_dir = os.path.join(root, "venv")
        packages_dir, python_bin_dir = _site_packages(venv_dir), os.path.join(venv_dir, "bin")
        if not os.path.exists(os.path.join(root, READY_MARKER)):
            if not install:
                raise TritonUnavailableError(f"the Triton side environment is not prepared (python -m samples.triton "
                                             f"--setup-only): {root}")
            _install(root, venv_dir)
    # keyed by where the wheel is: an environment of its own may hold another version of it
    key = hashlib.sha1(packages_dir.encode()).hexdigest()[:12]
    backend_dir = _backend_dir(packages_dir, os.path.join(root, f"backends-{key}"))
    pytriton_dir = os.path.join(packages_dir, "pytriton", "tritonserver")
    return ServerEnvironment(
        server_binary=os.path.join(pytriton_dir, "bin", "tritonserver"), python_bin_dir=python_bin_dir,
        backend_dir=backend_dir,
        library_dirs=(sysconfig.get_config_var("LIBDIR") or "", os.path.join(packages_dir, "nvidia_pytriton.libs")),
        python_path=(REPO_ROOT, *site.getsitepackages()))


def _install(root: str, venv_dir: str) -> None:
    """A virtual environment of this interpreter without pip, the two packages put into its
    site-packages by this interpreter's pip; renamed into place when complete."""
    tmp = venv_dir + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    commands = [[sys.executable, "-m", "venv", "--without-pip", tmp],
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", _site_packages(tmp),
                 PYTRITON_REQUIREMENT, STUB_NUMPY_REQUIREMENT]]
    for command in commands:
        logger.info("preparing the Triton side environment: %s", " ".join(command))
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise TritonUnavailableError(f"could not prepare the Triton environment ({' '.join(command[2:4])}): "
                                         f"{result.stderr.strip()[-800:]}")
    shutil.rmtree(venv_dir, ignore_errors=True)
    os.replace(tmp, venv_dir)
    with open(os.path.join(root, READY_MARKER), "w") as f:
        f.write(PYTRITON_REQUIREMENT + "\n")


def _backend_dir(packages_dir: str, directory: str) -> str:
    """backends/python/ with the wheel's backend library and utils and this interpreter's stub
    (the stub has to sit next to the library)."""
    source = os.path.join(packages_dir, "pytriton", "tritonserver")
    python_dir = os.path.join(directory, "python")
    stub = os.path.join(source, "python_backend_stubs", f"{sys.version_info[0]}.{sys.version_info[1]}",
                        "triton_python_backend_stub")
    if not os.path.exists(stub):
        raise TritonUnavailableError(f"the Triton wheel has no Python backend stub for Python "
                                     f"{sys.version_info[0]}.{sys.version_info[1]}")
    os.makedirs(python_dir, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        target = os.path.join(python_dir, name)
        if not os.path.exists(target):
            shutil.copy2(os.path.join(source, "backends", "python", name), target)
    target = os.path.join(python_dir, "triton_python_backend_stub")
    if not os.path.exists(target):
        shutil.copy2(stub, target)
    return directory
