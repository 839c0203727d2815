"""CPU tensors on 2 MiB pages (native/huge_pages.py): the KV pool and the linear layers'
panels ask for them before they touch their memory.

Whether the kernel finds free 2 MiB blocks is the host's state: a host fragmented by
hours of other work may have none left, which is not the code's fault (skipped, saying
so); where transparent huge pages are off (`never`) nothing is asked.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from engine import cpu_linear
from loadtest.spawn import python_path
from native.huge_pages import HUGE_PAGE, advise_huge_pages, huge_page_empty


def _anon_huge_kib(addr: int) -> int:
    """AnonHugePages of the mapping that holds `addr` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def _thp_mode() -> str:
    path = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not os.path.exists(path):
        return "never"
    with open(path) as f:
        return f.read().split("[")[1].split("]")[0]


def _free_huge_blocks() -> int:
    """Free blocks of 2 MiB or more (/proc/buddyinfo, orders >= 9 of 4 KiB pages)."""
    with open("/proc/buddyinfo") as f:
        return sum(int(n) << (order - 9) for line in f
                   for order, n in enumerate(line.split()[4:]) if order >= 9)


def _skip_if_fragmented(huge_kib: int) -> None:
    if huge_kib == 0 and _free_huge_blocks() < 32:
        pytest.skip(f"the host has {_free_huge_blocks()} free 2 MiB blocks: too fragmented")


needs_thp = pytest.mark.skipif(sys.platform != "linux" or _thp_mode() == "never",
                               reason="no transparent huge pages here")


@needs_thp
def test_pool_memory_is_backed_by_huge_pages() -> None:
    """The pool asks for 2 MiB pages before it touches its memory."""
    # In a fresh process, as a server allocates its pool at start-up: in this one, earlier
    # tests' allocations may hand the pool memory the allocator already touched (no
    # page fault, no huge page), which failed the suite twice while it passed alone.
    code = ("from native.huge_pages import advise_huge_pages\n"
            "from attention.storage import KVStorage\n"
            "from tests.test_huge_pages import _anon_huge_kib\n"
            "kv = KVStorage(4096, 16, 2, 64).kv\n"  # 64 MiB of K/V
            "assert kv.nbytes == 64 << 20 and advise_huge_pages(kv)\n"
            "print(_anon_huge_kib(kv.data_ptr() + kv.nbytes // 2))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": python_path()})
    assert out.returncode == 0, out.stderr
    huge = int(out.stdout.split()[-1])
    _skip_if_fragmented(huge)
    assert huge >= 16 << 10


@needs_thp
def test_huge_page_empty_is_a_tensor_on_huge_pages_of_its_own() -> None:
    """A mapping of its own, starting on a 2 MiB boundary: every whole 2 MiB of it is a
    huge page once written, even in a process whose heap earlier tests have touched; the
    tensor alone keeps the mapping alive; the tail past the last whole huge page stays on
    small pages (no partly used huge page held)."""
    t = huge_page_empty((5 * HUGE_PAGE // 8 + 300, 2), torch.float16)  # 5 MiB + 1,200 B
    assert t.shape == (5 * HUGE_PAGE // 8 + 300, 2) and t.dtype == torch.float16
    assert t.is_contiguous() and t.data_ptr() % HUGE_PAGE == 0
    gc.collect()
    t.fill_(1.5)
    assert float(t.float().sum()) == 1.5 * t.numel()
    huge = _anon_huge_kib(t.data_ptr())
    _skip_if_fragmented(huge)
    assert huge == 4 << 10  # the two whole 2 MiB pages; the last 1 MiB and 1,200 B are not
    assert not advise_huge_pages(torch.empty(3 * HUGE_PAGE // 2, dtype=torch.uint8))
    small = huge_page_empty((1000,), torch.float32)  # under two huge pages: torch.empty
    assert small.shape == (1000,) and small.untyped_storage().nbytes() == 4000


@needs_thp
@pytest.mark.skipif(not cpu_linear.panels_available(), reason="no panel layout on this CPU")
def test_linear_panels_are_on_huge_pages() -> None:
    """A decode step streams every panel of every layer: they lie on 2 MiB pages."""
    linear = nn.Linear(768, 4096, bias=False).to(torch.bfloat16)  # 6 MiB
    layer = cpu_linear.PanelLinear(linear)
    panels = layer.panels
    assert panels.data_ptr() % HUGE_PAGE == 0
    huge = _anon_huge_kib(panels.data_ptr())
    _skip_if_fragmented(huge)
    assert huge == 6 << 10
    x = torch.randn(3, 768).to(torch.bfloat16)
    with torch.inference_mode():
        want = torch.nn.functional.linear(x.float(), linear.weight.float())
        assert (layer(x).float() - want).abs().max() <= want.abs().max() * 2 ** -7
