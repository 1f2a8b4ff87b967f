"""Helpers for the black-box suite: stubs generated from proto/ with
grpcio-tools, and real `keel server` processes.

Nothing here knows Keel's Rust code: the suite talks to the server only as
an outside client does, through the .proto files and the wire.
"""

import atexit
import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROTO_DIR = os.path.join(REPO, "proto", "proto")
KEEL = os.environ.get("KEEL_BIN") or os.path.join(REPO, "target", "debug", "keel")


def _generate_stubs():
    """Compiles the API's .proto files into a temporary package directory
    and returns the (api_pb2, api_pb2_grpc, entry_pb2, raft_pb2) modules."""
    from grpc_tools import protoc

    out = tempfile.mkdtemp(prefix="keel-stubs-")
    atexit.register(shutil.rmtree, out, True)
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        "keel/entry/v1/entry.proto",
        "keel/entry/v1/snapshot.proto",
        "keel/api/v1/api.proto",
        "keel/raft/v1/raft.proto",
        "keel/replication/v1/replication.proto",
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + PROTO_DIR)
    sys.path.insert(0, out)
    return (
        importlib.import_module("keel.api.v1.api_pb2"),
        importlib.import_module("keel.api.v1.api_pb2_grpc"),
        importlib.import_module("keel.entry.v1.entry_pb2"),
        importlib.import_module("keel.raft.v1.raft_pb2"),
        importlib.import_module("keel.replication.v1.replication_pb2"),
    )


api, api_grpc, entry, raft, replication = _generate_stubs()


def wait_for(what, f, timeout_s=60.0):
    """Polls f until it returns something truthy; fails after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = f()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.025)


class Server:
    """A `keel server` process on 127.0.0.1 with its own data directory."""

    def __init__(self, *args, data_dir=None, tls=False):
        """With tls, the server is member 1 of a CA that `keel tls init`
        makes in its directory (self.certs), and the stub holds the
        client certificate `client-admin`."""
        import grpc

        self.dir = tempfile.mkdtemp(prefix="keel-blackbox-")
        self.certs = os.path.join(self.dir, "certs")
        if tls:
            subprocess.run([KEEL, "tls", "init", self.certs], check=True, stdout=subprocess.DEVNULL)
            args = (
                *args,
                "--tls-cert", self.cert_path("member-1.crt"),
                "--tls-key", self.cert_path("member-1.key"),
                "--tls-ca", self.cert_path("ca.crt"),
            )
        self.data = data_dir or os.path.join(self.dir, "data")
        os.makedirs(self.data, exist_ok=True)
        self.log_path = os.path.join(self.dir, "server.log")
        addr_file = os.path.join(self.data, "server.addr")
        if os.path.exists(addr_file):
            os.remove(addr_file)
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [KEEL, "server", "--listen", "127.0.0.1:0", "--data-dir", self.data, *args],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )

        def address():
            try:
                with open(addr_file) as f:
                    text = f.read()
            except FileNotFoundError:
                return None
            return text if ":" in text else None

        self.addr = wait_for("the server's address", address)
        if tls:
            self.channel = self.secure_channel("client-admin")
        else:
            self.channel = grpc.insecure_channel(self.addr)
        self.stub = api_grpc.KeelStub(self.channel)
        wait_for("a leader", self._leads)

    def cert_path(self, name):
        return os.path.join(self.certs, name)

    def secure_channel(self, holder, certs=None):
        """A TLS channel to the server, which it verifies against its CA,
        holding `holder`'s certificate (from `certs`, another `keel tls
        init` directory, if given)."""
        import grpc

        def read(directory, name):
            with open(os.path.join(directory, name), "rb") as f:
                return f.read()

        credentials = grpc.ssl_channel_credentials(
            root_certificates=read(self.certs, "ca.crt"),
            private_key=read(certs or self.certs, holder + ".key"),
            certificate_chain=read(certs or self.certs, holder + ".crt"),
        )
        return grpc.secure_channel(self.addr, credentials)

    def _leads(self):
        import grpc

        try:
            return self.stub.ClusterStatus(api.ClusterStatusRequest(), timeout=2).role == "leader"
        except grpc.RpcError:
            return False

    def alive(self):
        return self.proc.poll() is None

    def log_text(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stop(self):
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.log.close()

    def cleanup(self):
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def spec(name, **fields):
    """A one-GPU job spec as the API takes it."""
    s = entry.JobSpec(
        name=name,
        command=["true"],
        gpus_per_worker=1,
        min_workers=1,
        max_workers=1,
    )
    for k, v in fields.items():
        if isinstance(v, list):
            getattr(s, k).extend(v)
        elif isinstance(v, dict):
            getattr(s, k).update(v)
        else:
            setattr(s, k, v)
    return s
