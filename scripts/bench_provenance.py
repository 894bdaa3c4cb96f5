"""Where a benchmark script's numbers come from: the command, the commit, the host and the versions."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def host_provenance() -> dict:
    """Command, commit (and whether the work tree differs from it), UTC date, host, CPU model and count,
    torch and transformers versions, and the visible GPUs."""
    import torch
    import transformers

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {"command": " ".join([sys.executable, *sys.argv]), "commit": git("rev-parse", "HEAD") or None,
            "worktree_dirty": bool(git("status", "--porcelain")),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__, "gpus": gpus}
