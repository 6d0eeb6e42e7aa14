"""The one builder of this package's native libraries: the native CPU layer's library (cpu/: several
sources and headers, `build_sources`) and the emulation backend's translation units (cuda_src/ with
the shim, `build_library`).

A library is compiled once per sha256 of (source texts, flags, `$CXX --version`, and whatever the
caller adds to the key, e.g. the CPU model and flags for -march=native), written under a
temporary name and renamed, so concurrent builds are safe. Cache root: $BATCH_MANAGER_EMU_CACHE's
parent when set, else $XDG_CACHE_HOME/batch_manager (default ~/.cache/batch_manager); the emu
libraries live in its `emu/`, the CPU kernels in `native/`.
"""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV_VAR = "BATCH_MANAGER_EMU_CACHE"
CXX = os.environ.get("CXX", "g++")


def emu_cache_dir() -> Path:
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "batch_manager" / "emu"


def native_cache_dir() -> Path:
    return emu_cache_dir().parent / "native"


@lru_cache(maxsize=None)
def compiler_version(cxx: str = CXX) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout


def compiler_available() -> bool:
    try:
        return subprocess.run([CXX, "--version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def build_library(source: str, flags: tuple[str, ...], name: str, directory: Path, what: str,
                  extra_key: str = "") -> Path:
    """Compile the C++ `source` text with `flags` into `directory`/`name`-<digest>.so (cached);
    the library's path. The translation unit stays beside it (`.cpp`, same digest), so debuggers
    and sanitizer reports point at it. `what` names the library in errors and logs."""
    digest = hashlib.sha256("\0".join([source, " ".join(flags), compiler_version(), extra_key]).encode()
                            ).hexdigest()[:24]
    library = directory / f"{name}-{digest}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(suffix=".so", prefix=f".{name}-{digest}-", dir=directory)
    os.close(fd)
    # Its content is fixed by the digest, so concurrent writers replace it with identical text.
    source_path = directory / f"{name}-{digest}.cpp"
    source_tmp = Path(tmp_name).with_suffix(".cpp")
    source_tmp.write_text(source)
    os.replace(source_tmp, source_path)
    try:
        done = subprocess.run([CXX, *flags, "-x", "c++", str(source_path), "-o", tmp_name],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{what}: {CXX} failed ({done.returncode}):\n{done.stderr[-4000:]}")
        os.replace(tmp_name, library)
    finally:
        Path(tmp_name).unlink(missing_ok=True)
    logger.info("%s: built %s", what, library)
    return library


def build_sources(files: dict[str, str], sources: tuple[str, ...], flags: tuple[str, ...], name: str,
                  directory: Path, what: str, extra_key: str = "") -> Path:
    """Compile the translation units `sources` (names in `files`: name -> text, headers included)
    with `flags` into one library `directory`/`name`-<digest>.so (cached); its path. The files stay
    in `name`-<digest>/ beside it (debuggers and sanitizer reports point at them); the units compile
    in parallel, then link."""
    key = "\0".join([*(f"{n}\0{text}" for n, text in sorted(files.items())), " ".join(flags), compiler_version(),
                     extra_key])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    library = directory / f"{name}-{digest}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}-{digest}-", dir=directory))
    try:
        for file_name, text in files.items():
            (work / file_name).write_text(text)
        compile_flags = [f for f in flags if f != "-shared"]
        jobs = [subprocess.Popen([CXX, *compile_flags, "-c", "-x", "c++", str(work / source), "-o",
                                  str(work / f"{source}.o")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for source in sources]
        failures = [(job.args[-3], job.returncode, err) for job in jobs for _, err in [job.communicate()]
                    if job.returncode != 0]
        if failures:
            source, code, err = failures[0]
            raise RuntimeError(f"{what}: {CXX} failed on {Path(source).name} ({code}):\n{err[-4000:]}")
        linked = work / f"{name}.so"
        done = subprocess.run([CXX, *flags, *(str(work / f"{source}.o") for source in sources), "-o", str(linked)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{what}: linking failed ({done.returncode}):\n{done.stderr[-4000:]}")
        kept = directory / f"{name}-{digest}"
        if not kept.exists():
            kept.mkdir(exist_ok=True)
            for file_name, text in files.items():
                (kept / file_name).write_text(text)
        os.replace(linked, library)
    finally:
        for path in work.iterdir():
            path.unlink()
        work.rmdir()
    logger.info("%s: built %s", what, library)
    return library
