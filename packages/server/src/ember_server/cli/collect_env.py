"""``ember collect-env``: the facts a bug report needs, as plain text.

Versions of Python, the libraries Ember runs on and the Ember packages; the CPU and its flags;
GPUs, CUDA and the driver where present; and the environment variables that change Ember's or
torch's behaviour. Nothing here may fail the report: a part that cannot be read says so.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable, Iterable

PACKAGES = (
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "fastapi",
    "uvicorn",
    "pyzmq",
    "msgspec",
    "xgrammar",
    "ray",
)
EMBER_PACKAGES = (
    "ember",
    "ember-kv-cache",
    "ember-core-scheduler",
    "ember-attention-kernels",
    "ember-spec-decode",
    "ember-worker",
    "ember-server",
)
ENV_PREFIXES = ("EMBER_", "CUDA_", "NCCL_", "TORCH_", "TRITON_", "HF_", "TRANSFORMERS_")
ENV_NAMES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NVIDIA_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF",
    "TOKENIZERS_PARALLELISM",
    "LD_LIBRARY_PATH",
)
# Values of variables with these words in their names are secrets: report only that they are set.
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu() -> list[tuple[str, str]]:
    info = {"architecture": platform.machine()}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags", "Features") and key not in info:
                    info[key] = value.strip()
    except OSError:
        info["model name"] = platform.processor() or "unknown"
    rows = [
        ("model", info.get("model name", "unknown")),
        ("architecture", info["architecture"]),
        ("cores (usable / total)", f"{len(os.sched_getaffinity(0))} / {os.cpu_count()}"),
    ]
    flags = info.get("flags") or info.get("Features")
    if flags:
        rows.append(("flags", flags))
    return rows


def _torch() -> list[tuple[str, str]]:
    try:
        import torch
    except ImportError:
        return [("torch", "not installed")]
    rows = [
        ("built with CUDA", str(torch.version.cuda)),
        ("threads (intra-op)", str(torch.get_num_threads())),
    ]
    if not torch.cuda.is_available():
        return [*rows, ("GPUs", "none visible to torch")]
    rows.append(("cuDNN", str(torch.backends.cudnn.version())))
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        memory = f"{props.total_memory / 1024**3:.1f} GiB"
        rows.append(
            (f"GPU {index}", f"{props.name}, {memory}, compute {props.major}.{props.minor}")
        )
    return rows


def _driver() -> str:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "no nvidia-smi"
    return (
        done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout else "unknown"
    )


def _environment(environ: dict[str, str]) -> list[tuple[str, str]]:
    names = sorted(n for n in environ if n.startswith(ENV_PREFIXES) or n in ENV_NAMES)
    return [(n, "(set, hidden)" if _SECRET.search(n) else environ[n]) for n in names]


def _section(title: str, rows: Callable[[], Iterable[tuple[str, str]]]) -> list[str]:
    try:
        lines = [f"{key}: {value}" for key, value in rows()]
    except Exception as exc:  # a report with a hole beats no report
        lines = [f"(could not be read: {type(exc).__name__}: {exc})"]
    return [f"== {title}", *(lines or ["(none)"]), ""]


def collect_env(environ: dict[str, str] | None = None) -> str:
    """The whole report as text."""
    environ = dict(os.environ if environ is None else environ)
    sections = [
        ("System", lambda: [
            ("OS", platform.platform()),
            ("Python", sys.version.replace("\n", " ")),
            ("executable", sys.executable),
        ]),
        ("Ember packages", lambda: [(n, _version(n)) for n in EMBER_PACKAGES]),
        ("Libraries", lambda: [(n, _version(n)) for n in PACKAGES]),
        ("CPU", _cpu),
        ("torch and GPUs", lambda: [*_torch(), ("NVIDIA driver", _driver())]),
        ("Environment variables", lambda: _environment(environ)),
    ]  # fmt: skip
    return "\n".join(line for title, rows in sections for line in _section(title, rows))


def main(_args=None) -> int:
    print(collect_env(), end="")
    return 0
