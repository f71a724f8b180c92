"""`python -m engine.distributed.worker_main`: a tensor-parallel worker process (engine/distributed/worker.py).
A module of its own, which nothing imports, so that running it does not import it twice."""
from engine.distributed.worker import main

if __name__ == "__main__":
    main()
