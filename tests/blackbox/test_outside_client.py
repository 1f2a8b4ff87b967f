"""Keel's API as an outside client sees it: stubs generated from proto/ in
Python (grpcio), not the keel CLI, which validates before sending.

Each test names the item of issue 19 it covers. Every test ends by checking
that the server still serves and that what it acknowledged is still there.
Run by controlplane/tests/blackbox.rs (cargo test), which points KEEL_BIN
at the keel binary it built.
"""

import os
import subprocess
import unittest

import grpc

from keel_blackbox import KEEL, Server, api, api_grpc, entry, raft, replication, spec, wait_for

CODE = grpc.StatusCode


def refusal(test, call, request, metadata=None):
    """The code, message and ErrorInfo of a refused call."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    with test.assertRaises(grpc.RpcError) as caught:
        call(request, timeout=20, metadata=metadata)
    info = error_details_pb2.ErrorInfo()
    status = rpc_status.from_call(caught.exception)
    test.assertIsNotNone(status, caught.exception.details())
    test.assertTrue(
        any(d.Unpack(info) for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR))
    )
    return caught.exception.code(), caught.exception.details(), info


class OneServer(unittest.TestCase):
    """A fresh server with no nodes of its own for each test."""

    args = ("--no-local-node", "--node-timeout-s", "300")

    def setUp(self):
        self.server = Server(*self.args)
        self.stub = self.server.stub

    def tearDown(self):
        self.server.cleanup()

    def refused(self, call, request, code, *words):
        """Calls and expects a refusal with `code` whose message has every
        one of `words`; returns the message."""
        with self.assertRaises(grpc.RpcError) as caught:
            call(request, timeout=20)
        err = caught.exception
        self.assertEqual(err.code(), code, err.details())
        for w in words:
            self.assertIn(w, err.details())
        return err.details()

    def jobs(self):
        return list(self.stub.ListJobs(api.ListJobsRequest(), timeout=10).jobs)

    def assert_serving(self, jobs):
        """The server runs, answers, and holds exactly `jobs` (names)."""
        self.assertTrue(self.server.alive(), self.server.log_text()[-2000:])
        self.assertEqual(sorted(j.spec.name for j in self.jobs()), sorted(jobs))


class TraceContext(OneServer):
    """Issue 24: the `traceparent` a caller sends. The server exports spans
    (to a port where nothing listens) and starts no trace of its own
    (ratio 0), so a job has a trace exactly when its caller sent a valid,
    sampled context; anything else in the header is ignored, never an
    error."""

    args = (
        *OneServer.args,
        "--otlp-endpoint",
        "http://127.0.0.1:1",
        "--trace-sample-ratio",
        "0",
    )

    def submit(self, name, traceparent):
        answer = self.stub.SubmitJob(
            api.SubmitJobRequest(spec=spec(name)),
            timeout=20,
            metadata=[("traceparent", traceparent)],
        )
        return self.stub.GetJob(api.GetJobRequest(job_id=answer.job_id), timeout=20)

    def test_a_sampled_context_is_followed_and_anything_else_ignored(self):
        trace = "4bf92f3577b34da6a3ce929d0e0e4736"
        self.assertEqual(self.submit("sampled", f"00-{trace}-00f067aa0ba902b7-01").trace_id, trace)
        for name, header in [
            ("unsampled", f"00-{trace}-00f067aa0ba902b7-00"),
            ("zero-trace", "00-" + "0" * 32 + "-00f067aa0ba902b7-01"),
            ("upper-case", f"00-{trace.upper()}-00f067aa0ba902b7-01"),
            ("garbage", "not a trace context"),
            ("oversized", "00-" + "a" * 4000),
        ]:
            self.assertEqual(self.submit(name, header).trace_id, "", name)
        self.assertTrue(self.server.alive(), self.server.log_text()[-2000:])


class RetriedWrites(OneServer):
    """Item 4: a write sent again under its request id applies once."""

    def test_a_submission_sent_again_is_one_job_with_the_first_answer(self):
        req = api.SubmitJobRequest(spec=spec("once"), request_id="py-client:1")
        first = self.stub.SubmitJob(req, timeout=10)
        # The answer was lost; the client sends the same request again, on
        # a new connection.
        self.server.channel.close()
        import keel_blackbox

        self.server.channel = grpc.insecure_channel(self.server.addr)
        self.stub = keel_blackbox.api_grpc.KeelStub(self.server.channel)
        again = self.stub.SubmitJob(req, timeout=10)
        self.assertEqual(again.job_id, first.job_id)
        # The same id for another job is refused, naming the id.
        self.refused(
            self.stub.SubmitJob,
            api.SubmitJobRequest(spec=spec("other"), request_id="py-client:1"),
            CODE.ALREADY_EXISTS,
            "py-client:1",
        )
        # Malformed ids name the field and the limit.
        self.refused(
            self.stub.SubmitJob,
            api.SubmitJobRequest(spec=spec("x"), request_id="a" * 65),
            CODE.INVALID_ARGUMENT,
            "request_id",
            "64",
        )
        self.refused(
            self.stub.SubmitJob,
            api.SubmitJobRequest(spec=spec("x"), request_id="has space"),
            CODE.INVALID_ARGUMENT,
            "request_id",
        )
        # Without an id, a retry is a second job (documented).
        self.stub.SubmitJob(api.SubmitJobRequest(spec=spec("twice")), timeout=10)
        self.stub.SubmitJob(api.SubmitJobRequest(spec=spec("twice")), timeout=10)
        self.assert_serving(["once", "twice", "twice"])

    def test_a_cancellation_sent_again_succeeds_again(self):
        job = self.stub.SubmitJob(api.SubmitJobRequest(spec=spec("c")), timeout=10)
        req = api.CancelJobRequest(job_id=job.job_id, reason="done", request_id="py-cancel-1")
        self.stub.CancelJob(req, timeout=10)
        # A retry after a lost answer is told what the first one was told,
        # not "already ended".
        self.stub.CancelJob(req, timeout=10)
        # A new cancellation (another id) is refused: the job has ended.
        self.refused(
            self.stub.CancelJob,
            api.CancelJobRequest(job_id=job.job_id, request_id="py-cancel-2"),
            CODE.FAILED_PRECONDITION,
            "already ended",
        )
        self.assert_serving(["c"])


class NodesFromHeartbeats(OneServer):
    """Items 2, 5 and 6: what a heartbeat from anyone can and cannot do."""

    def heartbeat(self, name, gpu_type="v100", note=""):
        return self.stub.NodeHeartbeat(
            api.NodeHeartbeatRequest(
                nodes=[
                    entry.RegisterNode(
                        name=name,
                        address="10.0.0.9",
                        gpus=[entry.Gpu(index=0, gpu_type=gpu_type)],
                        note=note,
                    )
                ]
            ),
            timeout=10,
        )

    def node(self, name):
        for n in self.stub.ListNodes(api.ListNodesRequest(), timeout=10).nodes:
            if n.name == name:
                return n
        return None

    def test_a_node_known_from_a_heartbeat_runs_nothing_and_can_be_removed(self):
        self.heartbeat("rogue-0")
        node = wait_for("rogue-0 registered", lambda: self.node("rogue-0"))
        self.assertTrue(node.unowned)
        marker = os.path.join(self.server.dir, "ran")
        job = self.stub.SubmitJob(
            api.SubmitJobRequest(
                spec=spec("rogue", command=["touch", marker], gpu_types_allowed=["v100"])
            ),
            timeout=10,
        )

        def held_back():
            j = self.stub.GetJob(api.GetJobRequest(job_id=job.job_id), timeout=10)
            return j if "not launched" in j.message else None

        j = held_back() or wait_for("the job held back", held_back)
        self.assertIn("rogue-0", j.message)
        wait_for(
            "the refused launch in the server's log",
            lambda: "not launched: no executor" in self.server.log_text(),
        )
        self.assertFalse(os.path.exists(marker), "the job's command ran on the server")
        # Item 5: refused while the job holds its GPU; forced, it is gone
        # and the job is back in the queue.
        self.refused(
            self.stub.RemoveNode,
            api.RemoveNodeRequest(name="rogue-0"),
            CODE.FAILED_PRECONDITION,
            "force",
        )
        removed = self.stub.RemoveNode(
            api.RemoveNodeRequest(name="rogue-0", force=True), timeout=10
        )
        self.assertEqual(list(removed.requeued), [job.job_id])
        self.assertIsNone(self.node("rogue-0"))
        self.refused(
            self.stub.RemoveNode,
            api.RemoveNodeRequest(name="rogue-0"),
            CODE.NOT_FOUND,
            "rogue-0",
        )
        j = self.stub.GetJob(api.GetJobRequest(job_id=job.job_id), timeout=10)
        self.assertEqual(j.state, "preempted")
        self.assert_serving(["rogue"])

    def test_heartbeats_follow_the_naming_rules_of_job_specs(self):
        self.refused(
            lambda r, timeout: self.heartbeat("../../x"), None, CODE.INVALID_ARGUMENT, "node name"
        )
        self.refused(
            lambda r, timeout: self.heartbeat("n0", "V100!"),
            None,
            CODE.INVALID_ARGUMENT,
            "type",
        )
        self.assertEqual(list(self.stub.ListNodes(api.ListNodesRequest(), timeout=10).nodes), [])
        self.assert_serving([])

    def test_a_heartbeats_note_has_a_limit_and_is_shown(self):
        """Issue 30: a report's note (why a node offers fewer GPUs) is held
        to 1 KiB, refused whole beyond it, and shown as the node's message."""
        self.refused(
            lambda r, timeout: self.heartbeat("n1", note="x" * 1025),
            None,
            CODE.INVALID_ARGUMENT,
            "note is 1025 bytes long; the limit is 1024",
        )
        self.assertIsNone(self.node("n1"))
        self.heartbeat("n1", note="offers 1 of 4 GPUs: 3 requested by other workloads")
        node = wait_for("n1 registered with its note", lambda: self.node("n1"))
        self.assertEqual(node.message, "offers 1 of 4 GPUs: 3 requested by other workloads")
        self.assert_serving([])


    def report(self, name, gpus, failed):
        return self.stub.NodeHeartbeat(
            api.NodeHeartbeatRequest(
                reports=[
                    entry.RecordNodeInventory(
                        name=name,
                        address="10.0.0.9",
                        gpus=[entry.Gpu(index=i, gpu_type="v100") for i in gpus],
                        failed=[
                            entry.FailedGpu(index=i, gpu_type="v100", reason=why)
                            for i, why in failed
                        ],
                    )
                ]
            ),
            timeout=10,
        )

    def test_a_report_of_failed_gpus_is_checked_and_shown(self):
        """Issue 33: a report's failed GPUs are held to the limits of a
        reason (4 KiB) and a GPU type, refused whole beyond them, and shown
        as gone GPUs with their reason once the node has them."""
        self.refused(
            lambda r, timeout: self.report("n2", [0], [(1, "x" * 4097)]),
            None,
            CODE.INVALID_ARGUMENT,
            "failure reason is 4097 bytes long; the limit is 4096",
        )
        # A GPU both offered and failed, or failed twice, is refused at the
        # API, not proposed and refused in the log.
        self.refused(
            lambda r, timeout: self.report("n2", [0, 1], [(1, "Xid 79")]),
            None,
            CODE.INVALID_ARGUMENT,
            'node "n2" lists GPU index 1 twice',
        )
        self.refused(
            lambda r, timeout: self.report("n2", [0], [(1, "Xid 79"), (1, "Xid 48")]),
            None,
            CODE.INVALID_ARGUMENT,
            'node "n2" lists GPU index 1 twice',
        )
        self.assertIsNone(self.node("n2"))
        self.report("n2", [0, 1], [])
        wait_for("n2 with two GPUs", lambda: (self.node("n2") or api.Node()).gpus or None)
        self.report("n2", [0], [(1, "Xid 79: GPU has fallen off the bus.")])

        def gone():
            node = self.node("n2")
            return node if node is not None and node.gone_gpus else None

        node = wait_for("GPU 1 gone", gone)
        self.assertEqual([g.index for g in node.gpus], [0])
        self.assertEqual(
            [(g.index, g.reason) for g in node.gone_gpus],
            [(1, "Xid 79: GPU has fallen off the bus.")],
        )
        self.assert_serving([])


class BadInputs(OneServer):
    """Items 7, 8, 9 and 13: bad input gets a clear error and changes nothing."""

    def raw(self, method, body):
        call = self.server.channel.unary_unary(
            f"/keel.api.v1.Keel/{method}",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        return call(body, timeout=10)

    def test_malformed_protobuf_is_invalid_argument(self):
        valid = api.SubmitJobRequest(spec=spec("x")).SerializeToString()
        # spec (field 1) holding a name (field 1) of one byte that is not UTF-8
        not_utf8 = bytes([0x0A, 0x03, 0x0A, 0x01, 0xFF])
        for body in (os.urandom(64) + b"\xff" * 16, valid[:-3], not_utf8):
            with self.assertRaises(grpc.RpcError) as caught:
                self.raw("SubmitJob", body)
            self.assertEqual(caught.exception.code(), CODE.INVALID_ARGUMENT, caught.exception.details())
            self.assertIn("not a valid SubmitJobRequest", caught.exception.details())
        self.assert_serving([])

    def test_a_request_over_the_limit_is_resource_exhausted(self):
        huge = api.SubmitJobRequest(spec=spec("x" * (2 * 1024 * 1024)))
        self.refused(self.stub.SubmitJob, huge, CODE.RESOURCE_EXHAUSTED, "bytes")
        self.assert_serving([])

    def test_an_explicit_zero_is_refused_not_dropped(self):
        s = spec("zero")
        s.total_steps = 0
        self.refused(
            self.stub.SubmitJob, api.SubmitJobRequest(spec=s), CODE.INVALID_ARGUMENT, "total_steps"
        )
        s = spec("zero")
        s.epochs = 0
        self.refused(self.stub.SubmitJob, api.SubmitJobRequest(spec=s), CODE.INVALID_ARGUMENT, "epochs")
        self.assert_serving([])

    def test_resource_limits_out_of_range_are_refused_and_kept_when_valid(self):
        s = spec("tiny")
        s.resources.memory_bytes = 1000
        self.refused(
            self.stub.SubmitJob,
            api.SubmitJobRequest(spec=s),
            CODE.INVALID_ARGUMENT,
            "resources.memory",
            "4Mi",
        )
        s = spec("tiny")
        s.resources.cpu_millis = 0
        self.refused(
            self.stub.SubmitJob, api.SubmitJobRequest(spec=s), CODE.INVALID_ARGUMENT, "resources.cpus"
        )
        s = spec("limited")
        s.resources.memory_bytes = 64 << 20
        s.resources.cpu_millis = 1500
        job = self.stub.SubmitJob(api.SubmitJobRequest(spec=s), timeout=10)
        got = self.stub.GetJob(api.GetJobRequest(job_id=job.job_id), timeout=10).spec.resources
        self.assertEqual((got.memory_bytes, got.cpu_millis), (64 << 20, 1500))
        self.assert_serving(["limited"])

    def test_log_rotation_out_of_range_is_refused_and_kept_when_valid(self):
        s = spec("one-file")
        s.logs.max_files = 1
        self.refused(
            self.stub.SubmitJob,
            api.SubmitJobRequest(spec=s),
            CODE.INVALID_ARGUMENT,
            "logs.max_files",
            "2 to 100",
        )
        s = spec("huge-files")
        s.logs.max_file_bytes = 2 << 30
        self.refused(
            self.stub.SubmitJob,
            api.SubmitJobRequest(spec=s),
            CODE.INVALID_ARGUMENT,
            "logs.max_file_size",
            "1Gi",
        )
        s = spec("rotated")
        s.logs.max_file_bytes = 1 << 20
        s.logs.max_files = 3
        job = self.stub.SubmitJob(api.SubmitJobRequest(spec=s), timeout=10)
        got = self.stub.GetJob(api.GetJobRequest(job_id=job.job_id), timeout=10).spec.logs
        self.assertEqual((got.max_file_bytes, got.max_files), (1 << 20, 3))
        self.assert_serving(["rotated"])

    def test_limits_name_the_field_and_the_unit(self):
        job = self.stub.SubmitJob(api.SubmitJobRequest(spec=spec("j")), timeout=10)
        self.refused(
            self.stub.CancelJob,
            api.CancelJobRequest(job_id=job.job_id, reason="r" * 100000),
            CODE.INVALID_ARGUMENT,
            "reason is 100000 bytes long",
            "4096",
        )
        self.refused(
            self.stub.SetPolicy,
            api.SetPolicyRequest(name="no-such-policy"),
            CODE.INVALID_ARGUMENT,
            "no-such-policy",
        )
        self.refused(
            self.stub.SetNodeState,
            api.SetNodeStateRequest(name="n", state="sideways"),
            CODE.INVALID_ARGUMENT,
            "state",
        )
        self.refused(
            self.stub.GetJob, api.GetJobRequest(job_id=4242), CODE.NOT_FOUND, "4242"
        )
        self.assert_serving(["j"])

    def test_a_job_no_node_can_run_says_why_it_waits(self):
        job = self.stub.SubmitJob(
            api.SubmitJobRequest(spec=spec("h", gpu_types_allowed=["h100x"])), timeout=10
        )
        j = self.stub.GetJob(api.GetJobRequest(job_id=job.job_id), timeout=10)
        self.assertEqual(j.state, "pending")
        self.assertIn("h100x", j.message)
        listed = [x for x in self.jobs() if x.id == job.job_id]
        self.assertIn("h100x", listed[0].message)
        self.assert_serving(["h"])

    def test_an_env_name_that_looks_like_a_credential_is_warned_of_not_refused(self):
        """Issue 35: a plain env value named like a credential is accepted,
        and the answer says it is kept and shown in plain."""
        s = spec("tracked")
        s.env["WANDB_API_KEY"] = "k"
        s.env["EPOCHS"] = "3"
        job = self.stub.SubmitJob(api.SubmitJobRequest(spec=s), timeout=10)
        self.assertEqual(len(job.warnings), 1, job.warnings)
        self.assertIn("env.WANDB_API_KEY looks like a credential", job.warnings[0])
        plain = self.stub.SubmitJob(api.SubmitJobRequest(spec=spec("plain")), timeout=10)
        self.assertEqual(list(plain.warnings), [])
        self.assert_serving(["tracked", "plain"])


class EventStreams(OneServer):
    """Issue 22, item 5: a replica serves at most --max-event-streams event
    streams; one more is RESOURCE_EXHAUSTED with the reason
    TOO_MANY_STREAMS, and a stream its client cancels frees its place."""

    args = OneServer.args + ("--max-event-streams", "2")

    def test_one_stream_over_the_limit_is_refused_and_a_cancelled_one_frees_its_place(self):
        from google.rpc import error_details_pb2
        from grpc_status import rpc_status

        self.stub.SubmitJob(api.SubmitJobRequest(spec=spec("watched")), timeout=10)
        follow = api.WatchEventsRequest(from_index=0, follow=True)
        first = self.stub.WatchEvents(follow)
        second = self.stub.WatchEvents(follow)
        # Both serve the submission.
        self.assertTrue(next(first).events)
        self.assertTrue(next(second).events)
        with self.assertRaises(grpc.RpcError) as caught:
            next(self.stub.WatchEvents(follow))
        err = caught.exception
        self.assertEqual(err.code(), CODE.RESOURCE_EXHAUSTED, err.details())
        self.assertIn("2 event streams", err.details())
        self.assertIn("--max-event-streams", err.details())
        info = error_details_pb2.ErrorInfo()
        self.assertTrue(
            any(d.Unpack(info) for d in rpc_status.from_call(err).details
                if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR))
        )
        self.assertEqual(info.reason, "TOO_MANY_STREAMS")
        # The client goes away from one: its place comes back.
        second.cancel()

        def opened():
            stream = self.stub.WatchEvents(follow)
            try:
                return stream if next(stream).events else None
            except grpc.RpcError as e:
                self.assertEqual(e.code(), CODE.RESOURCE_EXHAUSTED)
                return None

        third = wait_for("a place for a new stream", opened)
        first.cancel()
        third.cancel()
        self.assert_serving(["watched"])


class ErrorReasons(OneServer):
    """Issue 21, item 6: a client decides on the code and a machine-readable
    reason (google.rpc.ErrorInfo in the status details, with a BadRequest
    field violation for a bad field), never on the message's words."""

    def details(self, call, request):
        from google.rpc import error_details_pb2
        from grpc_status import rpc_status

        with self.assertRaises(grpc.RpcError) as caught:
            call(request, timeout=20)
        status = rpc_status.from_call(caught.exception)
        self.assertIsNotNone(status, "no status details")
        info, bad = None, None
        for d in status.details:
            if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                d.Unpack(info)
            elif d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                d.Unpack(bad)
        self.assertIsNotNone(info, status)
        self.assertEqual(info.domain, "keel.dev")
        return caught.exception.code(), info, bad

    def test_errors_carry_a_reason_and_the_field_at_fault(self):
        s = spec("zero")
        s.total_steps = 0
        code, info, bad = self.details(self.stub.SubmitJob, api.SubmitJobRequest(spec=s))
        self.assertEqual((code, info.reason), (CODE.INVALID_ARGUMENT, "INVALID_ARGUMENT"))
        self.assertEqual(info.metadata["field"], "spec.total_steps")
        self.assertEqual([v.field for v in bad.field_violations], ["spec.total_steps"])

        code, info, _ = self.details(self.stub.GetJob, api.GetJobRequest(job_id=4242))
        self.assertEqual((code, info.reason), (CODE.NOT_FOUND, "JOB_NOT_FOUND"))

        self.stub.SubmitJob(api.SubmitJobRequest(spec=spec("a"), request_id="r-1"), timeout=10)
        code, info, _ = self.details(
            self.stub.SubmitJob, api.SubmitJobRequest(spec=spec("b"), request_id="r-1")
        )
        self.assertEqual((code, info.reason), (CODE.ALREADY_EXISTS, "REQUEST_ID_REUSED"))
        self.assert_serving(["a"])


class Membership(OneServer):
    """Item 1 (one-member cluster) and 13: a member nothing answers for is
    refused, and the cluster keeps its quorum."""

    def test_adding_a_member_where_nothing_answers_changes_nothing(self):
        for learner_only in (False, True):
            self.refused(
                self.stub.AddMember,
                api.AddMemberRequest(id=2, address="127.0.0.1:1", learner_only=learner_only),
                CODE.FAILED_PRECONDITION,
                "127.0.0.1:1",
            )
        status = self.stub.ClusterStatus(api.ClusterStatusRequest(), timeout=10)
        self.assertEqual(list(status.voters), [1])
        # Still a quorum: a write commits.
        self.stub.SubmitJob(api.SubmitJobRequest(spec=spec("after")), timeout=10)
        self.refused(
            self.stub.AddMember,
            api.AddMemberRequest(id=70000, address="127.0.0.1:1"),
            CODE.INVALID_ARGUMENT,
            "65535",
        )
        self.refused(
            self.stub.AddMember,
            api.AddMemberRequest(id=2, address="127.0.0.1:1", catch_up_timeout_s=5000),
            CODE.INVALID_ARGUMENT,
            "catch_up_timeout_s",
            "3600",
        )
        self.assert_serving(["after"])





class RaftEnvelope(OneServer):
    """Issue 21, item 2: the Raft service's versioned envelope, as an
    outside client can reach it on the API's port. A message in a format
    newer than the replica reads is refused naming both, a payload that
    does not decode is INVALID_ARGUMENT, and neither changes anything."""

    def vote(self, message, to=None):
        call = self.server.channel.unary_unary(
            "/keel.raft.v1.Raft/Vote",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=raft.RaftMessage.FromString,
        )
        metadata = [("keel-to", str(to))] if to is not None else None
        return call(message, timeout=10, metadata=metadata)

    def test_bad_formats_and_payloads_are_refused_and_change_nothing(self):
        # Addressed to nobody: refused, naming the replica's Raft id.
        with self.assertRaises(grpc.RpcError) as caught:
            self.vote(raft.RaftMessage(format_version=2))
        self.assertEqual(caught.exception.code(), CODE.FAILED_PRECONDITION)
        me = dict(caught.exception.trailing_metadata())["keel-raft-id"]
        status = self.stub.ClusterStatus(api.ClusterStatusRequest(), timeout=10)
        # A format from the future.
        request = replication.VoteRequest(vote=replication.Vote(term=1, node=9))
        newer = raft.RaftMessage(
            payload=request.SerializeToString(), format_version=3, reads_up_to=3
        )
        with self.assertRaises(grpc.RpcError) as caught:
            self.vote(newer, to=me)
        self.assertEqual(caught.exception.code(), CODE.FAILED_PRECONDITION)
        details = caught.exception.details()
        self.assertIn("format 3", details)
        self.assertIn("formats 1 to 2", details)
        self.assertIn("upgrade", details)
        # Payloads that do not decode, in both formats, and one without
        # its required vote.
        for format_version, payload in (
            (2, b"\xff" * 16),
            (1, b"\xff" * 16),
            (0, b""),
            (2, replication.VoteRequest().SerializeToString()),
        ):
            with self.assertRaises(grpc.RpcError) as caught:
                self.vote(
                    raft.RaftMessage(payload=payload, format_version=format_version),
                    to=me,
                )
            self.assertEqual(
                caught.exception.code(), CODE.INVALID_ARGUMENT, caught.exception.details()
            )
            self.assertIn("Raft message", caught.exception.details())
        # Nothing changed: the same term, still leading, still writable.
        after = self.stub.ClusterStatus(api.ClusterStatusRequest(), timeout=10)
        self.assertEqual(after.role, "leader")
        self.assertEqual(after.term, status.term)
        self.stub.SubmitJob(api.SubmitJobRequest(spec=spec("after")), timeout=20)
        self.assert_serving(["after"])


class FollowLeaderStream(OneServer):
    """Issue 26: `FollowLeader`, the stream a follower holds to its leader's
    process, as an outside client can reach it on the API's port. Without
    its addressee, or from another cluster, it is refused; addressed right,
    the leader answers with its term and keeps the stream open; past 16
    open streams the next is refused, and one closed makes room again.
    None of it changes the leader's term."""

    def follow(self, to=None, cluster=None):
        call = self.server.channel.unary_stream(
            "/keel.raft.v1.Raft/FollowLeader",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=raft.LeaderPresent.FromString,
        )
        metadata = []
        if to is not None:
            metadata.append(("keel-to", str(to)))
        if cluster is not None:
            metadata.append(("keel-cluster-id", cluster))
        return call(raft.FollowLeaderRequest(follower=2), timeout=30, metadata=metadata)

    def refused_stream(self, code, *words, **kwargs):
        with self.assertRaises(grpc.RpcError) as caught:
            next(self.follow(**kwargs))
        self.assertEqual(caught.exception.code(), code, caught.exception.details())
        for w in words:
            self.assertIn(w, caught.exception.details())
        return caught.exception

    def test_bad_callers_are_refused_and_open_streams_are_bounded(self):
        status = self.stub.ClusterStatus(api.ClusterStatusRequest(), timeout=10)
        # Addressed to nobody: refused, naming the replica's Raft id.
        err = self.refused_stream(CODE.FAILED_PRECONDITION)
        me = dict(err.trailing_metadata())["keel-raft-id"]
        # From another cluster.
        self.refused_stream(
            CODE.FAILED_PRECONDITION, "cluster id mismatch", to=me, cluster="another"
        )
        # Addressed right: the leader's term, and the stream stays open.
        streams = [self.follow(to=me) for _ in range(16)]
        for stream in streams:
            self.assertEqual(next(stream).term, status.term)
        self.refused_stream(CODE.RESOURCE_EXHAUSTED, "16 FollowLeader streams", to=me)
        streams.pop().cancel()
        # The place comes back once the server sees the cancel.
        wait_for("a stream's place to be given back", lambda: self._opens(me), timeout_s=20)
        for stream in streams:
            stream.cancel()
        after = self.stub.ClusterStatus(api.ClusterStatusRequest(), timeout=10)
        self.assertEqual((after.role, after.term), ("leader", status.term))
        self.stub.SubmitJob(api.SubmitJobRequest(spec=spec("after")), timeout=20)
        self.assert_serving(["after"])

    def _opens(self, me):
        """Whether a new stream opens now (closing it again)."""
        stream = self.follow(to=me)
        try:
            next(stream)
            return True
        except grpc.RpcError as e:
            self.assertEqual(e.code(), CODE.RESOURCE_EXHAUSTED, e.details())
            return False
        finally:
            stream.cancel()


class RaftClockFields(OneServer):
    """Issue 29: the clock fields of the Raft envelope (the sender's clock,
    the log time, the offset a leader tells a follower) from an outside
    caller. Only a leader's AppendEntries that the replica accepts is heard:
    forged values on a message it refuses or does not accept change neither
    its log time nor its leadership."""

    def append(self, message, to):
        call = self.server.channel.unary_unary(
            "/keel.raft.v1.Raft/AppendEntries",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=raft.RaftMessage.FromString,
        )
        return call(message, timeout=10, metadata=[("keel-to", str(to))])

    def test_forged_clock_fields_change_nothing(self):
        with self.assertRaises(grpc.RpcError) as caught:
            self.append(raft.RaftMessage(format_version=2), to=0)
        me = dict(caught.exception.trailing_metadata())["keel-raft-id"]
        before = self.stub.ClusterStatus(api.ClusterStatusRequest(), timeout=10)
        forged = dict(
            sent_at_ms=2**63,
            log_time_ms=2**63,
            clock_offset_ms=10**12,
        )
        # A stale leader's AppendEntries (term 0): answered, not accepted;
        # the answer says this replica's own clock.
        stale = replication.AppendEntriesRequest(
            vote=replication.Vote(term=0, node=9, committed=True)
        )
        reply = self.append(
            raft.RaftMessage(
                payload=stale.SerializeToString(),
                format_version=2,
                reads_up_to=2,
                **forged,
            ),
            to=me,
        )
        self.assertGreater(reply.sent_at_ms, 0)
        self.assertLess(reply.sent_at_ms, 2**62)
        # One that does not decode: refused.
        with self.assertRaises(grpc.RpcError) as caught:
            self.append(
                raft.RaftMessage(payload=b"\xff" * 16, format_version=2, **forged),
                to=me,
            )
        self.assertEqual(caught.exception.code(), CODE.INVALID_ARGUMENT)
        # Still leading in the same term, no refusal, log time near its
        # clock, and writable.
        after = self.stub.ClusterStatus(api.ClusterStatusRequest(), timeout=10)
        self.assertEqual(after.role, "leader")
        self.assertEqual(after.term, before.term)
        self.assertEqual(after.clock_refusal, "")
        self.assertLess(
            abs(after.log_time_ms - after.wall_clock_ms),
            after.max_clock_offset_ms + 60_000,
        )
        self.stub.SubmitJob(api.SubmitJobRequest(spec=spec("after-forged")), timeout=20)
        self.assert_serving(["after-forged"])

    def test_the_append_stream_checks_every_message_and_ends_at_a_refusal(self):
        """Issue 26: `AppendEntriesStream`, the stream a leader holds to
        each follower. Each message is answered in order as AppendEntries
        answers it; the call's addressee is checked for every message; a
        refusal ends the stream with AppendEntries' status, and nothing of
        a refused or stale message moves the replica."""
        stream = self.server.channel.stream_stream(
            "/keel.raft.v1.Raft/AppendEntriesStream",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=raft.RaftMessage.FromString,
        )
        with self.assertRaises(grpc.RpcError) as caught:
            self.append(raft.RaftMessage(format_version=2), to=0)
        me = dict(caught.exception.trailing_metadata())["keel-raft-id"]
        before = self.stub.ClusterStatus(api.ClusterStatusRequest(), timeout=10)
        stale = raft.RaftMessage(
            payload=replication.AppendEntriesRequest(
                vote=replication.Vote(term=0, node=9, committed=True)
            ).SerializeToString(),
            format_version=2,
            reads_up_to=2,
            sent_at_ms=2**63,
            log_time_ms=2**63,
        )
        # Addressed to another incarnation: the first message is refused
        # and the stream ends, naming this replica.
        replies = stream(iter([stale, stale]), timeout=10, metadata=[("keel-to", "0")])
        with self.assertRaises(grpc.RpcError) as caught:
            list(replies)
        self.assertEqual(caught.exception.code(), CODE.FAILED_PRECONDITION)
        self.assertEqual(dict(caught.exception.trailing_metadata())["keel-raft-id"], me)
        # To this replica: two stale leaders' messages answered in order,
        # each with this replica's clock; then one that does not decode
        # ends the stream as AppendEntries refuses it.
        garbage = raft.RaftMessage(payload=b"\xff" * 16, format_version=2)
        replies = stream(
            iter([stale, stale, garbage, stale]), timeout=10, metadata=[("keel-to", me)]
        )
        answered = []
        with self.assertRaises(grpc.RpcError) as caught:
            for reply in replies:
                answered.append(reply)
        self.assertEqual(caught.exception.code(), CODE.INVALID_ARGUMENT)
        self.assertEqual(len(answered), 2)
        for reply in answered:
            self.assertEqual(reply.format_version, 2)
            self.assertGreater(reply.sent_at_ms, 0)
            self.assertLess(reply.sent_at_ms, 2**62)
        after = self.stub.ClusterStatus(api.ClusterStatusRequest(), timeout=10)
        self.assertEqual((after.role, after.term), ("leader", before.term))
        self.stub.SubmitJob(api.SubmitJobRequest(spec=spec("after-stream")), timeout=20)
        self.assert_serving(["after-stream"])


if __name__ == "__main__":
    unittest.main()

class MutualTls(unittest.TestCase):
    """Issue 22, item 1: a server with TLS, reached through grpcio's own TLS
    with the certificates `keel tls init` made. A caller with a client
    certificate from the cluster's CA is served; a plaintext caller and one
    holding another CA's certificate get nothing; a client certificate
    cannot speak Raft."""

    def setUp(self):
        self.server = Server("--no-local-node", "--node-timeout-s", "300", tls=True)
        self.stub = self.server.stub

    def tearDown(self):
        self.server.cleanup()

    def unavailable(self, channel):
        with self.assertRaises(grpc.RpcError) as caught:
            api_grpc.KeelStub(channel).ClusterStatus(api.ClusterStatusRequest(), timeout=5)
        channel.close()
        self.assertEqual(caught.exception.code(), CODE.UNAVAILABLE, caught.exception.details())

    def test_only_the_cas_certificates_are_served_and_a_client_cannot_speak_raft(self):
        self.stub.SubmitJob(api.SubmitJobRequest(spec=spec("over-tls")), timeout=20)
        self.unavailable(grpc.insecure_channel(self.server.addr))
        other = os.path.join(self.server.dir, "other")
        subprocess.run([KEEL, "tls", "init", other], check=True, stdout=subprocess.DEVNULL)
        self.unavailable(self.server.secure_channel("client-admin", certs=other))
        before = self.stub.ClusterStatus(api.ClusterStatusRequest(), timeout=10)
        vote = self.server.channel.unary_unary(
            "/keel.raft.v1.Raft/Vote",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=raft.RaftMessage.FromString,
        )
        # A candidate "member 2" with a higher term, holding the client's
        # certificate: refused before anything of it is read.
        request = replication.VoteRequest(vote=replication.Vote(term=before.term + 5, node=2))
        with self.assertRaises(grpc.RpcError) as caught:
            vote(
                raft.RaftMessage(
                    payload=request.SerializeToString(), format_version=2, reads_up_to=2
                ),
                timeout=10,
            )
        self.assertEqual(caught.exception.code(), CODE.PERMISSION_DENIED)
        self.assertIn("needs that member's certificate", caught.exception.details())
        self.assertIn("2.members.keel", caught.exception.details())
        # Nor can it hold a follower's stream to the leader (issue 26).
        follow = self.server.channel.unary_stream(
            "/keel.raft.v1.Raft/FollowLeader",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=raft.LeaderPresent.FromString,
        )
        with self.assertRaises(grpc.RpcError) as caught:
            next(follow(raft.FollowLeaderRequest(follower=2), timeout=10))
        self.assertEqual(caught.exception.code(), CODE.PERMISSION_DENIED)
        self.assertIn("2.members.keel", caught.exception.details())
        # Nor send a leader's entries on the stream a leader holds to each
        # follower: the message names leader 2, the certificate a client.
        append = self.server.channel.stream_stream(
            "/keel.raft.v1.Raft/AppendEntriesStream",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=raft.RaftMessage.FromString,
        )
        entries = replication.AppendEntriesRequest(
            vote=replication.Vote(term=before.term + 5, node=2, committed=True)
        )
        message = raft.RaftMessage(
            payload=entries.SerializeToString(), format_version=2, reads_up_to=2
        )
        with self.assertRaises(grpc.RpcError) as caught:
            list(append(iter([message]), timeout=10))
        self.assertEqual(caught.exception.code(), CODE.PERMISSION_DENIED)
        self.assertIn("names no member", caught.exception.details())
        after = self.stub.ClusterStatus(api.ClusterStatusRequest(), timeout=10)
        self.assertEqual((after.role, after.term), ("leader", before.term))
        self.assertEqual(
            [j.spec.name for j in self.stub.ListJobs(api.ListJobsRequest(), timeout=10).jobs],
            ["over-tls"],
        )

    def test_entries_record_the_certificate_holder_and_a_forged_caller_is_ignored(self):
        """Issue 22, item 3: a submission records who asked, from the
        caller's certificate; a `keel-caller` header, which replicas use
        to say whom they forward for, is believed of members only."""
        forged = [("keel-caller", "cert:root")]
        reply = self.stub.SubmitJob(
            api.SubmitJobRequest(spec=spec("audited")), timeout=20, metadata=forged
        )
        job = self.stub.GetJob(api.GetJobRequest(job_id=reply.job_id), timeout=10)
        self.assertEqual(job.submitted_by, "cert:admin")
        history = self.stub.JobHistory(api.JobHistoryRequest(job_id=reply.job_id), timeout=10)
        self.assertEqual(
            [(e.command, e.actor) for e in history.entries], [("submit_job", "cert:admin")]
        )


class AclTokens(unittest.TestCase):
    """Issue 22, item 2: a server with TLS and --acl, called with tokens as
    `authorization: Bearer` metadata by an outside client: bad requests
    name their field, a retried bootstrap gets its first answer, a forged
    caller header or a malformed or revoked token gains nothing, and a user
    cannot read another's job."""

    def setUp(self):
        self.server = Server("--acl", "--no-local-node", "--node-timeout-s", "300", tls=True)
        self.stub = self.server.stub

    def tearDown(self):
        self.server.cleanup()

    @staticmethod
    def bearer(secret):
        return [("authorization", "Bearer " + secret)]

    def refusal(self, call, request, metadata=None):
        return refusal(self, call, request, metadata)

    def test_tokens_from_outside_are_checked_and_bad_ones_gain_nothing(self):
        root_secret = "outside-root-secret-0123456789abcdefghij"
        # A request id without a chosen secret: refused, naming the field.
        code, _, info = self.refusal(
            self.stub.BootstrapAcl, api.BootstrapAclRequest(request_id="py-boot")
        )
        self.assertEqual((code, info.metadata["field"]), (CODE.INVALID_ARGUMENT, "secret"))
        # A secret too short: refused, naming the field and the limit.
        code, message, info = self.refusal(
            self.stub.BootstrapAcl, api.BootstrapAclRequest(secret="short")
        )
        self.assertEqual((code, info.metadata["field"]), (CODE.INVALID_ARGUMENT, "secret"))
        self.assertIn("32 to 256", message)
        # The bootstrap, sent twice (its answer lost): one token, the same
        # answer.
        boot = api.BootstrapAclRequest(secret=root_secret, request_id="py-boot-2")
        first = self.stub.BootstrapAcl(boot, timeout=20)
        again = self.stub.BootstrapAcl(boot, timeout=20)
        self.assertEqual((first.name, first.role, first.secret), ("root", "admin", root_secret))
        self.assertEqual((again.name, again.secret), (first.name, first.secret))
        root = self.bearer(root_secret)
        tokens = self.stub.ListTokens(api.ListTokensRequest(), timeout=10, metadata=root).tokens
        self.assertEqual([(t.name, t.role) for t in tokens], [("root", "admin")])
        # Bad token requests name their field.
        for request, field in [
            (api.CreateTokenRequest(name="alice", role="superuser"), "role"),
            (api.CreateTokenRequest(name="a b", role="user"), "name"),
            (api.CreateTokenRequest(name="alice", role="user", ttl_s=10**12), "ttl_s"),
        ]:
            code, _, info = self.refusal(self.stub.CreateToken, request, root)
            self.assertEqual((code, info.metadata["field"]), (CODE.INVALID_ARGUMENT, field))
        # A secret the leader makes, when none is chosen and no request id
        # is sent.
        alice = self.stub.CreateToken(
            api.CreateTokenRequest(name="alice", role="user"), timeout=20, metadata=root
        )
        self.assertTrue(alice.secret.startswith("keel_") and len(alice.secret) == 69, alice.secret)
        bob_secret = "outside-bob-secret-0123456789abcdefghijk"
        self.stub.CreateToken(
            api.CreateTokenRequest(name="bob", role="user", secret=bob_secret),
            timeout=20,
            metadata=root,
        )
        # Issue 23: a token limited to queues. Bad lists name the field
        # and make nothing; a limited holder submits to its queues only.
        self.stub.CreateQueue(
            api.CreateQueueRequest(
                name="team-a", spec=entry.QueueSpec(quota=entry.GpuCounts(), weight=1)
            ),
            timeout=20,
            metadata=root,
        )
        for request, why in [
            (api.CreateTokenRequest(name="carol", role="operator", queues=["team-a"]),
             "only a user token"),
            (api.CreateTokenRequest(name="carol", role="user", queues=["team-z"]),
             "no queue is named"),
            (api.CreateTokenRequest(name="carol", role="user", queues=["team-a", "team-a"]),
             "named twice"),
            (api.CreateTokenRequest(name="carol", role="user", queues=["q%d" % i for i in range(65)]),
             "at most 64"),
        ]:
            code, message, info = self.refusal(self.stub.CreateToken, request, root)
            self.assertEqual((code, info.metadata["field"]), (CODE.INVALID_ARGUMENT, "queues"))
            self.assertIn(why, message)
        carol = self.stub.CreateToken(
            api.CreateTokenRequest(name="carol", role="user", queues=["team-a"]),
            timeout=20,
            metadata=root,
        )
        carols = self.bearer(carol.secret)
        code, message, info = self.refusal(
            self.stub.SubmitJob, api.SubmitJobRequest(spec=spec("carols-default")), carols
        )
        self.assertEqual((code, info.metadata["right"]), (CODE.PERMISSION_DENIED, "submit-jobs"))
        self.assertIn('queue "team-a" only', message)
        in_team_a = spec("carols")
        in_team_a.queue = "team-a"
        self.stub.SubmitJob(api.SubmitJobRequest(spec=in_team_a), timeout=20, metadata=carols)
        who = self.stub.WhoAmI(api.WhoAmIRequest(), timeout=10, metadata=carols)
        self.assertEqual(list(who.queues), ["team-a"])
        self.stub.RevokeToken(api.RevokeTokenRequest(name="carol"), timeout=20, metadata=root)
        # Alice forges the header replicas use to say whom they forward
        # for: she is still alice.
        forged = self.bearer(alice.secret) + [("keel-caller", "token:root")]
        reply = self.stub.SubmitJob(
            api.SubmitJobRequest(spec=spec("alices")), timeout=20, metadata=forged
        )
        job = self.stub.GetJob(api.GetJobRequest(job_id=reply.job_id), timeout=10, metadata=root)
        self.assertEqual(job.submitted_by, "token:alice")
        code, _, _ = self.refusal(self.stub.SetPolicy, api.SetPolicyRequest(name="fifo"), forged)
        self.assertEqual(code, CODE.PERMISSION_DENIED)
        # Bob may not read or cancel alice's job, nor see it listed.
        bob = self.bearer(bob_secret)
        code, message, info = self.refusal(
            self.stub.GetJob, api.GetJobRequest(job_id=reply.job_id), bob
        )
        self.assertEqual((code, info.reason, info.metadata["right"]),
                         (CODE.PERMISSION_DENIED, "PERMISSION_DENIED", "read-jobs"))
        self.assertIn("job %d" % reply.job_id, message)
        code, _, info = self.refusal(
            self.stub.CancelJob, api.CancelJobRequest(job_id=reply.job_id), bob
        )
        self.assertEqual((code, info.metadata["right"]), (CODE.PERMISSION_DENIED, "cancel-jobs"))
        self.assertEqual(list(self.stub.ListJobs(api.ListJobsRequest(), timeout=10, metadata=bob).jobs), [])
        # Malformed, oversized, unknown: unauthenticated, never a lesser role.
        for metadata in [
            [("authorization", "Basic YWxpY2U6cHc=")],
            [("authorization", "Bearer ")],
            self.bearer("x" * 8000),
            self.bearer(alice.secret + "x"),
        ]:
            code, _, info = self.refusal(self.stub.ClusterStatus, api.ClusterStatusRequest(), metadata)
            self.assertEqual((code, info.reason), (CODE.UNAUTHENTICATED, "UNAUTHENTICATED"))
        # A revocation naming no possible token is refused before it is
        # logged, naming the field; nothing changes.
        before = self.stub.ListTokens(api.ListTokensRequest(), timeout=10, metadata=root).tokens
        for name in ["a b", "x" * 300, ""]:
            code, _, info = self.refusal(self.stub.RevokeToken, api.RevokeTokenRequest(name=name), root)
            self.assertEqual((code, info.metadata["field"]), (CODE.INVALID_ARGUMENT, "name"))
        after = self.stub.ListTokens(api.ListTokensRequest(), timeout=10, metadata=root).tokens
        self.assertEqual([t.name for t in after], [t.name for t in before])
        # Revoked: refused from then on.
        self.stub.RevokeToken(api.RevokeTokenRequest(name="alice"), timeout=20, metadata=root)
        code, message, _ = self.refusal(self.stub.ListJobs, api.ListJobsRequest(), self.bearer(alice.secret))
        self.assertEqual(code, CODE.UNAUTHENTICATED)
        self.assertIn("not one of this cluster's", message)
        # Still serving, and what it acknowledged is there.
        names = [j.spec.name for j in self.stub.ListJobs(api.ListJobsRequest(), timeout=10, metadata=root).jobs]
        self.assertEqual(names, ["carols", "alices"])


    def test_a_backup_is_for_an_admin_and_holds_the_state_it_names(self):
        """Issue 25, item 6: SaveSnapshot answers an admin token only, in
        pieces that together are a SnapshotFile whose state hash and index
        are those the cluster shows."""
        root_secret = "outside-root-secret-backup-0123456789ab"
        self.stub.BootstrapAcl(api.BootstrapAclRequest(secret=root_secret), timeout=20)
        root = self.bearer(root_secret)
        user_secret = "outside-user-secret-backup-0123456789ab"
        self.stub.CreateToken(
            api.CreateTokenRequest(name="dana", role="user", secret=user_secret),
            timeout=20,
            metadata=root,
        )
        for who in [self.bearer(user_secret), None, [("x-keel-caller", "member 1")]]:
            with self.assertRaises(grpc.RpcError) as caught:
                list(self.stub.SaveSnapshot(api.SaveSnapshotRequest(), timeout=20, metadata=who))
            self.assertIn(
                caught.exception.code(),
                (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED),
                caught.exception.details(),
            )
        pieces = list(self.stub.SaveSnapshot(api.SaveSnapshotRequest(), timeout=20, metadata=root))
        self.assertTrue(pieces)
        self.assertTrue(all(len(p.data) <= 1 << 20 for p in pieces))
        saved = api.SnapshotFile.FromString(b"".join(p.data for p in pieces))
        status = self.stub.ClusterStatus(api.ClusterStatusRequest(), timeout=10, metadata=root)
        self.assertEqual(saved.format, 1)
        self.assertEqual(saved.state_hash, status.state_hash)
        self.assertEqual(saved.index, status.last_applied_index)
        self.assertEqual(saved.cluster_id, status.cluster_id)
        self.assertTrue(saved.state)


class Queues(OneServer):
    """Issue 23, item 1: queues from outside. Every bad request is refused
    naming its field and changes nothing, and a change sent again under
    its request id applies once."""

    args = ("--simulated-gpus", "2xv100", "--node-timeout-s", "300")

    def quota(self, **gpus):
        return entry.QueueSpec(quota=entry.GpuCounts(gpus=gpus), weight=1)

    def test_bad_queue_requests_name_their_field_and_change_nothing(self):
        wait_for("the node", lambda: self.stub.ListNodes(api.ListNodesRequest(), timeout=10).nodes or None)
        for request, field in [
            (api.CreateQueueRequest(name="Team A", spec=self.quota(v100=1)), "name"),
            (api.CreateQueueRequest(name="x" * 64, spec=self.quota(v100=1)), "name"),
            (api.CreateQueueRequest(name="team-a"), "spec"),
            (api.CreateQueueRequest(name="team-a", spec=self.quota(h100=1)), "quota"),
            (api.CreateQueueRequest(name="team-a", spec=self.quota(v100=2_000_000)), "quota"),
            (api.CreateQueueRequest(name="team-a", spec=entry.QueueSpec(weight=1)), "quota"),
            (api.CreateQueueRequest(name="team-a", spec=entry.QueueSpec(
                quota=entry.GpuCounts(gpus={"v100": 1}), weight=0)), "weight"),
            (api.CreateQueueRequest(name="team-a", spec=entry.QueueSpec(
                quota=entry.GpuCounts(gpus={"v100": 1}), weight=1, borrow_limit={"v100": 1})), "cohort"),
            (api.CreateQueueRequest(name="team-a", spec=entry.QueueSpec(
                quota=entry.GpuCounts(gpus={"v100": 1}), weight=1, cohort="Bad Cohort")), "cohort"),
            (api.UpdateQueueRequest(name="nowhere", spec=self.quota(v100=1)), "name"),
            (api.DeleteQueueRequest(name="a b"), "name"),
        ]:
            call = {
                api.CreateQueueRequest: self.stub.CreateQueue,
                api.UpdateQueueRequest: self.stub.UpdateQueue,
                api.DeleteQueueRequest: self.stub.DeleteQueue,
            }[type(request)]
            code, message, info = refusal(self, call, request)
            self.assertIn(code, (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), message)
            self.assertEqual(info.metadata["field"], field, message)
        code, _, _ = refusal(self, self.stub.DeleteQueue, api.DeleteQueueRequest(name="default"))
        self.assertEqual(code, grpc.StatusCode.FAILED_PRECONDITION)
        # A job naming no queue that exists: refused, naming the field.
        code, message, info = refusal(
            self, self.stub.SubmitJob, api.SubmitJobRequest(spec=spec("lost", queue="nowhere"))
        )
        self.assertEqual((code, info.metadata["field"]), (grpc.StatusCode.INVALID_ARGUMENT, "queue"), message)
        # Nothing changed.
        names = [q.name for q in self.stub.ListQueues(api.ListQueuesRequest(), timeout=10).queues]
        self.assertEqual(names, ["default"])
        # A creation sent twice under one request id: one queue, one answer.
        create = api.CreateQueueRequest(name="team-a", spec=self.quota(v100=1), request_id="py-queue-1")
        self.stub.CreateQueue(create, timeout=20)
        # The answer was lost; the same request again is taken, not
        # refused as a second queue of that name.
        self.stub.CreateQueue(create, timeout=20)
        names = [q.name for q in self.stub.ListQueues(api.ListQueuesRequest(), timeout=10).queues]
        self.assertEqual(names, ["default", "team-a"])
        code, _, info = refusal(self, self.stub.CreateQueue,
                                api.CreateQueueRequest(name="team-a", spec=self.quota(v100=1)))
        self.assertEqual((code, info.reason), (grpc.StatusCode.ALREADY_EXISTS, "QUEUE_EXISTS"))
        # A queue holding an unfinished job is kept.
        held = spec("held", queue="team-a")
        del held.command[:]
        held.command.extend(["sleep", "60"])
        job = self.stub.SubmitJob(api.SubmitJobRequest(spec=held), timeout=20).job_id
        code, message, _ = refusal(self, self.stub.DeleteQueue, api.DeleteQueueRequest(name="team-a"))
        self.assertEqual(code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("job %d" % job, message)
        listed = self.stub.ListJobs(api.ListJobsRequest(queue="team-a"), timeout=10).jobs
        self.assertEqual([j.id for j in listed], [job])
        self.stub.CancelJob(api.CancelJobRequest(job_id=job), timeout=20)
        self.stub.DeleteQueue(api.DeleteQueueRequest(name="team-a"), timeout=20)
        names = [q.name for q in self.stub.ListQueues(api.ListQueuesRequest(), timeout=10).queues]
        self.assertEqual(names, ["default"])


def secret_key_file():
    """A file holding a fresh key from `keel secret new-key`."""
    import tempfile

    key = subprocess.run([KEEL, "secret", "new-key"], check=True, capture_output=True, text=True).stdout
    fd, path = tempfile.mkstemp(prefix="keel-blackbox-key-")
    with os.fdopen(fd, "w") as f:
        f.write(key)
    return path


class Secrets(OneServer):
    """Issue 35: secrets from outside. Bad puts are refused naming their
    field and change nothing; a put sent again under its request id is
    taken once; no answer holds a value; a job naming a secret or key that
    does not exist is refused."""

    VALUE = b"py-outside-credential-5e2d"

    def setUp(self):
        self.key_file = secret_key_file()
        self.args = ("--no-local-node", "--node-timeout-s", "300", "--secret-key-file", self.key_file)
        super().setUp()

    def tearDown(self):
        super().tearDown()
        os.remove(self.key_file)

    def test_bad_secret_requests_name_their_field_and_a_retry_applies_once(self):
        put = self.stub.PutSecret
        for request, field in [
            (api.PutSecretRequest(name="Bad Name", values={"k": b"v"}), "name"),
            (api.PutSecretRequest(name="x" * 64, values={"k": b"v"}), "name"),
            (api.PutSecretRequest(name="empty"), "values"),
            (api.PutSecretRequest(name="many", values={"k%d" % i: b"v" for i in range(65)}), "values"),
            (api.PutSecretRequest(name="bad-key", values={"a key": b"v"}), "values"),
            (api.PutSecretRequest(name="long", values={"k": b"v" * 8193}), "values.k"),
            (api.PutSecretRequest(name="binary", values={"k": b"\xff\xfe"}), "values.k"),
            (api.PutSecretRequest(name="nul", values={"k": b"a\x00b"}), "values.k"),
            (api.PutSecretRequest(name="lost", values={"k": b"v"}, queue="nowhere"), "queue"),
        ]:
            code, message, info = refusal(self, put, request)
            self.assertEqual(code, CODE.INVALID_ARGUMENT, message)
            self.assertEqual(info.metadata["field"], field, message)
        code, _, info = refusal(self, self.stub.DeleteSecret, api.DeleteSecretRequest(name="nowhere"))
        self.assertEqual((code, info.reason), (CODE.NOT_FOUND, "SECRET_NOT_FOUND"))
        self.assertEqual(list(self.stub.ListSecrets(api.ListSecretsRequest(), timeout=10).secrets), [])
        # Sent twice under one request id (the answer was lost): one put.
        request = api.PutSecretRequest(name="tracker", values={"api_key": self.VALUE}, request_id="py-secret-1")
        self.assertEqual(put(request, timeout=20).revision, 1)
        self.assertEqual(put(request, timeout=20).revision, 1, "the retry gets the first answer")
        listed = self.stub.ListSecrets(api.ListSecretsRequest(), timeout=10)
        self.assertEqual([(s.name, list(s.keys), s.revision) for s in listed.secrets], [("tracker", ["api_key"], 1)])
        self.assertTrue(listed.secrets[0].opens_here)
        self.assertNotIn(self.VALUE, listed.SerializeToString())
        # A job naming a secret or a key that does not exist is refused.
        for ref in ("nowhere/api_key", "tracker/nope"):
            code, message, info = refusal(
                self, self.stub.SubmitJob, api.SubmitJobRequest(spec=spec("lost", secret_env={"K": ref}))
            )
            self.assertEqual((code, info.reason), (CODE.NOT_FOUND, "SECRET_NOT_FOUND"), message)
        code, message, info = refusal(
            self, self.stub.SubmitJob, api.SubmitJobRequest(spec=spec("bad", secret_env={"K": "no-slash"}))
        )
        self.assertEqual((code, info.metadata["field"]), (CODE.INVALID_ARGUMENT, "spec.env.K"), message)
        self.assertIn("NAME/KEY", message)
        job = self.stub.SubmitJob(
            api.SubmitJobRequest(spec=spec("uses", secret_env={"TRACKER_KEY": "tracker/api_key"})), timeout=20
        ).job_id
        answer = self.stub.GetJob(api.GetJobRequest(job_id=job), timeout=10)
        self.assertEqual(dict(answer.spec.secret_env), {"TRACKER_KEY": "tracker/api_key"})
        self.assertNotIn(self.VALUE, answer.SerializeToString())
        # A rotation with the one key this server holds re-seals nothing,
        # and again nothing: it is idempotent, so a client may retry it.
        for _ in range(2):
            rotated = self.stub.RotateSecretKey(api.RotateSecretKeyRequest(), timeout=20)
            self.assertEqual((rotated.resealed, rotated.already_current), (0, 1))
            self.assertEqual(rotated.key_id, listed.key_ids_held[0])
        # Kept while the job is unfinished.
        code, message, _ = refusal(self, self.stub.DeleteSecret, api.DeleteSecretRequest(name="tracker"))
        self.assertEqual(code, CODE.FAILED_PRECONDITION, message)
        self.assertIn("job %d" % job, message)
        self.assert_serving(["uses"])


class NoSecretKey(OneServer):
    """Issue 35: a server started without a key refuses to keep or re-seal
    a secret, saying how to give it one."""

    def test_a_put_or_rotation_without_a_key_is_refused_naming_the_flag(self):
        code, message, info = refusal(
            self, self.stub.PutSecret, api.PutSecretRequest(name="tracker", values={"k": b"v"})
        )
        self.assertEqual((code, info.reason), (CODE.FAILED_PRECONDITION, "SECRET_KEY_MISSING"), message)
        self.assertIn("--secret-key-file", message)
        code, message, info = refusal(self, self.stub.RotateSecretKey, api.RotateSecretKeyRequest())
        self.assertEqual((code, info.reason), (CODE.FAILED_PRECONDITION, "SECRET_KEY_MISSING"), message)
        listed = self.stub.ListSecrets(api.ListSecretsRequest(), timeout=10)
        self.assertEqual((list(listed.secrets), list(listed.key_ids_held)), ([], []))
        self.assert_serving([])


class Admission(OneServer):
    """Issue 23, items 2 and 6: a queue's quota holds from outside. A job
    beyond its queue's quota waits, and GetJob says why; a job within
    another queue's quota starts beside it."""

    args = ("--simulated-gpus", "2xv100", "--node-timeout-s", "300", "--round-s", "0.2")

    def test_a_job_beyond_its_queues_quota_waits_and_says_why(self):
        wait_for("the node", lambda: self.stub.ListNodes(api.ListNodesRequest(), timeout=10).nodes or None)
        for name in ("small", "other"):
            self.stub.CreateQueue(api.CreateQueueRequest(
                name=name, spec=entry.QueueSpec(quota=entry.GpuCounts(gpus={"v100": 1}), weight=1)), timeout=20)

        def sleeper(name, queue):
            s = spec(name, queue=queue)
            del s.command[:]
            s.command.extend(["sleep", "60"])
            return self.stub.SubmitJob(api.SubmitJobRequest(spec=s), timeout=20).job_id

        def job(job_id):
            return self.stub.GetJob(api.GetJobRequest(job_id=job_id), timeout=10)

        first = sleeper("first", "small")
        wait_for("the first job to run", lambda: job(first).HasField("allocation") or None)
        second = sleeper("second", "small")
        waiting = wait_for("the second job's reason", lambda: "over quota" in job(second).message and job(second))
        self.assertFalse(waiting.HasField("allocation"), waiting)
        self.assertIn('queue "small"', waiting.message)
        # The other queue's GPU is its own: its job starts at once.
        third = sleeper("third", "other")
        wait_for("the other queue's job to run", lambda: job(third).HasField("allocation") or None)
        self.assertFalse(job(second).HasField("allocation"))
        for j in (first, second, third):
            self.stub.CancelJob(api.CancelJobRequest(job_id=j), timeout=20)


class Paging(OneServer):
    """ListJobs answers a page at a time; a bad size or token names its
    field."""

    def test_jobs_come_a_page_at_a_time_and_bad_pages_name_their_field(self):
        for i in range(3):
            self.stub.SubmitJob(api.SubmitJobRequest(spec=spec("p%d" % i)), timeout=20)
        ids, token = [], ""
        while True:
            page = self.stub.ListJobs(api.ListJobsRequest(page_size=2, page_token=token), timeout=10)
            ids.append([j.id for j in page.jobs])
            token = page.next_page_token
            if not token:
                break
        self.assertEqual(ids, [[1, 2], [3]])
        for request, field in [
            (api.ListJobsRequest(page_size=10001), "page_size"),
            (api.ListJobsRequest(page_token="x"), "page_token"),
        ]:
            code, message, info = refusal(self, self.stub.ListJobs, request)
            self.assertEqual((code, info.metadata["field"]), (grpc.StatusCode.INVALID_ARGUMENT, field), message)
        self.assert_serving(["p0", "p1", "p2"])


class NoIdentityInPlaintext(OneServer):
    """Issue 22, item 3: without TLS there is no identity: an entry records
    no actor, whatever `keel-caller` header the caller sends."""

    def test_a_plaintext_caller_cannot_name_itself(self):
        reply = self.stub.SubmitJob(
            api.SubmitJobRequest(spec=spec("plain")),
            timeout=20,
            metadata=[("keel-caller", "cert:admin")],
        )
        job = self.stub.GetJob(api.GetJobRequest(job_id=reply.job_id), timeout=10)
        self.assertEqual(job.submitted_by, "")
        history = self.stub.JobHistory(api.JobHistoryRequest(job_id=reply.job_id), timeout=10)
        self.assertEqual([e.actor for e in history.entries], [""])
        self.assert_serving(["plain"])


class Overload(OneServer):
    """Issue 22, item 5: a replica works on at most --max-api-requests
    requests at once; one more is refused at once (RESOURCE_EXHAUSTED,
    nothing done), while health checks are still answered. Here the one
    place is held by an AddMember that waits for a member nothing answers
    for."""

    args = OneServer.args + ("--max-api-requests", "1")

    def test_a_request_over_the_bound_is_refused_and_health_still_answers(self):
        held = self.stub.AddMember.future(
            api.AddMemberRequest(id=2, address="127.0.0.1:1"), timeout=60
        )

        def refused():
            try:
                self.stub.ListJobs(api.ListJobsRequest(), timeout=10)
            except grpc.RpcError as e:
                if e.code() == CODE.RESOURCE_EXHAUSTED:
                    return e.details()
                raise
            self.assertFalse(held.done(), "AddMember ended before a refusal was seen")
            return None

        details = wait_for("a refusal while AddMember holds the place", refused)
        self.assertIn("--max-api-requests", details)
        status = self.stub.ClusterStatus(api.ClusterStatusRequest(), timeout=10)
        self.assertEqual(status.role, "leader")
        with self.assertRaises(grpc.RpcError) as caught:
            held.result()
        self.assertEqual(caught.exception.code(), CODE.FAILED_PRECONDITION)
        # The place is free again.
        self.stub.SubmitJob(api.SubmitJobRequest(spec=spec("after")), timeout=20)
        self.assert_serving(["after"])
