"""Serving: how an engine meets its clients over Arrow Flight, written once for every server.

    protocol          the `["retrieve"]` exchange and the actions of DESIGN section 5 (`RetrieveServer`,
                      the client calls); `inputs` and `request_columns` the two request forms
    engine_server     the co-located server around any `andromeda_nb.interfaces.Engine`
    batcher           requests of concurrent calls gathered into one engine batch
    engine_front,     the co-located server over several engine processes behind one front
    engine_worker,    (`serve colocated --engines N`): the front, one engine worker's side, and the
    engine_channel    channel between them
    wal, durable,     the update log, updates acknowledged once on disk, and its folding into a new
    compaction        snapshot
    guard, limits     who may call (TLS, tokens, exposure) and what one call may ask
    process           a server process's life: listening, stopping in bounded time, its settings
    services          server processes started and stopped by the parent that needs them
    client            the client of a running server, for a person (`andromeda query`, `health`)
    relay             a counting TCP relay: real bytes on the wire
    hostmem           the allocator setting of a serving process

The servers themselves are thin and say which engine they wrap: `migration.colocated_server` (the co-located
design, an `EngineServer` around the engine `--device` picks), `cpu_baseline.remote_servers` (the remote
design's index host and scoring service), `cluster.front` (shards behind one front).

The names below are this package's face: `from serving import EngineServer` loads only the module
that holds it.
"""

from __future__ import annotations

import importlib

_FACE = {
    "RetrieveServer": "protocol", "retrieve_over_flight": "protocol", "flight_action": "protocol",
    "wait_until_healthy": "protocol", "InvalidInput": "inputs", "request_columns": "request_columns",
    "EngineServer": "engine_server", "RequestBatcher": "batcher", "PooledEngineServer": "engine_front",
    "WriteAheadLog": "wal", "LogError": "wal", "UpdateJournal": "durable", "compact_corpus": "compaction",
    "ServerGuard": "guard", "ClientCredentials": "guard", "ServiceLimits": "limits", "LimitExceeded": "limits",
    "ServerSettings": "process", "listen": "process", "serve_until_stopped": "process",
    "ServiceProcess": "services", "ServedRetriever": "services",
    "query": "client", "health": "client", "Relay": "relay", "keep_freed_memory": "hostmem",
}


def __getattr__(name: str):
    if name not in _FACE:
        raise AttributeError(f"module 'serving' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_FACE[name]}", __name__), name)


__all__ = sorted(_FACE)
