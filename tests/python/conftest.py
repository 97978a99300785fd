import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _binary() -> str:
    env = os.environ.get("TRAINMEM_BIN")
    if env:
        return env
    for cand in (ROOT / "build" / "trainmem", shutil.which("trainmem")):
        if cand and Path(cand).exists():
            return str(cand)
    pytest.skip("trainmem binary not built (make build)")


@pytest.fixture(scope="session")
def trainmem_bin() -> str:
    return _binary()


@pytest.fixture
def run(trainmem_bin):
    def _run(*args, timeout=60):
        return subprocess.run([trainmem_bin, *map(str, args)], capture_output=True, text=True,
                              timeout=timeout)
    return _run
