"""Where the host KV tier's start time goes: pinning host memory the ways vLLM can.

Needs torch only (no vLLM, no model): runs on the GPU machine's image as it is. Each case runs
in a fresh process (torch reads its pinned-allocator settings once per process) and reports the
seconds it took and how much MemAvailable fell (what was really pinned):

  torch       torch.zeros((blocks, 4 MiB), int8, pin_memory=True): vLLM 0.26's native tier
              (CPUOffloadingWorker, v1/kv_offload/cpu/gpu_worker.py); cudaHostAlloc of the size
              rounded up to a power of two, then a zero fill
  torch_empty the same allocation without the zero fill (torch.empty)
  register    torch.zeros as above with PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,
              pinned_num_register_threads:N: malloc, the pages faulted in by N threads, then one
              cudaHostRegister (still rounded up to a power of two)
  shm         a /dev/shm file, mmap, MADV_POPULATE_WRITE, cudaHostRegister of the exact size:
              vLLM 0.26's TieringOffloadingSpec primary tier (SharedOffloadRegion)
  anon        anonymous mmap, MADV_POPULATE_WRITE in N threads, cudaHostRegister of the exact
              size: what a patched allocation could do

Usage: python -m bench.pinprobe [--gib 31 40 64] [--cases torch register shm anon] [--threads 16]
Prints one JSON object per case and size; docs/benchmarks/kv-tier-start.md says what to compare.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from typing import Any

BLOCK = 4 * 2**20  # one 16-token block of QwQ-32B's KV cache in bf16 (64 layers, 8 heads, 128)
MADV_POPULATE_WRITE = 23  # Linux 5.14+
CASES = ("torch", "torch_empty", "register", "shm", "anon")


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _populate(address: int, size: int, threads: int) -> None:
    """MADV_POPULATE_WRITE over [address, address + size) in ``threads`` slices at once
    (ctypes releases the GIL for the call)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    step = -(-size // threads // page) * page
    errors: list[int] = []

    def one(start: int) -> None:
        length = min(step, size - start)
        if length > 0 and libc.madvise(address + start, length, MADV_POPULATE_WRITE) != 0:
            errors.append(ctypes.get_errno())

    workers = [threading.Thread(target=one, args=(i * step,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise OSError(errors[0], os.strerror(errors[0]))


def _register(torch: Any, address: int, size: int) -> float:
    started = time.monotonic()
    result = torch.cuda.cudart().cudaHostRegister(address, size, 0)
    if int(getattr(result, "value", result)) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {result}")
    return time.monotonic() - started


def run_case(case: str, gib: float, threads: int) -> dict[str, Any]:
    import torch

    blocks = int(gib * 2**30) // BLOCK
    size = blocks * BLOCK
    before = mem_available()
    out: dict[str, Any] = {"case": case, "gib": gib, "bytes": size, "threads": threads}
    started = time.monotonic()
    keep: list[Any] = []
    if case in ("torch", "torch_empty", "register"):
        make = torch.zeros if case != "torch_empty" else torch.empty
        tensor = make((blocks, BLOCK), dtype=torch.int8, device="cpu", pin_memory=True)
        keep.append(tensor)
        out["seconds"] = time.monotonic() - started
        stats = getattr(torch.cuda, "host_memory_stats", None)
        if stats is not None:
            values = stats()
            out["host_alloc_reserved_bytes"] = values.get("reserved_bytes.current", values.get("reserved_bytes"))
            out["host_alloc_time_us"] = values.get("host_alloc_time.total")
    else:
        if case == "shm":
            path = f"/dev/shm/pinprobe_{os.getpid()}.mmap"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
                region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.unlink(path)  # the mapping keeps the memory; nothing is left behind
                os.close(fd)
            populate_threads = 1  # as vLLM 0.26 does it: one madvise over the region
        else:
            region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            populate_threads = threads
        keep.append(region)
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        _populate(address, size, populate_threads)
        out["populate_seconds"] = time.monotonic() - started
        # Without CUDA (a CPU machine: trying the probe) only the population is timed.
        out["register_seconds"] = _register(torch, address, size) if torch.cuda.is_available() else None
        out["seconds"] = time.monotonic() - started
    out["mem_available_drop_bytes"] = before - mem_available()
    out["pinned_gib"] = round(out["mem_available_drop_bytes"] / 2**30, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, nargs="+", default=[31.0, 40.0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--threads", type=int, default=16, help="threads that fault pages in (a power of two)")
    parser.add_argument("--one", nargs=2, metavar=("CASE", "GIB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # the child: one case, then exit (and give its memory back)
        print(json.dumps(run_case(args.one[0], float(args.one[1]), args.threads)), flush=True)
        return
    for gib in args.gib:
        for case in args.cases:
            env = dict(os.environ)
            if case == "register":
                env["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(
                    filter(
                        None,
                        [
                            env.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                            f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{args.threads}",
                        ],
                    )
                )
            command = [sys.executable, "-m", "bench.pinprobe", "--one", case, str(gib), "--threads", str(args.threads)]
            started = time.monotonic()
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            wall = round(time.monotonic() - started, 2)
            if done.returncode == 0:
                result = json.loads(done.stdout.strip().splitlines()[-1])
                result["process_seconds"] = wall  # includes torch's import and CUDA's start
            else:
                result = {"case": case, "gib": gib, "error": done.stderr.strip().splitlines()[-1:]}
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
