"""The attention settings under test (santa_cupy.AttentionSetting: dense, or SANTA's sampler / budget /
samples, either optionally on key-sampled scores) and the grid of them. A setting's name (``str``,
``.label``) is its row in the tables and its key in the result files: "dense",
"systematic/global/S=256", "dense/keys=block:FB=16,f=0.875".
"""

from __future__ import annotations

from santa_cupy.setting import AttentionSetting

DENSE = AttentionSetting(method="dense")


def run_setting(setting: AttentionSetting, seed: int, block_n=None) -> AttentionSetting:
    """The setting a run decodes with: the estimator everywhere (santa_min_length=0: no dense
    fallback for short sequences), with the run's seed and tile size (dense: the tile size only;
    dense on key-sampled scores: also the seed, which keys the key sampling)."""
    if setting.method == "dense":
        return setting.replace(block_n=block_n, **({"seed": int(seed)} if setting.key_sampled else {}))
    return setting.replace(seed=int(seed), block_n=block_n, santa_min_length=0)


def settings_grid(samplers, budgets, samples) -> list[AttentionSetting]:
    """Every sampler x budget x S; the one-pass budget only with the systematic sampler (its design)."""
    from santa_cupy import spec
    return [AttentionSetting(method="santa", sampler=sm, budget=bu, samples=int(s))
            for sm in samplers for bu in budgets for s in samples if bu != spec.ONE_PASS or sm == "systematic"]
