"""`python -m eagle_mlx.benchmark --context 1k 4k 16k`: what speculation costs and yields as
the context grows.

Prompts are made long with real text: a ShareGPT conversation history before an MT-bench
question ("chat"), or HumanEval files before a HumanEval function to complete ("code"), cut
from the front to the length asked for. At every length, each prompt is decoded plainly,
with the head's tree, with adaptive speculation and with adaptive speculation under costs
that make nothing pay ("auto, plain": the engine's own plain passes, against mlx-lm's
`generate_step`) (interleaved, each first by turns), with
float KV caches and, with `--kv-bits`, quantized ones; per length and cache: tokens/s of
each (from the prefill's token on) and their ratio to plain decoding's, tau, prefill
tokens/s, peak memory, whether the text is plain decoding's (greedy), what auto chose; and
the KV cache's size and the cost curves at that length — one verify pass over k tree tokens against one token
(measured, and as the adaptive controller models it at that length from its two
measurements), and the drafter's step over k nodes.
"""

import gzip
import json
import statistics
import sys
from contextlib import contextmanager
from typing import List, Optional, Sequence, Tuple

from ..cli import UsageError, chat_prompt, load_from_args
from ..decoding.settings import GenerationSettings, KVQuantization
from ..errors import EagleError
from ..outputs import atomic_file
from .curves import cost_curves
from .prompts import HUMANEVAL, MTBENCH, package_file, spread
from .timing import timed_generation

SIZES = (1, 2, 4, 8, 16, 32)
CODE_ASK = ("\n\nComplete the following Python function, which may use the code above.\n\n")


def parse_length(text: str) -> int:
    """'1k' = 1024 positions, '16k' = 16384, '3000' = 3000."""
    t = text.strip().lower()
    try:
        n = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise UsageError(f"--context takes lengths such as 1k 4k 16k or 3000 (got {text!r}).") \
            from None
    if n < 64:
        raise UsageError(f"--context lengths must be at least 64 positions (got {text!r}).")
    return n


def _merge_roles(messages: List[dict]) -> List[dict]:
    """Consecutive messages of one role as one (chat templates want turns that alternate)."""
    out: List[dict] = []
    for m in messages:
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {"role": m["role"], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append(dict(m))
    return out


def _fit(tokenizer, messages: List[dict], length: int, template: bool,
         keep: int) -> List[int]:
    """The ids of `messages` cut from the front to at most `length` tokens, as close to it
    as whole words allow: whole leading turn pairs first, then the text of the earliest
    turns from their start (a turn emptied down to its last word before the next is cut);
    the last `keep` characters (the question) are kept whole."""
    def ids(ms):
        return chat_prompt(tokenizer, ms, use_template=template)

    while len(messages) > 3 and len(ids(messages[2:])) >= length:  # (a turn pair at a time)
        messages = messages[2:]
    messages = [dict(m) for m in messages]
    for i in range(len(messages)):
        text = messages[i]["content"]
        end = len(text) - keep if i == len(messages) - 1 else len(text)

        def fits(cut):
            return len(ids(messages[:i] + [{**messages[i], "content": text[cut:]}]
                           + messages[i + 1:])) <= length

        last_word = text[:end].rstrip().rfind(" ") + 1
        if not fits(last_word):  # (even its last word is too much: emptied, the next cut)
            messages[i]["content"] = text[last_word:]
            continue
        lo, hi = 0, last_word  # the fewest characters to cut so that it fits
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        while 0 < lo < len(text) and not text[lo - 1].isspace():
            lo += 1  # (to the next word's start)
        messages[i]["content"] = text[lo:]
        break
    return ids(messages)


def long_prompts(tokenizer, datasets: Sequence[str], n: int, length: int,
                 template: bool = True) -> List[Tuple[str, List[int]]]:
    """n prompts of each dataset, each holding about `length` tokens (see the module
    docstring): ("chat" | "code", ids)."""

    out = []
    if "mt-bench" in datasets:
        from ..training.data import load_conversations

        questions = [json.loads(l)["turns"][0] for l in
                     package_file(MTBENCH).read_text().splitlines() if l.strip()]
        conversations = load_conversations(limit=2000)
        for i, q in enumerate(spread(questions, n)):
            history, j = [], (i * 97) % len(conversations)
            final = [{"role": "user", "content": q}]
            while len(chat_prompt(tokenizer, history + final, use_template=template)) < length:
                turns = _merge_roles(conversations[j % len(conversations)])
                if turns[-1]["role"] == "user":
                    turns = turns[:-1]
                history += turns
                j += 1
            out.append(("chat", _fit(tokenizer, _merge_roles(history + final), length,
                                     template, len(q))))
    if "humaneval" in datasets:
        with gzip.open(package_file(HUMANEVAL), "rt") as f:
            rows = [json.loads(l) for l in f if l.strip()]
        for i, r in enumerate(spread(rows, n)):
            files, j = "", (i * 31 + 1) % len(rows)
            ask = CODE_ASK + r["prompt"]
            while len(chat_prompt(tokenizer, [{"role": "user", "content": files + ask}],
                                  use_template=template)) < length:
                other = rows[j % len(rows)]
                if other is not r:
                    files += other["prompt"] + other["canonical_solution"] + "\n\n"
                j += 1
            out.append(("code", _fit(tokenizer, [{"role": "user", "content": files + ask}],
                                     length, template, len(ask))))
    return out


def context_costs(model, length: int, kv: Optional[KVQuantization], sizes=SIZES) -> dict:
    """The cost curves after `length` positions (quantized as `kv` says): a verify pass over
    k tree tokens and the drafter's step over k nodes, each over one token's verify; beside
    them the adaptive controller's t(k)/t(1) at that length."""

    info = {}
    verify, draft = cost_curves(model, length, sizes, reps=3, kv=kv, info=info)
    t1 = verify[1]
    out = {"verify_seconds_1": t1, "kv_cache_mb": info["kv_bytes"] / 2 ** 20,
           "verify_cost_curve": {str(k): verify[k] / t1 for k in sizes},
           "draft_cost_curve": {str(k): draft[k] / t1 for k in sizes} if draft else {}}
    if _adaptive(model):
        costs = model.costs(kv)  # (quantized from the start here: the costs measured so)
        out["modelled_verify_cost_curve"] = {
            str(k): costs.verify(k, length) / costs.verify(1, length) for k in sizes}
    return out


def _adaptive(model) -> bool:
    """Whether auto speculates on this model (else it decodes plainly, no costs)."""
    return model.group is None and (model.head is not None or model.auto_lookup is not None)


def context_report(model, tokenizer, args, lengths: Sequence[int]) -> dict:
    """Every length: the prompts, each mode with each KV cache, the cost curves; printed as
    it goes, returned as the JSON report."""
    tree = model.tree_settings()
    shape = {"total_tokens": tree.total_tokens, "depth": tree.depth,
             "draft_top_k": tree.draft_top_k}
    wanted = set(getattr(args, "modes", None) or ("tree", "auto", "auto-plain"))
    modes = {"plain": dict(speculate=False)}
    if model.head is not None and "tree" in wanted:
        modes["tree"] = dict(speculate=True, **shape)
    if "auto" in wanted:
        modes["auto"] = dict(speculate="auto")
    if _adaptive(model) and "auto-plain" in wanted:  # (the engine's plain passes, against
        modes["auto, plain"] = dict(speculate="auto")  # mlx-lm's: `PLAIN_COSTS`)

    kvs: List[Optional[KVQuantization]] = \
        ([] if getattr(args, "quantized_only", False) else [None]) + \
        ([args.kv] if args.kv is not None else [])
    if _adaptive(model):
        for kv in kvs:  # (measured before anything is timed, where none are on record)
            model.costs(kv)
    from ..tuning import machine

    report = {"machine": machine(), "model": str(model.target.path), "eagle": model.head_path,
              "max_tokens": args.max_tokens, "tree": shape, "temp": args.temps[0],
              "lengths": {}}
    temp = args.temps[0]
    for length in lengths:
        prompts = long_prompts(tokenizer, args.datasets, args.num_prompts, length,
                               not args.ignore_chat_template)
        per_kv = {}
        for kv in kvs:
            name = "float" if kv is None else f"{kv.bits}-bit"
            kv_args = {} if kv is None else {"kv_bits": kv.bits, "kv_group_size": kv.group_size,
                                              "quantized_kv_start": kv.start}
            rows = []
            for i, (src, ids) in enumerate(prompts):
                row = {"source": src, "prompt_tokens": len(ids)}
                order = list(modes) if i % 2 == 0 else list(modes)[::-1]
                for m in order:
                    s = GenerationSettings(max_tokens=args.max_tokens, temp=temp,
                                           seed=args.seed + i, **modes[m], **kv_args)
                    with plain_costs(model, kv, m == "auto, plain"):
                        row[m] = timed_generation(model, tokenizer, ids, settings=s)
                for m in modes:
                    if m != "plain" and temp == 0:
                        row[m]["identical"] = row[m]["tokens"] == row["plain"]["tokens"]
                rows.append(row)
            summary = _summarise(rows, modes)
            summary["costs"] = context_costs(model, int(statistics.median(
                r["prompt_tokens"] for r in rows)), kv)
            per_kv[name] = {"summary": summary, "prompts": [
                {k: ({kk: vv for kk, vv in v.items() if kk != "tokens"}
                     if isinstance(v, dict) else v) for k, v in r.items()} for r in rows]}
            _print(length, name, summary)
        report["lengths"][str(length)] = per_kv
    return report


# costs under which nothing pays (every pass costs what its tokens would plainly): auto then
# decodes plainly throughout, through the engine's cycle, so its speed against plain
# decoding's (mlx-lm's `generate_step`) is what the engine's plain pass costs beyond it
PLAIN_COSTS = {1: 1.0, 2: 2.0, 4: 4.0, 16: 16.0}


@contextmanager
def plain_costs(model, kv: Optional[KVQuantization], on: bool):
    """While inside, where `on`, the model's costs (float and `kv`'s) are PLAIN_COSTS."""
    if not on:
        yield
        return
    from ..decoding.adaptive import Costs

    key = None if kv is None else (kv.bits, kv.group_size)
    saved = model.measured, dict(model.measured_kv)
    model.measured = Costs(PLAIN_COSTS)
    if key is not None:
        model.measured_kv[key] = Costs(PLAIN_COSTS)
    try:
        yield
    finally:
        model.measured, model.measured_kv = saved[0], saved[1]


def _summarise(rows, modes) -> dict:
    out = {"prompt_tokens": statistics.mean(r["prompt_tokens"] for r in rows)}
    plain = None
    for m in modes:
        produced = sum(len(r[m]["tokens"]) - 1 for r in rows)
        tps = produced / max(sum(r[m]["seconds"] for r in rows), 1e-9)
        plain = plain or tps
        passes = {}
        for r in rows:
            for k, n in r[m]["passes"].items():
                passes[k] = passes.get(k, 0) + n
        out[m] = {"tokens_per_second": tps, "ratio": tps / plain,
                  "tau": sum(len(r[m]["tokens"]) for r in rows) /  # (tokens a target pass)
                  max(sum(r[m]["target_forwards"] for r in rows), 1),
                  "prefill_tokens_per_second": sum(r["prompt_tokens"] for r in rows) /
                  sum(r[m]["prefill_seconds"] for r in rows),
                  "peak_memory_gb": max(r[m]["peak_memory_gb"] for r in rows),
                  "passes": passes}
        if m != "plain" and all("identical" in r[m] for r in rows):
            out[m]["identical"] = all(r[m]["identical"] for r in rows)
    return out


def _print(length, name, s) -> None:
    c = s["costs"]
    parts = [f"plain {s['plain']['tokens_per_second']:.2f} tok/s"]
    for m in ("tree", "auto", "auto, plain"):
        if m in s:
            same = {True: ", same text", False: ", TEXT DIFFERS"}.get(s[m].get("identical"), "")
            parts.append(f"{m} {s[m]['tokens_per_second']:.2f} tok/s "
                         f"({s[m]['ratio']:.2f}x, tau {s[m]['tau']:.2f}{same})")
    curve = c["verify_cost_curve"]
    modelled = c.get("modelled_verify_cost_curve")
    print(f"context {length} ({int(s['prompt_tokens'])} tokens), {name} KV: " + "; ".join(parts)
          + (f"; auto's passes {s['auto']['passes']}" if "auto" in s else "")
          + "; verify t(k)/t(1) "
          + ", ".join(f"{k}: {v:.2f}" for k, v in curve.items())
          + (" (modelled " + ", ".join(f"{k}: {v:.2f}" for k, v in modelled.items()) + ")"
             if modelled else "")
          + (f"; draft step over 1/16 nodes {c['draft_cost_curve']['1']:.2f}/"
             f"{c['draft_cost_curve']['16']:.2f} t(1)" if c["draft_cost_curve"] else "")
          + f"; KV cache {c['kv_cache_mb']:.1f} MB, peak memory "
          f"{max(s[m]['peak_memory_gb'] for m in ('plain', 'tree', 'auto') if m in s):.2f} GB",
          file=sys.stderr, flush=True)


def context_main(args, output) -> int:
    """`--context`: the long-context report, written as JSON."""
    from ..decoding.plan import check_kv
    from ..distributed import group, rank

    for spec in ([MTBENCH] if "mt-bench" in args.datasets else []) + \
            ([HUMANEVAL] if "humaneval" in args.datasets else []):
        package_file(spec)  # (before the model loads)
    if "mt-bench" in args.datasets:
        from ..training.data import sharegpt_path

        sharegpt_path()
    model, tokenizer = load_from_args(args)
    target = model.target
    for n in args.context:
        if n + args.max_tokens + 16 > target.max_context:
            raise UsageError(f"--context {n} with --max-tokens {args.max_tokens} exceeds the "
                             f"model's context of {target.max_context} tokens.")
    if args.kv is not None:
        try:
            check_kv(model, args.kv)
        except EagleError as e:
            raise UsageError(str(e)) from None
    report = context_report(model, tokenizer, args, args.context)
    if rank(group()) == 0:
        atomic_file(output, lambda tmp: tmp.write_text(json.dumps(report, indent=2)))
    return 0
