"""The co-located architecture: ColocatedRetriever on --device cpu and sim equals the reference through
update streams; the co-located Flight server answers a plain pyarrow.flight client correctly, reports
health and stats, rejects malformed requests clearly and keeps serving, and takes updates while
serving. Servers bind 127.0.0.1 and are started and stopped here."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from serving import protocol as fl
from andromeda_nb.compare import compare_topk
from andromeda_nb.dataset import Dataset
from andromeda_nb.model import MoeModel, quantize
from andromeda_nb.reference import ReferenceRetriever
from andromeda_nb.targeting import request_to_json
from andromeda_nb.testing import KERNEL_DEVICE, random_ads, random_requests, random_updates, update_to_json

SEED = 0


def make_dataset(seed, n_ads=150, n_requests=4, precision="fp32", D=16, F=2):
    rng = np.random.default_rng(seed)
    ads = [a for a in random_ads(rng, n_ads, dim=D)]
    ads = [a.__class__(**{**a.__dict__, "format": a.format % F}) for a in ads]
    requests = random_requests(rng, n_requests)
    model = MoeModel.init(seed, D=D, F=F)
    table = quantize(np.stack([a.embedding for a in ads]), precision)
    return Dataset(ads=ads, embeddings=table, requests=requests, model=model, seed=SEED, precision=precision), rng


def assert_equal_reference(reference, requests, answers, k, context):
    assert len(answers) == len(requests)
    for request, (ids, scores) in zip(requests, answers):
        ref_ids, result = reference.score_eligible(request)
        cmp = compare_topk(ref_ids, result, ids, scores, k)
        assert cmp.ok, f"{context}, request {request.request_id}, k={k}: {cmp.message}"


def _updates(rng, reference, dataset, n):
    ups = random_updates(rng, list(reference.index.ads.values()), n, dim=dataset.model.D)
    out = []
    for u in ups:  # keep formats inside the model's F
        ad = getattr(u, "ad", None)
        if ad is not None and ad.format >= dataset.model.F:
            u = u.__class__(ad.__class__(**{**ad.__dict__, "format": ad.format % dataset.model.F}))
        out.append(u)
    return out


@pytest.mark.parametrize("device,precision", [("cpu", "int8"), ("cpu", "fp16"), (KERNEL_DEVICE, "int8")])
def test_colocated_equals_reference_through_updates(device, precision):
    from migration.colocated import ColocatedRetriever

    dataset, rng = make_dataset(31, precision=precision, n_requests=3 if device == KERNEL_DEVICE else 8)
    reference = ReferenceRetriever.build(dataset)
    retriever = ColocatedRetriever.build(dataset, device=device)
    try:
        assert retriever.device == device
        for step in range(2):
            for k in ((7,) if device == KERNEL_DEVICE else (1, 10, 200)):
                answers = retriever.retrieve(dataset.requests, k)
                assert_equal_reference(reference, dataset.requests, answers, k, f"{device} {precision} step {step}")
            assert sum(len(a[0]) for a in answers) > 0
            for update in _updates(rng, reference, dataset, 15):
                reference.apply(update)
                retriever.apply(update)
    finally:
        retriever.close()


def test_the_gpu_engine_applies_a_slice_in_one_piece_as_it_applies_updates_one_by_one():
    """`GpuEngine.apply_many` (one index upload for many updates, what the co-located server does with
    each slice) against `apply` one at a time and the reference, on a stream that upserts an ad twice,
    upserts a new ad and retires it, and retires an ad and brings it back, within one call."""
    from andromeda_nb.types import Retire, Upsert
    from gpu.engine import GpuEngine

    dataset, rng = make_dataset(43, precision="fp16", n_requests=3)
    reference = ReferenceRetriever.build(dataset)
    stream = _updates(rng, reference, dataset, 12)
    ad = dataset.ads[0]
    again = ad.__class__(**{**ad.__dict__, "embedding": rng.standard_normal(dataset.model.D).astype(np.float32)})
    last = again.__class__(**{**again.__dict__, "embedding": -again.embedding})
    fresh = ad.__class__(**{**ad.__dict__, "ad_id": 10**12 + 7})
    victim = dataset.ads[1]
    stream += [Upsert(again), Upsert(last), Upsert(fresh), Retire(fresh.ad_id), Retire(victim.ad_id), Upsert(victim)]
    whole, single = GpuEngine(dataset, KERNEL_DEVICE), GpuEngine(dataset, KERNEL_DEVICE)
    try:
        whole.apply_many(stream)
        for update in stream:
            single.apply(update)
            reference.apply(update)
        assert len(whole) == len(single) == len(reference.index.ads)
        # the same state in every live slot: ad id, stored embedding and scale, eligibility word (a
        # slot freed within the call may keep what `apply` wrote there before: no request reads it)
        live = np.flatnonzero(whole.index.slots.slot_ad_id >= 0)
        assert np.array_equal(live, np.flatnonzero(single.index.slots.slot_ad_id >= 0)) and len(live)
        for name in ("_values", "_scale", "_slot_ad_id"):
            assert np.array_equal(getattr(whole.scorer, name)[live], getattr(single.scorer, name)[live]), name
        assert np.array_equal(whole.scorer.d_scale.copy_to_host()[live], single.scorer.d_scale.copy_to_host()[live])
        assert np.array_equal(whole.index.d_resid.copy_to_host()[live], single.index.d_resid.copy_to_host()[live])
        got, want = whole.retrieve(dataset.requests, 9), single.retrieve(dataset.requests, 9)
        for (gi, gs), (wi, ws) in zip(got, want):
            assert np.array_equal(gi, wi) and np.array_equal(gs, ws)
        assert_equal_reference(reference, dataset.requests, got, 9, "apply_many")
        assert sum(len(ids) for ids, _ in got) > 0
    finally:
        whole.close()
        single.close()


@pytest.fixture(scope="module")
def server():
    from migration.colocated import make_server

    dataset, rng = make_dataset(41, precision="int8", n_requests=6)
    # its batches overlapped (serving.overlap): the tests below run that path, with updates and bad input;
    # the rest of the suite runs batches one after another
    srv = make_server(dataset, "grpc://127.0.0.1:0", device="cpu", overlap=True)
    assert srv.batcher.overlap is not None
    yield srv, f"grpc://127.0.0.1:{srv.port}", dataset, rng
    srv.shutdown()
    srv.close_resources()


def ask_plainly(location, requests, k):
    """The answers a plain pyarrow.flight client gets for `requests` in one retrieve exchange, and the
    table they came in."""
    client = flight.connect(location)
    batch = pa.record_batch([pa.array([r.request_id for r in requests], pa.int64()),
                             pa.array([json.dumps(request_to_json(r)) for r in requests], pa.utf8()),
                             pa.array([k] * len(requests), pa.int32())],
                            names=["request_id", "request", "k"])
    writer, reader = client.do_exchange(flight.FlightDescriptor.for_path("retrieve"))
    with writer:
        writer.begin(batch.schema)
        writer.write_batch(batch)
        writer.done_writing()
        table = reader.read_all()
    client.close()
    rid = table.column("request_id").to_numpy()
    answers = [(table.column("ad_id").to_numpy()[rid == r.request_id], table.column("score").to_numpy()[rid == r.request_id])
               for r in requests]
    return answers, table


def test_plain_flight_client_gets_correct_answers(server):
    srv, location, dataset, _ = server
    answers, table = ask_plainly(location, dataset.requests, 9)
    assert table.schema.names == ["request_id", "ad_id", "score"]
    assert_equal_reference(ReferenceRetriever.build(dataset), dataset.requests, answers, 9, "plain client")
    assert len(table) > 0


def test_a_server_with_slots_laid_out_by_geography_answers_as_the_reference_and_the_cpu_refuses_it():
    from migration.architectures import build_engine
    from migration.colocated import make_server

    dataset, _ = make_dataset(43, precision="int8", n_requests=3)
    srv = make_server(dataset, "grpc://127.0.0.1:0", device=KERNEL_DEVICE, layout="geo")
    try:
        assert srv.engine.describe()["layout"] == "geo"
        answers, table = ask_plainly(f"grpc://127.0.0.1:{srv.port}", dataset.requests, 7)
        assert len(table) > 0
        assert_equal_reference(ReferenceRetriever.build(dataset), dataset.requests, answers, 7, "geo layout")
    finally:
        srv.shutdown()
        srv.close_resources()
    with pytest.raises(ValueError, match="the slot layout 'geo' is the GPU engine's"):
        build_engine(dataset, "cpu", layout="geo")
    with pytest.raises(ValueError, match="unknown slot layout 'zigzag'; choose from format, geo"):
        build_engine(dataset, "cpu", layout="zigzag")


def test_malformed_request_gets_a_clear_error_and_serving_goes_on(server):
    srv, location, dataset, _ = server
    client = flight.connect(location)
    bad = pa.record_batch([pa.array([1], pa.int64()), pa.array(['{"user": '], pa.utf8()), pa.array([5], pa.int32())],
                          schema=fl.REQUEST_SCHEMA)
    with pytest.raises(flight.FlightServerError, match="invalid request: request 1: request is not valid JSON"):
        fl.exchange_batches(client, [bad], timeout=10)
    with pytest.raises(flight.FlightServerError, match="k = 0 is outside"):
        fl.exchange_batches(client, [fl.request_batch([request_to_json(dataset.requests[0])], [0])], timeout=10)
    client.close()
    assert len(fl.retrieve_over_flight(location, dataset.requests[:2], 5)) == 2
    stats = fl.flight_action(location, "stats")
    assert stats["errors"] >= 2 and stats["requests"] >= 2
    health = fl.flight_action(location, "health")
    assert health["status"] == "ok" and health["device"] == "cpu" and health["ads"] == len(srv.engine)


def test_updates_while_serving(server):
    srv, location, dataset, rng = server
    reference = ReferenceRetriever.build(dataset)
    updates = _updates(rng, reference, dataset, 20)
    ack = fl.flight_action(location, "update", "\n".join(json.dumps(update_to_json(u)) for u in updates))
    seconds = ack.pop("seconds")  # where the call's time went
    assert set(seconds) == {"parse", "log", "apply"} and all(v >= 0 for v in seconds.values()), seconds
    assert ack == {"applied": len(updates), "rejected": [], "seq": len(updates)}
    for u in updates:
        reference.apply(u)
    answers = fl.retrieve_over_flight(location, dataset.requests, 12)
    assert_equal_reference(reference, dataset.requests, answers, 12, "after updates")
    ack = fl.flight_action(location, "update", json.dumps({"op": "retire", "ad_id": 987654321}))
    assert ack["applied"] == 0 and "does not exist" in ack["rejected"][0]["error"]


@pytest.mark.parametrize("overlap", [False, True])
def test_concurrent_plain_clients_share_engine_batches_and_get_their_own_answers(overlap):
    """Sixteen plain Flight clients at once, one request each: every answer equals the reference at
    its own k, and the server ran fewer engine batches than it took calls (serving.batcher); also with
    its batches overlapped (serving.overlap: here the CPU engine's batch in one piece at its fetch)."""
    import threading

    from migration.colocated import make_server

    dataset, _ = make_dataset(43, precision="fp16", n_requests=16)
    srv = make_server(dataset, "grpc://127.0.0.1:0", device="cpu", batch_wait_s=0.05, overlap=overlap)
    location = f"grpc://127.0.0.1:{srv.port}"
    reference = ReferenceRetriever.build(dataset)
    got, errors = {}, []

    def client(i):
        try:
            r = dataset.requests[i]
            got[i] = fl.retrieve_over_flight(location, [r], 3 + i)[0]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        for i, r in enumerate(dataset.requests):
            assert_equal_reference(reference, [r], [got[i]], 3 + i, f"client {i}")
        batching = fl.flight_action(location, "stats")["batching"]
        assert batching["calls"] == 16 and batching["requests"] == 16
        assert batching["batches"] < 16 and batching["overlap"] is overlap, batching
    finally:
        srv.shutdown()
        srv.close_resources()


def test_both_engines_break_a_request_into_stages_over_the_same_eligible_ads():
    """`stages` (what the demo's stage line and `andromeda_nb.engine.stage_breakdown` read): on the
    GPU engine and the CPU engine, every stage timed, and scoring over exactly the ads the reference
    finds eligible, reading their stored bytes; the GPU match reads the live index and the
    eligibility bits."""
    from andromeda_nb.budget import stored_ad_bytes
    from andromeda_nb.engine import stage_breakdown
    from cpu_baseline.engine import CpuEngine
    from gpu.engine import GpuEngine

    dataset, _ = make_dataset(47, precision="fp16", n_requests=4)
    reference = ReferenceRetriever.build(dataset)
    gpu, cpu = GpuEngine(dataset, KERNEL_DEVICE), CpuEngine(dataset)
    try:
        for request in dataset.requests:
            want = len(reference.index.match([request])[0])
            g, c = gpu.stages(request, 5), cpu.stages(request, 5)
            assert list(g) == ["user_side", "match_preparation", "match", "scoring_and_topk", "answers"]
            assert list(c) == ["match", "user_side", "scoring", "topk"]
            assert all(row["seconds"] > 0 for row in (*g.values(), *c.values()))
            assert g["scoring_and_topk"]["eligible"] == c["scoring"]["eligible"] == want
            assert c["scoring"]["bytes"] == want * stored_ad_bytes("fp16", dataset.model.D)
            assert g["match"]["bytes"] == sum(gpu.index.live_bytes().values()) + gpu.index.capacity // 8
        table = stage_breakdown(cpu, dataset.requests, 5, repeat=1)
        assert list(table) == ["match", "user_side", "scoring", "topk"] and table["scoring"]["us"] > 0
    finally:
        gpu.close()
        cpu.close()


def test_an_empty_request_batch_gets_an_empty_answer_at_the_current_seq(server):
    """A batch of no requests on an exchange (requests are decoded on the batcher's worker, but this
    one never reaches it) is answered with no rows and the sequence number the server is at, and a
    request batch after it on the same exchange is answered as usual."""
    srv, location, dataset, rng = server
    client = flight.connect(location)
    try:
        writer, reader = client.do_exchange(flight.FlightDescriptor.for_path(*fl.RETRIEVE_PATH))
        with writer:
            writer.begin(fl.REQUEST_SCHEMA)
            writer.write_batch(pa.RecordBatch.from_pylist([], schema=fl.REQUEST_SCHEMA))
            chunk = reader.read_chunk()
            assert chunk.data.num_rows == 0 and fl.answer_seq(chunk) == srv.seq
            writer.write_batch(fl.request_batch(dataset.requests[:1], 5))
            chunk = reader.read_chunk()
            assert set(chunk.data.column("request_id").to_pylist()) == {dataset.requests[0].request_id}
            assert fl.answer_seq(chunk) == srv.seq
            writer.done_writing()
    finally:
        client.close()
