"""An engine worker process of a co-located server with several engines (`serve colocated --engines
N`; the front, `serving.engine_front`, starts it as `python -m migration.engine_worker --channel-fd FD
--lanes-fd FD --parent-pid PID`).

It reads its configuration from the channel (`serving.engine_channel`: the corpus directory, the
device, the kernel version and layout, the limits, the batch wait, the file of the GPU turn when the
engines take turns, and with `--endpoints` the host and guard of its own Flight server), loads the
corpus, builds the
engine for the device (`migration.architectures.build_engine`: one CUDA context of its own on a
GPU) and serves the channel (`serving.engine_worker.EngineWorker`). Its start-up steps go to stderr,
prefixed with its name, when the front says them (`--steps`); it writes nothing to stdout (the
front's announcement is the only line there). It ignores SIGINT (Ctrl-C at a terminal reaches the
whole process group: the front stops, and stops its workers after the batches in flight), and ends
when the front says so, when its channel ends, or when its parent is gone.

With `lanes_to` in its configuration it is a front instead (`serve colocated --fronts M`,
`serving.lane_engine`): it reads only the corpus's meta and model, serves the retrieve exchange on
its own Flight server, and sends its batches to the engine worker named there, on a lane.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

PARENT_POLL_S = 0.25


def _leave_lanes(lane_path: str | None) -> None:
    """Remove this worker's lane socket and, once the last worker's is gone, the front's lane
    directory: a front that was killed cannot remove them itself."""
    if not lane_path:
        return
    for remove in (os.unlink, lambda path: os.rmdir(os.path.dirname(path))):
        try:
            remove(lane_path)
        except OSError:  # gone already, or another worker's socket is still there
            pass


def _watch_parent(parent_pid: int, lane_path: str | None = None) -> None:
    """Exit at once when the front is gone, even while the engine is still being built."""

    def watch():
        while True:
            if os.getppid() != parent_pid:
                _leave_lanes(lane_path)
                os._exit(0)
            time.sleep(PARENT_POLL_S)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def serve_channel(conn, lanes=None, build=None) -> int:
    """Read the configuration, build, serve; the exit code. `lanes`: the listening socket of the
    front's request lanes; `build(dataset, config, say)`: the engine (default: the device's,
    `migration.architectures.build_engine`)."""
    import gc

    from andromeda_nb.devices import resolve
    from andromeda_nb.store import load_dataset
    from serving import engine_channel as ch
    from serving.batcher import GpuTurn
    from serving.engine_worker import EngineWorker, limits_of
    from serving.hostmem import keep_freed_memory
    from serving.process import set_switch_interval

    msg = conn.recv_bytes()
    if msg[:1] != ch.CONFIG:
        raise SystemExit("engine worker: the channel did not begin with its configuration")
    config = ch.json_body(msg, with_id=False)
    name = config.get("name", "engine worker")

    def say(message: str) -> None:
        print(f"{name}: {message}", file=sys.stderr, flush=True)

    keep_freed_memory()
    set_switch_interval(config.get("switch_interval_ms"))
    try:
        from .architectures import build_engine

        if config.get("lanes_to"):  # a front (`--fronts`): its engine is an engine worker's, over a lane
            return _serve_front(conn, lanes, config, say)
        device = resolve(config["device"])
        dataset = load_dataset(config["data"], say=say if config.get("steps") else None)
        if build is not None:
            engine = build(dataset, config, say if config.get("steps") else None)
        else:
            engine = build_engine(dataset, device, version=config.get("version"), layout=config.get("layout"),
                                  say=say if config.get("steps") else None)
        turn = GpuTurn(config["turn"]) if config.get("turn") else None
        worker = EngineWorker(engine, dataset, conn, lanes=lanes, limits=limits_of(config),
                              batch_wait_s=config["batch_wait_s"], decode_ahead=bool(config.get("decode_ahead")),
                              name=name, turn=turn, overlap=bool(config.get("overlap")))
        if config.get("endpoint"):  # its own Flight server, listed by the front (`--endpoints`)
            from serving.engine_worker import WorkerEndpoint
            from serving.guard import ServerGuard

            spec = config["endpoint"]
            worker.endpoint = WorkerEndpoint(worker, spec["host"], guard=ServerGuard.from_json(spec["guard"]))
    except Exception as exc:  # noqa: BLE001 - the front says why this worker could not start
        return _failed(conn, say, exc)
    gc.collect()
    gc.freeze()  # what was built lives as long as the process: no collection walks it again
    try:
        worker.serve()
    finally:
        engine.close()
    return 0


def _failed(conn, say, exc: Exception) -> int:
    """Say why this process could not start, on stderr and to the front (FAILED); the exit code."""
    from serving import engine_channel as ch

    say(f"could not start: {type(exc).__name__}: {exc}")
    try:
        conn.send_bytes(ch.message(ch.FAILED, body={"message": f"{type(exc).__name__}: {exc}"}))
    except OSError:
        pass
    return 2


def _serve_front(conn, lanes, config: dict, say) -> int:
    """A front process (`serve colocated --fronts N`, `serving.lane_engine`): the corpus's model and
    meta only, a `LaneEngine` to the engine worker named in `config["lanes_to"]`, and its own Flight
    server (`config["endpoint"]`); the exit code."""
    import gc

    from serving.engine_worker import WorkerEndpoint, limits_of
    from serving.guard import ServerGuard
    from serving.lane_engine import FrontWorker, LaneEngine, corpus_head

    name = config.get("name", "front")
    try:
        limits = limits_of(config)
        target = config["lanes_to"]
        engine = LaneEngine(target["path"], target["name"], limits)
        worker = FrontWorker(engine, corpus_head(config["data"]), conn, lanes=lanes, limits=limits,
                             batch_wait_s=config["batch_wait_s"], decode_ahead=bool(config.get("decode_ahead")),
                             name=name)
        spec = config["endpoint"]
        worker.endpoint = WorkerEndpoint(worker, spec["host"], guard=ServerGuard.from_json(spec["guard"]))
        worker.endpoint.name = "colocated front"  # what its health and stats call it
    except Exception as exc:  # noqa: BLE001 - the server's front says why this one could not start
        return _failed(conn, say, exc)
    gc.collect()
    gc.freeze()
    try:
        worker.serve()
    finally:
        engine.close()
    return 0


def main(argv=None, build=None) -> int:
    """The worker's entry point (`build`: as `serve_channel`'s)."""
    from multiprocessing.connection import Connection

    parser = argparse.ArgumentParser(prog="python -m migration.engine_worker", description=__doc__.split("\n")[0])
    parser.add_argument("--channel-fd", type=int, required=True, help="the channel to the front (a socket)")
    parser.add_argument("--lanes-fd", type=int, required=True,
                        help="the listening socket the front connects its request lanes to")
    parser.add_argument("--parent-pid", type=int, required=True, help="the front: exit when it is gone")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import socket

    lanes = socket.socket(fileno=args.lanes_fd)
    lane_path = lanes.getsockname() or None
    _watch_parent(args.parent_pid, lane_path)
    try:
        return serve_channel(Connection(args.channel_fd), lanes, build)
    finally:
        _leave_lanes(lane_path)


if __name__ == "__main__":
    sys.exit(main())
