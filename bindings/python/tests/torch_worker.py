"""torch_worker.py - a worker of the tdist.torch_rpc tests: joins the group through the
PyTorch-shaped API (init_rpc with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the
environment, as "w<rank>"), serves until every worker called shutdown, exits 0 (1 on failure).
With TORCH_WORKER_SHUTDOWN_AFTER=PATH it calls shutdown only once PATH exists, and writes
PATH.entered just before (a test controls when the main thread enters shutdown)."""
import os
import sys
import time

import torch  # noqa: F401

import tdist.torch_rpc as rpc
import torch_fns  # noqa: F401  (the functions the tests call here)


def main():
    rpc.init_rpc("w" + os.environ["RANK"])
    gate = os.environ.get("TORCH_WORKER_SHUTDOWN_AFTER")
    if gate:
        end = time.monotonic() + 120
        while not os.path.exists(gate) and time.monotonic() < end:
            time.sleep(0.01)
        with open(gate + ".entered", "w") as f:
            f.write("1")
    rpc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
