"""The co-located architecture (`--arch colocated`) on whichever device: one process matches, scores
and selects top-K next to the ads, and only the final candidates leave it.

* `ColocatedRetriever`: `interfaces.Retriever`. In process by default, over the engine for the device
  (`migration.architectures.build_engine`: `gpu.engine.GpuEngine` on a GPU or the simulator,
  `cpu_baseline.engine.CpuEngine` on the CPU); with `served=True` or `traffic=True` it starts the
  co-located server as a subprocess on 127.0.0.1 (`python -m migration.colocated_server --device D`, the device
  resolved here and passed explicitly) and talks Flight to it
  (through a counting relay with `traffic=True`, so `retrieve_traffic` reports real bytes on the wire).
* `make_server`: that server, `serving.engine_server.EngineServer` around the device's engine.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from andromeda_nb.devices import resolve
from serving.services import (ServedRetriever, ServiceProcess, check_same_corpus, child_args, dataset_args,
                                   relay_in_front, stop_all)
from andromeda_nb.types import Request, Update

from .architectures import build_engine

START_TIMEOUT_S = 180.0
SERVE_MODULE = "migration.colocated_server"
WORKER_MODULE = "migration.engine_worker"


def make_server(dataset, location: str = "grpc://127.0.0.1:0", device: str = "auto", version=None, *, log=None,
                limits=None, guard=None, batch_wait_s: float | None = None, decode_ahead: bool = False,
                layout: str | None = None, say=None, overlap: bool = False):
    """The co-located server over the engine for `device`, listening at `location` (`log`: its
    write-ahead log, replayed before it listens; `limits`, `guard`: `serving.limits`, `.guard`;
    `layout`: the GPU engine's slot order, None for its default; `say`: told each step of the
    engine's construction as it ends, `build_engine`); `overlap`: the next batch's host work while the
    device answers the one before (`serving.overlap`)."""
    from serving.engine_server import EngineServer  # pyarrow.flight loads only when serving

    engine = build_engine(dataset, device, version=version, layout=layout, say=say)
    try:
        options = {"decode_ahead": decode_ahead, "overlap": overlap}
        if batch_wait_s is not None:
            options["batch_wait_s"] = batch_wait_s
        return EngineServer(engine, dataset, location, log=log, limits=limits, guard=guard, **options)
    except BaseException:
        engine.close()
        raise


def make_pooled_server(dataset, location: str = "grpc://127.0.0.1:0", device: str = "auto", version=None, *,
                       engines: int, log=None, limits=None, guard=None, batch_wait_s: float | None = None,
                       decode_ahead: bool = False, layout: str | None = None, say=None, gpu_turn: bool = False,
                       endpoints: bool = False, overlap: bool = False, fronts: int = 0):
    """The co-located server over `engines` engine worker processes behind one front
    (`serving.engine_front`): each worker loads the corpus directory the dataset was read from and
    builds the engine for `device` (`migration.engine_worker`); the same options as `make_server`, and
    `gpu_turn`: the workers take turns on the device (`serving.batcher.GpuTurn`, on a file of this
    process's private temporary directory, removed when it exits); `endpoints`: each worker also serves
    the retrieve exchange on a port of its own on the front's host, with its guard (listed by the
    front's GetFlightInfo); `fronts`: that many front processes beside the workers, each serving the
    retrieve exchange on a port of its own, listed in place of the workers' (`serving.lane_engine`)."""
    import sys
    from urllib.parse import urlsplit

    from serving.guard import OPEN

    from serving.batcher import DEFAULT_MAX_WAIT_S
    from serving.engine_front import start_pooled_server

    data_dir = getattr(dataset, "source_dir", None)
    if data_dir is None:
        raise ValueError("a server with several engines serves a corpus directory (each engine worker loads it)")
    config = {"data": str(data_dir), "device": resolve(device), "version": getattr(version, "number", version),
              "layout": layout, "batch_wait_s": DEFAULT_MAX_WAIT_S if batch_wait_s is None else batch_wait_s,
              "decode_ahead": decode_ahead, "switch_interval_ms": sys.getswitchinterval() * 1e3,
              "turn": _turn_file() if gpu_turn else None, "overlap": overlap}
    endpoint = {"host": urlsplit(location).hostname or "127.0.0.1", "guard": (guard or OPEN).to_json()}
    if endpoints:
        config["endpoint"] = endpoint
    return start_pooled_server(dataset, location, module=WORKER_MODULE, config=config, engines=engines, log=log,
                               limits=limits, guard=guard, say=say, fronts=fronts, front_endpoint=endpoint)


def _turn_file() -> str:
    """A new file for the engine workers' turn, in a temporary directory removed when this process exits."""
    import atexit
    import shutil
    import tempfile

    where = tempfile.mkdtemp(prefix="andromeda-turn-")
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    return os.path.join(where, "gpu.turn")


class ColocatedRetriever(ServedRetriever):
    """`interfaces.Retriever` for the co-located architecture: an engine in process, or over Flight to
    a server (retrieve, traffic, updates and actions: `serving.services.ServedRetriever`)."""

    server_name = "the co-located server"

    def __init__(self, engine=None, *, location: str | None = None, process=None,
                 relays=None, tmpdir=None, timeout_s: float = 60.0):
        self.engine = engine
        self.location = location
        self.process = process
        self.relays = relays or {}
        self._tmpdir = tmpdir
        self.timeout_s = timeout_s
        self.client = None
        self.device = engine.device if engine is not None else None
        if location is not None:
            import pyarrow.flight as flight

            from serving.protocol import flight_action

            self.client = flight.connect(location)
            self.device = flight_action(location, "health", client=self.client).get("device")

    @classmethod
    def build(cls, dataset, device: str = "auto", *, served: bool = False, traffic: bool = False,
              host: str | None = None, version=None, link=None, layout: str | None = None,
              **options) -> "ColocatedRetriever":
        if options:
            raise TypeError(f"unknown option(s) for the co-located retriever: {', '.join(options)}")
        if not (served or traffic or host):
            return cls(build_engine(dataset, device, version=version, layout=layout))
        device = resolve(device)  # here, so the server is told where it runs and decides nothing itself
        from serving.protocol import location_of, wait_until_healthy

        proc, tmp, relays = None, None, {}
        data_dir = getattr(dataset, "source_dir", None)  # read from a directory: the server loads it
        try:
            if host is None:  # a dataset made in memory is saved as a corpus directory for it
                source, tmp = dataset_args(dataset, data_dir, prefix="andromeda-colocated-")
                args = [*source, *child_args(), "--device", device]
                if version is not None:
                    args += ["--version", str(getattr(version, "number", version))]
                if layout is not None:
                    args += ["--layout", layout]
                proc = ServiceProcess(SERVE_MODULE, args, name="the co-located server", start_timeout_s=START_TIMEOUT_S)
                host = proc.location
            location = location_of(host)
            wait_until_healthy(location, timeout=30.0)
            if proc is not None and data_dir is not None:
                check_same_corpus(location, dataset, data_dir, "the co-located server")
            if traffic:
                relays["client->server"] = relay_in_front(location, link)
                location = relays["client->server"].location
            return cls(location=location, process=proc, relays=relays, tmpdir=tmp)
        except BaseException:
            stop_all([proc] if proc is not None else [], relays, tmp)
            raise

    def retrieve(self, requests: Sequence[Request], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        if self.engine is not None:
            return self.engine.retrieve(requests, k)
        return super().retrieve(requests, k)

    def apply(self, update: Update) -> None:
        if self.engine is not None:
            self.engine.apply(update)
            return
        super().apply(update)

    def services(self) -> dict:
        return {} if self.process is None else {"co-located server (match, scoring, top-K)": self.process}

    def close(self) -> None:
        self.close_client()
        stop_all([self.process] if self.process is not None else [], self.relays, self._tmpdir)
        self._tmpdir = None
        if self.engine is not None:
            self.engine.close()


__all__ = ["ColocatedRetriever", "SERVE_MODULE", "WORKER_MODULE", "make_pooled_server", "make_server"]
