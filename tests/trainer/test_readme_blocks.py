"""The README's code as written: the loop is ``trainer/examples/loop.py`` byte for byte (a test
runs that file with two replicas), and the ``Options`` block runs against a real Runtime."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from p2pft import Runtime
from p2pft.deploy.ports import free_ports
from p2pft.trainer import FaultTolerant, Options

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_loop_is_the_example_file() -> None:
    code = (ROOT / "trainer/examples/loop.py").read_text().split('"""\n', 1)[1]   # after the docstring
    assert BLOCKS and BLOCKS[0] == code


def test_the_readme_options_block_runs_as_written() -> None:
    block = next(b for b in BLOCKS if "Options(" in b)
    rt = Runtime(replica_id="r0", listen=f"127.0.0.1:{free_ports(1)[0]}", seeds=[]).start()
    model = torch.nn.Linear(4, 2)
    ns: dict[str, object] = {"rt": rt, "model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
    try:
        exec(compile(block, "README.md", "exec"), ns)
        ft, opts = ns["ft"], ns["opts"]
        assert isinstance(ft, FaultTolerant) and isinstance(opts, Options)
        assert (opts.batch_per_replica, opts.total_steps, opts.min_replicas) == (8, 60, 2)
        ft.close()
    finally:
        rt.close()
