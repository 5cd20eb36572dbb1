#!/usr/bin/env python3
"""Graph nodes of one EAGLE cycle on the demo pair: what Metal's per-kernel cost multiplies.

    python scripts/count_graph.py 0        # whole-vocabulary draft
    python scripts/count_graph.py 8192     # draft over 8192 tokens

Builds one cycle lazily after a 40-token prompt (draft with the default tree 16/4/4, the
verify pass, greedy acceptance), exports the graph with mx.export_to_dot and counts its
operations, beside mlx-lm's own forward of 16 tokens after the same prompt. The cycle
synchronises with the host once (the acceptance), whatever the counts.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import re, tempfile, mlx.core as mx, eagle_mlx
from eagle_mlx.demo import demo_head, demo_target
from eagle_mlx.decoding.tree import draft_dynamic
from eagle_mlx.decoding.accept import accept_greedy
n = int(sys.argv[1])
t, h = str(demo_target()), str(demo_head("eagle1"))  # the demo's EAGLE-1 head
model, tok = eagle_mlx.load(t, eagle=h, draft_vocab=n or None)
target, head = model.target, model.head
ids = mx.array(list(range(1, 41)))
cache, hc = target.make_cache(), head.make_cache()
hidden, _ = target(ids[None], cache); mx.eval(hidden, [c.keys for c in cache] + [c.values for c in cache])
feats = hidden[0]; root = target.lm_head(hidden[0, -1]).argmax(); mx.eval(root)
toks = mx.concatenate([ids[1:], root.reshape(1)])
def count(*outs):
    f = tempfile.NamedTemporaryFile(suffix=".dot", delete=False).name
    mx.export_to_dot(f, *outs)
    return len(re.findall(r'\[label =', open(f).read()))
tree = draft_dynamic(head, target, hc, feats, toks, root, 16, 4, 4)
d = count(tree.tokens, tree.anc, tree.depth)
size = tree.tokens.shape[0]; nn = 40
mask = mx.concatenate([mx.ones((size, nn), dtype=mx.bool_), tree.anc], axis=1)
hid, _ = target(tree.tokens[None], cache, positions=nn + tree.depth, mask=mask)
logits = target.lm_head(hid[0])
best, bonus = accept_greedy(tree, logits)
whole = count(tree.anc[best], bonus)
# mlx-lm's own forward of 16 tokens after the same 40-token cache, for comparison
from eagle_mlx.mlxlm import make_prompt_cache
pc = make_prompt_cache(target.model); target.model(ids[None], cache=pc); mx.eval([c.state for c in pc])
ref = count(target.model(mx.array([list(range(16))]), cache=pc))
print(f"draft_vocab {n or 'full'}: draft {d} nodes, verify+accept {whole - d}, cycle {whole}; "
      f"mlx-lm forward of 16 tokens {ref}")
