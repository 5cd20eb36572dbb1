"""Gemma 4's assistant drafters against transformers 5.24's `Gemma4AssistantForCausalLM`:
the drafting steps (one query over the target's shared keys and values, the hidden state fed
back) and the centroid output head."""

import json

import mlx.core as mx
import numpy as np
import pytest

from conftest import TINY_TARGETS
from test_windows import chi_square_against_transformers, hf_greedy, hf_model
from tiny import make_hf_model

import eagle_mlx
from eagle_mlx import GenerationSettings
from eagle_mlx.errors import EagleError


def _assistant(folder, target, ordered=False, seed=0):
    """A tiny assistant for the transformers Gemma 4 `target` (4 layers, three sliding and
    one full, reading the target's keys and values), saved to `folder`."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    tc = target.config
    text = Gemma4TextConfig(
        vocab_size=tc.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=tc.num_key_value_heads, head_dim=16,
        global_head_dim=32, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        sliding_window=tc.sliding_window, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, num_kv_shared_layers=4,
        rope_parameters=tc.rope_parameters, rms_norm_eps=1e-6, max_position_embeddings=512)
    config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=tc.hidden_size,
                                   use_ordered_embeddings=ordered, num_centroids=8,
                                   centroid_intermediate_top_k=2)
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(config).eval()
    if ordered:  # (transformers leaves the ordering zero: a permutation of the vocabulary)
        model.masked_embedding.token_ordering.copy_(torch.randperm(tc.vocab_size))
    model.save_pretrained(str(folder))
    return model


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    kind, overrides = TINY_TARGETS["gemma4_swa"]
    return make_hf_model(tmp_path_factory.mktemp("g4") / "t", kind, seed=3, vocab_size=64,
                         scale=4.0, **overrides)


@pytest.fixture(scope="module")
def target(target_dir):
    return hf_model(target_dir)


@pytest.fixture(scope="module")
def pair(target_dir, target):
    _assistant(target_dir.parent / "a", target)
    return target_dir, target_dir.parent / "a"


@pytest.mark.parametrize("ordered", [False, True], ids=["tied-head", "centroid-head"])
def test_drafting_steps_match_transformers(tmp_path, target, ordered):
    """Three chained steps after a prompt longer than the sliding window: every step's
    logits and fed-back hidden state within 1e-4 of transformers' assistant, given the
    target's shared keys and values, its post-norm last hidden state and its scaled
    embedding; with the E2B/E4B centroid head too."""
    import torch

    from eagle_mlx.heads.gemma4_assistant import AssistantArgs, Gemma4Assistant

    reference = _assistant(tmp_path / "a", target, ordered)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    ours = Gemma4Assistant(AssistantArgs.from_config(config, tmp_path / "a"))
    weights = mx.load(str(tmp_path / "a" / "model.safetensors"))
    weights.pop("lm_head.weight", None)  # (tied to the embedding)
    ours.load_weights(list(weights.items()))
    ids = torch.tensor([[5, 9, 13, 7, 22, 31, 40, 12, 33, 8, 19, 50]])  # (window 8)
    with torch.no_grad():
        out = target(ids, output_hidden_states=True, return_shared_kv_states=True)
        shared = {k: (mx.array(v[0].numpy()), mx.array(v[1].numpy()))
                  for k, v in out.shared_kv_states.items()}
        token, h = ids[:, -1:], out.hidden_states[-1][:, -1:]
        position = ids.shape[1] - 1
        for _ in range(3):
            x = torch.cat([target.get_input_embeddings()(token), h], dim=-1)
            r = reference(inputs_embeds=x, position_ids=torch.tensor([[position]]),
                          shared_kv_states=out.shared_kv_states,
                          attention_mask=torch.ones(1, ids.shape[1], dtype=torch.long))
            logits, fed = ours.step(mx.array(x.numpy()), shared, position)
            np.testing.assert_allclose(np.array(logits), r.logits[0].numpy(), atol=1e-4)
            np.testing.assert_allclose(np.array(fed), r.last_hidden_state.numpy(), atol=1e-4)
            token, h = r.logits.argmax(-1), r.last_hidden_state


def test_the_first_chain_is_transformers_assistants_drafts(pair, target):
    """After the prefill, the chain (draft_top_k 1) drafts the tokens transformers' assistant
    drafts greedily from the same committed state: its own greedy loop over the target's
    shared keys and values, its last hidden state and its last token."""
    import torch
    from transformers import Gemma4AssistantForCausalLM

    from eagle_mlx.decoding.engine import Engine, SamplingParams

    target_dir, assistant_dir = pair
    reference = Gemma4AssistantForCausalLM.from_pretrained(str(assistant_dir),
                                                           dtype=torch.float32).eval()
    model, _ = eagle_mlx.load(str(target_dir), eagle=str(assistant_dir))
    prompt = [5, 9, 13, 7, 22, 31, 40, 12, 33, 8, 19]
    engine = Engine(model.target, eagle_mlx.decoding.drafters.head_drafter(
        model.head, model.target, 5, 3, 1), SamplingParams(), 512)
    state = engine.new_state()
    engine.prefill(state, prompt)
    drafted = engine.draft(state).tokens.tolist()
    ids = torch.tensor([prompt + [drafted[0]]])
    with torch.no_grad():
        out = target(ids[:, :-1], output_hidden_states=True, return_shared_kv_states=True)
        token, h, expected = ids[:, -1:], out.hidden_states[-1][:, -1:], []
        for _ in range(4):
            x = torch.cat([target.get_input_embeddings()(token), h], dim=-1)
            r = reference(inputs_embeds=x, position_ids=torch.tensor([[len(prompt)]]),
                          shared_kv_states=out.shared_kv_states,
                          attention_mask=torch.ones(1, len(prompt) + 1, dtype=torch.long))
            token, h = r.logits.argmax(-1), r.last_hidden_state
            expected.append(int(token))
    assert drafted[1:] == expected


def test_chains_and_trees_decode_exactly_and_a_second_turn_reuses_the_cache(pair):
    """Greedy chains and EAGLE-2 trees of assistant steps give transformers' greedy tokens;
    a second turn through a prompt cache continues as a fresh run does."""
    target_dir, assistant_dir = pair
    model, tok = eagle_mlx.load(str(target_dir), eagle=str(assistant_dir))
    tok.eos_token_ids = set()
    reference = hf_model(target_dir)
    prompt = [5, 9, 13, 7, 22, 31, 40, 12, 33, 8, 19, 50]
    for tree in (dict(total_tokens=4, depth=2, draft_top_k=1),
                 dict(total_tokens=10, depth=3, draft_top_k=3)):
        out = [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=20, **tree)
               for t in r.tokens]
        assert out == hf_greedy(reference, prompt, 20), tree
    cache = eagle_mlx.PromptCache()
    settings = GenerationSettings(max_tokens=10, total_tokens=10, depth=3, draft_top_k=3)
    first = [t for r in eagle_mlx.stream_generate(model, tok, prompt, prompt_cache=cache,
                                                  settings=settings) for t in r.tokens]
    turn = prompt + first[:6] + [17, 18]
    again = [t for r in eagle_mlx.stream_generate(model, tok, turn, prompt_cache=cache,
                                                  settings=settings) for t in r.tokens]
    assert cache.reused > len(prompt)
    assert again == hf_greedy(reference, turn, 10)


@pytest.mark.long
def test_sampling_with_assistant_trees_is_lossless(pair):
    """The first three tokens sampled (temperature 0.7, top-k 5, top-p 0.9) through trees of
    10 assistant nodes have the distribution transformers' logits give, enumerated exactly."""
    assert chi_square_against_transformers(*pair, [5, 9, 13, 7, 22, 31], runs=300) > 1e-3


def test_assistants_that_do_not_fit_are_refused_in_one_sentence(pair, tmp_path):
    target_dir, assistant_dir = pair
    llama = make_hf_model(tmp_path / "llama", seed=1, vocab_size=64)
    with pytest.raises(EagleError, match="is a Gemma 4 assistant; target .* is llama"):
        eagle_mlx.load(str(llama), eagle=str(assistant_dir))
    config = json.loads((assistant_dir / "config.json").read_text())
    config["backbone_hidden_size"] = 96
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(config))
    (other / "model.safetensors").symlink_to(assistant_dir / "model.safetensors")
    with pytest.raises(EagleError, match="another size of the family"):
        eagle_mlx.load(str(target_dir), eagle=str(other))
    model, tok = eagle_mlx.load(str(target_dir), eagle=str(assistant_dir))
    with pytest.raises(EagleError, match="not in a batch"):
        eagle_mlx.batch_generate(model, tok, [[5, 6], [7, 8]], settings=[
            GenerationSettings(max_tokens=4)] * 2)


def test_convert_writes_an_assistant_read_back_identically(pair, tmp_path):
    from test_cli import cli

    from eagle_mlx.decoding.drafters import head_drafter
    from eagle_mlx.decoding.engine import Engine, SamplingParams

    target_dir, assistant_dir = pair
    proc = cli("convert", "--eagle", assistant_dir, "--mlx-path", tmp_path / "mlx")
    assert proc.returncode == 0 and "Gemma 4 assistant (4 layers)" in proc.stdout, proc.stderr
    trees = []
    for d in (assistant_dir, tmp_path / "mlx"):
        model, _ = eagle_mlx.load(str(target_dir), eagle=str(d))
        engine = Engine(model.target, head_drafter(model.head, model.target, 10, 3, 3),
                        SamplingParams(), 512)
        state = engine.new_state()
        engine.prefill(state, [5, 9, 13, 7, 22, 31])
        tree = engine.draft(state)
        trees.append((tree.tokens.tolist(), tree.parents.tolist(), np.array(tree.scores)))
    assert trees[0][:2] == trees[1][:2]
    assert np.array_equal(trees[0][2], trees[1][2])
