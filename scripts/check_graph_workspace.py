"""Whether a CUDA graph's GEMMs share their cuBLAS workspace with eager GEMMs run beside its
replays: the race that hung first starts of the torch engine on an H100 (2026-11-27) until
its captures moved to a stream that runs nothing else (engines/torch_engine/cuda_graphs.py,
CudaGraphs).

A thread captures GEMMs of decode-like shapes (bf16) on stream P and ends; another thread,
which PyTorch's handle pool hands the first one's cuBLAS handle, runs eager GEMMs while the
main thread replays the graph and compares its products with those of a replay alone. PyTorch
keys a handle's workspace by stream, so the modes are:

  alone        no eager GEMMs (shapes whose products vary even so are left out of the count)
  same         eager GEMMs on P under the capturing thread's handle (duet before the fix)
  apart        the same handle on another stream (duet's captures and warm-ups since)
  otherhandle  on P under another handle (the capturing thread kept alive)

Each mode runs in a process of its own. Needs a CUDA GPU:

  python scripts/check_graph_workspace.py --seconds 12 --out docs/bench/graph-workspace.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

MODES = ("alone", "same", "apart", "otherhandle")
SHAPES = [(1, 8192, 2048), (4, 8192, 2048), (16, 8192, 2048), (1, 2048, 8192),
          (64, 8192, 2048), (128, 8192, 2048), (8, 2048, 2048), (2, 16384, 1024)]


def products(torch, seed: int, scale: float):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
          for m, k, _ in SHAPES]
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * scale
          for _, k, n in SHAPES]
    return lambda: [x @ w.T for x, w in zip(xs, ws, strict=True)]


def run_mode(mode: str, seconds: float) -> dict:
    import torch

    capture_stream, other = torch.cuda.Stream(), torch.cuda.Stream()
    handles, made = {}, {}
    captured, release, stop = threading.Event(), threading.Event(), threading.Event()

    def capture() -> None:
        handles["capture"] = torch.cuda.current_blas_handle()
        with torch.inference_mode():
            step = products(torch, 0, 0.02)
            capture_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(capture_stream):
                for _ in range(3):
                    step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(capture_stream):
                graph.capture_begin(capture_error_mode="thread_local")
                out = step()
                graph.capture_end()
            torch.cuda.synchronize()
        made.update(graph=graph, out=out)
        captured.set()
        release.wait()

    capturer = threading.Thread(target=capture, daemon=True)
    capturer.start()
    captured.wait()
    if mode != "otherhandle":  # the thread ends, and its handle goes back to the pool
        release.set()
        capturer.join()
    graph, out = made["graph"], made["out"]
    graph.replay()
    torch.cuda.synchronize()
    first = [o.clone() for o in out]
    rounds = [0]

    def eager() -> None:
        handles["eager"] = torch.cuda.current_blas_handle()
        with torch.inference_mode(), torch.cuda.stream(other if mode == "apart" else
                                                       capture_stream):
            step = products(torch, 1, 1.0)
            while not stop.is_set():
                step()
                rounds[0] += 1
                if rounds[0] % 50 == 0:
                    torch.cuda.current_stream().synchronize()

    beside = threading.Thread(target=eager, daemon=True)
    if mode != "alone":
        beside.start()
        time.sleep(0.5)
    replays, wrong, hung = 0, [0] * len(SHAPES), False
    started = time.time()
    while time.time() - started < seconds and not hung:
        for _ in range(20):
            graph.replay()
        done = torch.cuda.Event()
        done.record()
        waited = time.time()
        while not done.query():
            if time.time() - waited > 15:
                hung = True
                break
            time.sleep(0.0005)
        replays += 20
        for i, (o, f) in enumerate(zip(out, first, strict=True)):
            wrong[i] += 0 if hung or torch.equal(o, f) else 1
    stop.set()
    release.set()
    return {"mode": mode, "same_handle": handles.get("eager") == handles["capture"],
            "replays": replays, "eager_rounds": rounds[0], "checks": replays // 20,
            "wrong_by_shape": wrong, "hung": hung}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=12.0, help="replaying, per mode")
    p.add_argument("--out", help="write the results here as JSON")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in-process
    args = p.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.seconds)), flush=True)
        # Daemon threads holding CUDA handles at interpreter exit can abort it: leave at once.
        os._exit(0)
    rows = []
    for mode in MODES:
        done = subprocess.run([sys.executable, __file__, "--mode", mode, "--seconds",
                               str(args.seconds)], capture_output=True, text=True,
                              timeout=args.seconds + 120)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        rows.append(json.loads(lines[-1]) if lines else {"mode": mode, "error": done.stderr[-300:]})
    varying = {i for r in rows if r["mode"] == "alone" and "wrong_by_shape" in r
               for i, w in enumerate(r["wrong_by_shape"]) if w}
    print(f"{'mode':<12} {'same handle':>11} {'replays':>8} {'eager GEMM rounds':>17} "
          f"{'checks':>7} {'wrong (steady shapes)':>21} {'hung':>5}")
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:<12} failed: {r['error']}")
            continue
        steady = sum(w for i, w in enumerate(r["wrong_by_shape"]) if i not in varying)
        print(f"{r['mode']:<12} {str(r['same_handle']):>11} {r['replays']:>8} "
              f"{r['eager_rounds']:>17} {r['checks']:>7} {steady:>21} {str(r['hung']):>5}")
    print(f"shapes whose products vary even replayed alone (left out): "
          f"{[SHAPES[i] for i in sorted(varying)]}")
    if args.out:
        import torch

        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "shapes": SHAPES,
                       "varying_alone": sorted(varying), "modes": rows}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
