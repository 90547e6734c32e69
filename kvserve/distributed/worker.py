"""Entry point of a tensor parallel worker rank: `python -m kvserve.distributed.worker RANK SIZE PORT
ERROR_FILE`, the engine config pickled on stdin. Rank 0 starts the ranks of its own node; on the other
nodes of a multi-host launch `kvserve tp-node` starts them (launch.py). A rank connects to rank 0's store
at the config's master_addr:PORT and listens for its peers on this host's address (group.py)."""

import os
import sys

from kvserve.distributed.tensor_parallel import worker_main

if __name__ == "__main__":
    code = worker_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter teardown: destroying the gloo process groups' threads there can
    # abort the process ("terminate called without an active exception") after a clean stop.
    os._exit(code)
