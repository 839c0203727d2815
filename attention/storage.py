"""The KV storage: the pool's tensors, in the model's dtype or a quantized format.

A block (a page) holds `block_size` token slots of K and V for one *lane*: one layer's
every kv head (`--kv-layout layer`), or one (layer, kv head) (`--kv-layout head`, a
pool of one head per page); its id (handed out by kvpool's `BlockPool`) indexes the
tensors' second axis.
"""

from __future__ import annotations

import torch

from attention import key_stats
from attention.quant import FORMATS, KVFormat, QuantCache, dequantize, quantize
from native.huge_pages import advise_huge_pages


def _format(dtype: torch.dtype | str) -> KVFormat | None:
    if isinstance(dtype, torch.dtype):
        return None
    if dtype not in FORMATS:
        raise ValueError(f"unknown quantized KV format {dtype!r}; one of {sorted(FORMATS)}")
    return FORMATS[dtype]


class PoolExhausted(RuntimeError):
    """Raised when an allocation asks for more blocks than are free (device or host)."""


class KVStorage:
    """The KV tensor `kv[2, num_blocks, block_size, num_kv_heads, head_dim]` and the only
    code that reads or writes it outside the attention kernels.

    The model runner owns it (vLLM v1's split: the block pool is metadata, the runner
    owns the KV tensors). kvpool's `BlockPool` hands out the block ids that index it and
    keeps their reference counts and prefix cache; the moves that kvpool decides
    (compaction, copy-on-write, RoPE shift, swap) are carried out through the methods
    here, so a quantized format's scales always travel with their codes.
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype | str = torch.float32,
                 device: str | torch.device = "cpu", scratch: bool = False) -> None:
        """`dtype`: a float dtype, or a quantized format's name (`attention.quant.FORMATS`:
        int8, fp8_e4m3, int4), whose codes go in `kv` and fp16 scales in `scales`.
        `scratch`: one more block past the `num_blocks` handed out, never owned or
        counted, whose first slot (`scratch_slot`) takes writes nobody reads (a CUDA
        graph's padded rows, engine/cuda_graphs.py), so an idle pool still reads 0 used."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_slot: int | None = num_blocks * block_size if scratch else None
        allocated = num_blocks + int(scratch)
        self.head_dim = head_dim
        self.quant: KVFormat | None = _format(dtype)
        self.scales: torch.Tensor | None = None  # [2, N, bs, Hkv, NG] with a quant format
        width = head_dim
        if self.quant is not None:
            self.quant.check(head_dim)
            width = self.quant.packed_dim(head_dim)
            self.scales = torch.zeros(2, allocated, block_size, num_kv_heads,
                                      self.quant.num_groups(head_dim), dtype=torch.float16,
                                      device=device)
            dtype = self.quant.storage
        # zero_() rather than torch.zeros: zeros may come from calloc, whose pages the OS
        # maps only on first touch, so the process would creep up to the pool's size as
        # blocks are first used (a soak would read that as a leak). Touch it all now:
        # the pool's memory is reserved at start-up, as operators expect.
        self.kv = torch.empty(2, allocated, block_size, num_kv_heads, width,
                              dtype=dtype, device=device)
        advise_huge_pages(self.kv)
        self.kv.view(torch.uint8).zero_()  # fp8 has no zero_ on every device
        self._flat = self.kv.view(2, -1, num_kv_heads, width)  # [2, slots, Hkv, Dp]
        self._flat_scales = (None if self.scales is None
                             else self.scales.view(2, -1, num_kv_heads, self.scales.shape[-1]))

    @staticmethod
    def bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype | str) -> int:
        """K and V bytes of one block, scales included (what pool sizing divides by)."""
        fmt = _format(dtype)
        if fmt is not None:
            return 2 * block_size * fmt.bytes_per_slot(num_kv_heads, head_dim)
        assert isinstance(dtype, torch.dtype)
        return 2 * block_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def heads_per_page(self) -> int:
        """The kv heads one page holds: the model's count, or 1 in a per-head pool."""
        return self.kv.shape[3]

    @property
    def k_cache(self) -> torch.Tensor:
        return self.kv[0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.kv[1]

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype a slot's K/V are stored in (a quantized format's codes'), for the
        runner's kernel choices: it reads the pool's tensors only through `write`/`attend`."""
        return self.kv.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (K and V, one layer; scales included)."""
        return self.nbytes // self.num_blocks

    @property
    def dtype_name(self) -> str:
        """What `--kv-cache-dtype` reports: the format's name or the float dtype's."""
        return self.quant.name if self.quant is not None else str(self.kv.dtype).split(".")[-1]

    # ---- what the runner and the policies' bridge do with the tensors ---------------
    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [T, Hkv, D] at physical slots [T] (rounded to the pool's dtype, or
        quantized with a scale per token and kv head / group). A per-head pool (one kv
        head a slot) takes a layer's K/V [T, H, D] as they are, at slots [H·T],
        head-major (the runner's `write_slots` of the layer's lanes)."""
        if (self.quant is None and slots.device.type == "cpu" and k.stride(-1) == 1
                and v.stride(-1) == 1 and key_stats.load_storage_ops()):
            # one C++ pass (csrc/storage_cpu.cpp)
            torch.ops.kvserve_storage.write_kv(self._flat[0], self._flat[1], slots, k, v)
            return
        if k.shape[1] != self.kv.shape[3]:  # per head: [T, H, D] -> [H·T, 1, D]
            k, v = (x.transpose(0, 1).reshape(-1, 1, x.shape[2]) for x in (k, v))
        if self.quant is None:
            self._flat[0][slots] = k.to(self.kv.dtype)
            self._flat[1][slots] = v.to(self.kv.dtype)
            return
        for i, x in enumerate((k, v)):
            codes, sc = quantize(x, self.quant)
            self._flat[i][slots] = codes
            self._flat_scales[i][slots] = sc

    def attend(self, fn, q: torch.Tensor, *args, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`fn(q, k_cache, v_cache, *args)`: one of this room's paged attention functions
        (torch, C++ or Triton, same contract) over this pool's blocks; a quantized pool
        adds `quant=` (format and scales), and the function dequantizes what it reads."""
        if self.quant is None:
            return fn(q, self.k_cache, self.v_cache, *args, **kw)
        sc = self.scales
        return fn(q, self.k_cache, self.v_cache, *args,
                  quant=QuantCache(self.quant, sc[0], sc[1]), **kw)

    def read_slots(self, phys: torch.Tensor, which: int) -> torch.Tensor:
        """K (which=0) or V (1) of physical slots [m], float32 on the pool's device:
        dequantized from a quantized pool, so every reader sees the stored values."""
        phys = phys.to(self._flat.device)
        x = self._flat[which].index_select(0, phys)
        if self.quant is None:
            return x.float()
        return dequantize(x, self._flat_scales[which].index_select(0, phys), self.quant)

    def rerotate(self, phys: torch.Tensor, rotate, delta: torch.Tensor) -> None:
        """Re-rotate the stored keys of slots `phys` by `rotate(keys, delta)` (RoPE
        shift). A quantized pool dequantizes them, rotates in fp32 and re-quantizes (new
        scales), so a shift costs one more rounding of the moved keys."""
        phys = phys.to(self._flat.device)
        if self.quant is None:  # rotated in the pool's dtype, as stored
            k = self._flat[0][phys]
            self._flat[0][phys] = rotate(k, delta.to(k.device)).to(self.kv.dtype)
            return
        k = self.read_slots(phys, 0)
        codes, sc = quantize(rotate(k, delta.to(k.device)), self.quant)
        self._flat[0][phys] = codes
        self._flat_scales[0][phys] = sc

    def copy_slots(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """K/V (and scales) of physical slots src -> dst (compaction); every source is
        read before any destination is written, so overlapping moves are safe."""
        dst, src = dst.to(self._flat.device), src.to(self._flat.device)
        self._flat[:, dst] = self._flat[:, src]
        if self._flat_scales is not None:
            self._flat_scales[:, dst] = self._flat_scales[:, src]

    def slot_arrays(self) -> list[torch.Tensor]:
        """The [2, slots, ...] views whose slots compaction moves (K/V, then the scales
        of a quantized pool), for `compaction.compact`'s C++ pass."""
        return [self._flat] + ([] if self._flat_scales is None else [self._flat_scales])

    def copy_blocks(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Whole blocks src -> dst, scales included (copy-on-write)."""
        dst, src = dst.to(self.kv.device), src.to(self.kv.device)
        self.kv[:, dst] = self.kv[:, src]
        if self.scales is not None:
            self.scales[:, dst] = self.scales[:, src]

    def read_blocks(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Copies of blocks `ids` (codes, then scales for a quantized pool): what swap
        space stores and `write_blocks` puts back."""
        ids = ids.to(self.kv.device)
        return [t[:, ids] for t in (self.kv, self.scales) if t is not None]

    def write_blocks(self, ids: torch.Tensor, data: list[torch.Tensor]) -> None:
        ids = ids.to(self.kv.device)
        for t, d in zip((t for t in (self.kv, self.scales) if t is not None), data):
            t[:, ids] = d.to(t.device)

    def gather_stats(self, phys: torch.Tensor, key_norm: bool = False, keys: bool = False,
                     value_norm: bool = False) -> dict[str, torch.Tensor]:
        """Key/value statistics of physical slots `phys` ([m]), one gather each:
        {"key_norm", "value_norm": [m, Hkv], "keys": [m, Hkv, D]}, float32 on the CPU
        (where the policies run), whatever the pool's dtype and device."""
        out: dict[str, torch.Tensor] = {}
        if key_norm or keys:  # a quantized pool: the dequantized keys attention sees
            k = self.read_slots(phys, 0).cpu()
            if key_norm:
                out["key_norm"] = torch.linalg.vector_norm(k, dim=-1)
            if keys:
                out["keys"] = k
        if value_norm:
            v = self.read_slots(phys, 1)
            out["value_norm"] = torch.linalg.vector_norm(v, dim=-1).cpu()
        return out

    def key_diversity(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """KeyDiff's score of every slot of rows of blocks (table [N, nb], positions
        [N, W]): [N, W] float32 from the keys in place (attention/key_stats.py; 0 on dead
        slots), or None where the C++ op does not serve this pool (a quantized pool,
        another device, no compiler): the caller then gathers the keys (`gather_stats`)
        and computes it in torch (`policies.norms.keydiff_scores`)."""
        if self.quant is not None or not key_stats.native_key_diversity(self.k_cache):
            return None
        return key_stats.key_diversity(self.k_cache, table, positions)

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's `num_blocks` blocks, scales included (what the pool was
        sized to; a scratch block is one more, not counted)."""
        n = self.num_blocks
        extra = 0 if self.scales is None else self.scales[:, :n].numel() * self.scales.element_size()
        return self.kv[:, :n].numel() * self.kv.element_size() + extra
