"""A load test of an OpenAI-compatible server on this machine: N clients at once, streamed and
not, mixed with malformed requests and clients that leave mid-stream.

    python -m eagle_mlx.benchmark load --clients 64 --max-tokens 16
    python -m eagle_mlx.benchmark load --servers eagle_mlx mlx_lm --clients 64

The target (default: the demo target) is converted once to an MLX folder (float32) so that
every server reads the same weights; each server is started on 127.0.0.1 with a free port,
warmed up, then sent every client's request at the same moment (a barrier): well-formed chat
requests (half streamed), `--bad` malformed ones (each a different mistake) and `--leave`
streams closed after their first chunk. Bounded: each request waits at most `--timeout`
seconds and the run stops sending after `--time-limit`. Reports requests answered, refused
(by status), lost (a connection reset, refused or timed out: must be 0), the p50/p99 time to
the first token of the answered ones and the aggregate completion tokens/s over the wall time.
"""

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import server as bench_server  # (starting the servers)

BAD = [b"{not json", b'{"messages": []}', b'{"messages": "hi"}',
       b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
       b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}']


def request(port, body: bytes, stream: bool, leave: bool, timeout: float):
    """(outcome, status, time to first token, completion tokens)."""
    start = time.perf_counter()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("POST", "/v1/chat/completions", body=body,
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            r.read()
            conn.close()
            return "refused", r.status, None, 0
        if not stream:
            data = json.loads(r.read())
            conn.close()
            n = (data.get("usage") or {}).get("completion_tokens", 0)
            return "answered", 200, time.perf_counter() - start, n
        first, n = None, 0
        for chunk in bench_server.sse_chunks(r):
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter() - start
                if leave:
                    conn.close()
                    return "left", 200, first, 0
        conn.close()
        return "answered", 200, first, n
    except (OSError, http.client.HTTPException) as e:
        return "lost", type(e).__name__, None, 0


def run_load(port, texts, args):
    plan = []  # (body, stream, leave)
    for i in range(args.clients):
        if i < args.bad:
            plan.append((BAD[i % len(BAD)], False, False))
            continue
        stream = i % 2 == 0
        leave = stream and i < args.bad + 2 * args.leave
        body = {"messages": [{"role": "user", "content": texts[i % len(texts)]}],
                "max_tokens": args.max_tokens, "temperature": 0.0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        plan.append((json.dumps(body).encode(), stream, leave))
    out = [None] * len(plan)
    barrier = threading.Barrier(len(plan))
    deadline = time.time() + args.time_limit

    def client(i):
        barrier.wait()
        if time.time() < deadline:
            out[i] = request(port, *plan[i], timeout=min(args.timeout, deadline - time.time()))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(plan))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done = [o for o in out if o is not None]
    ttft = sorted(o[2] for o in done if o[0] == "answered" and o[2] is not None)
    refused = {}
    for o in done:
        if o[0] == "refused":
            refused[o[1]] = refused.get(o[1], 0) + 1
    return {"answered": sum(o[0] == "answered" for o in done),
            "left": sum(o[0] == "left" for o in done), "refused": refused,
            "lost": sum(o[0] == "lost" for o in done) + (len(plan) - len(done)),
            "lost_kinds": sorted({o[1] for o in done if o[0] == "lost"}),
            "ttft_p50": statistics.median(ttft) if ttft else None,
            "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
            "tokens_per_s": sum(o[3] for o in done) / wall, "wall": wall}


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m eagle_mlx.benchmark load", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="target (default: the demo target)")
    p.add_argument("--eagle", help="head for eagle_mlx (default: the demo head with the demo target)")
    p.add_argument("--servers", nargs="+", default=["eagle_mlx", "mlx_lm"],
                   choices=["eagle_mlx", "mlx_lm"])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--bad", type=int, default=5, help="malformed requests among the clients")
    p.add_argument("--leave", type=int, default=4, help="streams closed after their first chunk")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=8, help="eagle_mlx's --max-batch")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--time-limit", type=float, default=1200.0, help="seconds the run may send")
    p.add_argument("--fastblas", default=None, help="as bench_server.py's --fastblas")
    args = p.parse_args(argv)
    if args.fastblas:
        bench_server.LAUNCH.append(args.fastblas)

    import eagle_mlx
    from .prompts import load_prompts
    from ..convert import save_target
    from ..demo import demo_paths

    model, head = (args.model, args.eagle) if args.model else demo_paths()
    texts = [t for _, t in load_prompts(["mt-bench", "humaneval"], 16)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "target"
        target, tokenizer = eagle_mlx.load_target(str(model), dtype="float32")
        save_target(target, tokenizer, folder)
        del target
        for name in args.servers:
            if name == "mlx_lm":
                proc, port = bench_server.start_mlx_lm(folder)
            else:
                flags = ["--model", str(folder), "--max-batch", str(args.max_batch)]
                proc, port = bench_server.start(flags + (["--eagle", head] if head else []))
            try:
                bench_server.one(port, "Hello.", 4, tokenizer)  # warm-up
                r = run_load(port, texts, args)
            finally:
                proc.terminate()
                proc.wait()
            rows.append((name, r))
            print(f"{name}: {r}", file=sys.stderr, flush=True)
    print(f"{args.clients} clients at once ({args.bad} malformed, {args.leave} leaving "
          f"mid-stream, half the rest streamed), {args.max_tokens} tokens each, greedy")
    print("| server | answered | left mid-stream | refused | lost | time to first token p50 / "
          "p99 | aggregate tokens/s |\n| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in rows:
        refused = ", ".join(f"{n} × {s}" for s, n in sorted(r["refused"].items())) or "0"
        lost = f"{r['lost']}" + (f" ({', '.join(r['lost_kinds'])})" if r["lost_kinds"] else "")
        ttft = (f"{r['ttft_p50']:.1f} / {r['ttft_p99']:.1f} s" if r["ttft_p50"] is not None
                else "–")
        print(f"| {name} | {r['answered']} | {r['left']} | {refused} | {lost} | {ttft} | "
              f"{r['tokens_per_s']:.1f} |")


if __name__ == "__main__":
    main()
