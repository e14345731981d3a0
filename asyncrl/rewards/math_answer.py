"""A math-answer reward: 1.0 when the completion's final answer equals ``record["answer"]``, else 0.0.

Equality is mathematical, by ``math-verify`` (sympy underneath): ``1/2``, ``0.5`` and ``\\frac{1}{2}``
agree, so do ``\\{1,2\\}`` and ``\\{2,1\\}``, ``x^2+2x+1`` and ``(x+1)^2``; intervals keep their open
and closed ends. The completion's answer is what math-verify extracts: a ``\\boxed{...}`` first,
then a "final answer is ..." phrase, then the last expression in the text.

Failures are not zeros. A record without an ``answer``, or with one math-verify cannot parse, raises
(``reward_error``: the data is wrong, not the model). Only a completion with no readable answer, or a
different one, scores 0.0.

Timeouts: math-verify's own timeouts use ``signal.alarm``, which works only on a process's main
thread and would fail in the generator's worker threads, so they are switched off here
(``parsing_timeout=None``, ``timeout_seconds=None``). Sympy can take unbounded time on adversarial
input, so serve this reward with a hard deadline::

    asyncrl reward-serve --reward asyncrl.rewards.math_answer:math_reward --deadline-s 10

whose worker processes are killed and replaced when an item overruns. Used in-process instead,
``episode.reward_timeout_s`` still fails the episode, but a stuck call keeps its thread.
"""

from __future__ import annotations

import numbers


def math_reward(prompt: str, completion: str, record: dict) -> float:
    """1.0 if ``completion``'s final answer equals ``record["answer"]`` (a string or a number), else 0.0."""
    from math_verify import parse, verify

    if "answer" not in record:
        raise KeyError("the record has no 'answer' to compare with")
    gold = parse(gold_latex(record["answer"]), parsing_timeout=None)
    if not gold:
        raise ValueError(f"cannot parse the record's answer {record['answer']!r:.80}")
    predicted = parse(completion, parsing_timeout=None)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0


def gold_latex(answer: object) -> str:
    """A reference answer as math-verify's LaTeX extraction expects it: bare answers go in ``$...$``."""
    if isinstance(answer, bool) or not isinstance(answer, str | numbers.Real):
        raise TypeError(f"the record's answer must be a string or a number, not {type(answer).__name__}")
    text = str(answer).strip()
    if not text:
        raise ValueError("the record's answer is empty")
    if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return text  # already delimited
    return f"${text}$"


if __name__ == "__main__":  # python -m asyncrl.rewards.math_answer ANSWER COMPLETION: the verdict on one pair
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m asyncrl.rewards.math_answer ANSWER COMPLETION")
    print(math_reward("", sys.argv[2], {"answer": sys.argv[1]}))
