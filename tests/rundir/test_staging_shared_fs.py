"""Issue 31, item 6 (threat model: a shared cluster file system). A folder built aside
(`rundir.staging`) removes the siblings earlier tries left behind, by asking whether the process
that made each one is still alive. A process id means something only on its own host: before, a
sibling made by a job still running on another node, whose process id happened to be free here,
was deleted under it. Now a sibling names its host, and only this host's dead tries are removed."""
from __future__ import annotations

import socket

from lhd_train.rundir.staging import STAGING, staged_dir

DEAD_PID = 2**22 + 12345  # above Linux's pid_max: never a live process here


def test_only_this_hosts_dead_tries_are_removed(tmp_path):
    target = tmp_path / "out"
    here = socket.gethostname()
    mine = tmp_path / f".out{STAGING}{here}-{DEAD_PID}-0123abcd"
    other = tmp_path / f".out{STAGING}gpu-node-17-{DEAD_PID}-4567cdef"  # a job on another node, maybe alive
    for d in (mine, other):
        d.mkdir()
        (d / "part").write_text("half a folder")
    with staged_dir(target) as stage:
        assert f"{STAGING}{here}-" in stage.name  # a try names its host
        (stage / "done").write_text("x")
    assert (target / "done").read_text() == "x"
    assert not mine.exists()
    assert (other / "part").read_text() == "half a folder"
