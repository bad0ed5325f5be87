"""The committed generated protobuf code is what scripts/gen_proto.sh produces from proto/."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a dev dependency")
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    generated = sorted(p.name for p in tmp_path.iterdir())
    committed = sorted(p.name for p in (ROOT / "swarm" / "proto").iterdir() if p.name.endswith((".py", ".pyi"))
                       and p.name != "__init__.py")
    assert generated == committed, "proto/ and swarm/proto/ disagree on which files exist: run scripts/gen_proto.sh"
    for name in generated:
        assert (tmp_path / name).read_text() == (ROOT / "swarm" / "proto" / name).read_text(), (
            f"swarm/proto/{name} is stale: run scripts/gen_proto.sh and commit the result"
        )
