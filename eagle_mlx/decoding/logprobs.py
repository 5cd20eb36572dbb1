"""The log-probability of every emitted token and its top alternatives (OpenAI's `logprobs`),
under the distribution the token was drawn from: greedy decoding reports the target's
distribution (log-softmax of its logits, as mlx-lm's `generate_step` returns it); sampling
reports the one it samples from, after top-p, min-p, top-k and the temperature.

The verify pass already holds the target's logits of every tree node, and an accepted token's
distribution is the logits row of its parent, so speculative decoding reports exactly what
plain decoding reports for the same tokens, at the cost of one small sync when asked for.
"""

from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..targets.layers import log_softmax

@dataclass
class TokenLogprob:
    """One emitted token: its log-probability, and the `top` most likely tokens of the same
    distribution, most likely first, as (token id, log-probability) — tokens the sampling
    filters removed are left out, so there may be fewer than asked. `text` is the piece of
    the output text the token completed (filled where the text is made; "" for a token
    whose characters finish with a later one, and for a stop token)."""

    token: int
    logprob: float
    top: List[Tuple[int, float]] = field(default_factory=list)
    text: str = ""


def distribution(sampling, logits: mx.array) -> mx.array:
    """The log-probabilities [..., V] tokens are drawn from, as reported (see above)."""
    if sampling.temp == 0:
        return log_softmax(logits.astype(mx.float32))
    return sampling.logprobs(logits)


def score(sampling, logits: mx.array, tokens: Sequence[int], top: int) -> List[TokenLogprob]:
    """logits [n, V]: row j is the target's distribution of tokens[j]; `top` alternatives
    each (0: the tokens' own log-probabilities only)."""
    lp = distribution(sampling, logits)
    idx = mx.array(list(tokens), dtype=mx.int32)
    own = mx.take_along_axis(lp, idx[:, None], axis=-1)[:, 0]
    if top > 0:
        best = mx.argpartition(-lp, kth=top - 1, axis=-1)[:, :top]
        best_lp = mx.take_along_axis(lp, best, axis=-1)
        mx.eval(own, best, best_lp)  # SYNC (only when asked for)
        best, best_lp = np.array(best), np.array(best_lp)
        order = np.argsort(-best_lp, axis=-1, kind="stable")
        best = np.take_along_axis(best, order, axis=-1).tolist()
        best_lp = np.take_along_axis(best_lp, order, axis=-1).tolist()
    own = np.array(own).tolist()  # SYNC
    out = []
    for j, t in enumerate(tokens):
        alts = [] if top == 0 else [(i, v) for i, v in zip(best[j], best_lp[j])
                                    if v != float("-inf")]
        out.append(TokenLogprob(int(t), own[j], alts))
    return out

