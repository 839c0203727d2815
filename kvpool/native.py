"""Building kvserve's C++ CPU ops on first use (torch.utils.cpp_extension).

Why at run time and not at install: the ops are compiled with -march=native for the CPU
they serve on (AVX-512 where it exists), and a pip wheel cannot know it. The library is
cached on disk (TORCH_EXTENSIONS_DIR), so only the first start pays the build. Without a
compiler, or with KVSERVE_CPU_KERNEL=0, `load_ops` returns False and the caller keeps
its torch path: a CPU install never fails over a native op.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: dict[str, bool] = {}


def load_ops(name: str, source: Path, cflags: list[str], ldflags: list[str] | None = None) -> bool:
    """Build (once per process) and load the extension `name` from one C++ source; the
    ops it registers appear under torch.ops. False when it cannot be built."""
    if name in _loaded:
        return _loaded[name]
    with _lock:
        if name not in _loaded:
            _loaded[name] = build(name, source, cflags, ldflags or [])
        return _loaded[name]


def build(name: str, source: Path, cflags: list[str], ldflags: list[str]) -> bool:
    if os.environ.get("KVSERVE_CPU_KERNEL", "1") == "0":
        return False
    try:
        from torch.utils.cpp_extension import load

        log.info("loading C++ ops %s (the first start compiles them)", name)
        load(name=name, sources=[str(source)], is_python_module=False, extra_cflags=cflags,
             extra_ldflags=ldflags, verbose=False)
        return True
    except Exception as exc:  # no compiler, no headers, ...: the torch path still works
        log.warning("C++ ops %s unavailable (%s); using the torch path", name, exc)
        return False
