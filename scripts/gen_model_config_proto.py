"""Regenerate asyncgraph/serve/proto/model_config_descriptor.py from model_config.proto.

    .venv/bin/python scripts/gen_model_config_proto.py          # write it
    .venv/bin/python scripts/gen_model_config_proto.py --check  # exit 1 if it is stale

As scripts/gen_grpc_protocol.py does for inference.proto (the same compile and layout): the
module holds the compiled .proto only, and asyncgraph/serve/model_config.py builds the
messages from it in a descriptor pool of its own.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_grpc_protocol import PROTO_DIR, render

PROTO = PROTO_DIR / "model_config.proto"
TARGET = PROTO_DIR / "model_config_descriptor.py"


def compile_proto() -> bytes:
    """The serialized FileDescriptorProto of model_config.proto, compiled by grpcio-tools."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        code = protoc.main([
            "protoc", f"-I{PROTO_DIR}", f"--descriptor_set_out={out}", PROTO.name,
        ])
        if code != 0:
            raise SystemExit(f"protoc failed on {PROTO} (exit {code})")
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (file,) = files.file
    return bytes(file.SerializeToString(deterministic=True))


def main(argv: list[str]) -> int:
    text = render(compile_proto()).replace("inference.proto", "model_config.proto").replace(
        "gen_grpc_protocol", "gen_model_config_proto")
    if "--check" in argv:
        if TARGET.read_text() != text:
            print(f"{TARGET} is stale: run scripts/gen_model_config_proto.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
