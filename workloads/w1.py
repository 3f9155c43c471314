"""W1: long chain-of-thought without tools (AIME-style): one request, one long decode."""
from __future__ import annotations

import random

from workloads.build import thinking
from workloads.spec import Scale, Turn, Workload

VERSION = "1"
OUTPUT_TOKENS = {"tiny": 32, "full": 8192}

_SYSTEM = ("You are a competition mathematician. Reason step by step, check every case, verify "
           "the arithmetic twice, and give the final answer as an integer from 0 to 999 in "
           "\\boxed{}.")
_RULES = ("Rules: show all intermediate steps; when a count is asked, describe the bijection or "
          "the case split you rely on; when an expression is simplified, state the identity "
          "used. Do not stop early: an answer without a derivation earns no credit.")
_PROBLEMS = (
    ("Let N be the number of ordered triples (a, b, c) of positive integers with a + b + c = {n} "
    "and a, b, c each not divisible by {p}. Find the remainder when N is divided by 1000."),
    ("A sequence is defined by x_1 = {a}, x_2 = {b} and x_(k+2) = x_(k+1) + {c} x_k for k >= 1. "
    "Find the remainder when x_{n} is divided by 1000."),
    ("In triangle ABC, AB = {a}, BC = {b} and CA = {c}. The incircle touches BC at D. Point E on "
    "segment AD satisfies AE:ED = {p}:1. Find floor(1000 * BE^2 / CE^2) mod 1000."),
    ("Find the number of subsets S of {{1, 2, ..., {n}}} such that no two elements of S differ by "
    "{p} or {c}. Give the remainder modulo 1000."),
    ("Let P(x) be the monic polynomial of degree {p} whose roots are the squares of the roots of "
    "x^{p} - {a}x + {b}. Find |P({c})| mod 1000."),
)


def build_w1(scale: Scale = "full", seed: int = 0) -> Workload:
    """One OpenAI chat request: system + an AIME-style problem; `OUTPUT_TOKENS[scale]` decode
    tokens (thousands at full scale, so the decode rate dominates)."""
    rng = random.Random(f"w1-{seed}")
    problem = rng.choice(_PROBLEMS).format(n=rng.randint(40, 400), p=rng.randint(3, 9),
                                           a=rng.randint(2, 40), b=rng.randint(2, 40),
                                           c=rng.randint(2, 40))
    n_out = OUTPUT_TOKENS[scale]
    body = {"model": "default", "messages": [
        {"role": "system", "content": _SYSTEM},
        {"role": "user", "content": f"{problem}\n\n{_RULES}"}],
        "max_tokens": 32768, "temperature": 0.6, "top_p": 0.95,
        "stream": True, "stream_options": {"include_usage": True}}
    reply = {"role": "assistant", "reasoning_content": thinking(rng, max(1, n_out - 16)),
             "content": f"\\boxed{{{rng.randint(0, 999)}}}"}
    turn = Turn("T1", "w1", "openai", body, n_out, group="main", reply=reply)
    return Workload("W1", VERSION, scale, seed, "long chain-of-thought, no tools (AIME-style)",
                    (turn,))
