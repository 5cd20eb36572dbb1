"""This machine's cost curves (a target forward over k tree tokens, the drafter's step over
k nodes) and the cycle model that turns them and a tree's tau into expected tokens/s."""

import mlx.core as mx
import numpy as np

from .timing import median_time

def heap_tree(k: int):
    """A k-node tree shaped like a drafted one (node i under node (i-1)//2: depth about
    log2 k, 5 at 60 nodes): its ancestor-or-self mask [k, k] and depths [k]."""
    parents = np.maximum((np.arange(k) - 1) // 2, 0)
    anc = np.eye(k, dtype=bool)
    for i in range(1, k):
        anc[i] |= anc[parents[i]]
    return mx.array(anc), mx.array(anc.sum(1) - 1)


def cost_curves(model, prefix_len, sizes, reps=5, kv=None, info=None):
    """Seconds for one target forward over k tree tokens after `prefix_len` cached tokens
    (quantized as `kv`, a KVQuantization, says, where it says so at that length), and for
    one head step over k frontier nodes. info: a dict that receives the bytes the target's
    caches hold after the prefix ("kv_bytes")."""
    target, head = model.target, model.head
    prefix = mx.array([list(range(3, 3 + prefix_len))]) % target.vocab_size
    cache = target.make_cache()
    hidden, _ = target(prefix, cache)
    mx.eval(hidden)
    target.quantize(cache, kv)
    if info is not None:
        info["kv_bytes"] = sum(int(getattr(c, "nbytes", 0)) for c in cache)
    taps = head.feature_taps(target) if head is not None else ()
    verify, draft = {}, {}
    for k in sizes:
        toks = mx.arange(3, 3 + k)[None] % target.vocab_size
        anc, depth = heap_tree(k)
        mask = mx.concatenate([mx.ones((k, prefix_len), dtype=mx.bool_), anc], axis=1)
        positions, levels = prefix_len + depth, int(depth.max().item())

        def run_target():
            h, tapped = target(toks, cache, positions=positions, mask=mask, taps=taps,
                               max_depth=levels)
            mx.eval(target.lm_head(h), *tapped)
            for c in cache:
                c.truncate(prefix_len)

        verify[k] = median_time(run_target, reps)
        if getattr(head, "block", False):  # a block of k slots after the context
            bstate = head.make_cache()
            head.add_context(bstate, mx.zeros((prefix_len, head.feature_size), target.dtype))
            mx.eval(bstate.layers[0].arrays())
            root = mx.array(3)

            def run_block():
                mx.eval(head.logits(head.block_hidden(bstate, root, target, k + 1),
                                    target).argmax(-1))

            draft[k] = median_time(run_block, reps)
        elif getattr(head, "reads_kv", False):  # k single-query steps side by side
            shared = {kind: tuple(target.committed_kv(cache, layer, prefix_len)[:2])
                      for kind, layer in head.kv_layers(target).items()}
            x = mx.zeros((1, k, 2 * head.feature_size), dtype=target.dtype)

            def run_steps():
                logits, fed = head.step(x, shared, prefix_len)
                mx.eval(logits.argmax(-1), fed)

            draft[k] = median_time(run_steps, reps)
        elif head is not None:
            hcache = head.make_cache()
            feats = mx.zeros((1, prefix_len, head.feature_size), dtype=target.dtype)
            mx.eval(head(feats, prefix, target.embed_tokens, hcache, fed_back=False))
            hfeat = mx.zeros((1, k, head.args.hidden_size), dtype=target.dtype)
            hmask = mask

            def run_head():
                out = head(hfeat, toks, target.embed_tokens, hcache, positions=positions,
                           mask=hmask, fed_back=True)
                mx.eval(head.logits(out, target).argmax(-1))
                hcache.truncate(prefix_len)

            draft[k] = median_time(run_head, reps)
    return verify, draft


def interp(curve, k):
    ks = sorted(curve)
    return float(np.interp(k, ks, [curve[x] for x in ks]))


def drafter_kind(head) -> str:
    """How a head's draft time grows with the tree: "block" (one block pass a cycle),
    "steps" (a Gemma 4 assistant: one query at the root, then `depth` levels of `draft_top_k`,
    nothing to catch up on) or "head" (an EAGLE head or MTP module)."""
    if getattr(head, "block", False):
        return "block"
    return "steps" if getattr(head, "reads_kv", False) else "head"


def draft_seconds(tree, tau, draft, kind: str = "head"):
    """Head time of a cycle from its cost curve (`drafter_kind`): catch-up over ~tau tokens
    + `depth` steps (block: one block as deep as the tree, the catch-up folded into it;
    steps: the root's step instead of a catch-up)."""
    if kind == "block":
        return interp(draft, tree["depth"] + 1)
    first = interp(draft, 1) if kind == "steps" else interp(draft, tau)
    return interp(draft, tree["draft_top_k"]) * tree["depth"] + first


def modelled_cycle(tree, tau, verify, draft, calibration):
    """A cycle's modelled seconds: the verify pass from the verify cost curve, the draft
    from the head's cost curve scaled by how the profiled cycles compared with it, the
    acceptance per tree node (sampling turns every node's logits into a distribution), plus
    the profiled fixed cost (cache update, loop)."""
    return (interp(verify, tree["total_tokens"])
            + draft_seconds(tree, tau, draft, calibration.get("drafter", "head"))
            * calibration["draft_scale"]
            + calibration["accept_seconds_per_node"] * tree["total_tokens"]
            + calibration["fixed_seconds"])


def expected_tokens_per_second(tree, tau, verify, draft, calibration):
    """tau tokens per cycle over the modelled cycle, times the one factor that makes the
    default tree's modelled cycle equal its measured one (the profile syncs after every
    phase, and the curves are measured apart from the loop): the default tree calibrates,
    every other tree is a prediction."""
    return tau / (modelled_cycle(tree, tau, verify, draft, calibration)
                  * calibration.get("cycle_scale", 1.0))
