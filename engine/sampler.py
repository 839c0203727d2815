"""Batched sampling: one set of tensor ops for every row of a step, whatever its params.

Randomness is a counter-based hash of (request seed, output index, token id), not a
torch.Generator per request: rows are sampled together, and a seeded request draws the
same tokens whatever else shares its batch, its device, or whether it was preempted
and recomputed in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling import SamplingParams
from native.build import load_ops

_M32 = 0xFFFFFFFF
_NO_ROWS = torch.empty(0)  # placeholder parameters of an all-greedy batch


@dataclass
class SamplingBatch:
    """Per-row parameters of one step as tensors ([B] each)."""

    temperature: torch.Tensor  # float32; rows with 0 are greedy
    top_p: torch.Tensor  # float32
    top_k: torch.Tensor  # int64; 0 = off
    min_p: torch.Tensor  # float32
    seed: torch.Tensor  # int64
    step: torch.Tensor  # int64: index of the token being drawn within its request
    all_greedy: bool
    needs_sort: bool  # some row uses top-k or top-p
    max_logprobs: int | None  # largest top-N asked for in the batch (None: nobody)
    needs_min_p: bool = False  # some row uses min-p (decided here: no device sync later)

    @staticmethod
    def greedy(max_logprobs: int | None = None) -> SamplingBatch:
        """Every row greedy (the common offline case): `sample` reads no parameter
        tensor, so none is built — six small tensors a step saved."""
        none = _NO_ROWS
        return SamplingBatch(none, none, none, none, none, none, all_greedy=True,
                             needs_sort=False, max_logprobs=max_logprobs)

    @staticmethod
    def build(params: list[SamplingParams], seeds: list[int], steps: list[int],
              device: torch.device | str = "cpu") -> SamplingBatch:
        """`device`: where the logits are; the parameters go there in one copy, so
        sampling never waits on the host."""
        temps = [p.temperature for p in params]
        lps = [p.logprobs for p in params if p.logprobs is not None]
        if not any(temps):
            return SamplingBatch.greedy(max(lps) if lps else None)
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        # One float64 host tensor (exact for ids, seeds and steps < 2**53), one copy.
        packed = torch.tensor([temps, top_p, min_p, top_k, seeds, steps], dtype=torch.float64)
        if torch.device(device).type == "cuda":  # pinned: an asynchronous copy, no sync
            packed = packed.pin_memory().to(device, non_blocking=True)
        else:
            packed = packed.to(device)
        # slices, not a list index (that would be an index tensor copied to the device)
        f32, i64 = packed[:3].float(), packed[3:].long()
        return SamplingBatch(
            temperature=f32[0], top_p=f32[1], min_p=f32[2], top_k=i64[0],
            seed=i64[1], step=i64[2],
            all_greedy=all(t == 0.0 for t in temps),
            needs_sort=any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p),
            max_logprobs=max(lps) if lps else None,
            needs_min_p=any(m > 0 for m in min_p),
        )


_U_MAX = 1.0 - 2.0**-24  # the float32 below 1 (sampling_cpu.cpp's kUMax)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1), a pure function of (seed, step, token id). Never 1:
    float32 rounds the top 2^-25 of (0, 1) up to 1.0, whose E = -log(1) = 0 gave a
    token of p = 0 (masked by a grammar, cut by top-k / top-p) the key 0 / 0 = NaN,
    which the race's argmax takes."""
    row = _mix32(_mix32(seed) ^ (_mix32(step + 0x27D4EB2F)))
    ids = torch.arange(vocab, dtype=torch.int64, device=seed.device)
    x = _mix32(row[:, None] + ids * 0x61C88647)
    return (x.to(torch.float64) + 0.5).div_(2.0**32).to(torch.float32).clamp_(max=_U_MAX)


def load_sampling_ops() -> bool:
    """Build (once; cached on disk) and load engine/csrc/sampling_cpu.cpp's ops."""
    return load_ops("kvserve_sampling_cpu")


def _native(x: torch.Tensor) -> bool:
    """Whether a [B, V] tensor goes to the C++ ops: float32 on CPU, a vocabulary."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.shape[1] > 0 and load_sampling_ops())


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """First index of each row's maximum (torch.max's tie and NaN rule). On CPU a C++
    op (engine/csrc/sampling_cpu.cpp: ~2x torch's max-with-indices, which runs a scalar
    loop); elsewhere, or without a compiler, max(dim).indices — a third of argmax's
    CPU cost for the same answer."""
    if _native(logits):
        return torch.ops.kvserve_sampling.greedy(logits)
    return logits.max(dim=-1).indices


def exponential_race(probs: torch.Tensor, seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """argmax_i p_i / E_i with E_i = -log(u_i) ~ Exp(1), `u` the (seed, step, token)
    noise: token i wins with probability p_i (the exponential race, vLLM's sampler's
    trick too). On CPU one C++ pass per row (engine/csrc/sampling_cpu.cpp: the same
    hash and keys, the log taken only where a bound says a token can win; ~11 ms of a
    160M decode step at 32 sampled rows before); elsewhere these tensor ops."""
    if _native(probs):
        return torch.ops.kvserve_sampling.race(probs, seed, step)
    expo = -torch.log(uniform_noise(seed, step, probs.shape[1]))
    return (probs / expo).argmax(dim=-1)


def truncate(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             native: bool = True) -> torch.Tensor:
    """`probs` with each row's tail zeroed: in stable descending order (ties: the lower
    id first), a token is dropped from rank top_k on (top_k > 0) and from the first one
    whose mass before it reaches top_p on (top_p < 1; the first token always stays). On
    CPU a C++ op orders only what the cut needs (engine/csrc/sampling_cpu.cpp: the
    whole-row sort was 17.7 ms of a 26 ms step at 64 rows of a 4k vocabulary); elsewhere
    a sort, the same tokens (`native` False: the sort on CPU too, what the op is checked
    and measured against)."""
    if native and _native(probs):
        return torch.ops.kvserve_sampling.truncate(probs, top_k, top_p)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(probs.shape[1], device=probs.device)[None, :]
    drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
    # from the first token with top_p before it on (float rounding of a near-flat tail
    # could otherwise let a later one back in)
    cut = ((sorted_p.cumsum(dim=-1) - sorted_p) >= top_p[:, None]) & (top_p[:, None] < 1)
    drop |= cut.to(torch.uint8).cummax(dim=-1).values.bool()
    return probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))


def sample(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Next token per row. logits: [B, V] float32 (raw model output)."""
    greedy = greedy_tokens(logits)
    if b.all_greedy:
        return greedy
    temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    if b.needs_sort:
        probs = truncate(probs, b.top_k, b.top_p)
    if b.needs_min_p:
        floor = b.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    sampled = exponential_race(probs, b.seed, b.step)
    return torch.where(b.temperature > 0, sampled, greedy)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, n: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the model's raw distribution (before temperature or
    truncation, as vLLM and OpenAI report them): the chosen token's [B], and the top-n
    ids [B, n] and values [B, n]."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    top = logp.topk(n, dim=-1) if n > 0 else (logp[:, :0], logp[:, :0].long())
    return chosen, top[1], top[0]


def to_host(tokens: torch.Tensor,
            logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
            ) -> tuple[list[int], tuple[list[float], list[list[int]], list[list[float]]] | None]:
    """The step's one device-to-host transfer: the sampled ids and, when some row asked,
    their logprobs and top-N, packed into one float64 tensor (ids are exact below 2**53).

    Why one: on a GPU every `.tolist()` or `.cpu()` is a synchronisation; the logits
    ([B, V]) never leave the device, only what the requests asked for."""
    if logprobs is None:
        return tokens.tolist(), None
    chosen, ids, vals = logprobs
    n = ids.shape[1]
    packed = torch.cat([tokens[:, None].double(), chosen[:, None].double(), ids.double(),
                        vals.double()], dim=1).cpu()
    host = packed.tolist()
    return ([int(r[0]) for r in host],
            ([r[1] for r in host], [[int(x) for x in r[2 : 2 + n]] for r in host],
             [r[2 + n :] for r in host]))


@dataclass
class TokenScores:
    """Host lists for scored rows (prompt logprobs), one entry per row."""

    logprob: list[float]  # the target token's logprob
    rank: list[int]  # its rank in the row's distribution, 1 = most likely (ties share)
    top_ids: list[list[int]]  # the top-n ids, best first
    top_logprobs: list[list[float]]

    def __len__(self) -> int:
        return len(self.logprob)


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, n: int) -> torch.Tensor:
    """[R, 2 + 2n] float64 on the logits' device: per row the target's logprob, its rank
    (how many tokens are at least as likely, itself included: vLLM's rank), the top-n
    ids and their logprobs. Packed so that all rows of a step come to the host in one
    copy (`scores_to_host`). logits: [R, V] float32; targets: [R] int64."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, targets[:, None])
    rank = (logp >= chosen).sum(dim=-1, keepdim=True)
    parts = [chosen.double(), rank.double()]
    if n > 0:
        top = logp.topk(n, dim=-1)
        parts += [top.indices.double(), top.values.double()]
    return torch.cat(parts, dim=1)


def scores_to_host(packed: torch.Tensor, n: int) -> TokenScores:
    """`score_tokens` rows (concatenated) -> host lists: one device-to-host copy."""
    host = packed.cpu().tolist()
    return TokenScores([r[0] for r in host], [int(r[1]) for r in host],
                       [[int(x) for x in r[2 : 2 + n]] for r in host],
                       [r[2 + n :] for r in host])
