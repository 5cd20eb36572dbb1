"""Bad input, as a new user makes it: every tool and the Python API answer with one sentence
and the right exit code (2 for values, 1 for files), never a traceback, and leave nothing
behind. The tools run in-process (their `main`, what the console scripts call); the cases
that need a real process (stdin bytes, Ctrl-C) run one."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import eagle_mlx
from eagle_mlx import EagleError
from tiny import ROOT, make_eagle_head, make_hf_model

TOOLS = {}


def tool(name):
    if name not in TOOLS:
        import importlib

        TOOLS[name] = importlib.import_module(f"eagle_mlx.{name}").main
    return TOOLS[name]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    target = make_hf_model(root / "target", "llama", seed=5, num_hidden_layers=2,
                           vocab_size=64, scale=4.0, max_position_embeddings=128)
    head = make_eagle_head(root / "head", target, "eagle1", seed=1)
    for name, change in (("head_eagle_yes", {"eagle": "yes"}),
                         ("head_hidden_big", {"hidden_size": "big"}),
                         ("head_rope_longrope", {"rope_scaling": {"rope_type": "longrope",
                                                                  "factor": 4.0}})):
        folder = root / name
        folder.mkdir()
        config = json.loads((head / "config.json").read_text())
        config.update(change)
        (folder / "config.json").write_text(json.dumps(config))
        for weights in head.iterdir():
            if weights.name != "config.json":
                (folder / weights.name).write_bytes(weights.read_bytes())
    # a speculators head with a flag this head does not know, and a Qwen3.5 checkpoint
    # without the MTP module an --eagle pointing at it asks for
    spec = root / "head_spec_flag"
    spec.mkdir()
    (spec / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3", "norm_before_attn": True,
        "transformer_layer_config": {"model_type": "llama", "hidden_size": 64}}))
    (spec / "pytorch_model.bin").write_bytes((head / "pytorch_model.bin").read_bytes())
    from conftest import HYBRID_TARGETS

    make_hf_model(root / "qwen35_no_mtp", "qwen3_5", seed=5, vocab_size=64,
                  **HYBRID_TARGETS["qwen3_5"][1])
    data = root / "data.json"
    data.write_text(json.dumps([{"id": str(i), "conversations": [
        {"from": "human", "value": "t5 t6 t7"}, {"from": "gpt", "value": "t8 t9 t10 t11"}]}
        for i in range(8)]))
    (root / "a_file").write_text("in the way\n")
    (root / "existing").mkdir()
    (root / "train_out_empty").mkdir()
    assert tool("regen")(["--model", str(target), "--data", str(data), "--out", str(root / "feats"),
                          "--answers", "data", "--no-taps", "--quiet"]) == 0
    # the same features, their index claiming EAGLE-3 taps: a folder of another recording
    shutil.copytree(root / "feats", root / "feats_taps")
    index = json.loads((root / "feats_taps" / "index.json").read_text())
    index["settings"]["taps"] = [0, 1, 2]
    (root / "feats_taps" / "index.json").write_text(json.dumps(index))
    return root, target, head, data


def _tree(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# (tool, argv with {T} target, {H} head, {R} the test folder, {D} data; exit code, fragment)
GEN = ["--model", "{T}", "--eagle", "{H}", "--prompt", "t5 t6"]
TRAIN = ["--model", "{T}", "--data", "{D}", "--out", "{R}/train_out", "--quiet"]
BENCH = ["--model", "{T}", "--eagle", "{H}", "--output", "{R}/bench.json"]
CASES = [
    ("generate", GEN + ["--seed", "-1"], 2, "--seed"),
    ("generate", GEN + ["--seed", str(2**64)], 2, "--seed"),
    ("generate", GEN + ["--temp", "inf"], 2, "--temp"),
    ("generate", GEN + ["--temp", "nan"], 2, "--temp"),
    ("generate", GEN + ["--top-p", "0"], 2, "--top-p"),
    ("generate", GEN + ["--min-p", "1.5"], 2, "--min-p"),
    ("generate", GEN + ["--top-k", "-3"], 2, "--top-k"),
    ("generate", GEN + ["--max-tokens", "0"], 2, "--max-tokens"),
    ("generate", GEN + ["--depth", "1000"], 2, "--depth"),
    ("generate", GEN + ["--draft-top-k", "4096"], 2, "--draft-top-k"),
    ("generate", GEN + ["--total-tokens", "5000"], 2, "--total-tokens"),
    ("generate", GEN + ["--total-tokens", "60", "--depth", "1", "--draft-top-k", "2"], 2,
     "total_tokens must be at most 7"),
    ("generate", GEN + ["--tree-choices", "[[7]]", "--draft-top-k", "4"], 2, "--tree-choices"),
    ("generate", GEN + ["--tree-choices", "[[0, 1]]"], 2, "not its parent"),
    ("generate", GEN + ["--tree-choices", "[[0.5]]"], 2, "--tree-choices"),
    ("generate", GEN + ["--tree-choices", "{}"], 2, "--tree-choices"),
    ("generate", GEN + ["--tree-choices", "nonsense"], 2, "--tree-choices"),
    ("generate", GEN + ["--dtype", "float8"], 2, "--dtype"),
    ("generate", GEN + ["--draft-vocab", "-1"], 2, "--draft-vocab"),
    ("generate", GEN + ["--draft-vocab", "100000"], 2, "--draft-vocab must be from 1 to"),
    ("generate", GEN + ["--draft-vocab", "10", "--draft-vocab-data", "{R}/missing.json"], 1,
     "--draft-vocab-data"),
    ("generate", GEN + ["--max-tokens", "many"], 2, "--max-tokens"),
    ("generate", ["--model", "{T}", "--prompt", "t5 \udcff"], 2, "--prompt is not valid UTF-8"),
    ("generate", GEN + ["--system-prompt", "\udcfe"], 2, "--system-prompt"),
    ("generate", ["--model", "{T}", "--prompt", "   "], 2, "--prompt is empty"),
    ("generate", ["--model", "{R}/missing", "--prompt", "t5"], 1, "does not exist"),
    ("generate", ["--model", "{T}", "--eagle", "{R}/missing", "--prompt", "t5"], 1, "does not exist"),
    ("generate", ["--model", "{T}", "--eagle", "{R}/head_eagle_yes", "--prompt", "t5"], 1,
     '"eagle" must be an object'),
    ("generate", ["--model", "{T}", "--eagle", "{R}/head_hidden_big", "--prompt", "t5"], 1,
     '"hidden_size" must be a positive whole number'),
    ("generate", ["--model", "{T}", "--eagle", "{R}/head_rope_longrope", "--prompt", "t5"], 1,
     '"rope_scaling" is of type \'longrope\', which eagle_mlx\'s heads do not compute'),
    ("generate", ["--model", "{T}", "--eagle", "{R}/head_spec_flag", "--prompt", "t5"], 1,
     '"norm_before_attn" is not one this head knows'),
    ("generate", ["--model", "{T}", "--eagle", "{R}/qwen35_no_mtp", "--prompt", "t5"], 1,
     "has no mtp.* tensors"),
    ("generate", GEN + ["--lookup", "--lookup-min-match", "0"], 2, "--lookup-min-match"),
    ("generate", GEN + ["--lookup", "--lookup-max-draft", "100000"], 2, "--lookup-max-draft"),
    ("generate", GEN + ["--lookup", "--lookup-max-draft", "nan"], 2, "--lookup-max-draft"),
    ("generate", GEN + ["--lookup-max-draft", "4"], 2, "--lookup-max-draft needs --lookup"),
    ("generate", GEN + ["--lookup", "--no-lookup"], 2, "--lookup and --no-lookup contradict"),
    ("generate", GEN + ["--draft-window", "0"], 2, "--draft-window"),
    ("generate", GEN + ["--draft-window", "-3"], 2, "--draft-window"),
    ("generate", GEN + ["--draft-confidence", "1.5"], 2, "--draft-confidence"),
    ("generate", GEN + ["--draft-confidence", "nan"], 2, "--draft-confidence"),
    ("generate", GEN + ["--draft-confidence", "0.5"], 1,
     "draft_confidence applies to DSpark drafters"),
    ("generate", GEN + ["--speculate", "sometimes"], 2, "--speculate"),
    ("generate", GEN + ["--kv-bits", "7"], 2, "--kv-bits must be one of 2, 3, 4, 5, 6, 8"),
    ("generate", GEN + ["--kv-bits", "four"], 2, "--kv-bits"),
    ("generate", GEN + ["--kv-bits", "4", "--kv-group-size", "48"], 2,
     "--kv-group-size must be one of 32, 64, 128"),
    ("generate", GEN + ["--kv-bits", "4", "--quantized-kv-start", "-1"], 2,
     "--quantized-kv-start must be a whole number"),
    ("generate", GEN + ["--quantized-kv-start", "10"], 2,
     "--quantized-kv-start applies to a quantized KV cache; give --kv-bits too"),
    ("generate", GEN + ["--kv-bits", "4"], 2,
     "group size of 64 (kv_group_size, --kv-group-size) does not divide the target's "
     "key/value head size 16"),
    ("server", ["--model", "{T}", "--kv-bits", "4", "--max-batch", "2"], 2,
     "--kv-bits quantizes one sequence's caches"),
    ("generate", GEN + ["--max-kv-size", "3"], 2, "--max-kv-size must be a whole number"),
    ("generate", GEN + ["--max-kv-size", "64", "--kv-bits", "8", "--kv-group-size", "32"], 2,
     "--max-kv-size and --kv-bits do not go together"),
    ("generate", GEN + ["--max-kv-size", "8", "--depth", "6"], 2,
     "max_kv_size 8 leaves each position a window of 4"),
    ("generate", GEN + ["--prompt-cache-file", "{R}/missing.safetensors"], 1,
     "missing.safetensors does not exist"),
    ("cache_prompt", ["--model", "{T}", "--prompt", "t5", "--prompt-cache-file",
                      "{R}/c.safetensors", "--kv-bits", "9"], 2, "--kv-bits must be one of"),
    ("cache_prompt", ["--model", "{T}", "--prompt", "t5", "--prompt-cache-file",
                      "{R}/no/such/folder/c.safetensors"], 1, "its folder"),
    ("server", ["--model", "{T}", "--speculate", "yes"], 2, "--speculate"),
    ("chat", ["--model", "{T}", "--lookup", "--lookup-min-match", "-3"], 2, "--lookup-min-match"),
    ("chat", ["--model", "{T}", "--seed", "-5"], 2, "--seed"),
    ("chat", ["--model", "{T}", "--temp", "nan"], 2, "--temp"),
    ("convert", ["--mlx-path", "{R}/out"], 2, "give --eagle"),
    ("convert", ["--eagle", "{H}", "--mlx-path", "{R}/existing"], 1, "already exists"),
    ("convert", ["--eagle", "{H}", "--mlx-path", "{R}/a_file/out"], 1, "is a file, not a folder"),
    ("convert", ["--eagle", "{H}", "--model", "{T}", "--mlx-path", "{R}/conv",
                 "--model-mlx-path", "{R}/a_file/t"], 1, "--model-mlx-path"),
    ("convert", ["--model", "{T}", "--mlx-path", "{R}/a_file/t"], 1, "--mlx-path"),
    ("convert", ["--eagle", "{H}", "--model", "{T}", "--layout", "speculators",
                 "--mlx-path", "{R}/spec"], 1, "the speculators layout holds EAGLE-3 heads"),
    ("convert", ["--eagle", "{H}", "--layout", "speculators", "-q", "--mlx-path", "{R}/spec"],
     2, "MLX's quantization (-q)"),
    ("convert", ["--eagle", "{H}", "--layout", "mlx-ish", "--mlx-path", "{R}/spec"], 2,
     "--layout"),
    ("train", TRAIN + ["--grad-clip", "-1"], 2, "--grad-clip"),
    ("train", TRAIN + ["--max-len", "1"], 2, "--max-len"),
    ("train", TRAIN + ["--noise", "nan"], 2, "--noise"),
    ("train", TRAIN + ["--num-conversations", "0"], 2, "--num-conversations"),
    ("train", TRAIN + ["--max-time", "-5"], 2, "--max-time"),
    ("train", TRAIN + ["--lr", "0"], 2, "--lr"),
    ("train", TRAIN + ["--seed", "-1"], 2, "--seed"),
    ("train", TRAIN + ["--kind", "eagle2"], 2, "--kind"),
    ("train", TRAIN + ["--lm-head-init", "random"], 2, "--lm-head-init is for EAGLE-3 heads"),
    ("train", TRAIN + ["--unroll", "0"], 2, "--unroll"),
    ("train", TRAIN + ["--draft-vocab", "65"], 2, "--draft-vocab 65 is larger"),
    ("train", TRAIN + ["--labels", "teacher"], 2, "--labels"),
    ("train", TRAIN + ["--features", "{R}/feats"], 2, "give one of them"),
    ("train", ["--model", "{T}", "--layout", "speculators", "--out", "{R}/train_out"], 2,
     "--layout speculators is the layout --export writes an EAGLE-3 head in"),
    ("train", ["--model", "{T}", "--features", "{R}/a_file", "--out", "{R}/train_out"], 1,
     "is not a folder of feature shards"),
    ("train", ["--model", "{T}", "--features", "{R}/existing", "--out", "{R}/train_out"], 1,
     "holds no shard yet"),
    ("train", ["--model", "{T}", "--features", "{H}", "--out", "{R}/train_out"], 1,
     "holds no index written by eagle_mlx.regen"),
    ("train", ["--model", "{R}/qwen35_no_mtp", "--features", "{R}/feats", "--out",
               "{R}/train_out"], 1, "holds the features of a llama target"),
    ("train", ["--model", "{T}", "--features", "{R}/feats", "{R}/feats/", "--out",
               "{R}/train_out"], 1, "names the same folder twice"),
    ("train", ["--model", "{T}", "--features", "{R}/feats", "{R}/feats_taps", "--out",
               "{R}/train_out"], 1, "train on one target's features at a time"),
    ("train", TRAIN + ["--kind", "eagle3", "--draft-vocab", "0"], 2, "--draft-vocab"),
    ("train", TRAIN + ["--kind", "eagle3", "--unroll", "0"], 2, "--unroll"),
    ("train", TRAIN + ["--kind", "eagle3", "--unroll", "1000"], 2, "--unroll"),
    ("train", TRAIN + ["--kind", "eagle3", "--warmup-steps", "-1"], 2, "--warmup-steps"),
    ("train", TRAIN + ["--kind", "eagle3", "--lm-head-init", "zeros"], 2, "--lm-head-init"),
    ("train", TRAIN + ["--export", "{R}/existing"], 1, "--export"),
    ("train", TRAIN + ["--export", "{R}/a_file/x"], 1, "--export"),
    ("train", ["--model", "{T}", "--data", "{D}", "--out", "{R}/a_file/o"], 1, "--out"),
    ("train", ["--model", "{T}", "--data", "{D}", "--out", "{R}/a_file"], 1, "is a file"),
    ("train", ["--model", "{T}", "--data", "{D}", "--out", "{R}/train_out_empty", "--resume"], 1,
     "no checkpoint"),
    ("train", TRAIN + ["--resume", "--init-head", "{H}"], 2, "give one of them"),
    ("benchmark", BENCH + ["--max-tokens", "1"], 2, "--max-tokens"),
    ("benchmark", BENCH + ["--temps", "nan"], 2, "--temps"),
    ("benchmark", BENCH + ["--trees", "16/4/4096"], 2, "--trees"),
    ("benchmark", BENCH + ["--trees", "16/x/4"], 2, "--trees"),
    ("benchmark", BENCH + ["--seed", "-1"], 2, "--seed"),
    ("benchmark", BENCH + ["--num-prompts", "0"], 2, "--num-prompts"),
    ("benchmark", ["--model", "{T}", "--eagle", "{H}", "--output", "{R}/a_file/b.json"], 1,
     "--output"),
    ("benchmark", BENCH + ["--plot", "{R}/existing"], 1, "--plot"),
    ("benchmark", BENCH + ["--max-tokens", "100"], 2, "no room for a prompt"),
    ("benchmark", BENCH + ["--draft-vocabs", "8192", "-1"], 2, "--draft-vocabs"),
    ("benchmark", BENCH + ["--lookup", "--lookup-max-draft", "0"], 2, "--lookup-max-draft"),
    ("benchmark", BENCH + ["--batch-sizes", "0"], 2, "--batch-sizes must be from 1 to 64"),
    ("benchmark", BENCH + ["--context", "4q"], 2, "--context takes lengths"),
    ("benchmark", BENCH + ["--context", "32"], 2, "at least 64"),
    ("benchmark", BENCH + ["--context", "1k"], 2, "exceeds the model's context of 128"),
    ("benchmark", BENCH + ["--context", "100", "--auto"], 2, "--auto does not apply"),
    ("benchmark", BENCH + ["--context", "100", "--prompts", "{D}"], 2, "--prompts does not"),
    ("benchmark", BENCH + ["--kv-bits", "4"], 2, "apply with --context"),
    ("benchmark", BENCH + ["--modes", "auto"], 2, "--modes and --quantized-only apply with"),
    ("benchmark", BENCH + ["--context", "100", "--quantized-only"], 2, "give --kv-bits too"),
    ("benchmark", BENCH + ["--context", "100", "--modes", "fast"], 2, "invalid choice"),
    ("benchmark", BENCH + ["--measure-under-load"], 2, "applies with --auto"),
    ("benchmark", BENCH + ["--rounds", "2"], 2, "--rounds applies with --auto"),
    ("benchmark", BENCH + ["--auto", "--rounds", "0"], 2, "--rounds must be at least 1"),
    ("benchmark", BENCH + ["--auto", "--measure-under-load", "--save-tuning"], 2,
     "give one of the two"),
    ("benchmark", BENCH + ["--context", "100", "--kv-bits", "7"], 2, "--kv-bits must be one of"),
    ("benchmark", BENCH + ["--context", "100", "--kv-group-size", "32"], 2, "give --kv-bits"),
    ("benchmark", BENCH + ["--context", "64", "--max-tokens", "8", "--kv-bits", "4",
                           "--kv-group-size", "32"], 2,
     "does not divide the target's key/value head size 16"),
    ("server", ["--model", "{T}", "--lookup", "--lookup-min-match", "0"], 2, "--lookup-min-match"),
    ("server", ["--model", "{T}", "--port", "70000"], 2, "--port"),
    ("server", ["--model", "{T}", "--max-connections", "0"], 2, "--max-connections must be"),
    ("server", ["--model", "{T}", "--max-connections", "-5"], 2, "--max-connections must be"),
    ("server", ["--model", "{T}", "--max-connections", "many"], 2, "--max-connections"),
    ("server", ["--model", "{T}", "--max-body-bytes", "10"], 2, "--max-body-bytes"),
    ("server", ["--model", "{T}", "--max-tokens", "0"], 2, "--max-tokens"),
    ("server", ["--model", "{T}", "--temp", "nan"], 2, "--temp"),
    ("server", ["--model", "{T}", "--api-key", " "], 2, "--api-key is empty"),
    ("server", ["--model", "{T}", "--max-batch", "0"], 2, "--max-batch must be from 1"),
    ("server", ["--model", "{T}", "--max-batch", "65"], 2, "--max-batch must be from 1"),
    ("server", ["--model", "{T}", "--max-batch", "two"], 2, "--max-batch"),
    ("server", ["--model", "{T}", "--port", "many"], 2, "--port"),
    ("regen", ["--model", "{T}", "--data", "{D}", "--out", "{R}/f", "--num-conversations", "0"],
     2, "--num-conversations"),
    ("regen", ["--model", "{T}", "--data", "{D}", "--out", "{R}/f", "--batch-size", "0"],
     2, "--batch-size"),
    ("regen", ["--model", "{T}", "--data", "{D}", "--out", "{R}/f", "--skip", "-1"], 2, "--skip"),
    ("regen", ["--model", "{T}", "--data", "{D}", "--out", "{R}/f", "--max-tokens", "64",
               "--max-len", "64"], 2, "leaves no room for a prompt"),
    ("regen", ["--model", "{T}", "--data", "{D}", "--out", "{R}/f", "--shard-conversations",
               "0"], 2, "--shard-conversations"),
    ("regen", ["--model", "{T}", "--data", "{D}", "--out", "{R}/f"], 1,
     "too few for the EAGLE-3 taps"),
    ("regen", ["--model", "{T}", "--data", "{D}", "--out", "{R}/a_file/f"], 1, "--out"),
    ("regen", ["--model", "{T}", "--data", "{D}", "--out", "{R}/a_file"], 1,
     "is a file, not a folder"),
    ("regen", ["--model", "{T}", "--data", "{D}", "--out", "{H}"], 1,
     "holds no index written by eagle_mlx.regen"),
]

# a folder that permission bits call writable for root but that refuses every new file
if Path("/proc/self").is_dir():
    CASES += [
        ("benchmark", BENCH[:-1] + ["/proc/eagle_mlx_bench.json"], 1, "cannot be written"),
        ("train", TRAIN[:5] + ["/proc/eagle_mlx_train", "--quiet"], 1, "cannot be written"),
        ("regen", ["--model", "{T}", "--data", "{D}", "--out", "/proc/eagle_mlx_regen"], 1,
         "cannot be written"),
        ("convert", ["--eagle", "{H}", "--mlx-path", "/proc/eagle_mlx_head"], 1,
         "cannot be written"),
    ]


def _fill(argv, root, target, head, data):
    return [a.replace("{T}", str(target)).replace("{H}", str(head)).replace("{R}", str(root))
            .replace("{D}", str(data)) for a in argv]


@pytest.mark.parametrize("name,argv,code,fragment", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_tool_refuses_in_one_sentence(world, capsys, name, argv, code, fragment):
    root, target, head, data = world
    before = _tree(root)
    try:
        rc = tool(name)(_fill(argv, root, target, head, data))
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == code, (rc, err)
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert fragment in err, err
    assert _tree(root) == before  # nothing left behind, nothing half-written


def test_benchmark_without_matplotlib_refuses_before_measuring(world, capsys, monkeypatch):
    root, target, head, data = world
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    before = _tree(root)
    assert tool("benchmark")(_fill(BENCH, root, target, head, data)) == 1
    err = capsys.readouterr().err.strip()
    assert "matplotlib" in err and "\n" not in err
    assert _tree(root) == before


@pytest.fixture(scope="module")
def api(world):
    _, target, head, _ = world
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    return model, tok


API_CASES = [
    (dict(prompt=None), "the prompt must be a string or a list of token ids"),
    (dict(prompt=["t5", "t6"]), "holding other values"),
    (dict(prompt=[5, 6.5]), "holding other values"),
    (dict(prompt="t5 \udcff"), "not valid UTF-8"),
    (dict(temp=None), "temp must be"),
    (dict(temp="hot"), "temp must be"),
    (dict(settings={"temp": 0.5}), "settings must be an eagle_mlx.GenerationSettings"),
    (dict(settings=eagle_mlx.GenerationSettings(top_p=0.0)), "top_p must be"),
    (dict(settings=eagle_mlx.GenerationSettings(speculate="yes")), "speculate must be"),
    (dict(temp=float("inf")), "temp must be"),
    (dict(top_p=float("nan")), "top_p must be"),
    (dict(max_tokens=2.5), "max_tokens must be"),
    (dict(max_context=0), "max_context must be"),
    (dict(max_context=10**6), "exceeds the model's context"),
    (dict(seed=-1), "seed must be"),
    (dict(seed=True and 2**64), "seed must be"),
    (dict(draft_top_k=4096), "draft_top_k must be from 1 to 64"),
    (dict(depth=0), "depth must be"),
    (dict(tree_choices=[[7]], draft_top_k=4), "draft_top_k 4"),
    (dict(tree_choices="[[0]]"), "tree_choices must be"),
    (dict(speculate="yes"), "speculate must be"),
    (dict(speculate="always"), "speculate must be \"auto\", True or False"),
    (dict(prompt_cache={}), "prompt_cache must be"),
    (dict(logprobs=21), "logprobs must be None (off) or the number of top alternatives"),
    (dict(logprobs="5"), "logprobs must be None (off)"),
    (dict(settings=eagle_mlx.GenerationSettings(logprobs=-1)), "logprobs must be None (off)"),
]


@pytest.mark.parametrize("kwargs,fragment", API_CASES, ids=[str(i) for i in range(len(API_CASES))])
def test_api_refuses_in_one_sentence(api, kwargs, fragment):
    model, tok = api
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", [5, 6, 7])
    with pytest.raises(EagleError) as e:
        list(eagle_mlx.stream_generate(model, tok, prompt, max_tokens=kwargs.pop("max_tokens", 4),
                                       **kwargs))
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


BATCH_CASES = [
    (dict(stop=5), "stop must be a list holding one list of stop strings per prompt"),
    (dict(stop=[5]), "stop must be a list holding one list of stop strings per prompt"),
    (dict(stop=[["a", 3]]), "stop must be a list holding one list of stop strings per prompt"),
    (dict(settings=5), "settings must be a list holding one eagle_mlx.GenerationSettings"),
    (dict(settings=[{"temp": 0.5}]), "settings must be a list holding one"),
    (dict(verbose="yes"), "verbose must be True or False"),
    (dict(max_batch="2"), "max_batch must be a whole number"),
    (dict(max_tokens=[4, 4]), "max_tokens has 2 values for 1 prompts"),
    (dict(max_tokens="many"), "max_tokens must be"),
    (dict(logprobs=True), "logprobs must be None (off)"),
]


@pytest.mark.parametrize("kwargs,fragment", BATCH_CASES,
                         ids=[str(i) for i in range(len(BATCH_CASES))])
def test_batch_api_refuses_in_one_sentence(api, kwargs, fragment):
    """batch_generate's arguments are checked before anything runs: a wrong type or value is
    one sentence, never an error from inside."""
    model, tok = api
    with pytest.raises(EagleError) as e:
        eagle_mlx.batch_generate(model, tok, [[5, 6]], **kwargs)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_batch_generator_add_refuses_in_one_sentence(api):
    model, tok = api
    gen = eagle_mlx.BatchGenerator(model, tok, max_batch=2)
    for kwargs, fragment in ((dict(record=5), "record must be a function"),
                             (dict(prompt_cache=5), "prompt_cache must be"),
                             (dict(temp="hot"), "temp must be")):
        with pytest.raises(EagleError, match=fragment):
            gen.add([5, 6], **kwargs)
    assert not gen.busy  # nothing was queued


def test_api_load_refuses_non_paths(world):
    _, target, head, _ = world
    with pytest.raises(EagleError, match="given as a string"):
        eagle_mlx.load(None)
    with pytest.raises(EagleError, match="given as a string"):
        eagle_mlx.load(str(target), eagle=3)
    with pytest.raises(EagleError, match="dtype must be one of"):
        eagle_mlx.load(str(target), dtype="hot")
    with pytest.raises(EagleError, match="lookup must be True, False or an"):
        eagle_mlx.load(str(target), lookup="yes")
    with pytest.raises(EagleError, match="lookup max_draft must be a whole number"):
        eagle_mlx.load(str(target), lookup=eagle_mlx.LookupSettings(max_draft=0))
    for kwargs, fragment in ((dict(lazy="yes"), "lazy must be True or False"),
                             (dict(draft_vocab="many"), "draft_vocab must be a whole number"),
                             (dict(draft_vocab=-1), "draft_vocab must be a whole number"),
                             (dict(draft_vocab_data=3), "draft_vocab_data must be the path")):
        with pytest.raises(EagleError, match=fragment):
            eagle_mlx.load(str(target), eagle=str(head), **kwargs)


def _run(args, **kw):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, cwd=ROOT,
                          timeout=300, **kw)


def test_undecodable_bytes_on_stdin(world):
    root, target, head, _ = world
    proc = _run(["eagle_mlx.generate", "--model", str(target), "--prompt", "-"],
                input=b"t5 \xff\xfe t6")
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.count("\n") == 1 and "not valid UTF-8" in err, err
    # a chat session survives a bad line and answers the next one
    proc = _run(["eagle_mlx.chat", "--model", str(target), "--max-tokens", "4"],
                input=b"t5 \xff\nt6 t7\n")
    assert proc.returncode == 0, proc.stderr
    assert b"not valid UTF-8" in proc.stderr and b"Traceback" not in proc.stderr
    assert proc.stdout.strip()  # the second line got its reply


def _endless_training(target, data, out):
    """A training run that only Ctrl-C ends (module and flags for python -m)."""
    return ["eagle_mlx.train", "--model", str(target), "--data", str(data), "--out", str(out),
            "--quiet", "--max-steps", "100000", "--batch-size", "2", "--eval-every", "100000",
            "--save-every", "100000", "--eval-conversations", "1"]


def _wait_for_two_steps(out):
    """The training log under out once it holds two steps (or after two minutes)."""
    log = out / "train_log.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (log.is_file() and log.read_text().count("\n") >= 2):
        time.sleep(0.2)
    return log


def test_ctrl_c_during_training_leaves_a_checkpoint_that_resumes(world, tmp_path):
    root, target, head, data = world
    out = tmp_path / "run"
    args = _endless_training(target, data, out)
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    log = _wait_for_two_steps(out)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == 130, err
    assert "interrupted: checkpoint of step" in err and "Traceback" not in err, err
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["step"] >= 2
    rows = [json.loads(r) for r in log.read_text().splitlines()]
    assert rows[-1]["step"] == state["step"]
    done = _run([*args[:-10], "--quiet", "--max-steps", str(state["step"] + 2), "--batch-size",
                 "2", "--eval-every", "100000", "--save-every", "100000",
                 "--eval-conversations", "1", "--resume"])
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "trainer_state.json").read_text())["step"] == state["step"] + 2


def test_ctrl_c_to_make_demo_stops_its_trainer_quietly(world, tmp_path):
    """scripts/make_demo.py runs the trainer as a child; Ctrl-C from a terminal reaches both
    (their process group): the trainer saves its step, the script waits for it and exits
    with the trainer's status, with no traceback of its own."""
    root, target, head, data = world
    out = tmp_path / "run"
    train = [sys.executable, "-m", *_endless_training(target, data, out)]
    script = ("import sys; sys.path.insert(0, 'scripts'); import make_demo; "
              f"raise SystemExit(make_demo.run_trainer({train!r}, None))")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    _wait_for_two_steps(out)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == 130, err
    assert "interrupted: checkpoint of step" in err and "Traceback" not in err, err
    assert json.loads((out / "trainer_state.json").read_text())["step"] >= 2


def test_a_failed_fresh_training_leaves_no_folder(world, tmp_path, capsys):
    root, target, head, _ = world
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"id": "0", "conversations": [
        {"from": "human", "value": " ".join(["t5"] * 40)}, {"from": "gpt", "value": "t6"}]}] * 4))
    out = tmp_path / "fresh"
    rc = tool("train")(["--model", str(target), "--data", str(bad), "--out", str(out),
                        "--max-len", "16", "--quiet", "--batch-size", "2",
                        "--eval-conversations", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "raise --max-len" in err, err
    assert not out.exists()


@pytest.mark.parametrize("delay", [0.2, 0.3, 0.5, 0.8])
def test_ctrl_c_while_a_tool_starts_is_quiet(world, delay):
    """Ctrl-C at any moment of a tool's start (importing MLX, loading) ends in one word.
    (Before 0.1 s the interpreter itself is still starting: that is Python's own.)"""
    _, target, head, _ = world
    proc = subprocess.Popen([sys.executable, "-m", "eagle_mlx.generate", "--model", str(target),
                             "--eagle", str(head), "--prompt", "t5", "--max-tokens", "2000"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (130, -signal.SIGINT), (proc.returncode, err)
    assert b"Traceback" not in err, err.decode()


def test_a_head_far_below_its_own_record_gets_a_warning(world):
    """A head whose acceptance is far below the held-out accuracy its trainer recorded (the
    sign of a head for another target) is named; one that lives up to it is not."""
    from eagle_mlx.generation import acceptance_warning

    _, target, head, _ = world
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    tok.eos_token_ids = set()
    r = list(eagle_mlx.stream_generate(model, tok, [5, 6, 7], max_tokens=120,
                                       speculate=True))[-1]
    assert r.head_accept_lengths == r.accept_lengths  # (the head drafted every cycle)
    first = sum(a >= 1 for a in r.accept_lengths) / len(r.accept_lengths)
    assert len(r.accept_lengths) >= 20 and first < 0.45  # a random head: few drafts accepted
    model.head.source = model.head.source.replace(held_out_top1=min(1.0, 2.5 * first + 0.3))  # promised far more than it did
    warning = acceptance_warning(model, r)
    assert warning and "a head for this target?" in warning and "\n" not in warning
    model.head.source = model.head.source.replace(held_out_top1=max(first, 0.01))  # it did what it promised
    assert acceptance_warning(model, r) is None
    model.head.source = model.head.source.replace(held_out_top1=None)
    model.tuning = {"tau": r.mean_accept_length * 3, "temp": 0.0}  # the benchmark saw far more
    assert "far below" in acceptance_warning(model, r)
    # under auto, where verifying costs what its tokens would, the head never drafts: its
    # passes are plain, and they say nothing about the head
    from eagle_mlx.decoding.adaptive import Costs

    model.measured, model.tuning = Costs({1: 1.0, 2: 2.0, 4: 4.0, 16: 16.0}), None
    r = list(eagle_mlx.stream_generate(model, tok, [5, 6, 7], max_tokens=120))[-1]
    assert len(r.accept_lengths) >= 20 and r.head_accept_lengths == []
    assert acceptance_warning(model, r) is None


@pytest.mark.parametrize("values", [["0"], ["3", "1000"], ["-2"]])
def test_bench_train_refuses_a_bad_unroll_before_measuring(values, tmp_path):
    """`python -m eagle_mlx.benchmark train --unroll`: a value out of range is one sentence and exit 2 before
    any features are recorded (nothing left in the temporary folder)."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "eagle_mlx.benchmark", "train", "--unroll", *values],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "--unroll must be from 1 to" in lines[-1] and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())
