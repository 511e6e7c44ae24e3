"""Scoring of model outputs against request answers, in points (0-100).

- `exact_match`: 100 if the normalised strings are equal, else 0.
- `token_f1`: SQuAD-style bag-of-tokens F1 over whitespace tokens.
- `rouge_l`: ROUGE-L F-measure (beta = 1, as the rouge-score package) from the longest
  common subsequence of whitespace tokens.
Normalisation (all three): lowercase, strip, collapse runs of whitespace. Unlike SQuAD,
punctuation and articles are kept: the answers here are generated words, not prose.

`score(record, generated)` cuts the generated text at its first newline (the answer
ends there) and applies the record's metric. A record is a `Request` or its dict form.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Mapping, Sequence

from .common import Request
from .errors import RecordFormatError


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def first_line(generated: str) -> str:
    """The model's prediction: its generated text up to the first newline."""
    return generated.split("\n", 1)[0]


def exact_match(reference: str, prediction: str) -> float:
    return 100.0 if normalize(reference) == normalize(prediction) else 0.0


def token_f1(reference: str, prediction: str) -> float:
    ref, pred = normalize(reference).split(), normalize(prediction).split()
    if not ref or not pred:
        return 100.0 if ref == pred else 0.0
    common = sum((Counter(ref) & Counter(pred)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 100.0 * 2 * precision * recall / (precision + recall)


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence of two token lists (O(len a * len b))."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(reference: str, prediction: str) -> float:
    ref, pred = normalize(reference).split(), normalize(prediction).split()
    if not ref or not pred:
        return 100.0 if ref == pred else 0.0
    lcs = lcs_length(ref, pred)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 100.0 * 2 * precision * recall / (precision + recall)


METRIC_FUNCTIONS: Mapping[str, Callable[[str, str], float]] = {
    "em": exact_match, "f1": token_f1, "rougeL": rouge_l,
}


def score(record: Request | Mapping[str, Any], generated: str) -> float:
    """Points (0-100) of `generated` (raw model output; cut at its first newline) for
    `record`, by the record's metric."""
    if isinstance(record, Request):
        answer, metric, rid = record.answer, record.metric, record.id
    else:
        try:
            answer, metric, rid = record["answer"], record["metric"], record.get("id")
        except (KeyError, TypeError) as exc:
            raise RecordFormatError(f"record needs 'answer' and 'metric' to be scored, got {record!r:.120}") from exc
    try:
        fn = METRIC_FUNCTIONS[metric]
    except KeyError:
        raise RecordFormatError(f"request {rid!r}: unknown metric {metric!r}; "
                                f"expected one of {', '.join(METRIC_FUNCTIONS)}") from None
    return fn(answer, first_line(generated))
