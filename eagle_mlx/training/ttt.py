"""The training-time test: the head unrolled on its own outputs, as it drafts (EAGLE-3's
recipe; for an EAGLE-1 head, `train --unroll`, the same idea as HASS's harmonized context).

At draft depth j the engine feeds a tree node the head's own output at its parent and
the token drafted there; the node attends to the real positions (the catch-up keys,
made from target features) and to its own chain of ancestors. Training reproduces
exactly that for every position i of a batch at once:

    step 0:  (target features_i, token_{i+1})          at position i
    step j:  (out_{j-1,i}, token_{i+1+j})              at position i + j

(EAGLE-3: the target features are fc(taps_i); EAGLE-1: the post-norm hidden state, and every
step's input is fc(embedding, features) as in the head's own forward.)

where step j attends to the step-0 keys of positions <= i and to the keys of steps 1..j
at position i alone (its ancestors and itself), and predicts the target's next-token
distribution at position i + 1 + j, restricted to the draft vocabulary. Step j's loss is
weighted 0.8**j (the official recipe, seven steps).
"""

from typing import List

import mlx.core as mx

from ..targets.layers import log_softmax

STEP_WEIGHT = 0.8  # the recipe's per-step loss weights: 0.8**j


def _heads(x: mx.array, n: int) -> mx.array:
    B, T, _ = x.shape
    return x.reshape(B, T, n, -1).transpose(0, 2, 1, 3)


def unroll(head, feats: mx.array, step_tokens: List[mx.array], embed) -> List[mx.array]:
    """The head's output hidden states [B, T, H] at each unroll step.

    feats [B, T, F]: the target's features of positions 0..T-1 (EAGLE-3: the tapped states,
    3 x target width; EAGLE-1: the post-norm hidden state);
    step_tokens[j] [B, T]: the token paired with position i at step j (token i+1+j).
    """
    if head.kind == "eagle1":
        layer = head.layers[0]
        h = feats

        def step_input(e, h):  # (attention input, residual)
            x = head.fc(mx.concatenate([e, h], axis=-1))
            return x, x
    else:
        layer = head.midlayer
        if "embed_tokens" in head:
            embed = head.embed_tokens
        h = head.fc(feats)

        def step_input(e, h):
            return mx.concatenate([layer.input_layernorm(e), layer.hidden_norm(h)], axis=-1), h
    attn = layer.self_attn
    T = feats.shape[1]
    rep = attn.n_heads // attn.n_kv_heads
    causal = mx.triu(mx.full((T, T), -mx.inf, dtype=mx.float32), k=1)
    keys, values, outs = [], [], []
    for j, tokens in enumerate(step_tokens):
        a, residual = step_input(embed(tokens).astype(h.dtype), h)
        q = attn.rope(_heads(attn.q_proj(a), attn.n_heads), offset=j)
        k = attn.rope(_heads(attn.k_proj(a), attn.n_kv_heads), offset=j)
        v = _heads(attn.v_proj(a), attn.n_kv_heads)
        if rep > 1:
            k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
        keys.append(k)
        values.append(v)
        # the real prefix (step-0 keys, causal), then this position's own chain
        scores = [(q @ keys[0].transpose(0, 1, 3, 2)) * attn.scale + causal]
        scores += [((q * keys[s]).sum(-1) * attn.scale)[..., None] for s in range(1, j + 1)]
        w = mx.softmax(mx.concatenate(scores, axis=-1).astype(mx.float32), axis=-1).astype(q.dtype)
        o = w[..., :T] @ values[0]
        for s in range(1, j + 1):
            o = o + w[..., T + s - 1: T + s] * values[s]
        B = o.shape[0]
        o = attn.o_proj(o.transpose(0, 2, 1, 3).reshape(B, T, -1))
        h = residual + o
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        outs.append(h)
    return outs


def step_tokens(tokens: mx.array, steps: int) -> List[mx.array]:
    """For a batch of sequences [B, L]: the tokens paired with positions 0..L-2 at each
    step (token i+1+j, zero past the end, where the loss mask is zero too)."""
    B, L = tokens.shape
    padded = mx.concatenate([tokens[:, 1:], mx.zeros((B, steps), dtype=tokens.dtype)], axis=1)
    return [padded[:, j: j + L - 1] for j in range(steps)]


def step_rows(outs: List[mx.array], sel: mx.array, T: int):
    """Per unroll step j: (j, its output rows scoring the `sel` rows, which of them are
    live). Row a (flat b*T + a) is scored by step j's output at position a - j, live where
    a - j >= 0 (within its own sequence)."""
    pos = sel % T
    for j, out in enumerate(outs):
        yield j, out.reshape(-1, out.shape[-1])[mx.maximum(sel - j, 0)], pos >= j


def unrolled_loss(head, feats, toks, embed, target_p, keep, sel, T, denom):
    """The weighted sum of step losses, each step's loss and correct-prediction count.

    target_p [n, N]: the target's distribution over the draft vocabulary at the `sel`
    rows (flat b*T + a: absolute position a+1, counted by the loss mask at a), or [n] the
    index of its token there (hard labels); keep [n]: whether the target's own top token
    is in the draft vocabulary (the recipe's t2d mask). Step j scores row a with its
    output at position a - j (when a - j >= 0).
    """
    outs = unroll(head, feats, toks, embed)
    total, losses, correct, counts = 0.0, [], [], []
    hard = target_p.ndim == 1
    top = target_p if hard else target_p.argmax(-1)
    for j, rows, live in step_rows(outs, sel, T):
        logits = head.lm_head(head.norm(rows)).astype(mx.float32)
        logp = log_softmax(logits)
        w = (live & keep).astype(mx.float32)
        if hard:
            ll = mx.take_along_axis(logp, target_p[:, None], axis=-1)[:, 0]
        else:
            ll = (target_p * logp).sum(-1)
        loss = -(w * ll).sum() / denom
        total = total + STEP_WEIGHT ** j * loss
        losses.append(loss)
        correct.append(((logits.argmax(-1) == top) & live & keep).sum())
        counts.append(live.sum())
    return total, losses, correct, counts
