"""Serving for `python -m eagle_mlx.server`: the job runner that runs the requests'
generations on the main thread (one at a time with a prompt cache kept across turns, or
continuously batched), the pool of prompt caches a batch's requests take and give back,
and the loop of the other ranks under mx.distributed (`follow`)."""

import json
import queue
import sys
import threading
from typing import List, Optional

from .errors import EagleError

SHUTTING_DOWN = "the server is shutting down."


class Job:
    """One request on its way through the job runner: settings in, events out. The events
    are ("text", str, scores) ... ("done", finish, usage) | ("error", message); scores: the
    log-probabilities of the tokens that made the text (where the request asked for them)."""

    def __init__(self, ids: List[int], settings, stop: List[str]):
        from .decoding.responses import ScoreRelease, StopFilter

        self.ids, self.settings, self.stop = ids, settings, stop
        self.events = queue.Queue()
        self.cancelled = threading.Event()
        self.stops = StopFilter(stop)
        self.scores = None if settings.logprobs is None else ScoreRelease()

    def feed(self, r) -> Optional[str]:
        """A GenerationResponse's text (and scores) through the stop strings to the events;
        returns the finish reason (a stop string finishes it too)."""
        emit, finish = self.stops.feed(r.text, r.finish_reason)
        scores = [] if self.scores is None else self.scores.feed(r.logprobs, emit, finish)
        if emit or scores:
            self.events.put(("text", emit, scores))
        return finish


class PromptCachePool:
    """The prompt caches of the latest finished requests (batched serving), at most `size`,
    the least recently used dropped first: a request takes the one sharing the longest
    prefix with its prompt, and gives it back when it leaves."""

    def __init__(self, size: int):
        self.size, self.caches = size, []  # most recently used last

    def take(self, ids):
        """The cache sharing the longest prefix with `ids` (out of the pool while its
        request runs), or a new one where none shares any."""
        from .decoding.steps import PromptCache

        best, most = None, 0
        for pc in self.caches:
            n = pc.shared_prefix(ids)
            if n > most:
                best, most = pc, n
        if best is None:
            return PromptCache()
        self.caches.remove(best)
        best.reused = 0  # (until its request joins)
        return best

    def put(self, pc) -> int:
        """A request's cache back (as it left it); returns the prompt tokens it found cached."""
        self.caches.append(pc)
        del self.caches[: -self.size]
        return pc.reused


class JobRunner:
    """The model, the loop that runs its generations (one at a time, or continuously
    batched), and the prompt caches it keeps. `run` is called on the main thread: MLX gives
    every thread its own streams, and a process whose other threads computed with MLX can
    abort as it exits."""

    def __init__(self, model, tokenizer, model_id: str, log=None, max_batch: int = 1):
        """Under mlx.launch (model.group set) this is rank 0: every request is sent to the
        other ranks (`follow`), which run the same generation on their shards. max_batch > 1:
        up to that many requests decode at once, continuously batched (`batch.py`)."""
        from .decoding.steps import PromptCache

        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        self.max_batch, self.running = max_batch, {}
        self.pool = PromptCachePool(max_batch)
        self.cache = PromptCache()
        self.jobs = queue.Queue()
        self.current, self.stopping = None, False
        self.lock = threading.Lock()  # no job is queued behind the end of the loop
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def submit(self, job: Job) -> Job:
        with self.lock:
            if self.stopping:
                job.events.put(("error", SHUTTING_DOWN))
            else:
                self.jobs.put(job)
        return job

    def stop(self) -> None:
        """Cancel what runs, refuse what waits, and end `run` (from any thread)."""
        with self.lock:
            if not self.stopping:
                self.stopping = True
                if self.current is not None:
                    self.current.cancelled.set()
                for job in list(self.running.values()):
                    job.cancelled.set()
                self.jobs.put(None)

    def _next_job(self):
        """The next job, waited for in short slices: Python runs a signal's handler only on
        the main thread between bytecodes, and a signal the kernel hands to another thread
        (MLX's, BLAS's) would otherwise wait behind a wait that never ends."""
        while True:
            try:
                return self.jobs.get(timeout=0.25)
            except queue.Empty:
                pass

    def _queued(self):
        """The next queued job without waiting (False: none)."""
        try:
            return self.jobs.get_nowait()
        except queue.Empty:
            return False

    def run(self) -> None:
        """Serve the queued jobs until `stop`."""
        from .distributed import share_text

        if self.max_batch > 1:
            return self._run_batched()
        while True:
            job = self.current = self._next_job()
            if job is None:
                share_text(self.model.group, None)  # the other ranks stop too
                return
            if job.cancelled.is_set() or self.stopping:
                job.events.put(("error", SHUTTING_DOWN))
                continue
            try:
                self._run(job)
            except EagleError as e:
                job.events.put(("error", str(e)))
            except Exception as e:  # keep serving: the request fails, the server does not
                self.log(f"error: generation failed ({type(e).__name__}: {e})")
                job.events.put(("error", "generation failed inside the server."))
            finally:
                self.current = None

    def _run(self, job: Job):
        from .distributed import (CANCELLED, CONTINUE, FINISHED, share_response_signal,
                                  share_text)
        from .generation import stream_generate

        group = self.model.group
        share_text(group, json.dumps({"ids": job.ids, "settings": job.settings.asdict()}))
        finish, last = None, None
        for r in stream_generate(self.model, self.tokenizer, job.ids, prompt_cache=self.cache,
                                 settings=job.settings):
            last = r
            if job.cancelled.is_set():
                share_response_signal(group, CANCELLED)  # the other ranks stop with it
                finish = "cancelled"
                break
            finish = job.feed(r)
            if share_response_signal(group, FINISHED if finish else CONTINUE) != CONTINUE:
                break
        self._done(job, finish, last, self.cache.reused)

    @staticmethod
    def _done(job: Job, finish, last, cached: int) -> None:
        usage = {
            "prompt_tokens": len(job.ids),
            "completion_tokens": last.generation_tokens if last else 0,
            "total_tokens": len(job.ids) + (last.generation_tokens if last else 0),
            "prompt_tokens_details": {"cached_tokens": cached},
            "eagle": {"tau": round(last.mean_accept_length, 4) if last else 0.0,
                      "target_forwards": last.target_forwards if last else 0,
                      "speculative": bool(last and (
                          any(k != "plain" for k in last.passes) if last.passes
                          else last.accept_lengths)),
                      "passes": dict(last.passes) if last else {}},
        }
        job.events.put(("done", "stop" if finish in ("stop", "cancelled") else finish or "length",
                        usage))

    # ---------------------------------------------------------------- batched
    def _run_batched(self) -> None:
        """Serve the queued jobs continuously batched until `stop`: between cycles, new jobs
        join (their prefill a chunk per cycle), finished and cancelled ones leave."""
        from .decoding.batch import BatchGenerator

        gen = BatchGenerator(self.model, self.tokenizer, self.max_batch)
        self.last, self.caches = {}, {}  # per running request: its latest response, its cache
        while True:
            job = False if gen.busy else self._next_job()  # wait for work only when there is none
            if job is False:
                job = self._queued()
            while job is not False:
                if job is None or self.stopping:
                    return self._end_batched(job)
                self._admit(gen, job)
                job = self._queued()
            for uid, j in list(self.running.items()):
                if j.cancelled.is_set():  # the client left
                    gen.cancel(uid)
                    self._leave(uid, "cancelled", self.last.pop(uid, None))
            try:
                out = gen.step()
            except Exception as e:  # the batch fails, the server does not
                self.log(f"error: batched generation failed ({type(e).__name__}: {e})")
                for j in self.running.values():
                    j.events.put(("error", "generation failed inside the server."))
                self.running.clear()
                self.last.clear()
                gen = BatchGenerator(self.model, self.tokenizer, self.max_batch)
                continue
            self._deliver(gen, out)

    def _admit(self, gen, job: Job) -> None:
        """A queued job joins the batch with the pooled cache that fits it best."""
        if job.cancelled.is_set():
            job.events.put(("error", SHUTTING_DOWN))
            return
        pc = self.pool.take(job.ids)
        try:
            uid = gen.add(job.ids, job.settings, prompt_cache=pc)
        except EagleError as e:
            self.pool.put(pc)  # (a refused request leaves the cache as it was)
            job.events.put(("error", str(e)))
            return
        self.running[uid], self.caches[uid] = job, pc

    def _deliver(self, gen, out) -> None:
        """A step's responses to their requests' events; finished requests leave."""
        for uid, r in out:
            if uid not in self.running:
                continue
            self.last[uid] = r
            finish = self.running[uid].feed(r)
            if finish is not None:
                if r.finish_reason is None:  # a stop string: it leaves the batch
                    gen.cancel(uid)
                self._leave(uid, finish, self.last.pop(uid))

    def _leave(self, uid, finish, last) -> None:
        job = self.running.pop(uid)
        self._done(job, finish, last, self.pool.put(self.caches.pop(uid)))

    def _end_batched(self, job) -> None:
        """`stop`: the job that asked for it (if any) and every job still queued behind it
        refused, the running ones cancelled (no request waits on an answer that never
        comes; `submit` queues nothing once stopping is set)."""
        while job is not False:
            if job is not None:
                job.events.put(("error", SHUTTING_DOWN))
            job = self._queued()
        for uid, j in list(self.running.items()):
            self._done(j, "cancelled", self.last.get(uid), 0)
        self.running.clear()


def follow(model, tokenizer) -> None:
    """Ranks other than 0: run every generation rank 0's server runs, on this rank's shard,
    until it stops."""
    from .distributed import CONTINUE, share_response_signal, share_text
    from .generation import stream_generate
    from .decoding.steps import PromptCache
    from .decoding.settings import GenerationSettings

    cache = PromptCache()
    while True:
        spec = share_text(model.group, None)
        if spec is None:
            return
        spec = json.loads(spec)
        try:
            for r in stream_generate(model, tokenizer, spec["ids"], prompt_cache=cache,
                                     settings=GenerationSettings(**spec["settings"])):
                if share_response_signal(model.group, CONTINUE) != CONTINUE:
                    break
        except EagleError:
            pass  # rank 0 answers the request with the same error
