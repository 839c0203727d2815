"""Kernel choices measured on this machine, kept on disk so that a restart is instant.

What is kept: for each machine fingerprint (what decides which kernel is fastest: the
CPU's model and flags, the thread count, torch's version, the build of kvserve's own
kernel and its vector loop, and how the measurement weighs row counts), the choice made
for each layer shape with the times it was made on (engine/linear_choice.py). A restart
on the same fingerprint reads them; a changed fingerprint (another CPU, another thread
count, an edited kernel) measures again, beside the records of the others.

Where: `KVSERVE_KERNEL_CACHE` (a file), else `$XDG_CACHE_HOME/kvserve/cpu_kernels.json`,
else `~/.cache/kvserve/cpu_kernels.json`. A file that cannot be read or parsed, or a
folder that cannot be written, never fails a start: a warning, and the choices are
measured again (or fall back to the vendor rules) without it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from native.build import library_digest
from native.cpu import cpuinfo

log = logging.getLogger("kvserve.engine")

ENV_CACHE = "KVSERVE_KERNEL_CACHE"
VERSION = 1  # of the file's layout
KEEP = 16  # fingerprints kept in the file (the most recently written)


def cache_path() -> Path:
    """The cache file (`KVSERVE_KERNEL_CACHE`, else under XDG_CACHE_HOME or ~/.cache)."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvserve" / "cpu_kernels.json"


@functools.cache
def _cpu() -> tuple[str, str]:
    """This CPU's name (vendor, family, model, stepping, model name) and a digest of its
    flags: read once."""
    name = " / ".join(cpuinfo(f) for f in ("vendor_id", "cpu family", "model\t", "stepping",
                                           "model name"))
    flags = hashlib.sha256(" ".join(sorted(cpuinfo("flags").split())).encode())
    return name, flags.hexdigest()[:16]


@functools.cache
def _panels_build() -> str:
    return library_digest("kvserve_layer_ops_cpu")


def fingerprint(panels_isa: str, scheme: str) -> dict[str, Any]:
    """What decides which kernel is fastest here: the CPU, its flags, torch's thread
    count and version, the panel kernel's build (source, headers, flags) and vector
    loop (`panels_isa`), and `scheme` (the row counts measured and their weights)."""
    name, flags = _cpu()
    return {"cpu": name, "cpu_flags": flags, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "panels_build": _panels_build(),
            "panels_isa": panels_isa, "scheme": scheme}


def fingerprint_key(fp: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def _read(path: Path) -> dict[str, Any]:
    """The file's records by fingerprint key; {} where there is none, and {} with a
    warning where it cannot be read or is not this layout."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.warning("CPU kernel cache %s unreadable (%s): measuring again", path, e)
        return {}
    try:
        data = json.loads(text)
        if data.get("version") != VERSION or not isinstance(data.get("machines"), dict):
            raise ValueError(f"not a version {VERSION} kernel cache")
        return data["machines"]
    except (ValueError, AttributeError) as e:
        log.warning("CPU kernel cache %s is corrupt (%s): ignored, measuring again", path, e)
        return {}


def load(fp: dict[str, Any], path: Path | None = None) -> dict[str, dict]:
    """The records kept for fingerprint `fp`: shape key -> record ({} if none)."""
    machine = _read(path or cache_path()).get(fingerprint_key(fp))
    shapes = machine.get("shapes") if isinstance(machine, dict) else None
    return shapes if isinstance(shapes, dict) else {}


def store(fp: dict[str, Any], shapes: dict[str, dict], path: Path | None = None) -> bool:
    """Add `shapes` to fingerprint `fp`'s records (the file read again first: another
    process may have written since), atomically; whether it was written (a warning if
    not)."""
    path = path or cache_path()
    machines = _read(path)
    key = fingerprint_key(fp)
    old = machines.pop(key, None)
    kept = old.get("shapes", {}) if isinstance(old, dict) else {}
    machines[key] = {"fingerprint": fp, "shapes": {**kept, **shapes}}  # last: newest
    machines = dict(list(machines.items())[-KEEP:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"version": VERSION, "machines": machines}, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        log.warning("CPU kernel cache %s not written (%s): the next start measures again",
                    path, e)
        return False
    return True
