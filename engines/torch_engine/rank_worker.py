"""A tensor-parallel rank other than 0: `python -m engines.torch_engine.rank_worker FD`, started
by rank 0 (ranks.py) with FD its end of a socket pair.

It loads its share of the model, allocates its share of the KV pool as rank 0 sized it, captures
its decode steps beside rank 0's, then runs every forward rank 0 tells it, in order: its heads'
part of each layer, summed with the other ranks'. It never samples: a pipelined step's tokens
come from rank 0 (tensor_parallel.TokenShare)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from .. import crash_stacks, gc_pauses
from ..device import memory_meter, torch_dtype
from . import quant
from .engine import device_memory_bytes, make_decoder, prepare_weights
from .executor import prefill_attention
from .loader import load_model
from .paged import PagedKV, build_batch
from .ranks import REPORT_S, PoolShape, RankSpec, join_group, rank_device, unslim
from .tensor_parallel import Shard, use_peer_sums

log = logging.getLogger("duet.engines.torch")


class Rank:
    def __init__(self, spec: RankSpec, conn: Connection):
        """Its share of the model, in the group main() has joined."""
        self.conn = conn
        self.device = rank_device(spec.device)
        import torch.distributed as dist

        self.spec = spec
        self.model = load_model(Path(spec.model_dir), torch_dtype(spec.dtype), self.device,
                                Shard(spec.rank, spec.world), dist.group.WORLD)
        self.weights_bytes = prepare_weights(self.model, spec.quantization, self.device,
                                             spec.compile, spec.dtype)
        self.meter = memory_meter(self.device)
        # The scratch caches of forwards outside the steps, and the batched copies inside them.
        self._scratch = contextlib.ExitStack()
        self._batched = contextlib.ExitStack()
        self._last: tuple[torch.Tensor, dict[int, int]] | None = None
        self._reported = 0.0

    def build(self, shape: PoolShape) -> None:
        self.model.setup_rope(shape.context_length)
        self.kv = PagedKV.for_model(self.model, shape.num_blocks, shape.block_size,
                                    torch_dtype(self.spec.dtype), self.device)
        use_peer_sums(self.model, self.device, shape.max_batch, shape.max_prefill_tokens)
        quant.compile_kernels(self.model)  # no collectives: each rank its own shards'
        self.decoder = make_decoder(self.model, self.kv, self.device, self.spec.compile,
                                    shape.max_batch, head=False)

    def step(self, prefill: list[tuple], decode: list[tuple], share: bool) -> None:
        """Rank 0's TorchExecutor.launch without the vocabulary projection and sampling."""
        prefill, decode = unslim(prefill), unslim(decode)
        with torch.inference_mode():
            for rows in (prefill, decode):
                if not rows:
                    continue
                if rows is decode and self.decoder is not None:
                    self.decoder.run(rows, self._last)
                else:
                    batch = build_batch(rows, self.kv, self.model.max_len,
                                        self.model.args.sliding_window, self.device)
                    with prefill_attention(self.device):
                        self.model.hidden_paged(batch, self.kv).sum()  # waits for its sums
            due = [r.seq_id for r in (*prefill, *decode) if r.sample]
            if share and due:
                tokens = self.model.token_share.receive(len(due), self.device)
                self._last = (tokens, {seq_id: i for i, seq_id in enumerate(due)})
        self.meter.sample()

    def scratch(self, max_len: int) -> None:
        self._scratch.enter_context(self.model.scratch_cache(max_len))

    def forward(self, tokens: list[list[int]], pos: int, last_only: bool) -> None:
        with torch.inference_mode():
            x = torch.tensor(tokens, dtype=torch.long, device=self.device)
            self.model(x, pos, last_only).sum()

    def report(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._reported >= REPORT_S:
            self._reported = now
            self.conn.send(("report", {"memory": device_memory_bytes(self.device),
                                       "peak": self.meter.peak_bytes()}))

    def serve(self) -> None:
        trace = StepTrace.from_env(self.spec.rank)
        while True:
            msg = self.conn.recv()
            kind = msg[0]
            if kind == "step":
                self.step(*msg[1:])
                self.report()
                if trace is not None and trace.stepped():
                    trace = None
            elif kind == "scratch":
                self.scratch(msg[1])
            elif kind == "scratch_end":
                self._scratch.close()
            elif kind == "batched":
                self._batched.enter_context(self.model.batched_caches(*msg[1:]))
            elif kind == "batched_end":
                self._batched.close()
            elif kind == "forward":
                self.forward(*msg[1:])
            elif kind == "meter_reset":
                self.meter.reset()
                self.report(force=True)
            elif kind == "close":
                return
            else:
                raise ValueError(f"unknown message {kind!r}")


class StepTrace:
    """torch.profiler over STEPS of this rank's steps, from its first or, with
    $DUET_RANK_TRACE_FROM, after that many, written as a Chrome trace to
    $DUET_RANK_TRACE.rank<N>.json: the other ranks' side of the steps that
    scripts/profile_step.py --trace profiles on rank 0 (a slow rank holds every rank up at the
    next sum, and rank 0's trace shows only its wait)."""

    STEPS = 24  # a first request's prefill and tokens, then a profiled prefill and ~20 steps

    def __init__(self, path: str, skip: int = 0):
        from torch.profiler import ProfilerActivity, profile

        self.path, self.steps, self.skip = path, 0, skip
        self.profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        if not skip:
            self.profiler.start()

    @classmethod
    def from_env(cls, rank: int) -> StepTrace | None:
        stem = os.environ.get("DUET_RANK_TRACE")
        skip = int(os.environ.get("DUET_RANK_TRACE_FROM", "0"))
        return cls(f"{stem}.rank{rank}.json", skip) if stem else None

    def stepped(self) -> bool:
        """Count a step; at the last, write the trace and return True."""
        self.steps += 1
        if self.steps == self.skip:
            self.profiler.start()
        if self.steps < self.skip + self.STEPS:
            return False
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.profiler.stop()
        self.profiler.export_chrome_trace(self.path)
        log.info("wrote a trace of this rank's steps %d-%d to %s", self.skip + 1, self.steps,
                 self.path)
        return True


def _watch_parent() -> None:
    """Rank 0's process gone (killed, so its socket may not close while a collective waits):
    this rank goes too."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def main(fd: int) -> None:
    crash_stacks.enable()
    conn = Connection(fd)
    threading.Thread(target=_watch_parent, daemon=True).start()
    spec: RankSpec = conn.recv()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {spec.rank} %(message)s")
    if spec.device == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world))
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(rank_device(spec.device))
    join_group(spec)  # a rank that cannot join ends here, and rank 0's watch sees it
    try:
        rank = Rank(spec, conn)
    except Exception as exc:
        _failed(conn, spec.rank, exc)
        # Nothing collective is under way: rank 0 reads the error and closes the group, which
        # is the cue to go (an exit before would read as a rank lost).
        with contextlib.suppress(EOFError, OSError):
            while conn.recv()[0] != "close":
                pass
        _exit(1)
    try:
        conn.send(("loaded", rank.weights_bytes))
        msg = conn.recv()
        if msg[0] == "close":
            _exit(0)
        rank.build(msg[1])
    except (EOFError, OSError):
        _exit(0)  # rank 0 is gone
    except Exception as exc:
        # Rank 0 may be waiting in a collective of its graphs' capture by now: this rank's end
        # is what frees it (its watch ends the engine's process), the error is in the log.
        _failed(conn, spec.rank, exc)
        _exit(1)
    # Its shard, compiled step and graphs live as long as it does: a collection that walked
    # them mid-step would hold every rank at the next sum (gc_pauses.py).
    gc_pauses.watch()
    gc_pauses.settle(f"tensor-parallel rank {spec.rank}", None)
    try:
        conn.send(("built",))
        rank.report(force=True)
        rank.serve()
    except (EOFError, OSError):
        pass  # rank 0 is gone
    _exit(0)


def _failed(conn: Connection, rank: int, exc: Exception) -> None:
    """Rank 0 raises it as the load's error."""
    log.exception("rank %d failed to start", rank)
    with contextlib.suppress(OSError):
        conn.send(("failed", RuntimeError(f"tensor-parallel rank {rank}: {exc}")))


def _exit(code: int) -> None:
    # No group teardown: NCCL's waits for its peers, which may be gone or going (a close took
    # over 10 s so); the process's end frees what it held.
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    main(int(sys.argv[1]))
