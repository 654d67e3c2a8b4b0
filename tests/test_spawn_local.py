"""parallel/mesh.spawn_local: a worker killed by a signal (a native crash, no Python exception) is run once more, and
only once; a Python exception is never retried. The crash is os.abort() in rank 1, SIGABRT as torch's
"free(): invalid pointer" gave in a 2026-12 suite run."""
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from specco.parallel.mesh import spawn_local

pytestmark = pytest.mark.dist


def _abort_first_time(rank, world, marker):
    if rank == 1 and not os.path.exists(marker):
        Path(marker).write_text("crashed once")
        os.abort()
    Path(f"{marker}.done{rank}").write_text("ok")


def _abort_always(rank, world):
    if rank == 1:
        os.abort()


def _raise(rank, world, marker):
    with open(marker, "a") as f:
        f.write(f"{rank}\n")
    raise ValueError("a worker's own error")


def test_a_native_crash_runs_once_more(tmp_path, capfd):
    marker = str(tmp_path / "m")
    spawn_local(_abort_first_time, 2, marker)
    assert os.path.exists(f"{marker}.done0") and os.path.exists(f"{marker}.done1")
    assert "running _abort_first_time once more" in capfd.readouterr().err


def test_a_repeated_crash_fails():
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        spawn_local(_abort_always, 2)


def test_a_python_exception_is_not_retried(tmp_path):
    marker = tmp_path / "calls"
    with pytest.raises(Exception, match="a worker's own error"):
        spawn_local(_raise, 2, str(marker))
    assert len(marker.read_text().split()) <= 2  # one attempt (the other rank may be stopped before it writes)
