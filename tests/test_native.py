"""Building the C++ ops (kvpool/native.py): a lock left by a killed build is cleared."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvpool.native import STALE_LOCK_S, clear_stale_lock


def test_a_killed_builds_lock_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    """torch waits forever on a build lock; one older than any build is a killed
    build's and must go, a fresh one belongs to a build in progress and must stay."""
    lock = tmp_path / "lock"
    assert not clear_stale_lock(tmp_path)  # no lock
    lock.touch()
    assert not clear_stale_lock(tmp_path) and lock.exists()
    old = time.time() - STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()


def test_the_lock_checked_is_torchs_build_directory(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """load_ops clears the lock in torch's own build directory for the op (a private
    torch helper: this fails loudly if its contract moves)."""
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert Path(_get_build_directory("kvserve_x", verbose=False)) == tmp_path / "kvserve_x"
