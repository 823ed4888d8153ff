"""The attention setting under test (dense, or SANTA's sampler / budget / samples) and the grid of them.
"""

from __future__ import annotations

from dataclasses import dataclass



@dataclass(frozen=True)
class Setting:
    """One attention configuration under test ("dense" has no sampler/budget/S)."""

    method: str = "dense"
    sampler: str = ""
    budget: str = ""
    samples: int = 0

    @property
    def label(self) -> str:
        if self.method == "dense":
            return "dense"
        return f"{self.sampler}/{self.budget}/S={self.samples}"

    def attention(self, seed: int, block_n=None):
        from llama_min.model import AttentionConfig
        if self.method == "dense":
            return AttentionConfig(method="dense", block_n=block_n)
        return AttentionConfig(method="santa", samples=self.samples, sampler=self.sampler,   # the estimator
                               budget=self.budget, seed=seed, block_n=block_n, santa_min_length=0)  # everywhere


DENSE = Setting()


def settings_grid(samplers, budgets, samples) -> list[Setting]:
    """Every sampler x budget x S; the one-pass budget only with the systematic sampler (its design)."""
    from santa_cupy import spec
    return [Setting("santa", sm, bu, int(s)) for sm in samplers for bu in budgets for s in samples
            if bu != spec.ONE_PASS or sm == "systematic"]

