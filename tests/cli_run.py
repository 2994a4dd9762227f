"""`megatron-rl ARGV` inside the test process, as a `CompletedProcess`: what a separate process
would print and return, without its ~8 s of torch and transformers imports. For commands that
start their own ranks (spawned processes) or checks that end before any do."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from pathlib import Path


def cli_in_process(*argv: str, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    from megatron_rl.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(list(argv))
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(list(argv), rc, out.getvalue(), err.getvalue())
