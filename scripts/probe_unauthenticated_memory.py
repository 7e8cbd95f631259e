"""How much memory unauthenticated calls take from a server with tokens (issue 37, point 2: four
400 MB calls should leave the server's peak resident memory within 64 MB of idle).

Starts `python -m migration.colocated_server` (CPU engine, a small generated corpus, tokens from the
environment) on loopback, warms it with a few retrievals, notes its resident memory at rest, then for
each kind of call sends `--calls` concurrent calls of `--mb` MB each without a token and reads the
server's peak resident memory over them (`VmHWM`, reset before each kind through
/proc/PID/clear_refs, so no spike between two samples is missed) and its resident memory a second
after:

* `action-update`: `DoAction("update")` with the body whole, as the `update` action takes it;
* `exchange-retrieve`: a `["retrieve"]` exchange whose one request batch holds the bytes;
* `exchange-update`: the streamed `["update"]` exchange, the body in chunks of 1 MiB
  (`serving.protocol.UPDATE_CHUNK_BYTES`).

With `--mtls` the server also requires mutual TLS (`--tls-cert`, `--tls-key`, `--tls-client-ca`, certificates
from `serving.certificates`), and the calls come from clients that trust the server's CA but present no
certificate of their own: the TLS handshake refuses them before any byte of a call reaches gRPC, so
no kind of call, a `DoAction` included, can make the server hold its body. One more kind runs there,
`action-update-certified`: the action from a client that holds a certificate the CA signed but no
token, which the handshake admits, so gRPC reads its body whole before the token is checked.

Every call must be refused as unauthenticated (a call that is not is reported). Not a test: the
figures depend on the machine's allocator and gRPC; the test of the order of the checks is
tests/serving/test_limits.py (`::test_an_unauthenticated_or_over_limit_call_is_refused_before_its_body_is_parsed`).

    PYTHONPATH=. python3 scripts/probe_unauthenticated_memory.py --calls 4 --mb 400 \\
        --out docs/results/reliability/unauthenticated_memory_cpu.json
    PYTHONPATH=. python3 scripts/probe_unauthenticated_memory.py --calls 4 --mb 400 --mtls \\
        --out docs/results/reliability/unauthenticated_memory_mtls_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402
import pyarrow.flight as flight  # noqa: E402

from andromeda_nb.measure import log  # noqa: E402
from andromeda_nb.provenance import finish_probe  # noqa: E402
from serving import protocol as fl  # noqa: E402
from serving.certificates import make_local_certificates  # noqa: E402
from serving.guard import ClientCredentials  # noqa: E402
from serving.services import ServiceProcess  # noqa: E402

READER, ADMIN = "probe-reader-token-0123456789", "probe-admin-token-0123456789"
KINDS = ("action-update", "exchange-retrieve", "exchange-update")


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def reset_peak(pid: int) -> None:
    """Start VmHWM again from the current resident memory (Linux 4.0 and later)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def one_call(location: str, kind: str, payload, results: list, connect: dict) -> None:
    client = flight.connect(location, **connect)
    try:
        if kind.startswith("action-update"):
            list(client.do_action(flight.Action("update", payload), options=flight.FlightCallOptions(timeout=300)))
        elif kind == "exchange-retrieve":
            writer, reader = client.do_exchange(flight.FlightDescriptor.for_path(*fl.RETRIEVE_PATH),
                                                options=flight.FlightCallOptions(timeout=300))
            with writer:
                writer.begin(payload.schema)
                writer.write_batch(payload)
                writer.done_writing()
                reader.read_all()
        else:
            fl.send_update_stream(client, payload, timeout=300)
        results.append("answered")
    except flight.FlightUnauthenticatedError:
        results.append("unauthenticated")
    except flight.FlightUnavailableError as exc:
        # gRPC's word for a channel whose TLS handshake failed (no client certificate under mutual TLS)
        results.append("handshake refused" if "tls_root_certs" in connect else f"FlightUnavailableError: {str(exc)[:120]}")
    except Exception as exc:  # noqa: BLE001 - reported
        results.append(f"{type(exc).__name__}: {str(exc)[:120]}")
    finally:
        client.close()


def payload_of(kind: str, mb: int):
    size = mb << 20
    if kind == "exchange-retrieve":
        row = b"x" * (1 << 20)
        texts = pa.array([row] * mb, pa.binary()).cast(pa.utf8())
        return pa.record_batch([pa.array(range(mb), pa.int64()), texts, pa.array([10] * mb, pa.int32())],
                               schema=fl.REQUEST_SCHEMA)
    line = b'{"op":"retire","ad_id":1}\n'
    return line * (size // len(line))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--mb", type=int, default=400)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--mtls", action="store_true",
                        help="the server requires mutual TLS; the calls come without a client certificate")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from andromeda_nb.corpus import generate_corpus

    results = {"calls": args.calls, "mb": args.mb, "mutual_tls": args.mtls, "kinds": {}}
    with tempfile.TemporaryDirectory(prefix="andromeda-memory-") as tmp:
        root = Path(tmp) / "corpus"
        generate_corpus(root, 2000, 16, 1)
        server_args = ["--data", str(root), "--device", "cpu", "--port", "0", "--log", "off"]
        reader = ClientCredentials(token=READER)
        caller_ca = certified = None  # the unauthenticated callers' trust: none on plain gRPC
        if args.mtls:
            certs = make_local_certificates(Path(tmp) / "certs")
            server_args += ["--tls-cert", str(certs["server"]), "--tls-key", str(certs["server_key"]),
                            "--tls-client-ca", str(certs["ca"])]
            reader = ClientCredentials.from_files(token=READER, tls_ca=certs["ca"], tls_cert=certs["client"],
                                                  tls_key=certs["client_key"])
            caller_ca = certs["ca"].read_bytes()
            certified = {"tls_root_certs": caller_ca, "cert_chain": certs["client"].read_bytes(),
                         "private_key": certs["client_key"].read_bytes()}
        server = ServiceProcess("migration.colocated_server", server_args,
                                env={"ANDROMEDA_TOKEN": READER, "ANDROMEDA_ADMIN_TOKEN": ADMIN})
        try:
            from andromeda_nb.store import load_dataset

            dataset = load_dataset(root)
            for _ in range(5):
                fl.retrieve_over_flight(server.location, dataset.requests, 100, credentials=reader)
            time.sleep(1.0)
            pid = server.proc.pid
            kinds = args.kinds.split(",") + (["action-update-certified"] if args.mtls else [])
            for kind in kinds:
                connect = (certified if kind == "action-update-certified"
                           else {} if caller_ca is None else {"tls_root_certs": caller_ca})
                payload = payload_of(kind, args.mb)
                idle_kb = status_kb(pid, "VmRSS")
                reset_peak(pid)
                outcome: list = []
                threads = [threading.Thread(target=one_call, args=(server.location, kind, payload, outcome, connect))
                           for _ in range(args.calls)]
                t0 = time.monotonic()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                took = time.monotonic() - t0
                peak_kb = status_kb(pid, "VmHWM")
                time.sleep(1.0)
                after_kb = status_kb(pid, "VmRSS")
                row = {"idle_mb": round(idle_kb / 1024, 1), "peak_mb": round(peak_kb / 1024, 1),
                       "peak_over_idle_mb": round((peak_kb - idle_kb) / 1024, 1),
                       "after_1s_mb": round(after_kb / 1024, 1), "seconds": round(took, 2),
                       "outcomes": sorted(set(outcome)), "within_64_mb": (peak_kb - idle_kb) / 1024 <= 64}
                results["kinds"][kind] = row
                log(True, f"{kind:23s} {args.calls} x {args.mb} MB unauthenticated: idle {row['idle_mb']} MB, "
                          f"peak {row['peak_mb']} MB (+{row['peak_over_idle_mb']} MB), a second after "
                          f"{row['after_1s_mb']} MB, {took:.1f} s; {', '.join(row['outcomes'])}")
                del payload
        finally:
            server.stop()
    finish_probe(results, "probe_unauthenticated_memory.py", sys.argv[1:] if argv is None else argv, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
