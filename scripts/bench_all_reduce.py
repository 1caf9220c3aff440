#!/usr/bin/env python3
"""What a tensor-parallel decode step pays for its sums, on the GPUs of one host, inside CUDA
graphs as the engine replays them.

1. One all-reduce of R rows of the hidden size, repeated in a captured graph: NCCL's (the
   functional collective the model's step calls) against PyTorch's symmetric-memory one-shot
   and two-shot all-reduces (peer reads over NVLink, no multicast) and duet's peer sum
   (engines/torch_engine/peer_sum.py), which is first checked against NCCL's sums over
   hundreds of random sums, eager and replayed in a graph.
2. A decode step's matrix products alone, Llama-3.1-8B shape, bf16, 32 layers of distinct
   weights: the whole model on one GPU, against one rank's share with no sums, with NCCL's sums,
   the symmetric one-shot's and the peer sums (the vocabulary projection whole on every rank,
   or split); with --norms, each sum followed by the residual add and the next RMS norm, and
   the peer sums fused with them (one kernel each) besides.

Prints a table and writes JSON under docs/bench/.

  python scripts/bench_all_reduce.py --rows 1,64 --out docs/bench/all-reduce.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 14336, 32, 32, 8, 128, 128256


def timed(graph, device, repeats: int = 30) -> float:
    """Median milliseconds of one replay."""
    import torch

    times = []
    for _ in range(repeats):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def capture(fn, warm: int = 2):
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def sums(rank: int, world: int, rows_list: list[int], reps: int) -> list[dict]:
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem
    from torch.distributed import _functional_collectives as funcol

    from engines.torch_engine import peer_sum

    device = torch.device("cuda", rank)
    group = dist.group.WORLD
    name = group.group_name
    peer = peer_sum.create(group, f"cuda:{rank}", max(rows_list) * HIDDEN, torch.bfloat16)
    out = []
    for rows in rows_list:
        n = rows * HIDDEN
        x = torch.full((rows, HIDDEN), rank + 1.0, dtype=torch.bfloat16, device=device)
        buf = symm_mem.empty(n, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(buf, name)
        buf.copy_(x.reshape(-1))
        want = world * (world + 1) / 2

        def nccl():
            y = x
            for _ in range(reps):
                y = funcol.wait_tensor(funcol.all_reduce(y * 0.5 + 0.5 * x, "sum", group))
            return y

        def one_shot():
            y = x.reshape(-1)
            for _ in range(reps):
                y = torch.ops.symm_mem.one_shot_all_reduce_copy(buf, y * 0.5 + 0.5 * x.reshape(-1),
                                                                "sum", name)
            return y

        def two_shot():
            for _ in range(reps):
                buf.mul_(0.5).add_(x.reshape(-1), alpha=0.5)
                torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name)
            return buf

        def peer_sums():
            y = x
            for i in range(reps):  # phases alternate, as a forward's do
                y = peer(y * 0.5 + 0.5 * x, i % 2)
            return y

        line = {"rows": rows, "bytes": n * 2}
        checks = {
            "peer": lambda: (peer(x, 0), peer(x, 1))[1],
            "nccl": lambda: funcol.wait_tensor(funcol.all_reduce(x, "sum", group)),
            "one_shot": lambda: torch.ops.symm_mem.one_shot_all_reduce_copy(
                buf, x.reshape(-1), "sum", name),
            "two_shot": lambda: torch.ops.symm_mem.two_shot_all_reduce_(
                buf.copy_(x.reshape(-1)), "sum", name),
        }
        for label, fn in (("nccl", nccl), ("one_shot", one_shot), ("two_shot", two_shot),
                          ("peer", peer_sums)):
            try:
                got = checks[label]()
                torch.cuda.synchronize()
                line[label + "_ok"] = bool((got == want).all())
                graph = capture(fn)
                # The elementwise work between sums, alone, to subtract.
                base = capture(lambda: [x * 0.5 + 0.5 * x for _ in range(reps)])
                line[label + "_us"] = round((timed(graph, device) - timed(base, device))
                                            / reps * 1000, 2)
            except Exception as exc:  # an op this build or machine lacks
                line[label + "_us"] = None
                line[label + "_error"] = f"{type(exc).__name__}: {exc}"[:200]
            dist.barrier()
        out.append(line)
    return out


def layers(rank: int, world: int, rows_list: list[int], norms: bool = False) -> list[dict]:
    """A decode step's products: per layer QKV, output, gate/up, down, two sums; with norms,
    each sum followed by the residual add and an RMS norm, and the peer sums fused with them
    (peer_sum_norm) besides."""
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem
    import torch.nn.functional as F
    from torch.distributed import _functional_collectives as funcol

    device = torch.device("cuda", rank)
    group = dist.group.WORLD
    name = group.group_name
    torch.manual_seed(rank)

    def weights(split: int):
        q, kv, inter = HEADS * HEAD_DIM // split, KV_HEADS * HEAD_DIM // split, INTER // split
        return [(torch.randn(q + 2 * kv, HIDDEN, dtype=torch.bfloat16, device=device) * 0.01,
                 torch.randn(HIDDEN, q, dtype=torch.bfloat16, device=device) * 0.01,
                 torch.randn(2 * inter, HIDDEN, dtype=torch.bfloat16, device=device) * 0.01,
                 torch.randn(HIDDEN, inter, dtype=torch.bfloat16, device=device) * 0.01, q)
                for _ in range(LAYERS)]

    out = []
    max_rows = max(rows_list)
    buf = symm_mem.empty(max_rows * HIDDEN, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(buf, name)

    norm_w = torch.ones(HIDDEN, dtype=torch.bfloat16, device=device)

    def rms(y):
        return F.rms_norm(y, (HIDDEN,), norm_w, 1e-5)

    def step(ws, x, head, sum_fn, fused=False):
        if norms:
            h = rms(x)
            for wqkv, wo, wgu, wd, q in ws:
                a = (h @ wqkv.t())[:, :q] @ wo.t()
                if fused:
                    x, h = peer.add_norm(a, x, norm_w, 1e-5, 0)
                else:
                    x = x + sum_fn(a)
                    h = rms(x)
                gate, up = (h @ wgu.t()).chunk(2, dim=-1)
                d = (F.silu(gate) * up) @ wd.t()
                if fused:
                    x, h = peer.add_norm(d, x, norm_w, 1e-5, 1)
                else:
                    x = x + sum_fn(d)
                    h = rms(x)
            return h @ head.t()
        for wqkv, wo, wgu, wd, q in ws:
            h = x @ wqkv.t()
            x = x + sum_fn(h[:, :q] @ wo.t())
            g = x @ wgu.t()
            gate, up = g.chunk(2, dim=-1)
            x = x + sum_fn((F.silu(gate) * up) @ wd.t())
        return x @ head.t()

    def no_sum(y):
        return y

    def nccl(y):
        return funcol.wait_tensor(funcol.all_reduce(y, "sum", group))

    def one_shot(y):
        flat = y.reshape(-1)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(
            buf[: flat.numel()], flat, "sum", name).reshape(y.shape)

    from engines.torch_engine import peer_sum

    peer = peer_sum.create(group, f"cuda:{rank}", max_rows * HIDDEN, torch.bfloat16)
    phase = [0]

    def peer_fn(y):
        phase[0] ^= 1
        return peer(y, 1 - phase[0])

    split = weights(world)
    head_whole = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16, device=device) * 0.01
    head_split = head_whole[: VOCAB // world].clone()
    for rows in rows_list:
        x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device=device) * 0.1
        line = {"rows": rows}
        variants = [("split_no_sums", split, head_whole, no_sum),
                                    ("split_nccl", split, head_whole, nccl),
                                    ("split_nccl_vocab_split", split, head_split, nccl),
                                    ("split_one_shot", split, head_whole, one_shot),
                                    ("split_one_shot_vocab_split", split, head_split, one_shot),
                                    ("split_peer", split, head_whole, peer_fn),
                                    ("split_peer_vocab_split", split, head_split, peer_fn)]
        if norms:
            variants.append(("split_peer_fused_norms_vocab_split", split, head_split, "fused"))
        for label, ws, head, fn in variants:
            try:
                graph = capture(lambda: step(ws, x, head, fn, fused=fn == "fused"))
                line[label + "_ms"] = round(timed(graph, device), 3)
            except Exception as exc:
                line[label + "_ms"] = None
                line[label + "_error"] = f"{type(exc).__name__}: {exc}"[:200]
            dist.barrier()
        out.append(line)
    del split
    torch.cuda.empty_cache()
    dist.barrier()
    if rank == 0:
        whole = weights(1)
        for line in out:
            x = torch.randn(line["rows"], HIDDEN, dtype=torch.bfloat16, device=device) * 0.1
            graph = capture(lambda: step(whole, x, head_whole, no_sum))
            line["one_gpu_ms"] = round(timed(graph, device), 3)
        del whole
    dist.barrier()
    return out


# (programs, block, warps) tried by --layouts: the chunking the peer sums take by default
# (peer_sum.layout) against more programs or smaller blocks at a prefill's sizes.
LAYOUTS = ((128, 1024, 4), (128, 2048, 4), (128, 4096, 8), (128, 8192, 16), (256, 1024, 4),
           (256, 2048, 4), (256, 4096, 8))


def layouts(rank: int, world: int, rows_list: list[int], reps: int) -> list[dict]:
    """The peer sum's kernel launched with each of LAYOUTS, per sum, in a graph of reps sums
    (checked once each), against the default layout's choice."""
    import torch
    import torch.distributed as dist

    from engines.torch_engine import peer_sum as ps

    device = torch.device("cuda", rank)
    capacity = max(rows_list) * HIDDEN
    peer = ps.create(dist.group.WORLD, f"cuda:{rank}", capacity, torch.bfloat16)
    if peer is None:
        return [{"error": "no peer sums here"}]
    ptrs = peer.buffers.ptrs
    out = []
    for rows in rows_list:
        n = rows * HIDDEN
        x = torch.full((n,), rank + 1.0, dtype=torch.bfloat16, device=device)
        y = torch.empty_like(x)
        line = {"rows": rows, "default": list(ps.layout(n))}
        for programs, block, warps in LAYOUTS:
            def launch(i, programs=programs, block=block, warps=warps):
                ps._peer_sum_kernel[(min(programs, -(-n // block)),)](
                    x.view(torch.int16), y, ptrs, rank, n, capacity, (i % 2) * world * capacity,
                    WORLD=world, BF16=True, BLOCK=block, num_warps=warps)

            launch(0)
            torch.cuda.synchronize()
            ok = bool((y == world * (world + 1) / 2).all())
            graph = capture(lambda: [launch(i) for i in range(reps)])  # on every rank alike
            us = round(timed(graph, device) / reps * 1000, 2)
            line[f"{programs}x{block}/{warps}"] = us if ok else f"{us} WRONG"
            dist.barrier()
        out.append(line)
    return out


def stress(rank: int, world: int, max_rows: int, sums: int = 400) -> dict:
    """Peer sums against NCCL's on the same random parts: eager sums of random sizes, then a
    graph of 64 sums replayed on new inputs."""
    import torch
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    from engines.torch_engine import peer_sum

    device = torch.device("cuda", rank)
    group = dist.group.WORLD
    peer = peer_sum.create(group, f"cuda:{rank}", max_rows * HIDDEN, torch.bfloat16)
    if peer is None:
        return {"error": "no peer sums here"}
    sizes = torch.Generator().manual_seed(7)
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    worst, differ, total = 0.0, 0, 0
    for i in range(sums):
        rows = int(torch.randint(1, max_rows + 1, (1,), generator=sizes))
        x = torch.randn(rows, HIDDEN, generator=gen, device=device).to(torch.bfloat16)
        got = peer(x, i % 2)
        want = funcol.wait_tensor(funcol.all_reduce(x, "sum", group))
        differ += int((got != want).sum())
        total += got.numel()
        worst = max(worst, float((got.float() - want.float()).abs().max()))
    static = torch.zeros(64, max_rows, HIDDEN, dtype=torch.bfloat16, device=device)
    outs = []

    def chain():
        outs.clear()
        for j in range(64):
            outs.append(peer(static[j], j % 2))

    graph = capture(chain)
    for _ in range(20):
        static.copy_(torch.randn(static.shape, generator=gen, device=device))
        graph.replay()
        for j in range(64):
            want = funcol.wait_tensor(funcol.all_reduce(static[j], "sum", group))
            differ += int((outs[j] != want).sum())
            total += want.numel()
            worst = max(worst, float((outs[j].float() - want.float()).abs().max()))
    # The gather of a decode step's logits to rank 0, after a sum as in a step.
    part = VOCAB // world
    gather = peer_sum.create_gather(group, f"cuda:{rank}", max_rows, part, torch.bfloat16)
    gathered, gather_differ = 0, 0
    for i in range(60):
        rows = int(torch.randint(1, max_rows + 1, (1,), generator=sizes))
        peer(torch.randn(rows, HIDDEN, generator=gen, device=device).to(torch.bfloat16), i % 2)
        x = torch.randn(rows, part, generator=gen, device=device).to(torch.bfloat16)
        got = gather(x)
        want = funcol.wait_tensor(funcol.all_gather_tensor(x, 1, group))
        if rank == 0:
            gather_differ += int((got != want).sum())
            gathered += want.numel()
        else:
            gather_differ += int(got.numel() != 0)
    # The sum fused with the residual add and the norm, against the sum and the two ops after.
    weight = torch.rand(HIDDEN, generator=gen, device=device).to(torch.bfloat16) + 0.5
    fused_differ, fused_worst = 0, 0.0
    for i in range(100):
        rows = int(torch.randint(1, max_rows + 1, (1,), generator=sizes))
        x, res = (torch.randn(rows, HIDDEN, generator=gen, device=device).to(torch.bfloat16)
                  for _ in range(2))
        new, normed = peer.add_norm(x, res, weight, 1e-5, i % 2)
        want = res + funcol.wait_tensor(funcol.all_reduce(x, "sum", group))
        fused_differ += int((new != want).sum())
        fused_worst = max(fused_worst, float((normed.float() - torch.nn.functional.rms_norm(
            want, (HIDDEN,), weight, 1e-5).float()).abs().max()))
    return {"elements": total, "differ": differ, "max_abs_diff": worst,
            "gathered": gathered, "gather_differ": gather_differ,
            "fused_residual_differ": fused_differ, "fused_norm_max_abs_diff": fused_worst}


def worker(rank: int, world: int, args, port: int, results) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300),
                            device_id=torch.device("cuda", rank))
    rows = [int(r) for r in args.rows.split(",")]
    sum_rows = [int(r) for r in (args.sum_rows or args.rows).split(",")]
    got = {"stress": stress(rank, world, max(rows + sum_rows)),
           "sums": sums(rank, world, sum_rows, args.reps),
           "layers": layers(rank, world, rows, args.norms)}
    if args.layouts:
        got["layouts"] = layouts(rank, world, sum_rows, args.reps)
    if rank == 0:
        results.put(got)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    import socket

    import torch
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--sum-rows", default=None,
                        help="the rows of the sums' table, if not --rows (a prefill's: 2048)")
    parser.add_argument("--layouts", action="store_true",
                        help="the peer sum's kernel at --sum-rows in each of LAYOUTS too")
    parser.add_argument("--reps", type=int, default=64, help="sums per graph (two a layer)")
    parser.add_argument("--norms", action="store_true",
                        help="the step's residual adds and RMS norms too, and the peer sums "
                             "fused with them")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        print("needs two GPUs or more", file=sys.stderr)
        return 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, args, port, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = results.get(timeout=900)
    for p in procs:
        p.join(60)
    got.update(gpus=f"{world}x {torch.cuda.get_device_name(0)}", torch=torch.__version__,
               nccl=".".join(map(str, torch.cuda.nccl.version())),
               env={k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM"))})
    print(f"{got['gpus']}, torch {got['torch']}, NCCL {got['nccl']}")
    print(f"peer sums against NCCL's: {got['stress']}")
    print("one sum, microseconds (in a graph of --reps):")
    print(f"{'rows':>5} {'bytes':>8} {'nccl':>8} {'one-shot':>9} {'two-shot':>9} {'peer':>9}")
    for line in got["sums"]:
        cells = [f"{line.get(k + '_us')}{'' if line.get(k + '_ok', True) else ' WRONG'}"
                 for k in ("nccl", "one_shot", "two_shot", "peer")]
        print(f"{line['rows']:>5} {line['bytes']:>8} {cells[0]:>8} {cells[1]:>9} {cells[2]:>9} "
              f"{cells[3]:>9}")
    print("a decode step's products (8B shape), milliseconds:")
    keys = [k for k in got["layers"][0] if k.endswith("_ms")]
    for line in got["layers"]:
        one = line.get("one_gpu_ms")
        print(f"rows {line['rows']}: " + ", ".join(
            f"{k[:-3]} {line.get(k)}" + (f" ({one / line[k]:.2f}x)" if one and line.get(k)
                                           and k != "one_gpu_ms" else "") for k in keys))
    for line in got.get("layouts", []):
        print("peer sum's layouts (programs x block / warps), us: "
              + ", ".join(f"{k} {v}" for k, v in line.items()))
    for section in ("sums", "layers"):
        for line in got[section]:
            for k, v in line.items():
                if k.endswith("_error"):
                    print(f"{section} rows={line['rows']} {k}: {v}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(got, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
