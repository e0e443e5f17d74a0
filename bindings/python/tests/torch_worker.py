"""torch_worker.py - a worker of the tdist.torch_rpc tests: joins the group through the
PyTorch-shaped API (init_rpc with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the
environment, as "w<rank>"), serves until every worker called shutdown, exits 0 (1 on failure)."""
import os
import sys

import torch  # noqa: F401

import tdist.torch_rpc as rpc
import torch_fns  # noqa: F401  (the functions the tests call here)


def main():
    rpc.init_rpc("w" + os.environ["RANK"])
    rpc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
