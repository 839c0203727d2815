"""Synthetic `StepView`s and a tiny engine stand-in for the pure policy tests.

`Sim` plays the engine's part for one request: it appends positions, builds the view a
policy asked for (attention mass summed per kv group, norms, keys from fixed random
tensors), checks the plan names live positions only, and carries it out.
"""

from __future__ import annotations

import torch

from policies.base import LayerView, StepView


def view(layers: list[LayerView], seq_len: int, prompt_len: int, num_new: int = 1,
         prefill_done: bool = False, block_size: int = 4) -> StepView:
    return StepView(seq_len=seq_len, prompt_len=prompt_len, num_new=num_new,
                    prefill_done=prefill_done, block_size=block_size, layers=layers)


def arange(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64)


def causal_probs(logits: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """Softmax over keys of [Tq, H, n] logits with a causal mask (key pos <= query pos)."""
    mask = kpos[None, None, :] <= qpos[:, None, None]
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)


def group_sum(probs: torch.Tensor, hkv: int) -> torch.Tensor:
    """[Tq, H, n] per query head -> [Tq, Hkv, n] summed over each kv group (the view)."""
    tq, h, n = probs.shape
    return probs.view(tq, hkv, h // hkv, n).sum(dim=2)


class Sim:
    def __init__(self, policy, num_layers: int = 3, hkv: int = 2, group: int = 2,
                 dim: int = 8, block_size: int = 4, max_len: int = 4096, seed: int = 0):
        self.policy = policy
        self.num_layers, self.hkv, self.group, self.block_size = num_layers, hkv, group, block_size
        self.gen = torch.Generator().manual_seed(seed)
        shape = (num_layers, max_len, hkv, dim)
        self.keys = torch.randn(shape, generator=self.gen) * (1 + torch.rand(
            (num_layers, max_len, hkv, 1), generator=self.gen))
        self.values = torch.randn(shape, generator=self.gen)
        self.live = [arange(0) for _ in range(num_layers)]
        self.seq_len = 0
        self.prefill_seen = False

    def step(self, num_new: int, prompt_len: int) -> dict[int, torch.Tensor]:
        new = torch.arange(self.seq_len, self.seq_len + num_new)
        self.seq_len += num_new
        done = not self.prefill_seen and self.seq_len >= prompt_len
        self.prefill_seen |= done
        needs = self.policy.needs
        layers = []
        for layer in range(self.num_layers):
            pos = torch.cat([self.live[layer], new])
            self.live[layer] = pos
            lv = LayerView(positions=pos)
            if needs.attention:
                h = self.hkv * self.group
                logits = torch.randn((num_new, h, pos.numel()), generator=self.gen) * 2
                logits[:, :, pos == 0] += 4.0  # a sink, as real models have
                probs = causal_probs(logits, new, pos)
                lv.attention = group_sum(probs, self.hkv)
            k, v = self.keys[layer, pos], self.values[layer, pos]
            if needs.key_norm:
                lv.key_norm = k.norm(dim=-1)
            if needs.new_key_norm:
                lv.new_key_norm = self.keys[layer, new].norm(dim=-1)
            if needs.value_norm:
                lv.value_norm = v.norm(dim=-1)
            if needs.keys:
                lv.keys = k
            layers.append(lv)
        plan = self.policy.step(view(layers, self.seq_len, prompt_len, num_new, done,
                                     self.block_size))
        for layer, drop in plan.items():
            live = self.live[layer]
            assert drop.dtype == torch.int64
            assert drop.unique().numel() == drop.numel(), "duplicate positions in a plan"
            assert bool(torch.isin(drop, live).all()), "plan names a dead position"
            self.live[layer] = live[~torch.isin(live, drop)]
        return plan

    def counts(self) -> list[int]:
        return [p.numel() for p in self.live]
