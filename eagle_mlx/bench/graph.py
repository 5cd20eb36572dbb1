"""Graph nodes of one EAGLE cycle on the demo pair: what Metal's per-kernel cost multiplies.

    python -m eagle_mlx.benchmark graph --draft-vocab 0       # whole-vocabulary draft
    python -m eagle_mlx.benchmark graph --draft-vocab 8192    # draft over 8192 tokens

Builds one cycle lazily after a 40-token prompt (draft with the tree 16/4/4, the verify
pass, greedy acceptance), exports the graph with mx.export_to_dot and counts its operations,
beside mlx-lm's own forward of 16 tokens after the same prompt. The cycle synchronises with
the host once (the acceptance), whatever the counts.
"""

import argparse
import re
import tempfile

import mlx.core as mx


def count_nodes(*outputs) -> int:
    """Operations of the lazy graph that computes `outputs`."""
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return len(re.findall(r"\[label =", open(f.name).read()))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m eagle_mlx.benchmark graph",
                                description=__doc__.splitlines()[0])
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="the EAGLE-1 head's draft vocabulary (0: the whole vocabulary)")
    args = p.parse_args(argv)
    if args.draft_vocab < 0:
        p.error(f"--draft-vocab must be 0 or a positive size (got {args.draft_vocab}).")
    import eagle_mlx
    from ..decoding.accept import accept_greedy
    from ..decoding.tree import draft_dynamic
    from ..demo import demo_head, demo_target
    from ..mlxlm import make_prompt_cache

    model, _ = eagle_mlx.load(str(demo_target()), eagle=str(demo_head("eagle1")),
                              draft_vocab=args.draft_vocab or None)
    target, head, n = model.target, model.head, 40
    ids = mx.array(list(range(1, n + 1)))
    cache, head_cache = target.make_cache(), head.make_cache()
    hidden, _ = target(ids[None], cache)
    root = target.lm_head(hidden[:, -1:])[0, 0].argmax()
    mx.eval(hidden, root, [c.keys for c in cache] + [c.values for c in cache])
    tokens = mx.concatenate([ids[1:], root.reshape(1)])
    tree = draft_dynamic(head, target, head_cache, hidden[0], tokens, root, 16, 4, 4)
    drafted = count_nodes(tree.tokens, tree.anc, tree.depth)
    mask = mx.concatenate([mx.ones((tree.tokens.shape[0], n), dtype=mx.bool_), tree.anc], axis=1)
    out, _ = target(tree.tokens[None], cache, positions=n + tree.depth, mask=mask)
    best, bonus = accept_greedy(tree, target.lm_head(out)[0])
    whole = count_nodes(tree.anc[best], bonus)
    prompt_cache = make_prompt_cache(target.model)  # mlx-lm's own forward, the same cache
    target.model(ids[None], cache=prompt_cache)
    mx.eval([c.state for c in prompt_cache])
    ref = count_nodes(target.model(mx.array([list(range(16))]), cache=prompt_cache))
    print(f"draft_vocab {args.draft_vocab or 'full'}: draft {drafted} nodes, verify+accept "
          f"{whole - drafted}, cycle {whole}; mlx-lm forward of 16 tokens {ref}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
