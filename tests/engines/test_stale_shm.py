"""Shared memory left by killed engine processes is removed at the next start; files that a
live process maps or holds, and fresh ones, stay."""
import os
import subprocess
import sys
import time

from mcore_rl.engines.stale_shm import remove_stale_shared_memory, stale_shared_memory


def _make(directory, name, age_s):
    path = directory / name
    path.write_bytes(b"x" * 4096)
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def test_only_old_files_that_no_process_holds_are_removed(tmp_path):
    stale = _make(tmp_path, "psm_deadbeef", 3600)
    stale_sem = _make(tmp_path, "sem.mp-abc123", 3600)
    fresh = _make(tmp_path, "psm_fresh", 0)
    held = _make(tmp_path, "psm_held", 3600)
    other = _make(tmp_path, "not_ours_to_touch", 3600)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); "
                               "print('ready', flush=True); time.sleep(60)", str(held)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert sorted(p.name for p in stale_shared_memory(str(tmp_path))) == \
            ["psm_deadbeef", "sem.mp-abc123"]
        assert remove_stale_shared_memory(str(tmp_path)) == (2, 8192)
    finally:
        holder.kill()
        holder.wait()
    assert not stale.exists() and not stale_sem.exists()
    assert fresh.exists() and held.exists() and other.exists()
