"""Local TCP ports and stores for rendezvous."""
from __future__ import annotations

import socket
from datetime import timedelta


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_store(world_size: int, timeout: timedelta = timedelta(minutes=30)):
    """A torch.distributed ``TCPStore`` served by the calling (launching) process on a
    127.0.0.1 port the OS picks, and the environment that makes every rank join it as a
    client, rank 0 included, as under torchrun's agent. The port is bound from the start
    and held as long as the store lives, so no other process can take it between the
    choice and the ranks' start (a port merely found free can be). Keep the store alive
    until the ranks have ended."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout,
                          wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    return store, env
