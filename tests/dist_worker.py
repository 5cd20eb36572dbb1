"""Run under `mlx.launch`: generate with the target sharded over the ranks and write what
this rank produced to OUT/rank<r>.json (tests/test_distributed.py compares the ranks with
each other and with one process)."""

import json
import sys

import eagle_mlx
from eagle_mlx import distributed

# (sampling, speculate): greedy speculative, plain and adaptive (rank 0's costs and timings
# on every rank), sampling with a seed
CASES = [(dict(temp=0.0), True), (dict(temp=0.0), False), (dict(temp=0.7, top_k=5, seed=11), True),
         (dict(temp=0.0), "auto")]
PROMPT, MAX_TOKENS = [5, 9, 11, 20], 12
# the pair whose costs the ranks measure together for auto (a measurement's hundred cycles
# cost seconds here, each forward's collectives crossing between two processes)
AUTO_PAIR = "llama-eagle1"


def cases(name):
    """(index, sampling, speculate) of every case the pair `name` runs."""
    return [(i, case, speculate) for i, (case, speculate) in enumerate(CASES)
            if speculate != "auto" or name == AUTO_PAIR]


def run(pairs, out):
    group = distributed.group()
    assert group is not None and group.size() == 2
    results = {}
    for name, (target, head) in pairs.items():
        model, tok = eagle_mlx.load(target, eagle=head, group=group)
        for i, case, speculate in cases(name):
            rs = list(eagle_mlx.stream_generate(model, tok, PROMPT, max_tokens=MAX_TOKENS,
                                                speculate=speculate, **case))
            results[f"{name}/{i}"] = [t for r in rs for t in r.tokens]
            results[f"{name}/{i}/passes"] = rs[-1].passes  # (auto: the same on every rank)
        # a sampled generation without a seed: the ranks agree on one
        results[f"{name}/unseeded"] = [t for r in eagle_mlx.stream_generate(
            model, tok, [7, 8], max_tokens=20, temp=1.0) for t in r.tokens]
    with open(f"{out}/rank{group.rank()}.json", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    out, *rest = sys.argv[1:]
    cli = rest.index("--cli")
    pairs = rest[:cli]
    run({pairs[i]: (pairs[i + 1], pairs[i + 2]) for i in range(0, len(pairs), 3)}, out)
    # then the command-line tools, as `python -m eagle_mlx.TOOL ...` run under the launcher:
    # generate with the flags given, chat with the same model flags on the lines of stdin
    from eagle_mlx.chat import main as chat
    from eagle_mlx.generate import main as generate

    flags = rest[cli + 1:]
    code = generate(flags)
    print("---- chat", flush=True)
    model_flags = flags[:flags.index("--prompt")]
    sys.stdin = open(f"{out}/chat.txt")  # the lines typed (rank 0 reads them)
    sys.exit(code or chat([*model_flags, "--max-tokens", "8"]))
