#!/usr/bin/env python3
"""free_port.py - prints a TCP port on 127.0.0.1 that was free a moment ago, chosen at random below
the kernel's ephemeral port range, as td_mp_free_port (tests/common/mp_util.c) does: a port from
that range (what binding port 0 gives) can be taken before the worker binds it by any port-0 bind
or outgoing connection of the tests running beside. Importable: free_port()."""
import random
import socket


def _probe(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
        return s.getsockname()[1]
    except OSError:
        return -1
    finally:
        s.close()


def free_port():
    lo = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    first = 10000
    if lo - first >= 1000:
        rng = random.SystemRandom()
        for _ in range(100):
            port = rng.randrange(first, lo)
            if _probe(port) == port:
                return port
    return _probe(0)


if __name__ == "__main__":
    print(free_port())
