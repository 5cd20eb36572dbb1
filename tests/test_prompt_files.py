"""Prompt caches saved to a file (mlx-lm's format, `python -m eagle_mlx.cache_prompt`) and
continued from it (`generate --prompt-cache-file`): in another process exactly as in
memory; mlx-lm's own files load for plain decoding; bad files are one sentence."""

import subprocess
import sys

import pytest

from conftest import PATTERN3
from tiny import ROOT, make_eagle_head, make_hf_model, tool

import eagle_mlx
from eagle_mlx import EagleError, PromptCache, cache_file

PREFIX = [5, 9, 13, 7, 22, 31, 40, 12, 33, 8, 19, 50]
SUFFIX = [17, 18, 19]


def fresh_tokens(model, tok, ids, n=20, **kw):
    return [t for r in eagle_mlx.stream_generate(model, tok, ids, max_tokens=n, **kw)
            for t in r.tokens]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pc")
    target = make_hf_model(root / "t", "llama", seed=5, vocab_size=64, head_dim=32,
                           num_hidden_layers=7, num_key_value_heads=2, scale=4.0)
    return target, make_eagle_head(root / "h", target, "eagle3", seed=1)


def test_a_saved_cache_continues_in_another_process_as_in_memory(pair, tmp_path):
    """cache_prompt writes the caches of a prompt; generate --prompt-cache-file, in another
    process, continues it (the question inside the open user message) and prints what a
    run over the whole conversation prints — speculative with the EAGLE-3 head, its
    features taken from the file."""
    from eagle_mlx.cache_prompt import prompt_ids
    from eagle_mlx.cli import continuation

    target, head = pair
    path = tmp_path / "doc.safetensors"
    proc = tool("cache_prompt", "--model", target, "--eagle", head, "--prompt", "t5 t9 t13 t7 t22",
                "--prompt-cache-file", path)
    assert proc.returncode == 0, proc.stderr
    assert path.is_file() and not list(tmp_path.glob("*.partial*"))
    run = subprocess.run([sys.executable, "-m", "eagle_mlx.generate", "--model", str(target),
                          "--eagle", str(head), "--prompt-cache-file", str(path), "--prompt",
                          "t40 t41", "--max-tokens", "16", "--speculate", "always"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    messages = [{"role": "user", "content": "t40 t41"}]
    ids = prompt_ids(tok, "t5 t9 t13 t7 t22", True) + continuation(tok, messages, True)
    expected = eagle_mlx.generate(model, tok, ids, max_tokens=16, speculate=False)
    assert run.stdout.split("==========\n")[1] == expected + "\n"
    assert f"Prompt: {len(ids)} tokens" in run.stdout


@pytest.mark.parametrize("kind", ["llama-4bit", "llama-bounded", "gemma3_text", "qwen3_5"])
def test_files_round_trip_every_cache_kind(pair, tmp_path, kind):
    """Full, quantized, bounded, sliding-window and recurrent caches written and read back
    continue exactly as a fresh run over the whole prompt, plain and speculative (the head's
    state rebuilt from the features in the file); a file for other KV settings is refused."""
    kv = {}
    if kind == "llama-4bit":
        target, head = pair
        kv = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    elif kind == "llama-bounded":
        target, head = pair
        kv = dict(max_kv_size=16)
    else:
        overrides = dict(num_hidden_layers=4, num_key_value_heads=2)
        if kind == "gemma3_text":
            overrides.update(num_hidden_layers=6, sliding_window=8, layer_types=PATTERN3)
        target = make_hf_model(tmp_path / "t", kind, seed=3, vocab_size=64, scale=4.0,
                               **overrides)
        head = make_eagle_head(tmp_path / "h", target, "eagle1", seed=1)
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    tok.eos_token_ids = set()
    path = tmp_path / "c.safetensors"
    settings = eagle_mlx.GenerationSettings(**kv)
    cache_file.prefill_and_save(path, model, PREFIX, settings.kv,
                                max_kv_size=settings.max_kv_size)
    fresh = fresh_tokens(model, tok, PREFIX + SUFFIX, speculate=False, **kv)
    for speculate in (False, True):
        pc = cache_file.load(path, model, settings.kv, settings.max_kv_size)
        out = fresh_tokens(model, tok, PREFIX + SUFFIX, speculate=speculate, prompt_cache=pc,
                           **kv)
        assert out == fresh and pc.reused == len(PREFIX), (kind, speculate)
    if settings.max_kv_size:
        with pytest.raises(EagleError, match="bounded to 16 positions; the generation asks "
                                              "for None"):
            cache_file.load(path, model)
    if settings.kv:
        with pytest.raises(EagleError, match="quantized to 4 bits in groups of 32; the "
                                              "generation asks for 8 bits"):
            cache_file.load(path, model, eagle_mlx.GenerationSettings(kv_bits=8,
                                                                      kv_group_size=32).kv)


def test_mlx_lms_own_file_continues_with_plain_decoding(pair, tmp_path):
    """A file mlx_lm's save_prompt_cache wrote (after its generate_step prefilled the prompt)
    loads: its tokens unknown, it continues with plain decoding as a fresh run does; the
    tool says so in one line. mlx-lm's load_prompt_cache reads eagle_mlx's files too, and its
    generate_step continues from one as a fresh run does."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    target, head = pair
    reference, _ = mlx_lm.load(str(target))
    caches = make_prompt_cache(reference)
    for _ in generate_step(mx.array(PREFIX), reference, max_tokens=0, prompt_cache=caches):
        pass
    path = tmp_path / "mlx.safetensors"
    save_prompt_cache(str(path), caches, {"model": str(target), "tokenizer_config": "{}"})
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    tok.eos_token_ids = set()
    pc = cache_file.load(path, model)
    assert pc.opaque == len(PREFIX)
    out = fresh_tokens(model, tok, pc.tokens + SUFFIX, speculate=False, prompt_cache=pc)
    assert out == fresh_tokens(model, tok, PREFIX + SUFFIX, speculate=False)
    proc = tool("generate", "--model", target, "--eagle", head, "--prompt-cache-file", path,
                "--prompt", "t40", "--max-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    assert "was written by mlx-lm" in proc.stderr and "plain decoding" in proc.stderr
    # and the other way: mlx-lm reads eagle_mlx's file and continues as a fresh run
    ours = tmp_path / "ours.safetensors"
    cache_file.prefill_and_save(ours, model, PREFIX)
    loaded = load_prompt_cache(str(ours))
    steps = generate_step(mx.array(SUFFIX), reference, max_tokens=12, prompt_cache=loaded,
                          sampler=lambda x: mx.argmax(x, axis=-1))
    assert [int(t) for t, _ in steps] == out[:12]


def test_bad_cache_files_are_one_sentence(pair, tmp_path):
    from test_cli import one_sentence

    target, head = pair
    missing = tmp_path / "none.safetensors"
    one_sentence(tool("generate", "--model", target, "--prompt-cache-file", missing,
                      "--prompt", "t5"), 1, "does not exist")
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(b"\x10\x00\x00\x00not a safetensors file")
    one_sentence(tool("generate", "--model", target, "--prompt-cache-file", damaged,
                      "--prompt", "t5"), 1, "is not a prompt cache file")
    model, _ = eagle_mlx.load(str(target))
    good = tmp_path / "good.safetensors"
    cache_file.prefill_and_save(good, model, PREFIX)
    other = make_hf_model(tmp_path / "other", "llama", seed=2, vocab_size=64, head_dim=32,
                          num_hidden_layers=3, num_key_value_heads=2)
    one_sentence(tool("generate", "--model", other, "--prompt-cache-file", good,
                      "--prompt", "t5"), 1, "was made for another model")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(EagleError, match="is not a prompt cache file"):
        cache_file.load(truncated, model)
    out = tmp_path / "new.safetensors"
    one_sentence(tool("cache_prompt", "--model", target, "--prompt", "t5",
                      "--prompt-cache-file", out, "--kv-bits", "7"), 2, "--kv-bits")
    assert not out.exists()
    with pytest.raises(EagleError, match="does not exist"):
        cache_file.load(missing, model)
    assert isinstance(cache_file.load(good, model), PromptCache)


def test_chat_goes_on_inside_the_files_open_message(pair, tmp_path):
    """chat --prompt-cache-file: each turn is the file's prompt and then the conversation
    from its first user message on (that message's text going on after the cached one);
    two turns and a /reset print what generating from those prompts prints."""
    from eagle_mlx.cache_prompt import prompt_ids
    from eagle_mlx.cli import continuation

    target, head = pair
    path = tmp_path / "doc.safetensors"
    assert tool("cache_prompt", "--model", target, "--eagle", head, "--prompt", "t5 t9 t13",
                "--prompt-cache-file", path).returncode == 0
    proc = tool("chat", "--model", target, "--eagle", head, "--prompt-cache-file", path,
                "--max-tokens", 8, stdin="t40\nt41\n/reset\nt42\n")
    assert proc.returncode == 0, proc.stderr
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    prefix = prompt_ids(tok, "t5 t9 t13", True)

    def reply(messages):
        return eagle_mlx.generate(model, tok, prefix + continuation(tok, messages, True, 0),
                                  max_tokens=8, speculate=False)

    first = reply([{"role": "user", "content": "t40"}])
    second = reply([{"role": "user", "content": "t40"}, {"role": "assistant", "content": first},
                    {"role": "user", "content": "t41"}])
    third = reply([{"role": "user", "content": "t42"}])
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("[")]
    assert lines[:2] == [first, second] and lines[-1] == third


def test_the_server_answers_every_request_after_the_files_prompt(pair, tmp_path):
    """server --prompt-cache-file: every chat request goes on inside the file's open user
    message, every completion after its prompt; two different conversations in a row each
    get what generating from those prompts gives (the second cutting the cache back to the
    file's prompt). Several requests at once with it are refused in one sentence."""
    pytest.importorskip("openai", reason="the openai client (test extra) is not installed")
    from test_cli import one_sentence
    from test_server import KEY, Running

    from eagle_mlx.cache_prompt import prompt_ids
    from eagle_mlx.decoding.plan import encode_prompt
    from eagle_mlx.cli import continuation

    target, head = pair
    path = tmp_path / "doc.safetensors"
    assert tool("cache_prompt", "--model", target, "--eagle", head, "--prompt", "t5 t9 t13",
                "--prompt-cache-file", path).returncode == 0
    one_sentence(tool("server", "--model", target, "--prompt-cache-file", path,
                      "--max-batch", "2"), 2, "--prompt-cache-file serves one request at a time")
    model, tok = eagle_mlx.load(str(target), eagle=str(head))
    prefix = prompt_ids(tok, "t5 t9 t13", True)
    server = Running(["--model", target, "--eagle", head, "--api-key", KEY,
                      "--prompt-cache-file", path])
    try:
        client = server.client()
        for question in ("t40 t41", "t7"):
            messages = [{"role": "user", "content": question}]
            r = client.chat.completions.create(model="default", messages=messages,
                                               max_tokens=8)
            ids = prefix + continuation(tok, messages, True, 0)
            assert r.choices[0].message.content == eagle_mlx.generate(
                model, tok, ids, max_tokens=8, speculate=False)
            assert r.usage.prompt_tokens == len(ids)
        r = client.completions.create(model="default", prompt=" t50", max_tokens=6)
        ids = prefix + encode_prompt(tok, " t50")
        assert r.choices[0].text == eagle_mlx.generate(model, tok, ids, max_tokens=6,
                                                       speculate=False)
    finally:
        assert server.stop() == 0, "".join(server.lines[-20:])
