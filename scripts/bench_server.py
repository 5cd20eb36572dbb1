#!/usr/bin/env python3
"""Time to first token and tokens/s through `python -m eagle_mlx.server`: plain vs EAGLE.

    python scripts/bench_server.py --num-prompts 5 --max-tokens 64

Starts the server twice on the demo target (plain: the target alone; EAGLE: with the
shipped head), sends the same MT-bench first turns to each as streaming chat requests,
one at a time, and prints the medians. Pass --model/--eagle for another pair.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start(args):
    proc = subprocess.Popen([sys.executable, "-m", "eagle_mlx.server", "--port", "0", *args],
                            cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    line = ""
    while "serving" not in line:
        line = proc.stderr.readline()
        if not line:
            raise SystemExit(f"the server did not start ({' '.join(args)})")
    return proc, int(line.rsplit(":", 1)[1].split("/")[0])


def one(port, text, max_tokens):
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = usage = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft": first - start, "tps": (usage["completion_tokens"] - 1) / max(end - first, 1e-9),
            "tau": usage["eagle"]["tau"]}


def main():
    from eagle_mlx.benchmark import load_prompts
    from eagle_mlx.demo import demo_paths

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--eagle")
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    if args.model:
        plain, eagle = ["--model", args.model], ["--model", args.model, "--eagle", args.eagle]
    else:  # the demo pair as a user gets it (its draft vocabulary included)
        plain, eagle = ["--model", str(demo_paths()[0])], []
    prompts = [t for _, t in load_prompts(["mt-bench"], args.num_prompts)]
    rows = {}
    for name, flags in (("plain", plain), ("EAGLE", eagle)):
        proc, port = start(flags)
        try:
            one(port, "Hello.", 4)  # warm-up
            rows[name] = [one(port, t, args.max_tokens) for t in prompts]
        finally:
            proc.terminate()
            proc.wait()
    print(f"{len(prompts)} MT-bench first turns, {args.max_tokens} tokens, streamed, one at a time")
    print("| | time to first token | tokens/s | tau |\n| --- | --- | --- | --- |")
    for name, rs in rows.items():
        print(f"| {name} | {statistics.median(r['ttft'] for r in rs):.2f} s | "
              f"{statistics.median(r['tps'] for r in rs):.2f} | "
              f"{statistics.mean(r['tau'] for r in rs):.2f} |")


if __name__ == "__main__":
    main()
