"""The committed generated protobuf code is what scripts/gen_proto.sh produces from proto/.

gen_proto.sh runs the grpcio-tools pinned in scripts/constraints.txt in its own venv (created on
first use), so this test regenerates with exactly that generator, whatever protobuf .venv holds.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "swarm" / "proto"


def test_generated_code_is_fresh(tmp_path):
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True, timeout=300,
        env={**os.environ, "PYTHON": sys.executable, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"},
    )
    generated = sorted(p.name for p in tmp_path.iterdir())
    committed = sorted(p.name for p in PROTO.iterdir() if p.name.endswith((".py", ".pyi")) and p.name != "__init__.py")
    assert generated == committed, "proto/ and swarm/proto/ disagree on which files exist: run scripts/gen_proto.sh"
    for name in generated:
        assert (tmp_path / name).read_text() == (PROTO / name).read_text(), (
            f"swarm/proto/{name} is stale: run scripts/gen_proto.sh and commit the result"
        )


def test_generated_code_admits_the_oldest_supported_protobuf():
    """The gencode is no newer than pyproject's protobuf floor and binds no minimum runtime or grpcio."""
    text = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'"protobuf>=([\d.]+),', text)
    assert floor, "pyproject.toml names a protobuf floor"
    want = tuple(int(x) for x in floor.group(1).split("."))
    for path in sorted(PROTO.glob("*_pb2.py")):
        source = path.read_text()
        gencode = re.search(r"# Protobuf Python Version: ([\d.]+)", source)
        assert gencode, f"{path.name} names the protobuf it was generated for"
        assert tuple(int(x) for x in gencode.group(1).split(".")) <= want, (
            f"{path.name} is protobuf {gencode.group(1)} gencode, newer than the floor {floor.group(1)}")
        # newer protoc inserts a runtime check that refuses any protobuf older than the generator
        assert "ValidateProtobufRuntimeVersion" not in source, path.name
    # grpc stubs (*_pb2_grpc.py) would carry a grpcio version check; swarm registers its handlers itself
    assert not list(PROTO.glob("*_pb2_grpc.py"))
