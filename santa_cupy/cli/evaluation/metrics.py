"""Accuracy metrics, pure NumPy in float64: relative L2, KL and top-1 agreement of logits, NLL and
perplexity, exact-match length, retrieval success, and exact float64 attention.
"""

from __future__ import annotations

import math
import re

import numpy as np


def relative_l2(estimate, reference) -> float:
    """||estimate - reference||_2 / ||reference||_2 over all elements (float64)."""
    est = np.asarray(estimate, np.float64)
    ref = np.asarray(reference, np.float64)
    if est.shape != ref.shape:
        raise ValueError(f"shape mismatch: {est.shape} vs {ref.shape}")
    denom = np.linalg.norm(ref)
    if denom == 0:
        raise ValueError("reference has zero norm")
    return float(np.linalg.norm(est - ref) / denom)


def log_softmax(logits) -> np.ndarray:
    """Stable log-softmax over the last axis, float64."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def kl_from_logits(p_logits, q_logits) -> np.ndarray:
    """KL(p || q) per row (last axis = vocabulary) from unnormalised logits, float64, >= 0."""
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return np.maximum(kl, 0.0)


def top1_agreement(a_logits, b_logits) -> np.ndarray:
    """Per row: do the argmax tokens agree (bool array)."""
    return np.argmax(np.asarray(a_logits), -1) == np.argmax(np.asarray(b_logits), -1)


def token_nll(logits, targets) -> np.ndarray:
    """Per row negative log-likelihood of targets[i] under softmax(logits[i]), float64."""
    lp = log_softmax(logits)
    t = np.asarray(targets, np.int64)
    return -lp[np.arange(lp.shape[0]), t]


def perplexity(nll) -> float:
    """exp(mean NLL)."""
    nll = np.asarray(nll, np.float64)
    if nll.size == 0:
        raise ValueError("perplexity of zero tokens")
    return float(np.exp(nll.mean()))


def exact_match_length(reference, candidate) -> int:
    """Number of leading tokens on which two sequences agree (index of the first divergence)."""
    n = 0
    for a, b in zip(reference, candidate):
        if int(a) != int(b):
            break
        n += 1
    return n


def mean_std(values) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0 for a single value)."""
    v = np.asarray(values, np.float64)
    if v.size == 0:
        raise ValueError("mean_std of no values")
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def retrieval_success(answer: str, code) -> bool:
    """The answer contains the code's digits (spaces and thousands separators ignored)."""
    digits = re.sub(r"(?<=\d)[\s,.'](?=\d)", "", answer)
    return str(code) in digits


def success_rate(flags) -> float:
    flags = list(flags)
    if not flags:
        raise ValueError("success rate of no trials")
    return sum(bool(f) for f in flags) / len(flags)


def exact_attention(q, k_cache, v_cache, length: int, scale: float | None = None) -> np.ndarray:
    """Exact float64 decode attention of one sequence set: q [B,H,D], caches [B,L,KVH,D] (float
    arrays, already widened), first ``length`` rows -> o [B,H,D] float64."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k_cache[:, :length], np.float64)
    v = np.asarray(v_cache[:, :length], np.float64)
    B, H, D = q.shape
    KVH = k.shape[2]
    G = H // KVH
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qg = q.reshape(B, KVH, G, D)
    s = np.einsum("bkgd,blkd->bkgl", qg, k) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bkgl,blkd->bkgd", p, v).reshape(B, H, D)



def exact_lse(q, k_cache, length: int, scale: float | None = None) -> np.ndarray:
    """Log-sum-exp [B, H] float64 of the exact scaled scores of the first ``length`` rows (the
    shapes of exact_attention)."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k_cache[:, :length], np.float64)
    B, H, D = q.shape
    KVH = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = np.einsum("bkgd,blkd->bkgl", q.reshape(B, KVH, H // KVH, D), k) * scale
    m = s.max(-1, keepdims=True)
    return (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0].reshape(B, H)


def seed_bias(outs, exact) -> tuple[float, float, float]:
    """The bias of a random estimate over seeds, as tools/key_sampling_study.py measures it:
    outs [S, ...] (one estimate per seed), exact [...] -> (relative bias ||E o_hat - o|| / ||o||
    with the seed noise subtracted, bias^2 = max(0, ||mean - o||^2 - var / S), var the unbiased
    spread over seeds (0 for one seed); bias^2; the mean squared error)."""
    outs = np.asarray(outs, np.float64)
    exact = np.asarray(exact, np.float64)
    S = outs.shape[0]
    axes = tuple(range(1, outs.ndim))
    norm2 = float((exact ** 2).sum())
    mse = float(((outs - exact) ** 2).sum(axis=axes).mean())
    spread = float(((outs - outs.mean(axis=0)) ** 2).sum()) / max(S - 1, 1)
    bias2 = max(float(((outs.mean(axis=0) - exact) ** 2).sum()) - (spread / S if S > 1 else 0.0), 0.0)
    return (float(np.sqrt(bias2 / norm2)) if norm2 > 0 else 0.0), bias2, mse
