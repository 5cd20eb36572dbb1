"""Training a head: its loss functions and the loop, in the shape of mlx-lm's tuner.

The recipes (docs/training.md): EAGLE-1's loss (the head reads the target's feature f_i,
noised, and token t_{i+1}, and predicts f_{i+1}: SmoothL1 on the feature plus 0.1 x
cross-entropy against the target's next-token distribution), unrolled over N steps of its
own outputs where asked (`--unroll`, HASS); EAGLE-3's (three taps in through `fc`, a draft
vocabulary out, seven unrolled steps, step j's cross-entropy weighted 0.8**j, `ttt`). Each
kind is a `Recipe`: how its head is made, how a batch of the data becomes a `Batch` of its
inputs and labels, and its loss `loss(head, batch) -> (loss, stats)`; `Trainer` is the one
loop over any recipe (AdamW (0.9, 0.95), clipping, evaluation, checkpoints, resume).
"""

import json
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

from ..errors import EagleError
from ..heads.draft_vocab import eagle3_mapping, lm_head_rows
from ..heads.eagle import Eagle1Head, Eagle3Head, HeadArgs
from ..heads.read import load_head
from ..heads.write import save_head
from ..outputs import atomic_file
from ..targets.layers import log_softmax
from ..targets.load import convert_dtype
from . import ttt

STATE_FILE = "trainer_state.json"
CHECKPOINT_FILE = "checkpoint.safetensors"
LOG_FILE = "train_log.jsonl"
EAGLE3_DRAFT_VOCAB = 32000  # the recipe's draft vocabulary (at most the target's)
EAGLE3_UNROLL = 7  # the recipe's training-time-test steps
NAMES = {"eagle1": "EAGLE-1", "eagle3": "EAGLE-3"}
# per kind: learning rate, weight decay, feature noise (the official recipes)
DEFAULTS = {"eagle1": {"lr": 3e-5, "weight_decay": 0.01, "noise": 0.1},
            "eagle3": {"lr": 5e-5, "weight_decay": 0.0, "noise": 0.0}}


def new_head_config(target) -> dict:
    """An EAGLE-1 head config for `target`, in the published (Llama) layout."""
    c = target.family.text_config()
    n_heads = c["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
        "num_attention_heads": n_heads, "num_key_value_heads": c.get("num_key_value_heads") or n_heads,
        "vocab_size": c["vocab_size"], "rms_norm_eps": c.get("rms_norm_eps", 1e-6),
        "rope_theta": c.get("rope_theta", 10000.0), "num_hidden_layers": 1,
        "max_position_embeddings": target.max_context, "hidden_act": "silu",
        "bias": True, "torch_dtype": "float32",
    }


def counted(mask) -> mx.array:
    """Flat indices of the positions the loss mask counts (the vocabulary-wide work runs there only)."""
    return mx.array(np.flatnonzero(np.array(mask).reshape(-1) > 0).astype(np.int32))


def cross_entropy_terms(logp, target):
    """Per-row log-likelihood of the target (a distribution [n, N], or an index [n]) and the
    target's top token."""
    if target.ndim == 1:
        return mx.take_along_axis(logp, target[:, None], axis=-1)[:, 0], target
    return (target * logp).sum(-1), target.argmax(-1)


def smooth_l1(x, y):
    d = mx.abs(x - y)
    return mx.where(d < 1.0, 0.5 * d * d, d - 0.5)


# ------------------------------------------------------------------ the loss's vocabulary
class Vocabulary:
    """The loss's vocabulary: the n most frequent answer tokens of the training data
    (`draft_ids`, in id order; `t2d` marks them; `to_draft` maps a target id to its place
    among them; `d2t` the published offsets), or the target's whole vocabulary (n None:
    draft_ids None). `rows`: the target's lm_head rows for them (EAGLE-1, which drafts
    through the target's lm_head)."""

    def __init__(self, target, data, n: Optional[int], rows: bool):
        self.target, self.draft_ids, self.rows = target, None, None
        if n is None:
            return
        V = target.vocab_size
        self.d2t, self.t2d = eagle3_mapping(data.answer_counts(V), n)
        ids = (self.d2t + np.arange(n)).astype(np.int32)
        self.draft_ids, self.t2d_mx = mx.array(ids), mx.array(self.t2d)
        to_draft = np.zeros(V, dtype=np.int32)
        to_draft[ids] = np.arange(n, dtype=np.int32)
        self.to_draft = mx.array(to_draft)
        if rows:
            self.rows = lm_head_rows(target, self.draft_ids).astype(mx.float32)

    def labels(self, tokens, mask, next_feats, sel, kind):
        """What the head's distribution at the `sel` positions learns, and which of them count.

        soft: the target's distribution, from the features of the next position through
        `lm_head` (over this vocabulary; a position whose top token is outside it does not
        count). hard: the token two ahead (the one the head predicts) as an index, where
        that token is itself an answer token: in the target's own greedy answers it is the
        target's top token, so no `lm_head` is needed. Returns (target [n, N] or [n], keep or
        None: every position counts)."""
        if kind == "soft":
            logits = self.target.lm_head(next_feats.reshape(-1, next_feats.shape[-1])[sel])
            logits = logits.astype(mx.float32)
            if self.draft_ids is None:
                return mx.stop_gradient(mx.softmax(logits, axis=-1)), None
            keep = self.t2d_mx[logits.argmax(-1)]  # the target's top token is in the vocabulary
            return mx.stop_gradient(mx.softmax(logits[:, self.draft_ids], axis=-1)), keep
        B = tokens.shape[0]
        pad = mx.zeros((B, 1), dtype=tokens.dtype)
        ahead = mx.concatenate([tokens[:, 2:], pad], axis=1).reshape(-1)[sel]
        keep = mx.concatenate([mask[:, 2:], pad.astype(mask.dtype)], axis=1).reshape(-1)[sel] > 0
        if self.draft_ids is None:
            return ahead, keep
        return self.to_draft[ahead], keep & self.t2d_mx[ahead]

    def logits(self, rows):
        """EAGLE-1's draft logits of head outputs: the target's lm_head, or its kept rows."""
        if self.draft_ids is None:
            return self.target.lm_head(rows)
        return rows @ self.rows.T


# ------------------------------------------------------------------ batches and losses
@dataclass
class Batch:
    """One step's inputs and labels, for any recipe."""

    feats: mx.array                  # [B, T, F] the head's input features (noised in training)
    toks: Union[mx.array, List[mx.array]]  # [B, T] the tokens paired with them (per step, unrolled)
    labels: mx.array                 # at the `sel` positions: distributions [n, N] or ids [n]
    mask: mx.array                   # [B, T] the loss mask
    sel: mx.array                    # [n] flat indices of the positions the mask counts
    keep: Optional[mx.array] = None  # [n] which of them count (None: all)
    target_feats: Optional[mx.array] = None  # [B, T, H] the next features (EAGLE-1's)


def eagle1_loss(head, batch: Batch, embed, vocab: Vocabulary):
    """The EAGLE-1 recipe's loss; the vocabulary-wide part (logits, log-softmax,
    cross-entropy, about half of a step) only at the `sel` positions."""
    b = batch
    pred = head(b.feats, b.toks, embed)
    logits = vocab.logits(pred.reshape(-1, pred.shape[-1])[b.sel])
    logp = log_softmax(logits)
    denom = b.mask.sum() + 1e-5
    ce, top = cross_entropy_terms(logp, b.labels)
    if b.keep is None:
        ploss = -ce.sum() / denom
        right = logits.argmax(-1) == top
    else:
        ploss = -(b.keep * ce).sum() / denom
        right = (logits.argmax(-1) == top) & b.keep
    vloss = (b.mask * smooth_l1(pred, b.target_feats).mean(-1)).sum() / denom
    return vloss + 0.1 * ploss, {"vloss": vloss, "ploss": ploss,
                                 "correct": right.sum()[None], "count": b.mask.sum()[None]}


def eagle1_unrolled_loss(head, batch: Batch, embed, vocab: Vocabulary):
    """The EAGLE-1 loss at each of N unrolled steps, step j weighted 0.8**j: step j's
    output at position i (its input the head's own output of step j - 1) learns the
    target's features at i + 1 + j and the label of position i + j."""
    b = batch
    outs = ttt.unroll(head, b.feats, b.toks, embed)
    T = b.feats.shape[1]
    denom = b.mask.sum() + 1e-5
    total, vlosses, plosses, correct, counts = 0.0, [], [], [], []
    for j, rows, live in ttt.step_rows(outs, b.sel, T):
        out = outs[j]
        w = live if b.keep is None else live & b.keep
        logits = vocab.logits(rows)
        logp = log_softmax(logits)
        ce, top = cross_entropy_terms(logp, b.labels)
        ploss = -(w * ce).sum() / denom
        vloss = (b.mask[:, j:] * smooth_l1(out[:, : T - j], b.target_feats[:, j:]).mean(-1)
                 ).sum() / denom
        total = total + ttt.STEP_WEIGHT ** j * (vloss + 0.1 * ploss)
        vlosses.append(vloss)
        plosses.append(ploss)
        correct.append(((logits.argmax(-1) == top) & w).sum())
        counts.append(live.sum())
    return total, {"vloss": mx.stack(vlosses), "ploss": mx.stack(plosses),
                   "correct": mx.stack(correct), "count": mx.stack(counts)}


def eagle3_loss(head, batch: Batch, embed):
    """The EAGLE-3 recipe's loss: unrolled steps, step j's cross-entropy weighted 0.8**j."""
    b = batch
    denom = b.keep.size + 1e-5  # assistant positions of step 0: every step's denominator
    total, losses, correct, counts = ttt.unrolled_loss(
        head, b.feats, b.toks, embed, b.labels, b.keep, b.sel, b.feats.shape[1], denom)
    return total, {"ploss": mx.stack(losses), "correct": mx.stack(correct),
                   "count": mx.stack(counts)}


# ------------------------------------------------------------------ the recipes
class Recipe:
    """One kind of head: its config and head, its loss's vocabulary, how a data batch
    becomes a `Batch`, and its loss."""

    kind = ""
    taps: tuple = ()  # target layers whose inputs the head reads

    def __init__(self, target, data, args):
        self.target, self.data, self.args = target, data, args

    def noised(self, feats, step):
        """Training features with the recipe's U(-noise, noise), drawn from the step's own key
        (so a resumed run draws the same); evaluation (step None) is noise-free."""
        if step is None or self.args.noise <= 0:
            return feats
        key = mx.random.key(self.args.seed * 1_000_003 + step)
        return feats + mx.random.uniform(-self.args.noise, self.args.noise, feats.shape, key=key)

    def config(self) -> dict:
        raise NotImplementedError

    def make_head(self, config: dict):
        raise NotImplementedError

    def prepare(self, tokens, mask, ids, step: Optional[int] = None,
                labels: str = "soft") -> Batch:
        raise NotImplementedError

    def loss(self, head, batch: Batch):
        raise NotImplementedError


class Eagle1Recipe(Recipe):
    kind = "eagle1"

    def __init__(self, target, data, args):
        super().__init__(target, data, args)
        self.vocab = Vocabulary(target, data, args.draft_vocab, rows=True)  # (None: all)

    def config(self) -> dict:
        return new_head_config(self.target)

    def make_head(self, config: dict):
        return Eagle1Head(HeadArgs.from_config(config, "eagle1"))

    def prepare(self, tokens, mask, ids, step=None, labels="soft") -> Batch:
        hidden = self.data.features(tokens, ids, self.kind, self.taps)["hidden"]
        feats, target_feats = self.noised(hidden[:, :-1], step), hidden[:, 1:]
        sel = counted(mask[:, :-1])
        target, keep = self.vocab.labels(tokens, mask, target_feats, sel, labels)
        toks = tokens[:, 1:] if self.args.unroll == 1 else ttt.step_tokens(tokens,
                                                                           self.args.unroll)
        return Batch(feats, toks, target, mask[:, :-1], sel, keep, target_feats)

    def loss(self, head, batch: Batch):
        fn = eagle1_loss if self.args.unroll == 1 else eagle1_unrolled_loss
        return fn(head, batch, self.target.embed_tokens, self.vocab)


class Eagle3Recipe(Recipe):
    """Three target taps in, a draft vocabulary out, trained unrolled (ttt)."""

    kind = "eagle3"

    def __init__(self, target, data, args):
        super().__init__(target, data, args)
        # the recipe's draft vocabulary: the most frequent tokens of the training answers
        n = args.draft_vocab or min(EAGLE3_DRAFT_VOCAB, target.vocab_size)
        self.vocab = Vocabulary(target, data, n, rows=False)
        self.taps = target.eagle3_taps

    def config(self) -> dict:
        config = new_head_config(self.target)
        del config["bias"]
        config["draft_vocab_size"] = int(self.vocab.draft_ids.shape[0])
        config["tie_word_embeddings"] = False
        return config

    def make_head(self, config: dict):
        head = Eagle3Head(HeadArgs.from_config(config, "eagle3", has_d2t=True))
        head.d2t = mx.array(self.vocab.d2t)
        head.freeze(recurse=False, keys=["d2t"])  # the mapping, not a weight
        if self.args.lm_head_init == "target":
            head.lm_head.weight = lm_head_rows(self.target,
                                               self.vocab.draft_ids).astype(mx.float32)
            head.norm.weight = self.target.family.inner.norm.weight.astype(mx.float32)
        return head

    def prepare(self, tokens, mask, ids, step=None, labels="soft") -> Batch:
        f = self.data.features(tokens, ids, self.kind, self.taps)
        feats, hidden = self.noised(f["taps"][:, :-1], step), f["hidden"][:, 1:]
        sel = counted(mask[:, :-1])
        target_p, keep = self.vocab.labels(tokens, mask, hidden, sel, labels)
        toks = ttt.step_tokens(tokens, self.args.unroll)
        return Batch(feats, toks, mx.stop_gradient(target_p), mask[:, :-1], sel, keep)

    def loss(self, head, batch: Batch):
        return eagle3_loss(head, batch, self.target.embed_tokens)


RECIPES = {"eagle1": Eagle1Recipe, "eagle3": Eagle3Recipe}


# ------------------------------------------------------------------ the loop
class Trainer:
    """Training a head of `args.kind` over `data` (a training.data.TrainingData): the
    recipe, the head, the optimizer, the run's progress (state) and the loop."""

    def __init__(self, target, data, args):
        self.target, self.data, self.args = target, data, args
        self.recipe = RECIPES[args.kind](target, data, args)
        self.kind = args.kind
        self.out = Path(args.out)
        self.config = self.recipe.config()
        mx.random.seed(args.seed)  # the head's initial weights
        self.head = self.recipe.make_head(self.config)
        if args.init_head:
            self.init_from(args.init_head)
        lr = args.lr
        if args.warmup_steps:
            lr = optim.join_schedules([optim.linear_schedule(0.0, args.lr, args.warmup_steps),
                                       lambda step: args.lr], [args.warmup_steps])
        self.optimizer = optim.AdamW(learning_rate=lr, betas=[0.9, 0.95],
                                     weight_decay=DEFAULTS[self.kind]["weight_decay"])
        self.step, self.epoch, self.position = 0, 0, 0
        self.tokens, self.seconds = 0, 0.0  # training tokens (batch rows, unpadded), time
        self.last_eval: dict = {}
        self.loss_and_grad = nn.value_and_grad(self.head, self.recipe.loss)

    def init_from(self, path):
        """Start from the weights of an existing head of this kind for this target."""
        other = convert_dtype(load_head(path, self.target), mx.float32)  # (a quantized head too)
        mine = dict(tree_flatten(self.head.parameters()))
        theirs = dict(tree_flatten(other.parameters()))
        if other.kind != self.kind or set(theirs) != set(mine) or any(
                theirs[k].shape != mine[k].shape for k in mine):
            what = "fc bias, one layer" if self.kind == "eagle1" else "draft vocabulary size"
            raise EagleError(f"--init-head {path} is not an {NAMES[self.kind]} "
                             f"head of the shape this run trains (same target, {what}).")
        self.head.load_weights([(k, v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating)
                                 else v) for k, v in theirs.items()])

    @staticmethod
    def metrics(loss, stats, prefix=""):
        """Log values from a loss and its statistics (summed over batches for evaluation)."""
        acc = [c / max(n, 1) for c, n in zip(stats["correct"].tolist(), stats["count"].tolist())]
        row = {f"{prefix}loss": loss, f"{prefix}acc": acc[0]}
        if len(acc) > 1:  # per unroll step: acceptance deeper in the draft
            row[f"{prefix}acc_steps"] = [round(a, 4) for a in acc]
        for k in ("vloss", "ploss"):
            if k in stats and not prefix:
                v = stats[k]
                row[k] = v.item() if v.ndim == 0 else [round(x, 4) for x in v.tolist()]
        return row

    def train_step(self, batch):
        tokens, mask, ids, _ = batch
        inputs = self.recipe.prepare(tokens, mask, ids, step=self.step, labels=self.args.labels)
        (loss, stats), grads = self.loss_and_grad(self.head, inputs)
        grads, _ = optim.clip_grad_norm(grads, self.args.grad_clip)
        self.optimizer.update(self.head, grads)
        mx.eval(loss, stats, self.head.parameters(), self.optimizer.state)
        return self.metrics(loss.item(), stats)

    def evaluate(self):
        total, sums, n_batches = 0.0, None, 0
        eval_ids = self.data.eval_ids
        for s in range(0, len(eval_ids), self.args.batch_size):
            b = self.data.batch(eval_ids[s: s + self.args.batch_size])
            if b is None:
                continue
            loss, stats = self.recipe.loss(self.head, self.recipe.prepare(*b[:3]))
            stats = {"correct": stats["correct"], "count": stats["count"]}
            mx.eval(loss, stats)
            total += loss.item()
            sums = stats if sums is None else {k: sums[k] + v for k, v in stats.items()}
            n_batches += 1
        if sums is None:
            return {"eval_loss": 0.0, "eval_acc": 0.0}
        return self.metrics(total / n_batches, sums, prefix="eval_")

    # -------------------------------------------------------------- state
    def save(self):
        """The head folder (loadable by eagle_mlx.load) plus what --resume needs."""
        self.out.mkdir(parents=True, exist_ok=True)
        arrays = {f"head.{k}": v for k, v in tree_flatten(self.head.parameters())}
        arrays.update({f"opt.{k}": v for k, v in tree_flatten(self.optimizer.state)})
        state = {"step": self.step, "epoch": self.epoch, "position": self.position,
                 "seed": self.args.seed, "train_conversations": len(self.data.train_ids),
                 "kind": self.kind, "draft_vocab_size": self.head.draft_vocab_size,
                 "unroll": self.args.unroll,
                 "tokens": self.tokens, "seconds": round(self.seconds, 1)}
        # each file is replaced whole; the state names the step, so it is written last
        save_head(self.head, self.config, self.out / "head")
        atomic_file(self.out / CHECKPOINT_FILE, lambda t: mx.save_safetensors(str(t), arrays))
        atomic_file(self.out / STATE_FILE,
                    lambda t: t.write_text(json.dumps(state, indent=2) + "\n"))

    def _check_resumable(self, state: dict) -> None:
        where = f"--resume: the checkpoint in {self.out}"
        if state["train_conversations"] != len(self.data.train_ids) or \
                state["seed"] != self.args.seed:
            raise EagleError(f"{where} was made with other data or another --seed; resume "
                             "with the same --data, --num-conversations and --seed.")
        kind = state.get("kind", "eagle1")
        if kind != self.kind:
            raise EagleError(f"{where} trains an {NAMES[kind]} head; resume with --kind {kind}.")
        if state.get("draft_vocab_size", self.head.draft_vocab_size) != self.head.draft_vocab_size:
            raise EagleError(f"{where} drafts over {state['draft_vocab_size']} tokens; resume "
                             f"with --draft-vocab {state['draft_vocab_size']}.")
        unroll = state.get("unroll", EAGLE3_UNROLL if self.kind == "eagle3" else 1)
        if unroll != self.args.unroll:
            raise EagleError(f"{where} was trained with --unroll {unroll}; resume with "
                             f"--unroll {unroll}.")

    def restore(self):
        state_file, ckpt = self.out / STATE_FILE, self.out / CHECKPOINT_FILE
        if not (state_file.is_file() and ckpt.is_file()):
            raise EagleError(f"--resume: no checkpoint in {self.out} ({STATE_FILE} and "
                             f"{CHECKPOINT_FILE} are written by an earlier run with --out there).")
        state = json.loads(state_file.read_text())
        self._check_resumable(state)
        arrays = mx.load(str(ckpt))
        self.head.load_weights([(k[5:], v) for k, v in arrays.items() if k.startswith("head.")])
        self.optimizer.init(self.head.trainable_parameters())
        self.optimizer.state = tree_unflatten(
            [(k[4:], v) for k, v in arrays.items() if k.startswith("opt.")])
        self.step, self.epoch, self.position = state["step"], state["epoch"], state["position"]
        log = self.out / LOG_FILE
        if log.is_file():  # rows written after the checkpoint are done again
            rows = [r for r in log.read_text().splitlines() if r.strip()]
            kept = [r for r in rows if json.loads(r).get("step", 0) <= self.step]
            if len(kept) != len(rows):
                atomic_file(log, lambda t: t.write_text("".join(r + "\n" for r in kept)))
        self.seconds = float(state.get("seconds", 0.0))
        self.tokens = state["tokens"] if "tokens" in state else \
            self.data.tokens_until(self.epoch, self.position)

    # -------------------------------------------------------------- loop
    def run(self):
        """Train until --max-steps or --max-time (Ctrl-C: after the step under way), save;
        returns (the last held-out metrics or None if interrupted, seconds)."""
        args = self.args
        log = open(self.out / LOG_FILE, "a")
        start, before = time.time(), self.seconds
        bar = tqdm(total=args.max_steps, initial=self.step, desc="training head", unit="step",
                   disable=args.quiet)
        with _StopAfterStep() as stop:
            self._loop(log, start, before, bar, stop)
        bar.close()
        if stop.requested:
            log.close()
            self.seconds = before + time.time() - start
            self.save()
            return None, time.time() - start
        if not self.last_eval or self.step % args.eval_every:
            self._evaluated()
            log.write(json.dumps({"step": self.step, **self.last_eval}) + "\n")
        log.close()
        self.seconds = before + time.time() - start
        self.save()
        return self.last_eval, time.time() - start

    def _evaluated(self) -> dict:
        self.last_eval = self.evaluate()
        self.config["eagle"] = {"held_out_top1": round(self.last_eval["eval_acc"], 4)}
        return self.last_eval

    def _loop(self, log, start, before, bar, stop):
        args = self.args
        order = self.data.epoch_order(self.epoch)
        empty = 0  # batches in a row without a trainable token
        while self.step < args.max_steps and not stop.requested and (
                args.max_time is None or time.time() - start < args.max_time):
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
                order = self.data.epoch_order(self.epoch)
            b = self.data.batch(order[self.position: self.position + args.batch_size])
            self.position += args.batch_size
            if b is None:
                empty += 1
                if empty * args.batch_size >= len(order):
                    raise EagleError("no training conversation has an assistant token within "
                                     f"--max-len {args.max_len} tokens; raise --max-len.")
                continue
            empty = 0
            metrics = self.train_step(b)
            self.step, self.tokens = self.step + 1, self.tokens + b[3]
            row = {"step": self.step, **metrics, "tokens": self.tokens}
            if self.step % args.eval_every == 0 or self.step == args.max_steps:
                row.update(self._evaluated())
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.update(1)
            last = self.last_eval
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['acc']:.3f}",
                            **({"eval_acc": f"{last['eval_acc']:.3f}"} if last else {}))
            if self.step % args.save_every == 0:
                self.seconds = before + time.time() - start
                self.save()


class _StopAfterStep:
    """Ctrl-C during the loop asks it to stop after the step under way (then the run saves
    its checkpoint); a second Ctrl-C stops at once."""

    requested = False

    def __enter__(self):
        self.main = threading.current_thread() is threading.main_thread()
        if self.main:
            self.previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nstopping after this step (Ctrl-C again to stop at once)", file=sys.stderr)

    def __exit__(self, *exc: Any):
        if self.main:
            signal.signal(signal.SIGINT, self.previous)
