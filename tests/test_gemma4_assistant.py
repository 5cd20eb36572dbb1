"""Gemma 4's assistant drafters against transformers 5.24's `Gemma4AssistantForCausalLM`:
the drafting steps (one query over the target's shared keys and values, the hidden state fed
back) and the centroid output head."""

import json

import mlx.core as mx
import numpy as np
import pytest

from conftest import TINY_TARGETS
from tiny import make_hf_model


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
def target(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    kind, overrides = TINY_TARGETS["gemma4_swa"]
    folder = make_hf_model(tmp_path_factory.mktemp("g4") / "t", kind, seed=3, vocab_size=64,
                           scale=4.0, **overrides)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


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
