"""`jetllm worker` with fault injection (tests/helpers/faults.py): a real vLLM worker process whose
jobs can ask for an unexpected exception at any stage of their way through it.

    python -m tests.helpers.faulty_worker worker --nats ... --model ...
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from jetllm.cli import main
    from jetllm.workers.engine.vllm_engine import VllmEngine

    from .faults import install

    install(VllmEngine)
    sys.exit(main(sys.argv[1:]))
