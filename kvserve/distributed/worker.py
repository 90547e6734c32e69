"""Entry point of a tensor parallel worker rank: `python -m kvserve.distributed.worker RANK SIZE PORT
ERROR_FILE`, the engine config pickled on stdin (rank 0 starts these; see tensor_parallel.py)."""

import sys

from kvserve.distributed.tensor_parallel import worker_main

if __name__ == "__main__":
    sys.exit(worker_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
