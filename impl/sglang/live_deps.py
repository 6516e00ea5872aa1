"""SGLang's own requirements for the live venv, less the GPU-only ones.

``python -m impl.sglang.live_deps WHEEL`` prints one requirement a line, read from the
wheel's METADATA (so the list follows the release instead of being copied from it):
every unconditional ``Requires-Dist`` except the CUDA kernels and torch's family, which
scripts/install_live.sh pins to the local CPU build instead.
"""
from __future__ import annotations

import re
import sys
import zipfile

# CUDA-only kernels and libraries (no CPU wheel, or an import that needs the driver), and
# torch's family (torch 2.13.0 CPU is kept; torchvision is matched to it without deps).
GPU_ONLY = frozenset("""
cuda-python flash-attn-4 flashinfer-python humming-kernels nvidia-cutlass-dsl
nvidia-mathdx nvshmem4py-cu13 quack-kernels sgl-deep-ep sgl-deep-gemm sgl-flash-mla
sglang-kernel tilelang torch-memory-saver torch torchaudio torchcodec torchvision
""".split())
_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(metadata: str) -> list[str]:
    """The ``Requires-Dist`` lines of ``metadata`` without extras, markers or GPU-only names."""
    out = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        spec = line.split(":", 1)[1].strip()
        if ";" in spec:     # extras and platform markers: none apply to a CPU x86-64 venv
            continue
        match = _NAME.match(spec)
        if match and _normal(match.group(1).split("[")[0]) not in GPU_ONLY:
            out.append(re.sub(r"\[[^\]]*\]", "", spec))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m impl.sglang.live_deps WHEEL", file=sys.stderr)
        return 2
    try:
        with zipfile.ZipFile(argv[0]) as wheel:
            meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
            text = wheel.read(meta).decode("utf-8")
    except (OSError, zipfile.BadZipFile, StopIteration) as exc:
        print(f"live_deps: cannot read the METADATA of {argv[0]}: {exc!r}", file=sys.stderr)
        return 2
    print("\n".join(requirements(text)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
