"""A program that never configures logging still sees p2pft's lines with their level (and its
INFO lines); one that configures logging keeps control. Each case is a fresh interpreter."""
from __future__ import annotations

import os
import subprocess
import sys

PROGRAM = """
import logging, sys
if sys.argv[1] == "before":
    logging.basicConfig(level=logging.WARNING, format="USER %(levelname)s %(message)s")
from p2pft.runtime import Runtime
rt = Runtime(replica_id="solo", listen="127.0.0.1:0").start()
log = logging.getLogger("p2pft.probe")
log.info("probe info")
log.warning("probe warning")
if sys.argv[1] == "after":
    logging.basicConfig(level=logging.WARNING, format="USER %(levelname)s %(message)s")
    log.info("trigger")           # the fallback steps aside here
    log.info("late info")
    log.warning("late warning")
rt.close(leave=False)
"""


def _run(mode: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "P2PFT_LOG_LEVEL"}
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stderr


def test_no_logging_configured_shows_info_and_levels() -> None:
    err = _run("none")
    lines = err.splitlines()
    assert any(" INFO " in ln and "p2pft.probe: probe info" in ln and "[solo." in ln for ln in lines), err
    assert any(" WARNING " in ln and "p2pft.probe: probe warning" in ln for ln in lines), err
    assert "probe warning" not in [ln.strip() for ln in lines], "a warning without its level (Python's last resort)"
    assert any("p2pft.net.driver: listening on" in ln for ln in lines), err   # the runtime's own INFO lines


def test_a_program_that_configures_logging_keeps_control() -> None:
    err = _run("before")
    assert "probe info" not in err and "listening on" not in err, err   # its WARNING level holds
    assert err.splitlines().count("USER WARNING probe warning") == 1, err


def test_logging_configured_after_start_takes_over_without_duplicates() -> None:
    err = _run("after")
    assert " INFO " in err and "probe info" in err, err
    assert "late info" not in err, err
    assert err.count("late warning") == 1 and "USER WARNING late warning" in err, err
