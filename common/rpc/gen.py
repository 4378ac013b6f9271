"""Regenerate the committed protobuf/gRPC stubs from proto/baton.proto.

    python -m baton.common.rpc.gen            # writes common/rpc/baton_pb2{,_grpc}.py, .pyi

The stubs are committed so that running baton needs no code generation step;
tests/unit/test_proto_stubs.py regenerates them into a temporary folder and fails when the
committed copies differ. protoc writes `import baton_pb2` (a top-level module); we rewrite it
as a package-relative import so the stubs live under `baton.common.rpc`.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_NAME = "baton.proto"
RPC_DIR = Path(__file__).resolve().parent
# The .proto file is not package data: it is read from the repository checkout.
PROTO_DIR = RPC_DIR.parents[1] / "proto"
GENERATED = ("baton_pb2.py", "baton_pb2.pyi", "baton_pb2_grpc.py")

_TOP_LEVEL_PB2_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


def generate(out_dir: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Run protoc on `proto_dir/baton.proto`; write the fixed-up stubs into `out_dir`."""
    from grpc_tools import protoc  # only needed when regenerating

    proto_file = proto_dir / PROTO_NAME
    if not proto_file.is_file():
        raise FileNotFoundError(f"{proto_file} not found (run from a repository checkout)")
    well_known = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as raw:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{proto_dir}",
                f"-I{well_known}",
                f"--python_out={raw}",
                f"--pyi_out={raw}",
                f"--grpc_python_out={raw}",
                str(proto_file),
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto_file} (exit {rc})")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            text = (Path(raw) / name).read_text()
            text = _TOP_LEVEL_PB2_IMPORT.sub(r"from . import \1 as \2", text)
            target = out_dir / name
            target.write_text(text)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RPC_DIR, help="output folder")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
