"""Block drafters (DFlash checkpoints) and DDTree trees: against z-lab's `dflash` package
(its PyTorch drafter's forward and its own generation loop `dflash_generate`), DDTree
against mlx-vlm's builder of the paper's Algorithm 1, and decoding with them against
transformers (greedy) and the target's distribution enumerated (sampling)."""

import json
import shutil
import time

import mlx.core as mx
import numpy as np
import pytest

import eagle_mlx
from eagle_mlx import GenerationSettings
from eagle_mlx.errors import EagleError
from conftest import PATTERN3
from test_windows import chi_square_against_transformers, hf_greedy, hf_model
from tiny import make_dflash_drafter, make_dspark_drafter, make_hf_model

BLOCK = 4


def _reference():
    try:
        import dflash.model as dm
    except ImportError as e:
        pytest.skip(f"z-lab's dflash package is not installed ({e}); README's test command "
                    "installs it")
    dm._cuda_time = time.perf_counter  # (its timing calls CUDA; the stats need none)
    return dm


def _loaded(target_dir, draft_dir, ids, taps, version=1):
    """transformers' target, the package's drafter and eagle_mlx's pair, and the target's
    features of `ids` at the tap layers as the package reads them ([1, n, F], torch)."""
    import torch

    dm = _reference()
    reference = hf_model(target_dir)
    cls = dm.DFlash2DraftModel if version == 2 else dm.DFlashDraftModel
    draft = cls.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    model, _ = eagle_mlx.load(str(target_dir), eagle=str(draft_dir))
    with torch.no_grad():
        hs = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return reference, draft, model, torch.cat([hs[i + 1] for i in taps], dim=-1)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    _reference()
    return make_hf_model(tmp_path_factory.mktemp("block") / "t", "qwen3", seed=1,
                         vocab_size=64, num_hidden_layers=3, num_key_value_heads=2,
                         rope_theta=1e6, tie_word_embeddings=True, scale=4.0)


@pytest.fixture(scope="module")
def pair(target):
    """A tiny Qwen3 target and a DFlash drafter trained for it (blocks of 4)."""
    return target, make_dflash_drafter(target.parent / "d", target, layer_ids=(0, 2),
                                       block_size=BLOCK, steps=300)


@pytest.fixture(scope="module")
def pair2(target):
    """The same target and a DFlash 2 drafter (dynamic convolutions, a candidate selector)
    trained for it."""
    return target, make_dflash_drafter(target.parent / "d2", target, layer_ids=(0, 2),
                                       block_size=BLOCK, steps=300, version=2)


def _dspark():
    try:
        from mlx_dspark.config import DSparkConfig
        from mlx_dspark.model import DSparkDrafter
    except ImportError as e:
        pytest.skip(f"mlx-dspark is not installed ({e}); README's test command installs it")
    return DSparkConfig, DSparkDrafter


@pytest.fixture(scope="module")
def dspark(pair):
    """DSpark drafters for the pair's target (mlx-dspark's module, the DFlash drafter's
    backbone, a Markov head): predicting from slot 1 as DeepSpec's and as speculators'
    configs say it, and the same weights declared to predict from slot 0."""
    _dspark()
    target_dir, draft_dir = pair
    root = draft_dir.parent
    return {name: make_dspark_drafter(root / f"ds-{name}", target_dir, draft_dir,
                                      logits_start=start, speculators=spec)
            for name, start, spec in (("deepspec", 1, False), ("speculators", 1, True),
                                      ("slot0", 0, False))}


@pytest.fixture(params=[1, 2], ids=["dflash", "dflash2"])
def either(request, pair, pair2):
    return request.param, (pair if request.param == 1 else pair2)


def _tokens(model, tok, prompt, **settings):
    rs = list(eagle_mlx.stream_generate(model, tok, prompt,
                                        settings=GenerationSettings(**settings)))
    return [t for r in rs for t in r.tokens], rs


def test_chain_is_the_checkpoints_own_block_decoding(either):
    """draft_top_k 1 with a tree as large as the block: the tokens and every round's
    acceptance of the package's own `dflash_generate` (its last round verifies a shorter
    block where fewer tokens are left), for DFlash and DFlash 2 (its selector's chain)."""
    import torch

    dm = _reference()
    version, (target_dir, draft_dir) = either
    reference = hf_model(target_dir)
    cls = dm.DFlash2DraftModel if version == 2 else dm.DFlashDraftModel
    draft = cls.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    model, tok = eagle_mlx.load(str(target_dir), eagle=str(draft_dir))
    tok.eos_token_ids = set()
    rng = np.random.default_rng(3)
    seen = set()
    for _ in range(4):
        prompt = rng.integers(3, 63, 6).tolist()
        ref = dm.dflash_generate(draft, reference, torch.tensor([prompt]), 40, None,
                                 return_stats=True)
        out, rs = _tokens(model, tok, prompt, max_tokens=40, total_tokens=BLOCK,
                          depth=BLOCK - 2, draft_top_k=1)
        assert out == ref.output_ids[0, len(prompt):].tolist()
        rounds = [r.accept_length + 1 for r in rs[1:]]
        assert rounds[:-1] == ref.acceptance_lengths[:-1]
        seen.update(rounds)
    assert 1 in seen and BLOCK in seen  # (blocks partly right: a test of the acceptance)


@pytest.mark.parametrize("layers", [("full_attention", "full_attention"),
                                    ("sliding_attention", "full_attention")],
                         ids=["full", "sliding"])
def test_drafter_logits_match_the_reference_forward(tmp_path, layers):
    """Every block slot's logits within 1e-4 of the package's forward over the whole
    context, with the context given at once and then in two more pieces (the drafter keeps
    its context's keys and values; a sliding layer sees its window of them)."""
    import torch

    _reference()
    from eagle_mlx.decoding.block import BlockDrafter

    t = make_hf_model(tmp_path / "t", "qwen3", seed=2, vocab_size=64, num_hidden_layers=4,
                      num_key_value_heads=2, rope_theta=1e6)
    window = dict(sliding_window=5) if "sliding_attention" in layers else {}
    d = make_dflash_drafter(tmp_path / "d", t, layer_ids=(1, 3), block_size=5, steps=0,
                            layer_types=list(layers), **window)
    ids = np.random.default_rng(0).integers(3, 63, 20).tolist()
    reference, draft, model, feats = _loaded(t, d, ids, (1, 3))
    head = model.head
    drafter = BlockDrafter(head, model.target, 5, 3, 1)
    state = drafter.new_state()
    done = 0
    for end in (9, 14, 19):  # committed positions 0 .. end - 1; the root at `end`
        with torch.no_grad():
            block = torch.full((1, 5), 63)
            block[0, 0] = ids[end]
            hidden = draft(position_ids=torch.arange(end + 5)[None],
                           noise_embedding=reference.get_input_embeddings()(block),
                           target_hidden=feats[:, :end])
            expected = draft.compute_logits(hidden[:, 1:], reference.lm_head)[0].numpy()
        head.add_context(state, mx.array(feats[0, done:end].numpy()))
        done = end
        got = head.logits(head.block_hidden(state, mx.array(ids[end]), model.target, 5),
                          model.target)
        np.testing.assert_allclose(np.array(got), expected, atol=1e-4, rtol=0)


def test_ddtree_equals_mlx_vlm_builder():
    """The tree built from given block logits is the one mlx-vlm's `build_ddtree` (the
    paper's Algorithm 1, a best-first heap) pops, node for node (as root paths)."""
    try:
        from mlx_vlm.speculative.ddtree import build_ddtree as reference
    except ImportError as e:
        pytest.skip(f"mlx-vlm is not installed ({e}); README's test command installs it")
    from eagle_mlx.decoding.block import build_ddtree
    from eagle_mlx.targets.layers import log_softmax

    rng = np.random.default_rng(0)
    for L, V, budget, spread in [(3, 10, 5, 1.0), (6, 40, 20, 2.0), (15, 64, 63, 3.0),
                                 (4, 8, 30, 0.5), (7, 50, 1, 1.0), (5, 16, 12, 6.0)]:
        logits = mx.array(spread * rng.standard_normal((1, L + 1, V)).astype(np.float32))
        expected = {n.token_ids for n in reference(logits, budget)}
        tree = build_ddtree(log_softmax(logits[0, 1:]), mx.array(7), budget, budget)
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        assert tokens[0] == 7 and parents[0] == 0
        paths = [()]
        for i in range(1, len(tokens)):
            assert parents[i] < i
            paths.append(paths[parents[i]] + (tokens[i],))
        assert len(paths) - 1 == len(expected) and set(paths[1:]) == expected, (L, V, budget)
        # the scores are the paths' log-probabilities under the block's marginals
        lp = np.array(log_softmax(logits[0, 1:]))
        for p, s in zip(paths[1:], tree.scores.tolist()[1:]):
            assert s == pytest.approx(sum(lp[d, t] for d, t in enumerate(p)), abs=1e-4)


FAMILIES = {  # name -> (kind, target overrides, tap layers)
    "llama": ("llama", dict(num_hidden_layers=3), (0, 2)),
    "gemma3_swa": ("gemma3_text", dict(num_hidden_layers=4, num_key_value_heads=2,
                                       sliding_window=4, sliding_window_pattern=2), (1, 3)),
    "qwen3_5": ("qwen3_5", dict(num_hidden_layers=4, num_key_value_heads=2), (1, 3)),
    "gpt_oss_swa": ("gpt_oss", dict(num_hidden_layers=4, num_key_value_heads=2,
                                    sliding_window=8), (1, 3)),
    "gemma4_swa": ("gemma4_text", dict(num_hidden_layers=6, num_key_value_heads=2,
                                       sliding_window=8, layer_types=PATTERN3,
                                       num_kv_shared_layers=2, final_logit_softcapping=30.0),
                   (1, 5)),
}


@pytest.mark.long
@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_ddtrees_equal_transformers_on_every_family(tmp_path, name):
    """DDTrees and chains of a drafter trained briefly for each target (windowed families,
    attention sinks, KV sharing with a soft-capped target whose last layer is tapped after its
    norm, a hybrid with per-node recurrent states) give transformers' greedy tokens."""
    _reference()
    kind, overrides, taps = FAMILIES[name]
    t = make_hf_model(tmp_path / "t", kind, seed=4, vocab_size=64, scale=4.0, **overrides)
    d = make_dflash_drafter(tmp_path / "d", t, layer_ids=taps, block_size=5, steps=60)
    model, tok = eagle_mlx.load(str(t), eagle=str(d))
    tok.eos_token_ids = set()
    reference = hf_model(t)
    rng = np.random.default_rng(5)
    for tree in (dict(total_tokens=10, depth=3, draft_top_k=3),
                 dict(total_tokens=5, depth=3, draft_top_k=1)):
        prompt = rng.integers(3, 63, 7).tolist()
        out, rs = _tokens(model, tok, prompt, max_tokens=16, **tree)
        assert out == hf_greedy(reference, prompt, 16), tree


def test_ddtree_greedy_batch_and_prompt_cache(pair):
    """Greedy DDTrees give transformers' tokens; batched rows are their runs alone; a
    second turn through a prompt cache (the drafter's context cut back with the target's)
    is a fresh run's; a draft window shorter than the context changes drafts, not tokens."""
    target_dir, draft_dir = pair
    model, tok = eagle_mlx.load(str(target_dir), eagle=str(draft_dir))
    tok.eos_token_ids = set()
    reference = hf_model(target_dir)
    tree = dict(total_tokens=8, depth=2, draft_top_k=3)
    prompts = [[5, 9, 13, 7, 22, 31], [40, 41, 40, 41, 12], [3, 4, 5]]
    alone = []
    for p in prompts:
        out, rs = _tokens(model, tok, p, max_tokens=20, **tree)
        assert out == hf_greedy(reference, p, 20)
        alone.append(out)
    settings = [GenerationSettings(max_tokens=20, **tree)] * 3
    res = eagle_mlx.batch_generate(model, tok, prompts, settings=settings)
    assert [r.tokens for r in res.results] == alone
    cache = eagle_mlx.PromptCache()
    first = [t for r in eagle_mlx.stream_generate(model, tok, prompts[0], prompt_cache=cache,
                                                  max_tokens=12, **tree) for t in r.tokens]
    turn = prompts[0] + first[:8] + [17, 18]  # differs from what the cache holds
    again = [t for r in eagle_mlx.stream_generate(model, tok, turn, prompt_cache=cache,
                                                  max_tokens=12, **tree) for t in r.tokens]
    assert cache.reused > len(prompts[0])
    assert again == hf_greedy(reference, turn, 12)
    windowed, tok = eagle_mlx.load(str(target_dir), eagle=str(draft_dir), draft_window=3)
    tok.eos_token_ids = set()
    state = windowed.head.make_cache()
    assert [c.keep for c in state.layers] == [3, 3]
    out, _ = _tokens(windowed, tok, prompts[1], max_tokens=20, **tree)
    assert out == alone[1]
    with pytest.raises(EagleError, match="draft_window must be a positive whole number"):
        eagle_mlx.load(str(target_dir), eagle=str(draft_dir), draft_window=0)


@pytest.mark.long
@pytest.mark.parametrize("tree", [(10, 3, 3), (4, 2, 1), "dflash2", "dspark"],
                         ids=["ddtree", "drawn-chain", "dflash2-selector", "dspark-markov"])
def test_sampling_with_block_drafters_is_lossless(request, pair, pair2, tree):
    """The first three tokens sampled (temperature 0.7, top-k 5, top-p 0.9) through DDTrees
    of 10 nodes (deterministic candidates), and through chains drawn from the block (or by
    DFlash 2's selector) and accepted with min(1, p/q), have the distribution transformers'
    logits give, enumerated exactly."""
    from eagle_mlx.decoding.steps import eagle_steps

    sizes = (4, 2, 1) if isinstance(tree, str) else tree

    def steps(target, head, prompt, sampling, **_):
        return eagle_steps(target, head, prompt, sampling, *sizes)

    drafters = {"dflash2": pair2[1]}
    if tree == "dspark":
        drafters["dspark"] = request.getfixturevalue("dspark")["deepspec"]
    p = chi_square_against_transformers(pair[0], drafters.get(tree, pair[1]),
                                        [40, 41, 40, 41, 40], runs=400, steps=steps)
    assert p > 1e-3, p


def test_a_drawn_chain_is_drawn_from_the_block(pair):
    """At temperature > 0 a chain's tokens are draws from the block's distributions under the
    generation's settings (the sequence's seed repeats them, other seeds differ), and the
    tree carries those distributions for its acceptance."""
    from eagle_mlx.decoding.accept import KeyChain
    from eagle_mlx.decoding.block import BlockDrafter
    from eagle_mlx.decoding.engine import Engine, SamplingParams

    target_dir, draft_dir = pair
    model, _ = eagle_mlx.load(str(target_dir), eagle=str(draft_dir))
    drafter = BlockDrafter(model.head, model.target, 4, 2, 1)
    engine = Engine(model.target, drafter, SamplingParams(temp=1.0, top_k=5), 512)

    def first_tree(seed):
        state = engine.new_state()
        state.keys = KeyChain.start(seed)
        engine.prefill(state, [4, 9, 30, 26, 56, 34])
        tree = engine.draft(state)
        return tree.tokens.tolist(), np.exp(np.array(tree.q[1:]))

    tokens, q = first_tree(1)
    assert tokens == first_tree(1)[0]
    assert len({tuple(first_tree(s)[0]) for s in range(2, 12)}) > 1
    assert q.shape == (3, 64)
    np.testing.assert_allclose(q.sum(axis=1), 1.0, atol=1e-5)
    assert ((q > 0).sum(axis=1) <= 5).all()  # (top-k 5: the target's filters apply)
    assert all(q[i, t] > 0 for i, t in enumerate(tokens[1:]))


def _edited(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    draft = config["dflash_config"]
    for k, v in changes.items():
        (draft if k in ("target_layer_ids", "mask_token_id") else config)[k] = v
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("changes, says", [
    (dict(target_layer_ids=[0, 5]), "reads target layers [5], beyond the target's 3 layers"),
    (dict(mask_token_id=64), "mask_token_id 64 is outside the target's vocabulary"),
    (dict(num_target_layers=36), "made for a target of 36 layers"),
    (dict(layer_types=["sliding_attention", "full_attention"]),
     "sliding_attention layers but no \"sliding_window\""),
    (dict(hidden_size=32), "hidden size 32"),
], ids=["taps", "mask", "target-layers", "window", "hidden"])
def test_drafters_that_do_not_fit_are_refused_in_one_sentence(pair, tmp_path, changes, says):
    target_dir, draft_dir = pair
    d = _edited(draft_dir, tmp_path / "d", **changes)
    with pytest.raises(EagleError, match=says.replace("[", r"\[").replace("]", r"\]")):
        eagle_mlx.load(str(target_dir), eagle=str(d))


def test_static_trees_and_depths_beyond_the_block_are_refused(pair):
    target_dir, draft_dir = pair
    model, tok = eagle_mlx.load(str(target_dir), eagle=str(draft_dir))
    with pytest.raises(EagleError, match="a block drafter drafts a DDTree"):
        eagle_mlx.generate(model, tok, [5, 6], max_tokens=4, tree_choices=[[0], [0, 0]])
    with pytest.raises(EagleError, match="predicts 3 tokens a block"):
        eagle_mlx.generate(model, tok, [5, 6], max_tokens=4, total_tokens=8, depth=3)


def test_convert_writes_a_folder_read_back_identically(pair, tmp_path):
    """`convert --eagle <DFlash drafter>` writes an MLX folder whose blocks are the
    checkpoint's, bit for bit (float32), and a quantized one that drafts the same chains
    here; the speculators layout, which holds EAGLE-3 heads only, is refused."""
    from test_cli import one_sentence, tool

    target_dir, draft_dir = pair
    out, quant = tmp_path / "mlx", tmp_path / "q8"
    proc = tool("convert", "--eagle", draft_dir, "--mlx-path", out)
    assert proc.returncode == 0, proc.stderr
    assert "DFlash drafter (blocks of 4), reading target layers [0, 2]" in proc.stdout
    proc = tool("convert", "--eagle", draft_dir, "--mlx-path", quant, "-q", "--q-bits", "8",
               "--q-group-size", "32")
    assert proc.returncode == 0, proc.stderr
    one_sentence(tool("convert", "--eagle", draft_dir, "--mlx-path", tmp_path / "s",
                     "--layout", "speculators"), 1, "holds EAGLE-3 heads")
    assert not (tmp_path / "s").exists()
    ref, tok = eagle_mlx.load(str(target_dir), eagle=str(draft_dir))
    tok.eos_token_ids = set()
    feats = mx.array(np.random.default_rng(1).standard_normal((9, 128)).astype(np.float32))
    expected = None
    for d in (draft_dir, out, quant):
        model, _ = eagle_mlx.load(str(target_dir), eagle=str(d))
        head = model.head
        state = head.make_cache()
        head.add_context(state, feats)
        got = np.array(head.logits(head.block_hidden(state, mx.array(5), model.target, 4),
                                   model.target))
        if expected is None:
            expected = got
        elif d == out:
            assert np.array_equal(got, expected)
        else:  # (dequantized on loading: float32 on the CPU)
            assert json.loads((quant / "config.json").read_text())["quantization"]["bits"] == 8
            assert "layers.0.mlp.gate_proj.scales" in mx.load(str(quant / "model.safetensors"))
            assert not np.array_equal(got, expected)
            np.testing.assert_allclose(got, expected, atol=0.1)
    tree = dict(total_tokens=4, depth=2, draft_top_k=1)
    assert _tokens(model, tok, [4, 9, 30, 26, 56, 34], max_tokens=16, **tree)[0] == \
        _tokens(ref, tok, [4, 9, 30, 26, 56, 34], max_tokens=16, **tree)[0]


def test_a_draft_window_attends_to_the_last_positions_only(pair):
    """With a window of N, a block sees the context of the last N positions only: its
    logits are those of a drafter given just those positions' features (at their
    positions), however much context came before; without it they differ."""
    target_dir, draft_dir = pair
    model, _ = eagle_mlx.load(str(target_dir), eagle=str(draft_dir))
    head, target = model.head, model.target
    feats = mx.array(np.random.default_rng(2).standard_normal((300, 128)).astype(np.float32))

    def block(state):
        return np.array(head.logits(head.block_hidden(state, mx.array(5), target, 4), target))

    windowed = head.make_cache(window=5)
    for a in range(0, 300, 37):  # (in pieces, past the buffer's compaction)
        head.add_context(windowed, feats[a: a + 37])
    assert windowed.offset == 300 and windowed.layers[0].base > 0
    last = head.make_cache()  # (at positions 0..4: rotary attention sees only distances)
    head.add_context(last, feats[295:])
    whole = head.make_cache()
    head.add_context(whole, feats)
    np.testing.assert_allclose(block(windowed), block(last), atol=1e-5)
    assert not np.allclose(block(windowed), block(whole), atol=1e-3)


def test_dflash2_blocks_and_selector_match_the_reference(pair2):
    """DFlash 2: every slot's logits within 1e-4 of the package's forward (its dynamic
    convolutions around attention and MLP), the selector's greedy chain its `propose`'s, and
    the first slot's sampling distribution over its candidates the package's."""
    import torch

    ids = np.random.default_rng(4).integers(3, 63, 12).tolist()
    reference, draft, model, feats = _loaded(*pair2, ids, (0, 2), version=2)
    head = model.head
    with torch.no_grad():
        block = torch.full((1, BLOCK), 63)
        block[0, 0] = ids[11]
        hidden = draft(position_ids=torch.arange(11 + BLOCK)[None],
                       noise_embedding=reference.get_input_embeddings()(block),
                       target_hidden=feats[:, :11])[:, 1:]
        logits = draft.compute_logits(hidden, reference.lm_head)[0].numpy()
        tokens, cand, _ = draft.propose(hidden, block[:, 0], reference.lm_head, 0.0)
        _, cand_t, q = draft.propose(hidden, block[:, 0], reference.lm_head, 0.7)
    state = head.make_cache()
    head.add_context(state, mx.array(feats[0, :11].numpy()))
    ours_h = head.block_hidden(state, mx.array(ids[11]), model.target, BLOCK)
    ours = head.logits(ours_h, model.target)
    np.testing.assert_allclose(np.array(ours), logits, atol=1e-4, rtol=0)
    chain, _ = head.candidate_selector.walk(ours_h, ours, mx.array(ids[11]))
    assert chain.tolist() == tokens[0].tolist()
    _, lq = head.candidate_selector.walk(ours_h, ours, mx.array(ids[11]), 0.7, mx.random.key(0))
    expected = np.zeros(64)
    expected[cand_t[0, 0].numpy()] = q[0, 0].numpy()
    np.testing.assert_allclose(np.exp(np.array(lq[0])), expected, atol=1e-5)


@pytest.mark.parametrize("name", ["deepspec", "speculators", "slot0"])
def test_dspark_blocks_and_markov_chains_match_mlx_dspark(pair, dspark, name):
    """DSpark (DeepSpec's layout and speculators', predicting from slot 1 or slot 0): the
    first predicting slot as mlx-dspark reads the config, every predicted slot's logits and
    the Markov head's greedy chain as mlx-dspark's drafter computes them from the same
    context."""
    DSparkConfig, DSparkDrafter = _dspark()
    target_dir, _ = pair
    folder = dspark[name]
    ref_config = DSparkConfig.from_json(str(folder / "config.json"))
    reference = DSparkDrafter(ref_config)
    reference.load_weights(str(folder / "model.safetensors"))
    model, _ = eagle_mlx.load(str(target_dir), eagle=str(folder))
    head = model.head
    assert head.kind == "dspark" and head.args.logits_start == ref_config.logits_start
    n = head.predicts
    assert n == BLOCK - ref_config.logits_start
    feats = mx.array(np.random.default_rng(6).standard_normal((11, 128)).astype(np.float32))
    caches = reference.make_ctx_cache()
    reference.update_context(feats[None], 0, caches)
    hidden = reference.backbone(reference.embed(mx.array([[7] + [63] * (BLOCK - 1)])), 11,
                                caches)
    expected = reference.compute_logits(reference.head_slice(hidden, n))[0]
    state = head.make_cache()
    head.add_context(state, feats[:4])  # (in two pieces)
    head.add_context(state, feats[4:])
    ours = head.predict_hidden(state, mx.array(7), model.target, n)
    logits = head.logits(ours, model.target)
    np.testing.assert_allclose(np.array(logits), np.array(expected), atol=1e-5, rtol=0)
    assert head.chain(ours, logits, mx.array(7))[0].tolist() == \
        reference.sample_block(expected, 7).tolist()


def test_dspark_decodes_exactly_and_reads_the_slot_its_config_names(pair, dspark):
    """Greedy DSpark chains give transformers' tokens; the same weights declared to predict
    from slot 0 (the wrong slot for them) give the same tokens at a lower tau — what a
    misread `logits_start` costs, silently, in a peer."""
    target_dir, _ = pair
    reference = hf_model(target_dir)
    taus = {}
    for name in ("deepspec", "slot0"):
        model, tok = eagle_mlx.load(str(target_dir), eagle=str(dspark[name]))
        tok.eos_token_ids = set()
        accepted = []
        for prompt in ([4, 9, 30, 26, 56, 34], [40, 41, 40, 41, 12]):
            out, rs = _tokens(model, tok, prompt, max_tokens=20, total_tokens=BLOCK,
                              depth=BLOCK - 3, draft_top_k=1)
            assert out == hf_greedy(reference, prompt, 20), name
            accepted += [r.accept_length for r in rs[1:]]
        taus[name] = 1 + float(np.mean(accepted))
    assert taus["deepspec"] > taus["slot0"] + 0.5, taus


@pytest.mark.parametrize("changes, says", [
    (dict(model_type="gemma4_text"), "a Gemma-4-flavoured backbone"),
    (dict(log_snr_conditioning=True), "log-SNR conditioning"),
    (dict(has_lm_head=False), "the target's lm_head in place of its own"),
    (dict(logits_start=2), "\"logits_start\" must be 0 or 1"),
    (dict(vocab_size=80), "has a vocabulary of 80 tokens; the target.s has 64"),
], ids=["gemma4", "log-snr", "no-lm-head", "slot", "vocab"])
def test_dspark_variants_it_cannot_read_are_refused_in_one_sentence(pair, dspark, tmp_path,
                                                                    changes, says):
    target_dir, _ = pair
    d = tmp_path / "d"
    shutil.copytree(dspark["deepspec"], d)
    config = json.loads((d / "config.json").read_text())
    config.update(changes)
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(EagleError, match=says):
        eagle_mlx.load(str(target_dir), eagle=str(d))


def test_dspark_confidence_ends_chains_where_survival_drops(pair, dspark):
    """The confidence head's survival of a chain is mlx-dspark's (sigmoid of its confidence
    logits, multiplied along the chain); with `draft_confidence` each cycle's chain ends where
    it falls below the threshold, shorter chains that still give transformers' tokens."""
    _, DSparkDrafter = _dspark()
    from mlx_dspark.config import DSparkConfig

    target_dir, _ = pair
    folder = dspark["deepspec"]
    reference = DSparkDrafter(DSparkConfig.from_json(str(folder / "config.json")))
    reference.load_weights(str(folder / "model.safetensors"))
    model, tok = eagle_mlx.load(str(target_dir), eagle=str(folder))
    head = model.head
    hidden = mx.array(np.random.default_rng(8).standard_normal((3, 64)).astype(np.float32))
    chain = mx.array([9, 17, 4])
    expected = np.cumprod(np.array(mx.sigmoid(reference.confidence_logits(
        hidden, mx.array([7, 9, 17])))))
    np.testing.assert_allclose(np.array(head.survival(hidden, chain, mx.array(7))), expected,
                               atol=1e-6)
    # the chain a cycle drafts ends where the survival falls below the threshold
    from eagle_mlx.decoding.block import BlockDrafter

    feats = mx.array(np.random.default_rng(9).standard_normal((8, 128)).astype(np.float32))
    state = head.make_cache()
    head.add_context(state, feats)
    n = head.predicts
    h = head.predict_hidden(state, mx.array(7), model.target, n)
    walk = head.chain(h, head.logits(h, model.target), mx.array(7))[0]
    alive = np.array(head.survival(h, walk, mx.array(7))).tolist()
    for threshold in sorted(set(alive)) + [alive[0] + 1e-3]:
        head.args.confidence_threshold = threshold
        s = head.make_cache()
        tree = BlockDrafter(head, model.target, BLOCK, BLOCK, 1).propose(
            s, feats, None, mx.array(7))
        keep = max(1, next((i for i, a in enumerate(alive) if a < threshold), n))
        assert tree.tokens.tolist() == [7] + walk.tolist()[:keep], threshold
    head.args.confidence_threshold = None
    tok.eos_token_ids = set()
    prompt = [4, 9, 30, 26, 56, 34]
    cut, tok2 = eagle_mlx.load(str(target_dir), eagle=str(folder), draft_confidence=0.6)
    tok2.eos_token_ids = set()
    out, _ = _tokens(cut, tok2, prompt, max_tokens=20, total_tokens=BLOCK, depth=1,
                     draft_top_k=1)
    assert out == hf_greedy(hf_model(target_dir), prompt, 20)
    with pytest.raises(EagleError, match="draft_confidence applies to DSpark drafters"):
        eagle_mlx.load(str(target_dir), eagle=str(pair[1]), draft_confidence=0.5)


def test_auto_chooses_among_block_chains_and_ddtrees_exactly(pair, tmp_path, monkeypatch):
    """Under adaptive speculation (the default) a block drafter's chains and DDTrees are the
    head's options, measured on this machine like an EAGLE head's: the tokens are still the
    target's greedy ones."""
    monkeypatch.setenv("EAGLE_MLX_CACHE", str(tmp_path / "cache"))
    target_dir, draft_dir = pair
    model, tok = eagle_mlx.load(str(target_dir), eagle=str(draft_dir))
    tok.eos_token_ids = set()
    costs = model.costs()
    assert any(k.startswith("head") for k in costs.draft_costs), costs.draft_costs
    prompt = [4, 9, 30, 26, 56, 34]
    out, rs = _tokens(model, tok, prompt, max_tokens=24)
    assert out == hf_greedy(hf_model(target_dir), prompt, 24)
    assert sum(rs[-1].passes.values()) > 0
