"""A Ray node of a SLURM job: its own temp dir and ports, and a stop that ends exactly its
processes (those naming its temp dir and all their descendants), not every Ray on the host."""
import subprocess
import sys
import time

import pytest

from mcore_rl.launch import ray_node

SLEEPER = "import time; time.sleep(300)"
PARENT = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
          f"{SLEEPER!r}]); time.sleep(300)")


@pytest.fixture
def ray_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv(ray_node.TMP_BASE_ENV, str(tmp_path))
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    return tmp_path


def _children(pid: int) -> list[int]:
    return [p for p, (ppid, _) in ray_node._processes().items() if ppid == pid]


def test_stop_ends_the_processes_naming_the_nodes_temp_dir_and_their_children_only(ray_tmp):
    mine = ray_node.temp_dir("7")
    assert mine == ray_tmp / "mcore-rl-ray-7-n1"
    mine.mkdir()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, f"--temp-dir={mine}"])
    # Another node of the same job on this host, and a node whose name extends this one's.
    others = [subprocess.Popen([sys.executable, "-c", SLEEPER, f"--temp-dir={d}"])
              for d in (ray_node.temp_dir("7", "n2"), ray_node.temp_dir("7", "n10"))]
    try:
        deadline = time.monotonic() + 20
        while not _children(parent.pid):
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        [child] = _children(parent.pid)
        assert ray_node.node_processes(mine) == {parent.pid, child}
        assert ray_node.stop("7") == 2
        assert parent.wait(timeout=10) != 0 and not ray_node._alive(child)
        assert not mine.exists()
        assert all(p.poll() is None for p in others)
        assert ray_node.stop("7") == 0  # nothing left: a second stop finds nothing
    finally:
        for p in [parent, *others]:
            p.kill()
            p.wait()


def test_each_node_gets_its_temp_dir_and_free_ports_of_its_own(ray_tmp, monkeypatch):
    # The node name is made up: resolving it is the cluster's business (SLURM's hosts).
    monkeypatch.setattr(ray_node, "node_ip", lambda: "127.0.0.1")
    head = ray_node.start_args("7", True, 6400, None, 4, None)
    worker = ray_node.start_args("7", False, None, "10.0.0.1:6400", 4, 1)
    assert f"--temp-dir={ray_tmp}/mcore-rl-ray-7-n1" in head and "--head" in head
    assert "--port=6400" in head and "--num-cpus=4" in head and "--block" in head
    assert "--address=10.0.0.1:6400" in worker and "--num-gpus=1" in worker
    ports = [a.split("=", 1) for a in head if a.endswith(tuple("0123456789"))
             and "port" in a.split("=")[0]]
    picked = [int(v) for k, v in ports if k not in ("--port", "--max-worker-port")]
    assert len(picked) == len(set(picked)) >= 7  # every port explicit, none the same


class _LowestFreePortOS:
    """Sockets of an OS that hands ``bind(("", 0))`` the lowest port not bound right now:
    any two ports asked for one after the other, each socket closed in between, are equal."""

    def __init__(self, first: int):
        self.first, self.bound = first, set()

    def socket(self):
        os_ = self

        class Socket:
            port = None

            def bind(self, addr):
                port = addr[1] or min(set(range(os_.first, os_.first + 10_000)) - os_.bound)
                if port in os_.bound:
                    raise OSError("address in use")
                self.port = port
                os_.bound.add(port)

            def getsockname(self):
                return ("0.0.0.0", self.port)

            def close(self):
                os_.bound.discard(self.port)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.close()

        return Socket()


def test_a_nodes_ports_differ_even_when_the_os_hands_out_the_lowest_free_one(ray_tmp, monkeypatch):
    import socket
    import types

    fake = _LowestFreePortOS(first=20_000)  # the node's worker ports start there: kept out
    monkeypatch.setattr(ray_node, "socket", types.SimpleNamespace(
        socket=fake.socket, gethostname=socket.gethostname, gethostbyname=socket.gethostbyname))
    monkeypatch.setattr(ray_node, "free_port_window", lambda: 20_000)
    monkeypatch.setattr(ray_node, "node_ip", lambda: "127.0.0.1")
    for head in (True, False):
        args = ray_node.start_args("7", head, 6400 if head else None,
                                   None if head else "10.0.0.1:6400", 4, None)
        values = dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)
        low, high = int(values["--min-worker-port"]), int(values["--max-worker-port"])
        picked = [int(v) for k, v in values.items() if k.endswith("-port")
                  and k not in ("--port", "--min-worker-port", "--max-worker-port")]
        assert len(picked) == len(set(picked)) == (7 if head else 6)
        assert (low, high) == (20_000, 20_000 + ray_node.WORKER_PORTS - 1)
        assert not any(low <= p <= high for p in picked)
        assert not fake.bound  # every socket let go of once the ports are picked
