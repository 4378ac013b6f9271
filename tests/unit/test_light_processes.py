"""Processes that run no model start without torch: each import of it costs seconds of a
cluster's start-up (and every integration test starts clusters)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from baton.common.models.tiny import default_model_path


def run_fresh(code: str) -> None:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True)
    assert result.returncode == 0, result.stderr.decode()[-3000:]


def test_worker_frontend_leaves_torch_to_its_scheduler_process() -> None:
    run_fresh(
        """
        import sys
        import baton.services.worker.main
        assert "torch" not in sys.modules
        """
    )


def test_scheduler_process_entry_loads_nothing_of_the_frontend() -> None:
    run_fresh(
        """
        import sys
        from baton.services.worker.config import SchedulerProcArgs
        from baton.services.worker.spawn import scheduler_main
        assert not {"torch", "fastapi", "uvicorn"} & set(sys.modules)
        """
    )


def test_router_tokenizes_and_renders_chats_without_torch() -> None:
    run_fresh(
        f"""
        import sys
        from baton.services.router.main import _import_transformers_without_torch
        _import_transformers_without_torch()
        from baton.services.router.app import create_app
        from baton.common.tokenizer import Tokenizer
        tokenizer = Tokenizer.load({str(default_model_path())!r})
        tool = {{"type": "function", "function": {{"name": "f", "parameters": {{}}}}}}
        ids = tokenizer.apply_chat_template([{{"role": "user", "content": "hi"}}], [tool])
        assert "hi" in tokenizer.decode(ids), tokenizer.decode(ids)
        assert "torch" not in sys.modules
        """
    )
