"""_timeouts.py - the one place where Python timeouts become tdist's.

Python side (torch.distributed.rpc's convention): seconds as a float; UNSET (the default of every
call) means the agent's default timeout; 0 means no timeout (wait forever); None is accepted as
UNSET. C side (tdist/timeout.h): milliseconds as int64 with TD_TIMEOUT_DEFAULT (the agent's
default), TD_TIMEOUT_INFINITE (no limit) and TD_TIMEOUT_ZERO (expire at once, which Python never
asks for: 0 seconds means "no timeout" as in torch). Every call of the binding converts through
call_ms(); blocking waits slice their time with slices().
"""
import math
import time

from ._lib import lib

UNSET = object()  # torch.distributed.rpc's UNSET_RPC_TIMEOUT
AGENT_DEFAULT_MS = lib.TD_TIMEOUT_DEFAULT
NO_TIMEOUT_MS = lib.TD_TIMEOUT_INFINITE
# shutdown(timeout=None) waits this long, whatever the per-call default is (a short rpc timeout
# must not cut a graceful shutdown short while a long call finishes).
SHUTDOWN_DEFAULT_MS = 60000
# Blocking waits return to Python this often, so Ctrl-C (KeyboardInterrupt) is seen promptly.
SLICE_MS = 50


def call_ms(timeout):
    """A call's timeout (seconds, UNSET, None or 0) as tdist's milliseconds."""
    if timeout is UNSET or timeout is None:
        return AGENT_DEFAULT_MS
    t = float(timeout)
    if t < 0 or math.isnan(t):
        raise ValueError("timeout must be >= 0 seconds (0: none), got %r" % (timeout,))
    if t == 0 or math.isinf(t):
        return NO_TIMEOUT_MS
    return max(1, int(round(t * 1000)))


def seconds(ms):
    """tdist's milliseconds (TD_TIMEOUT_INFINITE: none) as seconds (0.0: none)."""
    return 0.0 if ms == NO_TIMEOUT_MS else ms / 1000.0


def slices(timeout):
    """Yields successive wait times in ms for a blocking wait of `timeout` seconds (None: no
    limit), each at most SLICE_MS; stops when the time is up."""
    if timeout is None:
        while True:
            yield SLICE_MS
    end = time.monotonic() + max(0.0, float(timeout))
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return
        yield max(1, min(SLICE_MS, int(left * 1000)))
