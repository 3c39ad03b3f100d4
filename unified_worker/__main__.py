"""`python -m unified_worker`: run one unified worker."""

from worker.cli_args import main

if __name__ == "__main__":  # vLLM spawns processes that re-import this module
    main("unified")
