#!/usr/bin/python3
"""test_outsider_ring.py - attacks the TCP ring of a CPU process group while it forms.

    test_outsider_ring.py TARGET_WORKER

Three target_worker processes (with a job secret) form a process group whose collectives run
over the TCP ring (TD_COLL_ALGO=ring). Rank 1 joins late, so rank 2's ring listener waits for its
left neighbour while this test, as a process of the same user (it finds the port the way any
local process can: /proc/net/tcp and the worker's socket inodes), connects first and tries:
  - to hold the listener: a connection that never speaks;
  - the ring's old clear-text hello (magic, group rank, group id);
  - a handshake without the secret (a HELLO, then a PROOF with a guessed key);
  - a handshake captured from an RPC stream (the job's key, not the group's);
  - as a malicious member with the secret: the group's own key, claiming a rank that is not the
    left neighbour;
  - to inject tensor data: a HELLO followed by 64 KiB of floats.
Every attempt must be closed by the member and counted in its refused connections; then rank 1
joins, the group forms, and every all_reduce over the ring is exact. Exit 0 on success, 77
(skip) without python3-h2 (the shared helpers import it).
"""
import hashlib
import hmac
import json
import os
import secrets
import shutil
import signal
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_outsider as t  # noqa: E402  (Group, check, the handshake helpers)


def listen_ports(pid):
    """The TCP ports process pid listens on (same user: its fds are readable)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                ports.add(int(f[1].split(":")[1], 16))
    return ports


def ring_key(secret, group_id, ranks, generation=0):
    """The group's handshake key: td__auth_derive(K, "ring", id | size | folded ranks |
    encrypted | generation), encrypted 0 here (no TLS), generation 0 (a group never re-formed)."""
    h = 1469598103934665603
    for r in ranks:
        h = ((h ^ (r & 0xFFFFFFFF)) * 1099511628211) & ((1 << 64) - 1)
    ctx = struct.pack("<QiQBQ", group_id, len(ranks), h, 0, generation)
    return hmac.new(t.key_of(secret), b"tdist/1 derive " + b"ring\x00" + ctx,
                    hashlib.sha256).digest()


def closed_by_peer(s, timeout):
    """True when the member closes s (reads until end of stream) within timeout seconds."""
    s.settimeout(0.2)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if s.recv(4096) == b"":
                return True
        except socket.timeout:
            continue
        except OSError:
            return True
    return False


def read_n(s, n, timeout=5.0):
    s.settimeout(timeout)
    b = b""
    try:
        while len(b) < n:
            k = s.recv(n - len(b))
            if not k:
                break
            b += k
    except OSError:
        pass
    return b


def handshake_attempt(port, key, claim, want, nonce=None):
    """HELLO, read the CHALLENGE, answer with a PROOF under key; returns (challenge, socket)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    nonce_c = nonce or secrets.token_bytes(32)
    s.sendall(t.hello(claim, want, nonce_c))
    ch = read_n(s, 76)
    if len(ch) == 76:
        nonce_s = ch[12:44]
        s.sendall(t.proof(key, nonce_c, nonce_s, claim, want))
    return ch, s


def main():
    worker = sys.argv[1]
    os.environ["TD_TARGET_RING"] = "1"
    os.environ["TD_COLL_ALGO"] = "ring"
    g = t.Group(worker)
    t_start = time.monotonic()
    attacks = 0
    try:
        for r in range(g.world):
            g.start(r)
        t.check(g.wait_ready(), "the group started")
        before = listen_ports(g.pid[2])
        open(os.path.join(g.dir, "pg_go"), "w").close()
        end = time.monotonic() + 30 * t.SCALE
        ring = set()
        while time.monotonic() < end and not ring:
            ring = listen_ports(g.pid[2]) - before
            time.sleep(0.02)
        t.check(len(ring) == 1, f"rank 2's ring listener found ({sorted(ring)})")
        port = min(ring) if ring else 0
        # 1. a connection that never speaks, held open during the others
        idle = socket.create_connection(("127.0.0.1", port), timeout=5)
        attacks += 1
        # 2. the old clear-text hello: magic "TDPG", group rank 1, group id 1
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(struct.pack("<IiQ", 0x54445047, 1, 1))
        t.check(closed_by_peer(s, 10 * t.SCALE), "the old clear-text hello is refused")
        s.close()
        attacks += 1
        # 3. no secret: HELLO claiming rank 1, then a PROOF under a guessed key
        ch, s = handshake_attempt(port, secrets.token_bytes(32), 1, 2)
        t.check(len(ch) == 76, "a stranger gets a CHALLENGE (it proves nothing without the key)")
        t.check(closed_by_peer(s, 10 * t.SCALE), "a PROOF under a guessed key is refused")
        s.close()
        attacks += 1
        # 4. a handshake under the job's key (what an RPC stream uses), not the group's
        ch, s = handshake_attempt(port, t.key_of(g.secret), 1, 2)
        t.check(closed_by_peer(s, 10 * t.SCALE),
                "a handshake under the job key (a captured RPC handshake) is refused")
        s.close()
        attacks += 1
        # 5. a member with the secret and the group's key, at the wrong place: claims rank 0
        ch, s = handshake_attempt(port, ring_key(g.secret, 1, [0, 1, 2]), 0, 2)
        t.check(len(ch) == 76 and closed_by_peer(s, 10 * t.SCALE),
                "a member that is not the left neighbour is refused")
        s.close()
        attacks += 1
        # 6. tensor data where the handshake should be
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(t.hello(1, 2, secrets.token_bytes(32)))
        read_n(s, 76)
        try:
            s.sendall(struct.pack("<16384f", *([1e30] * 16384)))
        except OSError:
            pass
        t.check(closed_by_peer(s, 10 * t.SCALE), "data injected in place of the PROOF is refused")
        s.close()
        attacks += 1
        t.check(closed_by_peer(idle, 15 * t.SCALE), "the silent connection is dropped in time")
        idle.close()
        # now the real left neighbour joins: the group forms, the ring carries exact sums
        open(os.path.join(g.dir, "pg_go1"), "w").close()
        end = time.monotonic() + 60 * t.SCALE
        while time.monotonic() < end and not all(
                os.path.exists(os.path.join(g.dir, f"{r}.pg")) for r in range(g.world)):
            time.sleep(0.05)
        t.check(all(os.path.exists(os.path.join(g.dir, f"{r}.pg")) for r in range(g.world)),
                "the group formed after the attacks")
        time.sleep(1.0)
    finally:
        codes, stats = g.stop() if g.procs else ({}, {})
        g.kill()
    print("worker stats:", json.dumps(stats), flush=True)
    for r in range(g.world):
        s = stats.get(r) or {}
        t.check(codes.get(r) == 0, f"worker {r} shut down gracefully (exit {codes.get(r)})")
        t.check(s.get("pg_ok") is True,
                f"worker {r}: every all_reduce over the ring exact ({s.get('pg_ops')} of 10)")
    s2 = stats.get(2) or {}
    t.check(s2.get("refused", 0) >= attacks,
            f"rank 2 counted its refusals ({s2.get('refused')} for {attacks} attempts)")
    try:
        log2 = open(os.path.join(g.dir, "2.log")).read()
    except OSError:
        log2 = ""
    t.check("is not the left neighbour" in log2,
            "the member with the group's key was refused for its place (not its key)")
    print(f"elapsed {time.monotonic() - t_start:.1f} s")
    if t.FAILURES:
        g.logs()
        print(f"{len(t.FAILURES)} checks failed")
        shutil.rmtree(g.dir, ignore_errors=True)
        sys.exit(1)
    shutil.rmtree(g.dir, ignore_errors=True)
    print("PASS")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))
    main()
