#!/usr/bin/python3
"""test_outsider.py - attacks a running tdist group the way a process on a shared machine could.

    test_outsider.py TARGET_WORKER

Starts a group of three target_worker processes on 127.0.0.1 with a job secret, then, speaking
HTTP/2 and gRPC by hand (python3-h2), tries as an outsider (no secret):
  - to call a function without the handshake, claiming rank 0;
  - to finish the handshake with a guessed secret;
  - to read the store (worker addresses, pids) and write it (the "abort" key, 512 x 1 MiB), also
    while the group is still starting;
  - to exhaust memory: thousands of idle streams on many connections, a gRPC message declaring
    3 GiB and never finished, a ping flood;
  - to keep members out by holding every handshake slot with idle streams, reopened faster than
    they time out (a member's new stream must still get in: a hand-made one, and rank 2's first
    calls to rank 1), or with HELLOs (refused at once: a stranger cannot make the HELLO's ticket);
  - the HTTP/2 rapid-reset pattern (CVE-2023-44487): streams opened and reset at once, on one
    connection (the connection is closed);
  - to keep memory: after an oversized message is reset, what gRPC buffered for it is given back;
and, as a malicious member (with the secret):
  - to claim another rank inside its frames;
  - to make one worker read a third worker's memory (a direct-copy descriptor naming its pid);
  - to reserve memory with a frame declaring a 2 GiB tensor and then stalling, and with two such
    frames on two streams (the second is refused: a bound per member across its streams).
Every attempt must be refused, every member must keep serving (rank 0 calls rank 1 every 50 ms
throughout: no failure, no call slower than a bound), resident memory must stay within bounds,
and the refusals must be counted. Exit status 0 on success; 77 (skip) without python3-h2.
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
import subprocess
import sys
import tempfile
import threading
import time

try:
    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions
except ImportError:
    print("SKIP: python3-h2 is not installed")
    sys.exit(77)

SCALE = float(os.environ.get("TD_TEST_TIMEOUT_SCALE", "1") or 1)
GRPC_OK, GRPC_UNAUTHENTICATED = 0, 16
FAILURES = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILURES.append(what)


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from free_port import free_port  # noqa: E402  (below the ephemeral range: free_port.py)


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


# ---- protobuf and tdist frames, by hand ----

def varint(v):
    out = bytearray()
    v &= (1 << 64) - 1
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def field_varint(n, v):
    return varint(n << 3) + varint(v)


def field_bytes(n, b):
    return varint((n << 3) | 2) + varint(len(b)) + b


def zigzag(v):
    return (v << 1) ^ (v >> 63)


def node_int(i):
    return field_varint(1, 2) + field_varint(3, zigzag(i))


def node_tensor_f32(shape):
    packed = b"".join(varint(s) for s in shape)
    return field_varint(1, 6) + field_varint(7, 0) + field_bytes(8, packed)


def request_frame(call_id, fn, from_rank, nodes, payload=b"", payload_len=None, magic=b"TDF1"):
    env = field_varint(1, 1) + field_bytes(2, fn.encode()) + field_varint(3, from_rank)
    env += field_varint(4, len(nodes))
    for n in nodes:
        env += field_bytes(5, n)
    plen = len(payload) if payload_len is None else payload_len
    prefix = magic + struct.pack("<IQQ", len(env), plen, call_id)
    return prefix + env + payload


def grpc_msg(payload):
    return b"\x00" + struct.pack(">I", len(payload)) + payload


# ---- the handshake (rpc/auth.h) ----

def key_of(secret):
    return hmac.new(secret.encode(), b"tdist/1 key", hashlib.sha256).digest()


def hello(client_rank, want_rank, nonce, key=None):
    """The HELLO; with key, its ticket too (RPC streams refuse a HELLO without one)."""
    h = b"TDH1" + bytes([1, 0, 1, 0]) + struct.pack("<ii", client_rank, want_rank) + nonce
    if key is None:
        return h
    return h + hmac.new(key, b"tdist/1 hello" + nonce + h[8:16], hashlib.sha256).digest()


def proof(key, nonce_c, nonce_s, client_rank, server_rank):
    ranks = struct.pack("<ii", client_rank, server_rank)
    mac = hmac.new(key, b"tdist/1 client" + nonce_c + nonce_s + ranks, hashlib.sha256).digest()
    return b"TDH3" + b"\x00" * 4 + mac


# ---- a minimal HTTP/2 gRPC client ----

class Conn:
    def __init__(self, addr, timeout=10.0):
        host, port = addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout * SCALE)
        cfg = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        self.h2 = h2.connection.H2Connection(config=cfg)
        self.h2.initiate_connection()
        self.flush()
        self.data = {}      # stream id -> bytearray
        self.trailers = {}  # stream id -> dict
        self.reset = set()
        self.closed = False
        self.goaway = False
        self.addr = addr

    def flush(self):
        out = self.h2.data_to_send()
        if out:
            self.sock.sendall(out)

    def open(self, path):
        sid = self.h2.get_next_available_stream_id()
        self.h2.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                   (":authority", self.addr), ("content-type", "application/grpc"),
                                   ("te", "trailers")])
        self.flush()
        return sid

    def send(self, sid, data, end=False):
        # respect flow control: wait for window when needed
        view = memoryview(data)
        while view:
            win = min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
            if win <= 0:
                self.pump(0.5)
                if self.closed or sid in self.reset or sid in self.trailers:
                    return False
                continue
            chunk = view[:win]
            self.h2.send_data(sid, bytes(chunk))
            view = view[len(chunk):]
            self.flush()
        if end:
            self.h2.end_stream(sid)
            self.flush()
        return True

    def pump(self, timeout):
        self.sock.settimeout(timeout)
        try:
            raw = self.sock.recv(1 << 20)
        except socket.timeout:
            return
        except OSError:
            self.closed = True
            return
        if not raw:
            self.closed = True
            return
        try:
            events = self.h2.receive_data(raw)
        except h2.exceptions.ProtocolError:
            self.closed = True
            return
        for ev in events:
            if isinstance(ev, h2.events.DataReceived):
                self.data.setdefault(ev.stream_id, bytearray()).extend(ev.data)
                self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.TrailersReceived):
                self.trailers[ev.stream_id] = dict(ev.headers)
            elif isinstance(ev, h2.events.ResponseReceived):
                hd = dict(ev.headers)
                if "grpc-status" in hd:  # trailers-only response
                    self.trailers[ev.stream_id] = hd
            elif isinstance(ev, h2.events.StreamReset):
                self.reset.add(ev.stream_id)
            elif isinstance(ev, h2.events.ConnectionTerminated):
                self.goaway = True
                self.closed = True
        try:
            self.flush()
        except OSError:
            self.closed = True

    def message(self, sid, timeout=10.0):
        """Waits for one whole gRPC message on sid; None when the stream ends first."""
        end = time.monotonic() + timeout * SCALE
        while time.monotonic() < end:
            buf = self.data.get(sid, bytearray())
            if len(buf) >= 5:
                n = struct.unpack(">I", buf[1:5])[0]
                if len(buf) >= 5 + n:
                    msg = bytes(buf[5:5 + n])
                    del buf[:5 + n]
                    return msg
            if sid in self.trailers or sid in self.reset or self.closed:
                return None
            self.pump(0.2)
        return None

    def status(self, sid, timeout=10.0):
        """Waits for the stream's end: (grpc-status or None, message, reset?)."""
        end = time.monotonic() + timeout * SCALE
        while time.monotonic() < end:
            if sid in self.trailers:
                t = self.trailers[sid]
                return int(t.get("grpc-status", "-1")), t.get("grpc-message", ""), False
            if sid in self.reset:
                return None, "reset", True
            if self.closed:
                return None, "connection closed", True
            self.pump(0.2)
        return None, "no answer", False

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def member_stream(addr, key, claim_rank, want_rank):
    """Opens a stream and completes the handshake as a member claiming claim_rank."""
    c = Conn(addr)
    sid = c.open("/tdist.Rpc/Stream")
    nc = secrets.token_bytes(32)
    c.send(sid, grpc_msg(hello(claim_rank, want_rank, nc, key)))
    ch = c.message(sid)
    assert ch is not None and len(ch) == 76 and ch[:4] == b"TDH2", f"no challenge: {ch!r}"
    c.send(sid, grpc_msg(proof(key, nc, ch[12:44], claim_rank, want_rank)))
    return c, sid


def reply_frames(c, sid, count, timeout=10.0):
    """Reads count tdist frames: [(kind, id, raw envelope)]."""
    buf = bytearray()
    frames = []
    end = time.monotonic() + timeout * SCALE
    while len(frames) < count and time.monotonic() < end:
        m = c.message(sid, timeout=1.0)
        if m is None:
            if sid in c.trailers or sid in c.reset or c.closed:
                break
            continue
        buf.extend(m)
        while len(buf) >= 24:
            hl, pl, fid = struct.unpack("<IQQ", buf[4:24])
            if len(buf) < 24 + hl + pl:
                break
            env = bytes(buf[24:24 + hl])
            frames.append((env[1] if len(env) > 1 else 0, fid, env))
            del buf[:24 + hl + pl]
    return frames


def envelope_int(env):
    """The value of the first int node of a response envelope (proto3 leaves out a zero)."""
    i = 0
    while i < len(env):
        tag, i = read_varint(env, i)
        fn, wt = tag >> 3, tag & 7
        if wt == 0:
            _, i = read_varint(env, i)
            continue
        if wt != 2:
            return None
        ln, i = read_varint(env, i)
        body = env[i:i + ln]
        i += ln
        if fn != 5:
            continue
        kind, value, j = 0, 0, 0
        while j < len(body):
            t2, j = read_varint(body, j)
            if t2 & 7 == 0:
                v, j = read_varint(body, j)
                if t2 >> 3 == 1:
                    kind = v
                elif t2 >> 3 == 3:
                    value = (v >> 1) ^ -(v & 1)
            elif t2 & 7 == 2:
                l2, j = read_varint(body, j)
                j += l2
            else:
                return None
        if kind == 2:
            return value
    return None


def read_varint(b, i):
    v = shift = 0
    while True:
        x = b[i]
        i += 1
        v |= (x & 0x7F) << shift
        shift += 7
        if not x & 0x80:
            return v, i


# ---- the group ----

class Group:
    def __init__(self, worker, world=3):
        self.dir = tempfile.mkdtemp(prefix="td_outsider_")
        self.secret = secrets.token_hex(32)
        self.port = free_port()
        self.world = world
        self.procs = {}
        self.worker = worker
        self.sanitizer = "none"

    def start(self, rank):
        env = dict(os.environ)
        for k in list(env):
            if k.startswith("TD_RPC_") or k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                del env[k]
        env.update(RANK=str(rank), WORLD_SIZE=str(self.world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(self.port), TD_RPC_SECRET=self.secret,
                   TD_RPC_STALL_TIMEOUT_MS=str(int(3000 * SCALE)), TD_RPC_MEMORY_QUOTA_MB="128",
                   TD_RPC_HANDSHAKE_TIMEOUT_MS=str(int(5000 * SCALE)),
                   TD_RPC_HELLO_TIMEOUT_MS=str(int(1000 * SCALE)))
        # AddressSanitizer builds (CI): its quarantine would hold every freed buffer of the
        # floods (256 MB by default) and hide what the limits keep
        asan = env.get("ASAN_OPTIONS", "")
        env["ASAN_OPTIONS"] = (asan + ":" if asan else "") + "quarantine_size_mb=4"
        log = open(os.path.join(self.dir, f"{rank}.log"), "w")
        self.procs[rank] = subprocess.Popen([self.worker, self.dir], env=env, stdout=log,
                                            stderr=subprocess.STDOUT)

    def wait_ready(self, timeout=60.0):
        end = time.monotonic() + timeout * SCALE
        self.addr, self.pid = {}, {}
        while time.monotonic() < end:
            for r in range(self.world):
                p = os.path.join(self.dir, f"{r}.addr")
                if r not in self.addr and os.path.exists(p):
                    a, pid, san = open(p).read().split()
                    self.addr[r], self.pid[r] = a, int(pid)
                    self.sanitizer = san
            if len(self.addr) == self.world:
                return True
            if any(p.poll() is not None for p in self.procs.values()):
                return False
            time.sleep(0.05)
        return False

    def stop(self, timeout=60.0):
        open(os.path.join(self.dir, "stop"), "w").close()
        end = time.monotonic() + timeout * SCALE
        codes = {}
        for r, p in self.procs.items():
            try:
                codes[r] = p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                codes[r] = p.wait()
        stats = {}
        for r in self.procs:
            try:
                stats[r] = json.load(open(os.path.join(self.dir, f"{r}.json")))
            except (OSError, ValueError):
                stats[r] = None
        return codes, stats

    def kill(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    def logs(self):
        for r in self.procs:
            try:
                print(f"--- worker {r} log ---\n" + open(os.path.join(self.dir, f"{r}.log")).read())
            except OSError:
                pass


def store_call(addr, payload):
    c = Conn(addr)
    sid = c.open("/tdist.Store/Op")
    c.send(sid, grpc_msg(payload), end=True)
    code, msg, _ = c.status(sid)
    c.close()
    return code, msg


def store_set_request(key, value):
    return field_varint(1, 1) + field_bytes(2, key.encode()) + field_bytes(3, value)


def outsider_store_attacks(addr0):
    # a plain store request (today's protocol without a session): refused
    code, msg = store_call(addr0, field_varint(1, 2) + field_bytes(2, b"direct/1"))
    check(code == GRPC_UNAUTHENTICATED, f"store read without a session refused ({code}: {msg})")
    # a session opened (anybody can), then an OP with a forged MAC writing "abort"
    c = Conn(addr0)
    sid = c.open("/tdist.Store/Op")
    c.send(sid, grpc_msg(b"TDS1\x01\x00\x00\x00" + secrets.token_bytes(32)), end=True)
    rep = c.message(sid)
    c.status(sid)
    c.close()
    check(rep is not None and len(rep) == 80, "a session can be opened (it is useless without the key)")
    sid_no = struct.unpack("<Q", rep[8:16])[0] if rep else 0
    body = store_set_request("abort", b"outsider says stop")
    op = b"TDS1\x02\x00\x00\x00" + struct.pack("<QQ", sid_no, 1) + b"\x00" * 32 + body
    code, msg = store_call(addr0, op)
    check(code == GRPC_UNAUTHENTICATED, f"store write with a forged MAC refused ({code}: {msg})")


def slot_attacks(g, a1):
    """Strangers keep rank 1's handshake slots full with idle streams, reopened faster than they
    time out, while rank 2 opens its first stream to rank 1 and calls it."""
    # an idle stream alone: closed when its HELLO is late (TD_RPC_HELLO_TIMEOUT_MS, 1 s here),
    # long before the handshake timeout (5 s here)
    c = Conn(a1)
    sid = c.open("/tdist.Rpc/Stream")
    t0 = time.monotonic()
    code, msg, _ = c.status(sid, timeout=10)
    took = time.monotonic() - t0
    check(code == 4 and "no HELLO" in msg and took < 4.5 * SCALE,
          f"a stream that sends no HELLO is closed after the HELLO timeout ({code}: {msg}; "
          f"{took:.1f} s)")
    c.close()
    stop, opened = [False], [0]

    def flood():
        held = []
        while not stop[0]:
            try:
                cc = Conn(a1)
                for _ in range(16):
                    cc.open("/tdist.Rpc/Stream")
                    opened[0] += 1
                held.append(cc)
            except (OSError, h2.exceptions.ProtocolError):
                pass
            for x in held:
                x.pump(0.001)
            while len(held) > 8:  # 128 idle streams: twice the 64 slots
                held.pop(0).close()
            time.sleep(0.02)
        for x in held:
            x.close()

    th = threading.Thread(target=flood)
    th.start()
    try:
        time.sleep(0.5 * SCALE)
        open(os.path.join(g.dir, "call21"), "w").close()
        path = os.path.join(g.dir, "2.call21")
        end = time.monotonic() + 60 * SCALE
        while not os.path.exists(path) and time.monotonic() < end:
            time.sleep(0.1)
    finally:
        stop[0] = True
        th.join()
    try:
        ok, bad, most = open(path).read().split()
    except (OSError, ValueError):
        ok, bad, most = 0, 10, "inf"
    check(int(ok) == 10 and int(bad) == 0,
          f"rank 2's first calls to rank 1 (a new stream) succeed while strangers reopen "
          f"{opened[0]} idle streams ({ok} ok, {bad} failed, slowest {most} ms)")


def rapid_reset(a1):
    """The HTTP/2 rapid-reset pattern (CVE-2023-44487): streams opened and reset at once on one
    connection. Rank 1 closes the connection after 64 of them."""
    c = Conn(a1)
    n = 0
    end = time.monotonic() + 20 * SCALE
    while not c.closed and n < 5000 and time.monotonic() < end:
        try:
            sid = c.open("/tdist.Rpc/Stream")
            c.h2.reset_stream(sid)
            c.flush()
            n += 1
        except (OSError, h2.exceptions.ProtocolError):
            break
        if n % 32 == 0:
            c.pump(0.01)
    end = time.monotonic() + 10 * SCALE
    while not c.closed and time.monotonic() < end:
        c.pump(0.2)
    check(c.closed and n < 5000,
          f"a connection opening and resetting streams is closed ({n} streams before it was)")
    c.close()


def member_bound(a1, key, pid1, mem):
    """A member (it has the secret) opens two streams as rank 2 and declares a 2 GiB tensor on
    each: the second frame is refused at its first byte (per member, not per stream)."""
    base = rss_kb(pid1)
    ca, sa = member_stream(a1, key, 2, 1)
    big = request_frame(20, "echo", 2, [node_tensor_f32([1 << 29])], payload=b"\x00" * 4096,
                        payload_len=2 << 30)
    ca.send(sa, grpc_msg(big))
    time.sleep(0.3 * SCALE)
    cb, sb = member_stream(a1, key, 2, 1)
    big2 = request_frame(21, "echo", 2, [node_tensor_f32([1 << 29])], payload=b"\x00" * 4096,
                         payload_len=2 << 30)
    cb.send(sb, grpc_msg(big2))
    frames = reply_frames(cb, sb, 1, timeout=10)
    refused = [env for _, fid, env in frames if fid == 21]
    check(any(b"per member" in e for e in refused),
          f"a second 2 GiB frame of the same member on another stream is refused "
          f"({[e[-120:] for e in refused]})")
    grew = (rss_kb(pid1) - base) / 1024
    check(grew < 64 * mem, f"... and rank 1 grew {grew:.0f} MB (bound {64 * mem})")
    ca.close()
    cb.close()


def main():
    worker = sys.argv[1]
    g = Group(worker)
    t_start = time.monotonic()
    try:
        # ---- while the group starts: rank 0 alone, an outsider at its store ----
        g.start(0)
        end = time.monotonic() + 30 * SCALE
        addr0 = f"127.0.0.1:{g.port}"
        while time.monotonic() < end:
            try:
                socket.create_connection(("127.0.0.1", g.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        outsider_store_attacks(addr0)
        rss0 = rss_kb(g.procs[0].pid)
        refused = 0
        for i in range(512):
            code, _ = store_call(addr0, store_set_request(f"junk/{i}", b"x" * (1 << 20)))
            refused += code == GRPC_UNAUTHENTICATED
        check(refused == 512, f"512 unauthenticated 1 MiB store writes refused ({refused})")
        grew = (rss_kb(g.procs[0].pid) - rss0) / 1024
        check(grew < 64, f"rank 0 grew {grew:.0f} MB under the store flood (bound 64)")
        for r in range(1, g.world):
            g.start(r)
        check(g.wait_ready(), "the group started despite the outsider (no abort)")
        if len(g.addr) != g.world:
            return
        a0, a1, a2 = g.addr[0], g.addr[1], g.addr[2]
        # ThreadSanitizer keeps shadow memory for every byte touched: bounds scale with it
        mem = 3 if g.sanitizer == "thread" else 1

        # ---- an outsider's calls ----
        c = Conn(a1)
        sid = c.open("/tdist.Rpc/Stream")
        c.send(sid, grpc_msg(request_frame(1, "secret_fn", 0, [node_int(7)])))
        code, msg, _ = c.status(sid)
        check(code == GRPC_UNAUTHENTICATED, f"a call without the handshake is refused ({code}: {msg})")
        c.close()
        wrong = key_of("not-the-secret-" + secrets.token_hex(8))
        c = Conn(a1)
        sid = c.open("/tdist.Rpc/Stream")
        c.send(sid, grpc_msg(hello(0, 1, secrets.token_bytes(32), wrong)))
        c.send(sid, grpc_msg(request_frame(2, "secret_fn", 0, [node_int(7)])))
        code, msg, _ = c.status(sid)
        check(code == GRPC_UNAUTHENTICATED and c.data.get(sid, b"") == b"",
              f"a guessed secret is refused at the HELLO, with no CHALLENGE ({code}: {msg})")
        c.close()
        c = Conn(a1)
        sid = c.open("/tdist.Rpc/Stream")
        c.send(sid, grpc_msg(hello(0, 1, secrets.token_bytes(32))))
        code, msg, _ = c.status(sid)
        check(code == GRPC_UNAUTHENTICATED and c.data.get(sid, b"") == b"",
              f"a HELLO without its ticket is refused, with no CHALLENGE ({code}: {msg})")
        c.close()

        # ---- memory: idle streams, a 3 GiB message, pings ----
        pid1 = g.pid[1]
        base = rss_kb(pid1)
        conns, opened, ended = [], 0, 0
        for _ in range(20):
            cc = Conn(a1)
            for _ in range(100):
                try:
                    cc.open("/tdist.Rpc/Stream")
                    opened += 1
                except h2.exceptions.ProtocolError:
                    break  # the server's SETTINGS cap the streams per connection
            cc.pump(0.2)
            conns.append(cc)
        time.sleep(1.0 * SCALE)
        for cc in conns:
            cc.pump(0.2)
            ended += len(cc.reset) + len(cc.trailers)
        grew = (rss_kb(pid1) - base) / 1024
        check(grew < 100 * mem, f"{opened} idle streams on 20 connections: rank 1 grew {grew:.0f} MB (bound {100 * mem})")
        check(ended > 0, f"streams beyond the limits were refused ({ended} ended by the server)")
        # a member's new stream gets its handshake slot while strangers hold half-open ones (it
        # takes the oldest's slot; before, it was refused while the slots were full)
        try:
            mc, _ = member_stream(a1, key_of(g.secret), 0, 1)
            mc.close()
            joined = True
        except AssertionError as e:
            print(f"member stream: {e}", flush=True)
            joined = False
        check(joined, f"a member's new stream completes its handshake beside {opened} strangers' streams")
        for cc in conns:
            cc.close()
        slot_attacks(g, a1)
        rapid_reset(a1)

        c = Conn(a1)
        sid = c.open("/tdist.Rpc/Stream")
        head = b"\x00" + struct.pack(">I", 3 << 30)
        c.send(sid, head)
        sent = 0
        chunk = b"\x00" * (1 << 20)
        while sent < (512 << 20) and c.send(sid, chunk):
            sent += len(chunk)
        code, msg, reset = c.status(sid, timeout=15)
        grew = (rss_kb(pid1) - base) / 1024
        check((code is not None or reset) and sent < (512 << 20),
              f"a message declaring 3 GiB is stopped at the memory quota (128 MiB here) "
              f"({code}, {msg}; {sent >> 20} MiB sent)")
        check(grew < 200 * mem, f"... and rank 1 grew {grew:.0f} MB (bound {200 * mem})")
        c.close()
        # what gRPC buffered for it is given back to the system (rank 1 trims its heap after a
        # stream that never authenticated, at most every 5 s). Sanitizer builds allocate through
        # the sanitizer's allocator, which glibc's malloc_trim does not reach: checked without.
        if g.sanitizer == "none":
            end = time.monotonic() + 8 * SCALE
            while time.monotonic() < end and (rss_kb(pid1) - base) / 1024 >= 48:
                time.sleep(0.25)
            kept = (rss_kb(pid1) - base) / 1024
            check(kept < 48, f"... and after the reset rank 1 keeps {kept:.0f} MB of it "
                  f"(bound 48)")
        else:
            print(f"skip the heap given back after the reset ({g.sanitizer} sanitizer's "
                  f"allocator)", flush=True)

        c = Conn(a1)
        for i in range(2000):
            try:
                c.h2.ping(struct.pack(">Q", i))
                c.flush()
            except (OSError, h2.exceptions.ProtocolError):
                break
            if i % 100 == 0:
                c.pump(0.01)
        end = time.monotonic() + 10 * SCALE
        while not c.closed and time.monotonic() < end:
            c.pump(0.2)
        check(c.goaway or c.closed, "a ping flood gets the connection closed")
        c.close()

        # ---- a malicious member (it has the secret) ----
        key = key_of(g.secret)
        c, sid = member_stream(a1, key, 0, 1)
        c.send(sid, grpc_msg(request_frame(10, "whoami", 2, [])))
        fr = reply_frames(c, sid, 1)
        who = envelope_int(fr[0][2]) if fr else None
        check(who == 0, f"a frame claiming rank 2 on rank 0's stream is served as rank 0 ({who})")
        c.close()
        # a direct-copy descriptor naming rank 0's pid, sent as rank 2 to rank 1
        c, sid = member_stream(a1, key, 2, 1)
        desc = struct.pack("<QII", 77, g.pid[0], 0) + struct.pack("<QQ", 0x10000, 16384)
        fr_bytes = request_frame(11, "echo", 2, [node_tensor_f32([4096])], payload=desc,
                                 magic=b"TDF2")
        c.send(sid, grpc_msg(fr_bytes))
        frames = reply_frames(c, sid, 2)
        kinds = sorted(k for k, _, _ in frames)
        errors = [env for k, fid, env in frames if fid == 11]
        check(any(b"not allowed" in e for e in errors),
              f"a descriptor naming a third worker's pid is refused ({len(frames)} frames back)")
        check(not any(k == 2 and fid == 11 for k, fid, _ in frames),
              "... and no bytes of that worker came back")
        c.close()
        # a frame declaring a 2 GiB tensor (within the message limit), 4 KiB of it, then silence:
        # memory is taken only as bytes arrive, the frame is dropped after the stall timeout
        base = rss_kb(pid1)
        c, sid = member_stream(a1, key, 2, 1)
        big = request_frame(12, "echo", 2, [node_tensor_f32([1 << 29])], payload=b"\x00" * 4096,
                            payload_len=2 << 30)
        c.send(sid, grpc_msg(big))
        time.sleep(1.0 * SCALE)
        grew = (rss_kb(pid1) - base) / 1024
        check(grew < 64 * mem, f"a frame declaring 2 GiB: rank 1 grew {grew:.0f} MB (bound {64 * mem})")
        code, msg, reset = c.status(sid, timeout=15)
        check(code is not None and code != GRPC_OK,
              f"... and the stalled frame's stream is closed ({code}: {msg})")
        c.close()
        member_bound(a1, key, pid1, mem)
    finally:
        codes, stats = g.stop() if g.procs else ({}, {})
        g.kill()
    print("worker stats:", json.dumps(stats), flush=True)
    for r in range(g.world):
        check(codes.get(r) == 0, f"worker {r} shut down gracefully (exit {codes.get(r)})")
        s = stats.get(r)
        check(s is not None and s["secret_fn_calls"] == 0, f"worker {r}: secret_fn never ran")
    s0 = stats.get(0) or {}
    bound = 2000 * SCALE
    # Known limitation (docs/SECURITY.md): gRPC's memory quota is one per process, so while an
    # outsider's oversized message fills it, gRPC may also reset a member's stream (RST_STREAM
    # ENHANCE_YOUR_CALM, code 11): the call fails with that error and the next one reconnects.
    # One such failure is reported and tolerated; any other failure, or more than one, fails.
    try:
        log0 = open(os.path.join(g.dir, "0.log")).read()
    except OSError:
        log0 = ""
    failed = [l for l in log0.splitlines() if l.startswith("target_worker: echo failed:")]
    quota = [l for l in failed if "RST_STREAM with error code 11" in l]
    if quota:
        print(f"known limitation: {len(quota)} call(s) of rank 0 reset under the outsider's "
              "quota pressure", flush=True)
    check(s0.get("echo_calls", 0) > 20 and s0.get("echo_failures", 1) == len(failed) and
          len(failed) == len(quota) and len(quota) <= 1,
          f"rank 0 kept calling rank 1 throughout ({s0.get('echo_calls')} calls, "
          f"{s0.get('echo_failures')} failed, {len(quota)} of them by the quota's stream reset)")
    check(s0.get("echo_max_ms", 1e9) < bound,
          f"slowest call during the attacks {s0.get('echo_max_ms')} ms (bound {bound:.0f})")
    s1 = stats.get(1) or {}
    check(s1.get("refused", 0) > 0, f"rank 1 counted its refusals ({s1.get('refused')})")
    check((stats.get(0) or {}).get("refused", 0) > 0, "rank 0 counted its refusals")
    print(f"elapsed {time.monotonic() - t_start:.1f} s")
    if FAILURES:
        g.logs()
        print(f"{len(FAILURES)} checks failed")
        shutil.rmtree(g.dir, ignore_errors=True)
        sys.exit(1)
    shutil.rmtree(g.dir, ignore_errors=True)
    print("PASS")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))
    main()
