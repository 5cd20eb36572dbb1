"""The cycle's bookkeeping through the drafter interface, with drafters whose acceptance is
known in advance: the target's own greedy continuation (every drafted token accepted) and
tokens the target never picks (none accepted)."""

from types import SimpleNamespace

import mlx.core as mx
import pytest

import eagle_mlx
from eagle_mlx.decoding.drafters import Drafter
from eagle_mlx.decoding.steps import PromptCache, SamplingParams, plain_steps, speculative_steps
from eagle_mlx.decoding.tree import tree_from_parents
from tiny import make_hf_model


class ChainDrafter(Drafter):
    """Proposes a chain of `length` tokens after the root, read off `reference` (the whole
    sequence: prompt and the target's greedy continuation), shifted by `shift` (0: the
    target's own tokens; 1: a token it never picks)."""

    features = None  # reads no target features

    def __init__(self, reference, length, vocab, shift=0):
        self.reference, self.length, self.vocab, self.shift = reference, length, vocab, shift
        self.max_depth = length
        self.parents = mx.array([0] + list(range(length)))
        self.calls = 0

    def new_state(self):
        return SimpleNamespace(offset=0)

    def offset(self, state):
        return state.offset

    def truncate(self, state, length):
        state.offset = min(state.offset, length)

    def propose(self, state, features, tokens, root):
        assert features is None
        state.offset += tokens.shape[0]  # the root sits at position `offset`
        self.calls += 1
        assert root.item() == self.reference[state.offset]
        nxt = self.reference[state.offset + 1: state.offset + 1 + self.length]
        chain = [(t + self.shift) % self.vocab for t in nxt]
        toks = mx.array([root.item()] + chain, dtype=mx.int32)
        return tree_from_parents(toks, self.parents, mx.zeros((self.length + 1,)), self.length)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(tmp_path_factory, request):
    folder = make_hf_model(tmp_path_factory.mktemp("drafters") / "t", request.param, seed=5,
                           vocab_size=64, num_hidden_layers=2)
    t, tok = eagle_mlx.load_target(str(folder))
    return t, tok, folder


PROMPT = [1, 7, 9, 12, 5, 30, 41]


def _reference(t, n):
    out = []
    for step in plain_steps(t, PROMPT, SamplingParams(), t.max_context):
        out += step.tokens
        if len(out) >= n:
            return PROMPT + out


def _run(t, drafter, n_tokens, prompt_cache=None, prompt=PROMPT):
    steps, out = [], []
    for step in speculative_steps(t, drafter, prompt, SamplingParams(),
                                  prompt_cache=prompt_cache):
        steps.append(step)
        out += step.tokens
        if len(out) >= n_tokens:
            break
    return steps, out[:n_tokens]


@pytest.mark.parametrize("length", [1, 3, 5])
def test_a_drafter_of_the_targets_own_tokens_is_accepted_whole(target, length):
    t, _, _ = target
    n = 40
    reference = _reference(t, n + 2 * length + 2)
    drafter = ChainDrafter(reference, length, t.vocab_size)
    steps, out = _run(t, drafter, n)
    assert out == reference[len(PROMPT): len(PROMPT) + n]  # = plain decoding
    assert steps[0].accept_length is None
    cycles = steps[1:]
    assert all(s.accept_length == length and len(s.tokens) == length + 1 for s in cycles)
    assert drafter.calls == len(cycles)  # one proposal per cycle, none after the last


def test_a_drafter_the_target_never_agrees_with_is_accepted_nowhere(target):
    t, _, _ = target
    n = 30
    reference = _reference(t, n + 8)
    steps, out = _run(t, ChainDrafter(reference, 4, t.vocab_size, shift=1), n)
    assert out == reference[len(PROMPT): len(PROMPT) + n]
    assert all(s.accept_length == 0 and len(s.tokens) == 1 for s in steps[1:])
    assert len(steps) == n  # one token per target forward: tau = 1


def test_a_prompt_cache_hands_the_drafter_its_own_state_back(target):
    """A second call extending the first one's text prefills only the difference, and the
    drafter picks up at the right position (its root check would fail otherwise)."""
    t, _, _ = target
    reference = _reference(t, 80)
    drafter = ChainDrafter(reference, 3, t.vocab_size)
    pc = PromptCache()
    _, first = _run(t, drafter, 12, pc)
    prompt2 = reference[: len(PROMPT) + 20]
    steps, out = _run(t, drafter, 16, pc, prompt=prompt2)
    assert pc.reused > len(PROMPT)
    assert out == reference[len(prompt2): len(prompt2) + 16]
    assert all(s.accept_length == 3 for s in steps[1:])
