"""Build, here, the wheels fleetwise needs on a GPU machine that has torch and nothing else of
fleetwise's (`make gpu-wheelhouse`; scripts/gpu_check.sh installs them there, offline).

    python scripts/gpu_wheelhouse.py [.whl] [--python-version 3.12] [--no-mlflow] [--limit-mib 64]

The target is a GPU image like this workplace's lent machines: Python 3.12 on x86-64 Linux
(manylinux wheels), torch 2.11.0+cu130 and a scientific stack preinstalled (IMAGE below), no
network; packages travel as wheels with the working tree, 64 MiB in all, tree included. So:

- `.whl/*.whl`: fleetwise itself (built from this checkout) and what it imports at runtime beyond
  torch and the image's packages: hydra-core, omegaconf, antlr4 (its runtime is an sdist only: built
  here into a pure wheel), pydantic and pydantic-core (cp312), annotated-types, typing-inspection,
  typing-extensions (pydantic needs a newer one than an image may have), and rich, PyYAML, psutil
  with rich's own (small; carried so that the versions are the ones fleetwise is tested with).
  numpy is on the image (torch is built against it) and is never carried; neither is torch, nor
  any of torch's own dependencies (the build fails if one slips in).
- `.whl/mlflow/*.whl` (unless --no-mlflow): MLflow and those of its dependencies the image lacks,
  installed apart by the GPU check for its one tracked run; everything else there runs with
  tracking off and needs none of it.
- `.whl/BUILD.json`: what was built (the checkout's commit, the versions, every file's size).

Versions are the ones installed in this checkout's virtual environment (what the tests ran with).
The total -- wheels plus the working tree that travels with them -- is printed, and the build
fails when it is over the limit.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLATFORMS = (  # pip matches each tag exactly: the ones the image's glibc (2.39) accepts, newest first
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
# Distributions fleetwise imports at runtime that a torch image may lack (and their own needs).
CORE = (
    "hydra-core",
    "omegaconf",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "rich",
    "markdown-it-py",
    "mdurl",
    "pygments",
    "PyYAML",
    "psutil",
)
SDIST_ONLY = ("antlr4-python3-runtime",)  # no wheel on the index: built here (pure Python)
NEVER = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia[-_].*|numpy)$")
# The Python packages on the GPU image (the device's package list, read 2026-11-17): MLflow's
# dependencies among them are not carried.
_IMAGE_NAMES = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
    jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
    numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
    onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil py-cpuinfo pyarrow pybind11 pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
    scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
    torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
    wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"""
IMAGE = frozenset(_IMAGE_NAMES.split())
MIB = 2**20


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_project(path: Path) -> str:
    """The distribution a wheel file is of ("pydantic_core-2.50.5-cp312-...whl" -> "pydantic-core")."""
    return canonical(path.name.split("-")[0])


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def binary_args(python_version: str) -> list[str]:
    out = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        out += ["--platform", platform]
    return out


def pinned(names: tuple[str, ...]) -> list[str]:
    """name==version as installed here (the versions the tests ran with)."""
    return [f"{n}=={importlib.metadata.version(n)}" for n in names]


def build_core(dest: Path, python_version: str) -> None:
    pip("download", "--no-deps", *binary_args(python_version), "-d", str(dest), *pinned(CORE))
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(dest), *pinned(SDIST_ONLY))
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(dest), str(REPO))


def build_mlflow(dest: Path, python_version: str, carried: set[str]) -> None:
    """MLflow with its dependencies resolved for the target, less those the image or the core has."""
    with tempfile.TemporaryDirectory(prefix="fleetwise-wheels-") as tmp:
        pip("download", *binary_args(python_version), "-d", tmp, *pinned(("mlflow",)))
        for wheel in sorted(Path(tmp).glob("*.whl")):
            project = wheel_project(wheel)
            if project not in IMAGE and project not in carried:
                shutil.copy2(wheel, dest / wheel.name)


def tree_bytes() -> int:
    """What the working tree sends with the wheels: tracked files and untracked ones not ignored."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum((REPO / f.decode()).stat().st_size for f in files if f and (REPO / f.decode()).is_file())


def commit() -> dict[str, object]:
    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--", "platform", "conf")),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dest", nargs="?", default=str(REPO / ".whl"))
    p.add_argument("--python-version", default="3.12")
    p.add_argument("--no-mlflow", action="store_true", help="leave MLflow out (the check tracks nothing)")
    p.add_argument("--limit-mib", type=float, default=64.0, help="wheels + working tree, at most")
    args = p.parse_args(argv)
    dest = Path(args.dest)
    shutil.rmtree(dest, ignore_errors=True)  # one version of each: two stop the whole install there
    (dest / "mlflow").mkdir(parents=True)
    build_core(dest, args.python_version)
    core = sorted(dest.glob("*.whl"))
    if not args.no_mlflow:
        build_mlflow(dest / "mlflow", args.python_version, {wheel_project(w) for w in core})
    extra = sorted((dest / "mlflow").glob("*.whl"))
    forbidden = [w.name for w in core + extra if NEVER.match(wheel_project(w))]
    if forbidden:
        print(
            f"✗ the wheelhouse must not carry torch, its dependencies or numpy: {forbidden}", file=sys.stderr
        )
        return 1
    sizes = {w.relative_to(dest).as_posix(): w.stat().st_size for w in core + extra}
    wheels, tree = sum(sizes.values()), tree_bytes()
    info = {
        "python_version": args.python_version,
        "platforms": list(PLATFORMS),
        **commit(),
        "core": [w.name for w in core],
        "mlflow": [w.name for w in extra],
        "bytes": sizes,
        "wheels_bytes": wheels,
        "tree_bytes": tree,
    }
    (dest / "BUILD.json").write_text(json.dumps(info, indent=1))
    for name, size in sorted(sizes.items(), key=lambda kv: -kv[1]):
        print(f"  {size / MIB:7.2f} MiB  {name}")
    core_mib = sum(w.stat().st_size for w in core) / MIB
    print(
        f"wheelhouse {dest}: core {core_mib:.1f} MiB ({len(core)} wheels) + mlflow "
        f"{sum(w.stat().st_size for w in extra) / MIB:.1f} MiB ({len(extra)} wheels) = {wheels / MIB:.1f} MiB; "
        f"with the working tree ({tree / MIB:.1f} MiB): {(wheels + tree) / MIB:.1f} of {args.limit_mib:g} MiB"
    )
    if wheels + tree > args.limit_mib * MIB:
        print(
            f"✗ over {args.limit_mib:g} MiB: build with --no-mlflow (GPU_WHEELHOUSE_MLFLOW=0), or carry less",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
