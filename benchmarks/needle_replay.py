"""Needle retrieval scored batched, by the harness's own rule: the piece that kvserve's
quality rows (`policy_eval.evaluate_quality`) and kvpress's (`kvpress_compare.rows`)
share, so neither module imports the other for it."""

from __future__ import annotations

from collections.abc import Sequence


class NeedleReplay:
    """Runs `demo_model.evaluate.needle` unchanged but batched: a first pass records
    its prompts (answering nothing), the caller generates them all at once, a second
    pass replays the answers in order and scores them with the harness's own rule."""

    def __init__(self, max_context: int) -> None:
        self.max_context = max_context
        self.prompts: list[list[int]] = []
        self.answers: list[list[int]] | None = None

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        if self.answers is None:
            self.prompts.append(list(prompt_ids))
            return []
        return self.answers.pop(0)

    def score(self, ids: Sequence[int]) -> list[float]:
        raise NotImplementedError("needle only")


def needle_summary(acc: dict) -> tuple[dict[str, float], float]:
    """{task: {length: {depth: acc}}} -> (mean accuracy per depth, overall mean)."""
    by_depth: dict[str, list[float]] = {}
    for by_len in acc.values():
        for row in by_len.values():
            for depth, v in row.items():
                by_depth.setdefault(depth, []).append(v)
    means = {d: sum(v) / len(v) for d, v in by_depth.items()}
    return means, sum(means.values()) / len(means)
