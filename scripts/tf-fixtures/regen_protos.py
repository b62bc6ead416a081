"""Regenerate object_detection/protos/*_pb2.py with the venv's protoc.

The sdist ships only old-style generated *_pb2.py files (protoc 3.x, which the
protobuf runtime that TF 2.21 needs refuses to load) and no .proto sources.
Each old file embeds its FileDescriptorProto as the `serialized_pb=` bytes
literal: this collects them into a FileDescriptorSet and asks grpc_tools'
protoc (``--descriptor_set_in``) to emit current *_pb2.py files for the same
descriptors. Nothing of the descriptors is changed.

usage: regen_protos.py <dir holding object_detection/>
"""
import ast
import glob
import os
import subprocess
import sys
import tempfile

from google.protobuf import descriptor_pb2


def serialized_pb(path):
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "serialized_pb":
                    return ast.literal_eval(kw.value)
    return None


def main(root):
    files = sorted(glob.glob(os.path.join(root, "object_detection", "protos", "*_pb2.py")))
    fds = descriptor_pb2.FileDescriptorSet()
    names = []
    for f in files:
        blob = serialized_pb(f)
        if blob is None:
            print("already regenerated (no serialized_pb):", f)
            continue
        fdp = fds.file.add()
        fdp.ParseFromString(blob)
        names.append(fdp.name)
    if not names:
        return
    with tempfile.TemporaryDirectory() as tmp:
        set_path = os.path.join(tmp, "set.pb")
        with open(set_path, "wb") as fh:
            fh.write(fds.SerializeToString())
        cmd = [sys.executable, "-m", "grpc_tools.protoc",
               "--descriptor_set_in=" + set_path, "--python_out=" + root] + names
        subprocess.check_call(cmd)
    print("regenerated %d files" % len(names))


if __name__ == "__main__":
    main(sys.argv[1])
