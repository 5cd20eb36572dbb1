"""Time to first token and tokens/s through `python -m eagle_mlx.server`: plain vs EAGLE,
and (--clients) concurrent clients against continuous batching and `mlx_lm.server`.

    python -m eagle_mlx.benchmark server --num-prompts 5 --max-tokens 64
    python -m eagle_mlx.benchmark server --clients 1 2 4 8 --max-tokens 48

Without --clients: starts the server twice on the demo target (plain: the target alone;
EAGLE: with the shipped head), sends the same MT-bench first turns to each as streaming chat
requests, one at a time, and prints the medians. Pass --model/--eagle for another pair.

With --clients: the target converted once to an MLX folder (float32, as eagle_mlx runs it on
a CPU) so that every server reads the same weights; then for each server — eagle_mlx batched
with EAGLE (--max-batch 8), eagle_mlx batched plain, eagle_mlx one at a time with EAGLE, and
mlx_lm.server (batched, no draft) — N clients each stream a different MT-bench / HumanEval
prompt at once: aggregate tokens/s (all completion tokens over the wall time), and per client
the median time to first token and tokens/s.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path



LAUNCH = [sys.executable]  # (--fastblas: through a fast-BLAS launcher that runs `-m module`)


def start(args):
    proc = subprocess.Popen([*LAUNCH, "-m", "eagle_mlx.server", "--port", "0", *args],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    line = ""
    while "serving" not in line:
        line = proc.stderr.readline()
        if not line:
            raise SystemExit(f"the server did not start ({' '.join(args)})")
    import threading

    threading.Thread(target=proc.stderr.read, daemon=True).start()  # (never a full pipe)
    return proc, int(line.rsplit(":", 1)[1].split("/")[0])


def start_mlx_lm(folder):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([*LAUNCH, "-m", "mlx_lm.server", "--model", str(folder),
                             "--port", str(port)], stderr=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
            return proc, port
        except OSError:
            if proc.poll() is not None:
                raise SystemExit("mlx_lm.server did not start")
            time.sleep(0.5)
    raise SystemExit("mlx_lm.server did not start in 300 s")


def sse_chunks(response):
    """The JSON chunks of a server-sent event stream (until `data: [DONE]`)."""
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def one(port, text, max_tokens, tokenizer=None):
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                       "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = usage = None
    text = ""
    with urllib.request.urlopen(req, timeout=1800) as r:
        for chunk in sse_chunks(r):
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                text += chunk["choices"][0]["delta"]["content"]
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else len(tokenizer.encode(text))
    return {"ttft": first - start, "tps": (n - 1) / max(end - first, 1e-9), "tokens": n,
            "tau": (usage or {}).get("eagle", {}).get("tau", 1.0), "end": end, "start": start}


def concurrent(port, prompts, max_tokens, tokenizer):
    """Every prompt streamed at once by its own client thread."""
    import threading

    out = [None] * len(prompts)

    def ask(i):
        out[i] = one(port, prompts[i], max_tokens, tokenizer)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(r["end"] for r in out) - min(r["start"] for r in out)
    return {"aggregate": sum(r["tokens"] for r in out) / wall,
            "ttft": statistics.median(r["ttft"] for r in out),
            "tps": statistics.median(r["tps"] for r in out),
            "tau": statistics.mean(r["tau"] for r in out)}


def clients_table(args):
    import tempfile

    import eagle_mlx
    from .prompts import load_prompts
    from ..convert import save_target
    from ..demo import demo_paths

    model, head = (args.model, args.eagle) if args.model else demo_paths()
    most = max(args.clients)
    texts = [t for _, t in load_prompts(["mt-bench", "humaneval"], (most + 1) // 2)][:most]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "target"
        target, tokenizer = eagle_mlx.load_target(str(model), dtype="float32")
        save_target(target, tokenizer, folder)
        del target
        servers = [("eagle_mlx batched, EAGLE", ["--eagle", head, "--max-batch", most]),
                   ("eagle_mlx batched, plain", ["--max-batch", most]),
                   ("eagle_mlx one at a time, EAGLE", ["--eagle", head]),
                   ("mlx_lm.server (batched, no draft)", None)]
        rows = []
        for name, flags in servers:
            if flags is None:
                proc, port = start_mlx_lm(folder)
            else:
                proc, port = start(["--model", str(folder), *map(str, flags)])
            try:
                one(port, "Hello.", 4, tokenizer)  # warm-up
                for n in args.clients:
                    r = concurrent(port, texts[:n], args.max_tokens, tokenizer)
                    rows.append((name, n, r))
                    print(f"{name}, {n} clients: {r}", file=sys.stderr, flush=True)
            finally:
                proc.terminate()
                proc.wait()
    print(f"{most} MT-bench / HumanEval prompts, {args.max_tokens} tokens each, greedy, streamed "
          "by concurrent clients")
    print("| server | clients | aggregate tokens/s | per client: time to first token | "
          "per client: tokens/s | tau |\n| --- | --- | --- | --- | --- | --- |")
    for name, n, r in rows:
        print(f"| {name} | {n} | {r['aggregate']:.1f} | {r['ttft']:.2f} s | {r['tps']:.2f} | "
              f"{r['tau']:.2f} |")


def main(argv=None):
    from .prompts import load_prompts
    from ..demo import demo_paths

    p = argparse.ArgumentParser(
        prog="python -m eagle_mlx.benchmark server", description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--eagle")
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--clients", type=int, nargs="+", default=None,
                   help="concurrent clients per measurement: compare batching servers")
    p.add_argument("--fastblas", default=None,
                   help="a launcher script run as `python SCRIPT -m MODULE ...` (a fast BLAS for "
                        "MLX's Linux CPU wheel) for every server")
    args = p.parse_args(argv)
    if args.fastblas:
        LAUNCH.append(args.fastblas)
    if args.clients:
        return clients_table(args)
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
