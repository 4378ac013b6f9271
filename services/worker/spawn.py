"""The scheduler process's entry point, kept apart from the frontend and from the engine.

The frontend spawns its scheduler process with `scheduler_main` as the target; the child
imports this module to find it, then the engine (torch, the model) inside it, and nothing
of the frontend (FastAPI, gRPC: ~0.3 s of every worker's start). The frontend itself never
imports the engine (~2 s before it could spawn the child).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton.services.worker.config import SchedulerProcArgs


def scheduler_main(args: SchedulerProcArgs) -> None:
    """The scheduler process: run, then exit without the interpreter's slow teardown."""
    from baton.services.worker.scheduler_proc import run

    run(args)
    logging.shutdown()
    os._exit(0)
