"""Gemma 4's assistant drafters against transformers 5.24's `Gemma4AssistantForCausalLM`:
the drafting steps (one query over the target's shared keys and values, the hidden state fed
back) and the centroid output head."""

import json

import mlx.core as mx
import numpy as np
import pytest

from conftest import TINY_TARGETS
from test_windows import chi_square_against_transformers, hf_greedy, hf_model
from tiny import make_gemma4_assistant, make_hf_model

import eagle_mlx
from eagle_mlx import GenerationSettings
from eagle_mlx.errors import EagleError


def _assistant(folder, target_dir, ordered=False):
    """A tiny untrained assistant for the transformers Gemma 4 target in `target_dir`
    (`tiny.make_gemma4_assistant`), saved to `folder`: transformers' module, loaded back."""
    import torch
    from transformers import Gemma4AssistantForCausalLM

    make_gemma4_assistant(folder, target_dir, ordered=ordered)
    return Gemma4AssistantForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    kind, overrides = TINY_TARGETS["gemma4_swa"]
    return make_hf_model(tmp_path_factory.mktemp("g4") / "t", kind, seed=3, vocab_size=64,
                         scale=4.0, **overrides)


@pytest.fixture(scope="module")
def target(target_dir):
    return hf_model(target_dir)


@pytest.fixture(scope="module")
def pair(target_dir):
    _assistant(target_dir.parent / "a", target_dir)
    return target_dir, target_dir.parent / "a"


@pytest.mark.parametrize("ordered", [False, True], ids=["tied-head", "centroid-head"])
def test_drafting_steps_match_transformers(tmp_path, target_dir, target, ordered):
    """Three chained steps after a prompt longer than the sliding window: every step's
    logits and fed-back hidden state within 1e-4 of transformers' assistant, given the
    target's shared keys and values, its post-norm last hidden state and its scaled
    embedding; with the E2B/E4B centroid head too."""
    import torch

    from eagle_mlx.heads.gemma4_assistant import AssistantArgs, Gemma4Assistant

    reference = _assistant(tmp_path / "a", target_dir, ordered)
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
            np.testing.assert_allclose(np.array(logits), r.logits.numpy(), atol=1e-4)
            np.testing.assert_allclose(np.array(fed), r.last_hidden_state.numpy(), atol=1e-4)
            token, h = r.logits.argmax(-1), r.last_hidden_state


def test_every_chain_is_transformers_assistants_drafts(pair, target):
    """Every cycle's chain (draft_top_k 1) drafts the tokens transformers' assistant drafts
    greedily from the same committed state — its own greedy loop over the target's shared
    keys and values, its last hidden state and its last token: after the prefill, and on
    through cycles that take the context well past the sliding window (the target's window
    cache compacting on the way)."""
    import torch
    from transformers import Gemma4AssistantForCausalLM

    from eagle_mlx.decoding.engine import Engine, SamplingParams

    target_dir, assistant_dir = pair
    reference = Gemma4AssistantForCausalLM.from_pretrained(str(assistant_dir),
                                                           dtype=torch.float32).eval()
    model, _ = eagle_mlx.load(str(target_dir), eagle=str(assistant_dir))
    prompt = [5, 9, 13, 7, 22, 31, 40, 12, 33, 8, 19]
    drafter = eagle_mlx.decoding.registry.head_drafter(model.head, model.target, 5, 3, 1)
    drafts, propose = [], drafter.propose

    def recorded(state, *args):
        tree = propose(state, *args)
        drafts.append((state.n, tree.tokens.tolist()))
        return tree

    drafter.propose = recorded
    engine = Engine(model.target, drafter, SamplingParams(), 512)
    state = engine.new_state()
    engine.prefill(state, prompt)
    while state.n < 40:
        engine.cycle(state)
    assert len(drafts) > 8
    for n, drafted in drafts:
        committed = state.history[:n]
        ids = torch.tensor([committed + [drafted[0]]])
        with torch.no_grad():
            out = target(ids[:, :-1], output_hidden_states=True, return_shared_kv_states=True)
            token, h, expected = ids[:, -1:], out.hidden_states[-1][:, -1:], []
            for _ in range(4):
                x = torch.cat([target.get_input_embeddings()(token), h], dim=-1)
                r = reference(inputs_embeds=x, position_ids=torch.tensor([[n]]),
                              shared_kv_states=out.shared_kv_states,
                              attention_mask=torch.ones(1, n + 1, dtype=torch.long))
                token, h = r.logits.argmax(-1), r.last_hidden_state
                expected.append(int(token))
        assert drafted[1:] == expected, n


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


def test_batch_rows_draft_together_and_are_their_runs_alone(pair, monkeypatch):
    """Rows of different lengths (some past the sliding window, one shorter than it) in one
    batch: they draft in one forward per depth, each over its own row of the target's ragged
    caches, and each row's tokens are its run alone — greedy (= transformers' greedy) with a
    tree and a chain, sampled with a seed (the same draws), and under auto."""
    from eagle_mlx.decoding.assistant import AssistantDrafter

    target_dir, assistant_dir = pair
    model, tok = eagle_mlx.load(str(target_dir), eagle=str(assistant_dir))
    tok.eos_token_ids = set()
    reference = hf_model(target_dir)
    widths = []
    trees = AssistantDrafter._trees

    def spy(self, shared, hidden, *rest):
        widths.append(hidden.shape[0])
        return trees(self, shared, hidden, *rest)

    monkeypatch.setattr(AssistantDrafter, "_trees", spy)
    prompts = [[5, 9, 13, 7, 22, 31, 40, 12, 33, 8, 19, 50], [40, 41, 40, 41, 12], [3, 4, 5],
               [7, 1, 60, 2, 9, 33, 17, 17, 4, 5]]
    runs = [GenerationSettings(max_tokens=16, total_tokens=10, depth=3, draft_top_k=3),
            GenerationSettings(max_tokens=16, total_tokens=4, depth=2, draft_top_k=1),
            GenerationSettings(max_tokens=16, total_tokens=10, depth=3, draft_top_k=3,
                               temp=0.8, seed=11),
            GenerationSettings(max_tokens=16)]  # (auto)
    for settings in runs:
        alone = [[t for r in eagle_mlx.stream_generate(model, tok, p, settings=settings)
                  for t in r.tokens] for p in prompts]
        if settings.temp == 0:
            assert alone == [hf_greedy(reference, p, 16) for p in prompts], settings
        widths.clear()
        res = eagle_mlx.batch_generate(model, tok, prompts, settings=[settings] * len(prompts))
        assert [r.tokens for r in res.results] == alone, settings
        if settings.speculate != "auto":
            assert max(widths) == len(prompts), widths


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
    with pytest.raises(EagleError, match="draft_window applies to block drafters, EAGLE heads "
                                         "and MTP modules"):
        eagle_mlx.load(str(target_dir), eagle=str(assistant_dir), draft_window=8)


def test_convert_writes_an_assistant_read_back_identically(pair, tmp_path):
    from test_cli import tool

    from eagle_mlx.decoding.registry import head_drafter
    from eagle_mlx.decoding.engine import Engine, SamplingParams

    target_dir, assistant_dir = pair
    proc = tool("convert", "--eagle", assistant_dir, "--mlx-path", tmp_path / "mlx")
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


def test_the_12b_unified_pair_loads_drafts_and_decodes_exactly(tmp_path):
    """The 12B's layout: a `gemma4_unified` target (text only here) and its
    `gemma4_unified_assistant`, tiny, from transformers' classes: the assistant's first
    chain equals transformers' unified assistant's greedy drafts, and chains and trees
    decode transformers' greedy tokens."""
    import torch
    from transformers import (Gemma4UnifiedAssistantConfig, Gemma4UnifiedAssistantForCausalLM,
                              Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration,
                              Gemma4UnifiedTextConfig)

    from eagle_mlx.decoding.registry import head_drafter
    from eagle_mlx.decoding.engine import Engine, SamplingParams
    from tiny import save_tokenizer

    torch.manual_seed(0)
    text = Gemma4UnifiedTextConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        layer_types=TINY_TARGETS["gemma4_swa"][1]["layer_types"], sliding_window=8,
        num_kv_shared_layers=2, final_logit_softcapping=30.0, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=2, eos_token_id=1)
    target = Gemma4UnifiedForConditionalGeneration(
        Gemma4UnifiedConfig(text_config=text.to_dict())).eval()
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    target.save_pretrained(str(tmp_path / "t"))
    save_tokenizer(tmp_path / "t", 64)
    assistant_text = Gemma4UnifiedTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=8,
        num_kv_shared_layers=4, max_position_embeddings=512)
    assistant = Gemma4UnifiedAssistantForCausalLM(Gemma4UnifiedAssistantConfig(
        text_config=assistant_text, backbone_hidden_size=64)).eval()
    assistant.save_pretrained(str(tmp_path / "a"))

    model, tok = eagle_mlx.load(str(tmp_path / "t"), eagle=str(tmp_path / "a"))
    tok.eos_token_ids = set()
    prompt = [5, 9, 13, 7, 22, 31, 40, 12, 33, 8, 19, 50]
    with torch.no_grad():
        greedy = target.generate(torch.tensor([prompt]), max_new_tokens=16,
                                 do_sample=False)[0, len(prompt):].tolist()
    for tree in (dict(total_tokens=4, depth=2, draft_top_k=1),
                 dict(total_tokens=10, depth=3, draft_top_k=3)):
        out = [t for r in eagle_mlx.stream_generate(model, tok, prompt, max_tokens=16, **tree)
               for t in r.tokens]
        assert out == greedy, tree
    engine = Engine(model.target, head_drafter(model.head, model.target, 5, 3, 1),
                    SamplingParams(), 512)
    state = engine.new_state()
    engine.prefill(state, prompt)
    drafted = engine.draft(state).tokens.tolist()
    lm = target.model.language_model
    with torch.no_grad():
        out = lm(torch.tensor([prompt]), return_shared_kv_states=True)
        token, h, expected = torch.tensor([[drafted[0]]]), out.last_hidden_state[:, -1:], []
        for _ in range(4):
            x = torch.cat([lm.embed_tokens(token), h], dim=-1)
            r = assistant(inputs_embeds=x, position_ids=torch.tensor([[len(prompt)]]),
                          shared_kv_states=out.shared_kv_states,
                          attention_mask=torch.ones(1, len(prompt) + 1, dtype=torch.long))
            token, h = r.logits.argmax(-1), r.last_hidden_state
            expected.append(int(token))
    assert drafted[1:] == expected


def test_every_round_drafts_what_transformers_assisted_generation_drafts(tmp_path):
    """transformers' own assisted generation (`generate(assistant_model=...)`, 3 drafts a
    round, greedy) against the engine's chains of 3, on 4 prompts over 44 tokens, a trained
    assistant: every round's drafts and accepted count are transformers', given its assistant
    the keys and values of the accepted positions. transformers 5.25 hands its assistant the
    verify pass's keys cut at the sequence's length, which keeps the key and value of the
    first rejected draft at the bonus token's position; with them left in, the rounds that
    differ all follow a round that accepted less than all it drafted (and past the target's
    sliding window its sliding layers' keys are those of its windowed cache and the verified
    block, rejected drafts included, so the window here is 64)."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma4AssistantForCausalLM
    from transformers.generation import candidate_generator as cg

    from eagle_mlx.decoding.engine import Engine, SamplingParams

    kind, overrides = TINY_TARGETS["gemma4_swa"]
    target_dir = make_hf_model(tmp_path / "t", kind, seed=3, vocab_size=64, scale=4.0,
                               **dict(overrides, sliding_window=64))
    make_gemma4_assistant(tmp_path / "a", target_dir, steps=200)
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    reference = Gemma4AssistantForCausalLM.from_pretrained(str(tmp_path / "a"),
                                                           dtype=torch.float32).eval()
    reference.generation_config.num_assistant_tokens = 3
    reference.generation_config.num_assistant_tokens_schedule = "constant"
    model, _ = eagle_mlx.load(str(target_dir), eagle=str(tmp_path / "a"))
    generator = cg.SinglePositionMultiTokenCandidateGenerator
    get_candidates = generator.get_candidates

    def transformers_rounds(prompt, committed_keys):
        rounds = []  # (sequence length, drafts)

        def recorded(self, input_ids, model_kwargs=None, model_outputs=None,
                     n_last_matches=0, **kwargs):
            if committed_keys and rounds and model_outputs is not None:
                rejected = len(rounds[-1][1]) - n_last_matches
                if rejected:
                    model_outputs.shared_kv_states = {
                        k: (kv[0][:, :, :-rejected], kv[1][:, :, :-rejected])
                        for k, kv in model_outputs.shared_kv_states.items()}
            ids, logits = get_candidates(self, input_ids, model_kwargs=model_kwargs,
                                         model_outputs=model_outputs,
                                         n_last_matches=n_last_matches, **kwargs)
            if ids.shape[1] > input_ids.shape[1]:
                rounds.append((input_ids.shape[1], ids[0, input_ids.shape[1]:].tolist()))
            return ids, logits

        generator.get_candidates = recorded
        try:
            with torch.no_grad():
                out = target.generate(torch.tensor([prompt]), assistant_model=reference,
                                      max_new_tokens=44, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
        finally:
            generator.get_candidates = get_candidates
        return out[0, len(prompt):].tolist(), rounds

    rng = np.random.default_rng(1)
    partial_rounds = 0
    for _ in range(4):
        prompt = rng.integers(3, 60, 11).tolist()
        drafter = eagle_mlx.decoding.registry.head_drafter(model.head, model.target, 4, 3, 1)
        drafts, propose = {}, drafter.propose

        def record(state, *args, drafts=drafts, propose=propose):
            tree = propose(state, *args)
            drafts[state.n + 1] = tree.tokens.tolist()[1:]  # (the root at position n)
            return tree

        drafter.propose = record
        engine = Engine(model.target, drafter, SamplingParams(), 512)
        state = engine.new_state()
        engine.prefill(state, prompt)
        while len(state.history) < len(prompt) + 44:
            engine.cycle(state)
        tokens, rounds = transformers_rounds(prompt, committed_keys=True)
        assert state.history[len(prompt): len(prompt) + 44] == tokens
        assert len(rounds) >= 10
        for i, (n, drafted) in enumerate(rounds):  # (the last rounds: cut to the budget)
            assert drafts[n][: len(drafted)] == drafted, (prompt, n)
            if i:  # the same accepted count: the next round starts where ours does
                assert n - rounds[i - 1][0] - 1 == \
                    next(k for k in range(4) if k == 3 or drafts[rounds[i - 1][0]][k] !=
                         state.history[rounds[i - 1][0] + k]), (prompt, n)
        _, uncut = transformers_rounds(prompt, committed_keys=False)
        after = {n: uncut[i - 1] for i, (n, _) in enumerate(uncut) if i}
        for i, (n, drafted) in enumerate(uncut):
            if n not in drafts:  # (after a round that differed, its rounds start elsewhere)
                continue
            if drafts[n][: len(drafted)] != drafted:
                prev_n, prev = after[n]
                assert n - prev_n - 1 < len(prev), (prompt, n)  # after a partial acceptance
                partial_rounds += 1
    assert partial_rounds > 0
