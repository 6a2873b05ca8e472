"""One answer to "how much more space will this build need": `status` and `doctor` project it with the same
function (builder/space/capacity.py, `capacity_from`), and samples retired by `hsbuild skip` are not in it (doctor
counted them: 200 tokens said by status, 4,200 by doctor, on the same build). A real build, run and skip, through
the CLI."""

from __future__ import annotations

import json

from builder.humanize import human_bytes


def test_status_and_doctor_project_the_same_remaining_space_without_retired_samples(tmp_path, make_build, cli):
    # 4 short samples are extracted; of the 8 long ones left, 6 are skipped: 2 x 300 tokens remain
    rows = [{"id": f"short{i}", "input_ids": [5 + i] * 20} for i in range(4)]
    rows += [{"id": f"long{i}", "input_ids": [7 + i] * 300} for i in range(8)]
    build = make_build(rows=rows)
    cp = cli("run", build, "--no-progress", "--limit", "4")
    assert cp.returncode == 0, cp.stderr
    cp = cli("skip", build, *[f"long{i}" for i in range(6)], "--reason", "too long for the draft")
    assert cp.returncode == 0, cp.stderr

    st = json.loads(cli("status", build, "--json", check=True).stdout)
    doc = json.loads(cli("doctor", build, "--json").stdout)
    space = next(c for c in doc["checks"] if c["name"] == "storage.space")["data"]
    assert st["retired"] == 6 and st["todo_samples"] == 2
    assert st["remaining_tokens"] == space["remaining_tokens"] == 600
    assert st["basis"] == space["basis"] == "measured"
    assert st["projected_bytes"] == space["projected_bytes"] > 0
    assert st["final_bytes"] == space["final_bytes"]
    # the figures as people read them: the same bytes in both
    text = cli("doctor", build).stdout
    line = next(ln for ln in text.splitlines() if "storage.space" in ln)
    assert f"projected {human_bytes(st['projected_bytes'])} more" in line, line
