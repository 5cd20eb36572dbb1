"""A tiny Gemma 4 target and a Gemma 4 assistant trained for it (transformers'
`Gemma4AssistantForCausalLM`, PyTorch), plus a prompts file: a pair to measure assistant
chains and trees on where no published pair runs. The target is first trained on text from a
random Markov chain (each token followed by one of three, with probabilities 0.6, 0.25 and
0.15), so that what follows is partly predictable, as in language; the assistant then on the
target's own continuations, sampled at temperature 1.

    python scripts/make_tiny_assistant_pair.py OUT [--steps 600] [--target-steps 400]
    python -m eagle_mlx.benchmark --model OUT/target --eagle OUT/assistant \\
        --prompts OUT/prompts.jsonl --ignore-chat-template --trees 5/3/1,5/3/2,...

Needs torch and transformers (what the tests install)."""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def train_on_a_markov_chain(folder: Path, steps: int, seed: int = 0) -> None:
    """The transformers model in `folder` trained `steps` steps on sequences of a random
    Markov chain over its vocabulary (tokens 3..V-1), saved back."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(3, V, (V, 3), generator=g)
    probs = torch.tensor([0.6, 0.25, 0.15])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        seq = [torch.randint(3, V, (32,), generator=g)]
        for _ in range(47):
            pick = torch.multinomial(probs.expand(32, 3), 1, generator=g)[:, 0]
            seq.append(successors[seq[-1], pick])
        ids = torch.stack(seq, 1)
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(str(folder))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--target-steps", type=int, default=400)
    p.add_argument("--num-prompts", type=int, default=8)
    args = p.parse_args(argv)
    if args.steps < 0 or args.target_steps < 0 or args.num_prompts < 1:
        p.error("--steps and --target-steps must be at least 0, --num-prompts at least 1")
    out = Path(args.out)
    if out.exists():
        p.error(f"{out} exists; give a new folder")
    from conftest import TINY_TARGETS
    from tiny import make_gemma4_assistant, make_hf_model

    out.mkdir(parents=True)
    kind, overrides = TINY_TARGETS["gemma4_swa"]  # (sliding windows of 8, KV sharing)
    target = make_hf_model(out / "target", kind, seed=3, vocab_size=64, **overrides)
    train_on_a_markov_chain(target, args.target_steps)
    make_gemma4_assistant(out / "assistant", target, steps=args.steps, temp=1.0,
                          hidden_size=64)
    rng = np.random.default_rng(11)
    with open(out / "prompts.jsonl", "w") as f:
        for _ in range(args.num_prompts):
            words = " ".join(f"t{i}" for i in rng.integers(3, 63, 6))
            f.write(json.dumps({"prompt": words}) + "\n")
    print(f"wrote {out}/target, {out}/assistant and {out}/prompts.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
