"""`RemoteRetriever` (`--arch remote`): the remote-scoring architecture as real processes on loopback.

`build(dataset)` starts the scoring service and the index host as subprocesses on 127.0.0.1 (free
ports), or connects to running ones (`scorer=`, `host=` addresses). With `traffic=True` a counting
relay (`serving.relay`) sits in front of each server it starts, so `retrieve_traffic` reports
the real bytes per request on both hops: client -> index host, and index host -> scoring service.

Updates go to the index host (`DoAction("update")`), which checks them, applies them and forwards
the accepted ones to the scoring service: both hold the same live ads afterwards.
"""

from __future__ import annotations

import tempfile

from serving.protocol import location_of, wait_until_healthy
from serving.guard import PAIR_SECRET_ENV, connect, new_pair_secret
from serving.relay import Relay
from serving.services import (START_TIMEOUT_S, ServedRetriever, ServiceProcess, check_same_corpus, child_args,
                                   dataset_args, relay_in_front, stop_all)

SERVE_MODULE = "cpu_baseline.remote_servers"


class RemoteRetriever(ServedRetriever):
    """interfaces.Retriever over the index host's `["retrieve"]` exchange (retrieve, traffic, updates
    and actions: `serving.services.ServedRetriever`)."""

    server_name = "the index host"

    def __init__(self, location: str, *, processes=(), relays: dict[str, Relay] | None = None,
                 tmpdir: tempfile.TemporaryDirectory | None = None, timeout_s: float = 60.0, credentials=None):
        self.location = location
        self.processes = list(processes)
        self.relays = relays or {}
        self._tmpdir = tmpdir
        self.timeout_s = timeout_s
        self.client = connect(location, credentials)

    @classmethod
    def build(cls, dataset=None, device=None, scorer: str | None = None, host: str | None = None, *,
              traffic: bool = False, data_dir: str | None = None, scorer_timeout_s: float = 10.0,
              threads: int | None = None, start_timeout_s: float = START_TIMEOUT_S, credentials=None,
              scorer_command: tuple[str, list[str]] | None = None, link=None, **options) -> "RemoteRetriever":
        """Start (or connect to) the scoring service and the index host. `device` is accepted for
        interface symmetry and ignored: this architecture runs on the CPU. The services load the
        corpus directory `data_dir`, or the one `dataset` was read from (`dataset.source_dir`: the
        fast load, nothing parsed), and are checked to hold the dataset's ads; a dataset made in
        memory is saved as a corpus directory for them. Started services end with this process and
        keep their updates in memory only (`--log off`): a command's own services never write into
        the corpus it reads.
        `credentials` (`serving.guard.ClientCredentials`): what to present to running services.
        `scorer_command` (module, extra arguments): how to start the scoring service instead of
        `python -m cpu_baseline.remote_servers scorer` (the migration layer starts one on a GPU with it).
        `link` (`serving.relay.Link`): the network every counted hop (`traffic=True`) behaves as.
        """
        processes: list[ServiceProcess] = []
        relays: dict[str, Relay] = {}
        tmp = None
        # the pair's secret, made here for the pair this starts and handed over in the environment (never in
        # the arguments, which every user of the machine can list); a scorer already running has its own
        env = {PAIR_SECRET_ENV: new_pair_secret()} if scorer is None else {}
        if data_dir is None and dataset is not None:
            data_dir = getattr(dataset, "source_dir", None)
        try:
            if host is None:
                source, tmp = dataset_args(dataset, data_dir or None, prefix="andromeda-remote-")
                extra = (["--threads", str(threads)] if threads else []) + child_args()
                if scorer is None:
                    module, args = scorer_command or (SERVE_MODULE, ["scorer"])
                    proc = ServiceProcess(module, [*args, *source, *extra], name="scorer",
                                          start_timeout_s=start_timeout_s, env=env)
                    processes.append(proc)
                    scorer = proc.location
                scorer_address = location_of(scorer)
                if traffic:
                    relays["index host->scorer"] = relay_in_front(scorer_address, link)
                    scorer_address = relays["index host->scorer"].location
                proc = ServiceProcess(SERVE_MODULE, ["remote", *source, *extra, "--scorer", scorer_address,
                                                     "--scorer-timeout", str(scorer_timeout_s)],
                                      name="remote", start_timeout_s=start_timeout_s, env=env)
                processes.append(proc)
                host = proc.location
            location = location_of(host)
            wait_until_healthy(location, timeout=30.0, credentials=credentials)
            if processes and data_dir and dataset is not None:
                check_same_corpus(location, dataset, data_dir, "the services", credentials)
            if traffic:
                relays["client->index host"] = relay_in_front(location, link)
                location = relays["client->index host"].location
            hops = ("client->index host", "index host->scorer")  # in the order a request travels
            relays = {hop: relays[hop] for hop in hops if hop in relays}
            return cls(location, processes=processes, relays=relays, tmpdir=tmp, credentials=credentials)
        except BaseException:
            stop_all(processes, relays, tmp)
            raise

    def services(self) -> dict:
        roles = {"scorer": "scoring service", "remote": "index host (match, top-K)"}
        return {roles.get(p.name, p.name): p for p in self.processes}

    def close(self) -> None:
        self.close_client()
        stop_all(self.processes, self.relays, self._tmpdir)  # the index host first, then the scorer
        self.processes, self._tmpdir = [], None


__all__ = ["RemoteRetriever", "ServiceProcess"]
