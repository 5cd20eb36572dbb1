"""Peers side by side: the same machine, the same model, the same prompts, interleaved.

    python -m eagle_mlx.benchmark peers [--model MLX_FOLDER] [--eagle HEAD] [--num-prompts 2]
        [--max-tokens 64] [--output bench_peers.json]

Modes (each where it is installed): mlx-lm's plain decoding (`generate_step`); mlx-dspark's
baseline (`greedy_generate`) and drafter-free lookup (`lookup_generate`); eagle_mlx plain
(`speculate=False`), lookup alone (`load(..., eagle=None, lookup=True)`, `speculate=True`)
and its default (`speculate="auto"` with the head). Prompt sets: chat (MT-bench) and
copy-heavy (`benchmark`'s edit prompts: correct or quote a passage, annotate a function).

Every mode runs every prompt once, in a rotating order (the machine's drift hits all
alike), greedy, timed from its first token (prefill apart). Reported per set and mode:
tokens per second, tau (tokens per target forward) and whether its tokens are mlx-lm's
plain decoding's. Without --model the demo target is converted once to a float32 MLX
folder (mlx-dspark reads MLX folders) in the user's cache.
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx

from ..outputs import user_cache


def demo_folder() -> str:
    """The demo target as a float32 MLX folder (converted once)."""
    from ..demo import demo_target

    folder = user_cache("peers") / "smollm2-135m-f32"
    if not (folder / "config.json").is_file():
        from ..convert import main as convert

        convert(["--model", str(demo_target()), "--mlx-path", str(folder),
                 "--dtype", "float32"])
    return str(folder)


def modes(model_path: str, eagle):
    """name -> generate(ids, max_tokens) -> (tokens, seconds from the first, forwards)."""
    import eagle_mlx
    from ..mlxlm import generate_step, load as lm_load

    out = {}
    lm, _ = lm_load(model_path)

    def mlx_lm_plain(ids, n):
        toks, start = [], None
        for tok, _ in generate_step(mx.array(ids), lm, max_tokens=n):
            toks.append(int(tok))
            start = start or time.perf_counter()
        return toks, time.perf_counter() - start, len(toks)

    out["mlx-lm plain"] = mlx_lm_plain
    try:
        from mlx_dspark.generate import greedy_generate
        from mlx_dspark.load import load_target
        from mlx_dspark.lookup import lookup_generate
    except ImportError as e:
        print(f"mlx-dspark left out ({e}); `pip install mlx-dspark` runs it too.",
              file=sys.stderr)
    else:
        dtarget, dtok = load_target(model_path)

        def dspark(fn):
            def run(ids, n):
                r = fn(dtarget, dtok, prompt_ids=list(ids), max_new_tokens=n)
                return r.token_ids, r.decode_seconds, r.target_forwards
            return run

        out["mlx-dspark baseline"] = dspark(greedy_generate)
        out["mlx-dspark lookup"] = dspark(lookup_generate)
    plain_model, tok = eagle_mlx.load(model_path, eagle=None, lookup=True)
    auto_model, _ = eagle_mlx.load(model_path, eagle=eagle) if eagle else (plain_model, None)
    auto_model.costs()  # (measured once, before any timing)

    def ours(model, speculate):
        def run(ids, n):
            toks, start, r = [], None, None
            for r in eagle_mlx.stream_generate(model, tok, ids, max_tokens=n,
                                               speculate=speculate):
                toks += r.tokens
                start = start or time.perf_counter()
            return toks, time.perf_counter() - start, r.target_forwards
        return run

    out["eagle_mlx plain"] = ours(plain_model, False)
    out["eagle_mlx lookup"] = ours(plain_model, True)
    out["eagle_mlx auto"] = ours(auto_model, "auto")
    return out, tok


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m eagle_mlx.benchmark peers", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an MLX folder (default: the demo target, as float32)")
    p.add_argument("--eagle", default=None, help="the head auto drafts with (default: the "
                   "demo's, with the demo target)")
    p.add_argument("--num-prompts", type=int, default=2, help="prompts per set")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--output", default="bench_peers.json")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.max_tokens < 2:
        p.error("--num-prompts must be at least 1 and --max-tokens at least 2.")
    from .prompts import edit_prompts, load_prompts
    from ..demo import demo_head

    model_path = args.model or demo_folder()
    eagle = args.eagle or (None if args.model else str(demo_head()))
    runs, tok = modes(model_path, eagle)
    sets = [("chat", p) for _, p in load_prompts(["mt-bench"], args.num_prompts)] + \
        [("copy", p) for _, p in edit_prompts(args.num_prompts)]
    rows = []
    names = list(runs)
    eos = set(tok.eos_token_ids)
    for i, (kind, prompt) in enumerate(sets):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True)
        row = {"set": kind, "prompt_tokens": len(ids), "modes": {}}
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            toks, seconds, forwards = runs[name](ids, args.max_tokens)
            toks = toks[: args.max_tokens]
            ends = [i for i, t in enumerate(toks) if t in eos]  # (the text ends before EOS:
            row["modes"][name] = {"tokens": toks[: ends[0]] if ends else toks,  # some modes
                                  "seconds": seconds, "forwards": forwards}  # stop there)
        ref = row["modes"]["mlx-lm plain"]["tokens"]
        print(f"[{kind} {i + 1}/{len(sets)}] " + ", ".join(
            f"{n} {(len(m['tokens']) - 1) / m['seconds']:.2f}" for n, m in row["modes"].items()),
            file=sys.stderr)
        for m in row["modes"].values():
            m["identical"] = m["tokens"] == ref
        rows.append(row)
    summary = {}
    for kind in ("chat", "copy"):
        mine = [r for r in rows if r["set"] == kind]
        summary[kind] = {}
        for name in names:
            ms = [r["modes"][name] for r in mine]
            tokens = sum(len(m["tokens"]) - 1 for m in ms)
            summary[kind][name] = {
                "tokens_per_second": tokens / sum(m["seconds"] for m in ms),
                "tau": sum(len(m["tokens"]) for m in ms) / max(sum(m["forwards"] for m in ms), 1),
                "identical": all(m["identical"] for m in ms)}
        base = summary[kind]["mlx-lm plain"]["tokens_per_second"]
        print(f"{kind}:", file=sys.stderr)
        for name, s in summary[kind].items():
            s["vs_mlx_lm_plain"] = s["tokens_per_second"] / base
            print(f"  {name:20s} {s['tokens_per_second']:6.2f} tok/s  {s['vs_mlx_lm_plain']:.2f}x"
                  f"  tau {s['tau']:.2f}  identical {s['identical']}", file=sys.stderr)
    report = {"machine": platform.platform(), "mlx": mx.__version__, "model": model_path,
              "eagle": eagle, "max_tokens": args.max_tokens, "summary": summary,
              "prompts": rows}
    Path(args.output).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
