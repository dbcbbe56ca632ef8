"""``StepRecord``: a trainer's record of the job's furthest step in its data directory."""
from __future__ import annotations

import json
from pathlib import Path

from p2pft.runtime import StepRecord


def test_step_record_keeps_the_furthest_step_and_refuses_another_replicas(tmp_path: Path) -> None:
    rec = StepRecord(str(tmp_path), "r0")
    assert rec.recorded is None
    rec.note(3)
    rec.note(9)          # within the throttle: pending
    rec.note(5)          # never goes back
    rec.flush()
    assert StepRecord(str(tmp_path), "r0").recorded == 9
    assert StepRecord(str(tmp_path), "r1").recorded is None      # another replica's directory
    (tmp_path / StepRecord.NAME).write_text("{not json")
    assert StepRecord(str(tmp_path), "r0").recorded is None      # unreadable: ignored, said once
    (tmp_path / StepRecord.NAME).write_text(json.dumps({"replica_id": "r0", "step": True}))
    assert StepRecord(str(tmp_path), "r0").recorded is None
