"""The offload package's C sources, built at first use with the system's C compiler (which Triton needs too): one
shared library per source version, flags and key, in the temporary directory, loaded with ctypes (which releases the
GIL during each call)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from edgemoe.errors import EdgeMoEError


def build_library(
    source: Path, name: str, what: str, flags: list[str], key: bytes = b"", libs: tuple[str, ...] = ()
) -> ctypes.CDLL:
    """`source` compiled with `flags` (and linked with `libs`) into `edgemoe-{name}-{hash}.so` unless it is there
    already, then loaded. `key`: more bytes the build depends on (included files; the CPU, for -march=native). A
    missing compiler or a failed build is one line of `EdgeMoEError` naming `what`."""
    text = source.read_bytes()
    digest = hashlib.sha256(text + "\0".join([*flags, *libs]).encode() + key).hexdigest()[:16]
    target = Path(tempfile.gettempdir()) / f"edgemoe-{name}-{digest}.so"
    if not target.exists():
        cc = os.environ.get("CC", "cc")
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cc, *flags, "-shared", "-fPIC", str(source), "-o", str(partial), *libs]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        except FileNotFoundError as e:
            raise EdgeMoEError(f"{what} needs a C compiler ({cc}): {e}") from None
        except subprocess.CalledProcessError as e:
            lines = e.stderr.strip().splitlines() or [f"{cc} exited with {e.returncode}"]
            first = next((line for line in lines if "error" in line), lines[-1])
            raise EdgeMoEError(f"building {what} failed: {first}") from None
        os.replace(partial, target)
    return ctypes.CDLL(str(target))
