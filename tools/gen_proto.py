"""Regenerate the gRPC stubs from proto/kvflow/proto/*.proto, or check they are fresh.

python tools/gen_proto.py          # rewrite the committed stubs
python tools/gen_proto.py --check  # exit 1 if the committed stubs differ from a fresh run
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE = PROTO_ROOT / "kvflow" / "proto"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    protos = sorted(PACKAGE.glob("*.proto"))
    for proto in protos:
        rel = proto.relative_to(PROTO_ROOT)
        rc = protoc.main(
            [
                "protoc",
                f"-I{PROTO_ROOT}",
                f"--python_out={out_dir}",
                f"--pyi_out={out_dir}",
                f"--grpc_python_out={out_dir}",
                str(rel),
            ]
        )
        if rc != 0:
            raise SystemExit(f"protoc failed on {rel} (exit {rc})")
    return [Path("kvflow/proto") / (p.stem + s) for p in protos for s in SUFFIXES]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        files = generate(out)
        stale = [
            f
            for f in files
            if not (PROTO_ROOT / f).exists()
            or not filecmp.cmp(out / f, PROTO_ROOT / f, shallow=False)
        ]
        if args.check:
            if stale:
                print("stale gRPC stubs (run `make proto`):", *map(str, stale), sep="\n  ")
                return 1
            print(f"gRPC stubs fresh ({len(files)} files)")
            return 0
        for f in files:
            shutil.copyfile(out / f, PROTO_ROOT / f)
        print(f"wrote {len(files)} files under {PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
