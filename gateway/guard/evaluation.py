"""Classifier metrics (no numpy/sklearn needed): F1, precision, recall, false-positive rate, ROC-AUC, and the
threshold choice used for the model card."""

from __future__ import annotations

import math


def metrics(labels: list[int], scores: list[float], threshold: float = 0.5) -> dict:
    tp = sum(1 for y, s in zip(labels, scores) if y == 1 and s >= threshold)
    fp = sum(1 for y, s in zip(labels, scores) if y == 0 and s >= threshold)
    fn = sum(1 for y, s in zip(labels, scores) if y == 1 and s < threshold)
    tn = sum(1 for y, s in zip(labels, scores) if y == 0 and s < threshold)
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {
        "n": len(labels),
        "positives": tp + fn,
        "threshold": threshold,
        "f1": round(f1, 4),
        "precision": round(precision, 4),
        "recall": round(recall, 4),
        "fpr": round(fp / (fp + tn), 4) if fp + tn else 0.0,
        "accuracy": round((tp + tn) / len(labels), 4) if labels else 0.0,
        "roc_auc": None if math.isnan(auc := roc_auc(labels, scores)) else round(auc, 4),  # JSON has no NaN
        "tp": tp,
        "fp": fp,
        "fn": fn,
        "tn": tn,
    }


def defined(figure: str, m: dict) -> bool:
    """Whether `figure` of metrics `m` means something for the labels it counted: recall needs attacks, the
    false-positive rate benign rows, the rest (F1, precision, ROC-AUC, ...) both; `metrics` reports 0 otherwise."""
    attacks, benign = m["positives"], m["n"] - m["positives"]
    if figure == "recall":
        return attacks > 0
    if figure == "fpr":
        return benign > 0
    return attacks > 0 and benign > 0


def roc_auc(labels: list[int], scores: list[float]) -> float:
    """Mann-Whitney U with average ranks for ties; NaN when one class is absent."""
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    pos = sum(labels)
    neg = len(labels) - pos
    if not pos or not neg:
        return math.nan
    return (sum(r for r, y in zip(ranks, labels) if y == 1) - pos * (pos + 1) / 2) / (pos * neg)


def choose_threshold(
    groups: dict[str, tuple[list[int], list[float]]], max_fpr: dict[str, float], penalty: float = 10.0
) -> float:
    """The threshold that maximises the worst group's F1 minus `penalty` x each group's false-positive rate above
    its cap: within the caps it is the best worst-group F1; past them, the least excess."""
    candidates = sorted({round(s, 3) for _, scores in groups.values() for s in scores} | {0.5})
    best, best_value = 0.5, -math.inf
    for t in candidates:
        ms = {g: metrics(y, s, t) for g, (y, s) in groups.items()}
        excess = sum(max(0.0, ms[g]["fpr"] - max_fpr.get(g, 1.0)) for g in ms)
        value = min(m["f1"] for m in ms.values()) - penalty * excess
        if value > best_value:
            best, best_value = t, value
    return best
