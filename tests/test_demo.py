"""The README's first command: ``trajgate demo`` captures a real agent episode end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import free_port

from trajgate.vllm_server import VLLMServer


def test_demo_captures_both_calls_of_the_openai_sdk_agent(vllm: VLLMServer, tmp_path: Path) -> None:
    vllm_port = vllm.url.rsplit(":", 1)[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJGATE_DATA")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trajgate.cli",
            "demo",
            "--json",
            "--port",
            str(free_port()),
            "--vllm-port",
            vllm_port,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["steps_captured"] == 2  # the tool call, then the answer
    assert summary["database_url"] == f"sqlite:///{tmp_path / '.trajgate' / 'pool.sqlite3'}"
    for step in summary["steps"]:
        assert step["response_tokens"] > 0
        assert step["prompt_tokens"] > 0
        assert step["policy_version"] == 0
    assert summary["steps"][1]["extends_parent"] is not None
