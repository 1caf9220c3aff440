"""The ranks of a tensor-parallel torch engine: rank 0 is the engine itself, with the runtime
and the scheduler; ranks 1..N-1 are processes it starts and supervises (rank_worker.py), one
per GPU, joined in one torch.distributed group (NCCL on CUDA, gloo on the CPU).

Each step's plan reaches every rank before rank 0 runs it: rank 0 sends it down a socket to
each rank (the rows' tokens, positions and KV blocks, no sampling settings), and every rank runs
the same forward over its own heads, the group's all-reduces pairing them layer by layer. Only
rank 0 samples; when its decode step is pipelined (CUDA graphs), it shares the step's tokens
with the other ranks (tensor_parallel.TokenShare), since the next step's inputs are taken on
the device from them. Forwards outside the steps (scoring) are told to the ranks the same way
(model.mirror), all from the engine's one thread, so every rank meets the collectives in one
order.

A rank process that ends while the engine runs takes the engine's process with it
(`on_lost`): its requests end with an error there and the server loads the model anew. So does
a step that fails on rank 0 after the other ranks were told it: they run it whole and wait in
its collectives for a rank 0 that will not come, or meet its next step's there, out of step.
Ranks watch for rank 0's end in turn (their socket closes, their parent changes)."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from ..quantization import Quantization
from ..runtime.plan import RankStatus, ScheduledSeq
from ..runtime.process import EngineProcessError

log = logging.getLogger("duet.engines.torch")

# How often a rank's memory is read while it works: ranks 1..N-1 report it at most this often,
# and rank 0 reads its own no oftener (the runtime's status is taken after every step).
REPORT_S = 0.25
# How long ranks wait for each other to join the group (a rank loading a large shard is still
# joining within this, since the group is joined before the weights load).
JOIN_TIMEOUT_S = 600
OVERLAPPING_DEVICES = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"


@dataclass(frozen=True)
class RankSpec:
    """What a rank process needs to load its share; sent to it once, when it starts."""

    model_dir: str
    dtype: str
    device: str  # "cpu" or "cuda": a rank takes the GPU of its own index
    compile: str
    quantization: Quantization | None
    rank: int
    world: int
    address: str  # the group's rendezvous, tcp://host:port


@dataclass(frozen=True)
class PoolShape:
    """Rank 0's sizing of the KV pool and the batch, which every rank follows."""

    num_blocks: int
    block_size: int
    context_length: int
    max_batch: int
    max_prefill_tokens: int


def rank_device(device: str) -> str:
    """A rank's device in its own process: each CUDA rank sees its GPU alone, as cuda:0
    (rank_environment), and rank 0 is the engine's process, on the first visible GPU."""
    return "cuda:0" if device.startswith("cuda") else device


def rank_environment(env: Mapping[str, str], device: str, rank: int) -> dict[str, str]:
    """A rank process's environment: on CUDA, CUDA_VISIBLE_DEVICES narrowed to the rank's own
    GPU (the rank-th of those the engine sees).

    Why: Inductor keys its compiled kernels and their tunings by the kernel's source, which
    names the device index. With every rank on cuda:0 the ranks' kernels are the same source,
    so they share one cache and, from a server's second start, one tuning; with a GPU index
    each, each rank tuned its kernels alone, and a split step runs each segment at the slower
    rank's choice (two H100s, 8B shape: the same gate/up product 43.4 us on one rank, 38.6 on
    the other). NCCL finds its peers by bus id and the peer sums map the other ranks' memory by
    handle, so neither needs the other GPUs visible; PyTorch's symmetric memory asks to be told
    that the ranks' equal device indices are distinct GPUs
    (TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES)."""
    out = dict(env)
    if device.startswith("cuda"):
        visible = env.get("CUDA_VISIBLE_DEVICES")
        gpus = ([g.strip() for g in visible.split(",") if g.strip()] if visible
                else [str(i) for i in range(rank + 1)])
        if rank >= len(gpus):
            raise ValueError(f"tensor-parallel rank {rank} has no GPU: CUDA_VISIBLE_DEVICES "
                             f"names {len(gpus)}")
        out["CUDA_VISIBLE_DEVICES"] = gpus[rank]
        out[OVERLAPPING_DEVICES] = "1"
    return out


def join_group(spec: RankSpec) -> None:
    import torch.distributed as dist

    cuda = spec.device.startswith("cuda")
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=spec.address, rank=spec.rank,
        world_size=spec.world, timeout=timedelta(seconds=JOIN_TIMEOUT_S),
        device_id=torch.device(rank_device(spec.device)) if cuda else None)


def slim(rows: Sequence[ScheduledSeq]) -> list[tuple]:
    """What a rank needs of a step's rows: where their tokens go and which keys they read."""
    return [(r.seq_id, r.tokens, r.start, r.blocks, r.sample) for r in rows]


def unslim(rows: list[tuple]) -> tuple[ScheduledSeq, ...]:
    return tuple(ScheduledSeq(seq_id, tokens, start, blocks, sample, None, 0)
                 for seq_id, tokens, start, blocks, sample in rows)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _project_root() -> str:
    return str(Path(__file__).resolve().parents[2])


class RankGroup:
    """Rank 0's side: starts ranks 1..N-1, tells them each step, reads what they report."""

    def __init__(self, spec: RankSpec, on_lost: Callable[[str], None] | None = None):
        """spec: rank 0's own (rank 0, the group's size); every other rank gets it with its
        rank. on_lost(why): the ranks can no longer work together, a rank's process having
        ended or a step having failed on rank 0 alone (by default the engine's process exits:
        see the module's note)."""
        self.world = spec.world
        self.on_lost = on_lost or _exit_engine_process
        self._closing = False
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen] = []
        self._reports: dict[int, dict] = {}
        spec = RankSpec(**{**spec.__dict__, "address": f"tcp://127.0.0.1:{_free_port()}"})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (_project_root(), os.environ.get("PYTHONPATH")) if p)}
        if spec.device.startswith("cuda"):
            # Rank 0 (this process) sees every GPU, yet its device index is 0 as the others'.
            os.environ[OVERLAPPING_DEVICES] = "1"
        for rank in range(1, self.world):
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen(
                [sys.executable, "-m", "engines.torch_engine.rank_worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=rank_environment(env, spec.device, rank))
            theirs.close()
            conn = Connection(ours.detach())
            conn.send(RankSpec(**{**spec.__dict__, "rank": rank}))
            self._conns.append(conn)
            self._procs.append(proc)
        # From here on a rank's end is watched: one that dies while the others wait for it in
        # a collective (joining the group, a graph's capture, a step) would hold them forever.
        for rank, proc in enumerate(self._procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True,
                             name=f"tp-rank-{rank}-watch").start()
        join_group(spec)
        import torch.distributed as dist

        self.group = dist.group.WORLD

    # -- start-up --------------------------------------------------------------------------------

    def _expect(self, what: str) -> list[tuple]:
        """Each rank's next message, which must be `what` (a rank that failed sends its error)."""
        replies = []
        for rank, conn in enumerate(self._conns, start=1):
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                code = self._procs[rank - 1].wait(30)
                raise RuntimeError(f"tensor-parallel rank {rank} exited while starting "
                                   f"(exit code {code})") from None
            if msg[0] == "failed":
                raise msg[1]
            if msg[0] != what:
                raise RuntimeError(f"rank {rank} answered {msg[0]!r}, not {what!r}")
            replies.append(msg)
        return replies

    def loaded_bytes(self) -> int:
        """The other ranks' weights, once they have loaded them."""
        return sum(msg[1] for msg in self._expect("loaded"))

    def build(self, shape: PoolShape) -> None:
        """The ranks allocate their KV pools and capture their steps; rank 0 does the same
        beside them (their captures' collectives pair with its), then calls built()."""
        self._send(("build", shape))

    def built(self) -> None:
        self._expect("built")
        for rank, conn in enumerate(self._conns, start=1):
            threading.Thread(target=self._read, args=(rank, conn), daemon=True,
                             name=f"tp-rank-{rank}").start()

    # -- running -----------------------------------------------------------------------------

    def _send(self, msg: tuple) -> None:
        payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._conns:
            conn.send_bytes(payload)

    def step(self, prefill: Sequence[ScheduledSeq], decode: Sequence[ScheduledSeq],
             share: bool) -> None:
        """Tell the ranks a step; share: rank 0 will share its sampled tokens after it."""
        self._send(("step", slim(prefill), slim(decode), share))

    def mirror(self, what: str, *args) -> None:
        """model.mirror: a forward outside the steps (scratch_cache, forward)."""
        self._send((what, *args))

    def reset_meters(self) -> None:
        self._send(("meter_reset",))

    def peak_bytes(self) -> int:
        """The other ranks' memory peaks since the last reset, as they last reported them."""
        return sum(r.get("peak", 0) for r in self._reports.values())

    def status(self) -> list[RankStatus]:
        """Ranks 1..N-1 as they last reported (a rank not heard from yet shows zeros)."""
        return [RankStatus(rank, proc.pid, self._reports.get(rank, {}).get("memory", 0),
                           self._reports.get(rank, {}).get("peak", 0))
                for rank, proc in enumerate(self._procs, start=1)]

    def failed(self, exc: BaseException, told: bool) -> BaseException:
        """What a step that failed ends its requests with; told: whether the other ranks were
        told it. A lost rank is the engine's process lost (a 503; the server loads it anew),
        and so is a step told and failed on rank 0 (on_lost ends the process)."""
        gone = [rank for rank, proc in enumerate(self._procs, start=1) if _ended(proc)]
        if gone:
            return EngineProcessError(f"tensor-parallel rank {gone[0]} of the engine ended "
                                      f"(exit code {self._procs[gone[0] - 1].returncode})")
        if not told:
            return exc
        self.on_lost(f"a step failed on rank 0 after the other ranks began it ({exc}): the "
                     "ranks are out of step")
        return EngineProcessError(f"the engine's tensor-parallel ranks are out of step after "
                                  f"a step failed: {exc}")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _read(self, rank: int, conn: Connection) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return  # its end is _watch's to see
            if msg[0] == "report":
                self._reports[rank] = msg[1]

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._closing:
            self.on_lost(f"tensor-parallel rank {rank} ended (exit code {code})")

    def close(self) -> None:
        self._closing = True
        try:
            self._send(("close",))
        except OSError:
            pass
        deadline = time.monotonic() + 10
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for conn in self._conns:
            conn.close()
        import torch.distributed as dist

        # gloo's group is torn down so that this process may form another (tests do); NCCL's
        # teardown waits on peers, and a CUDA engine's process ends after its close anyway.
        if dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()


def _ended(proc: subprocess.Popen, wait_s: float = 2.0) -> bool:
    """Whether proc has ended, giving a process being killed the time to be reaped (its
    socket's reset can reach a collective before its exit reaches waitpid)."""
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def _exit_engine_process(why: str) -> None:
    """The ranks cannot meet in their collectives again (a rank is gone, or they are out of
    step): end this process (the engine's own, which the server watches) and the other ranks
    with it."""
    log.error("%s: the engine stops", why)
    logging.shutdown()
    os._exit(70)
