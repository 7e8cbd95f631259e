"""The served-path load driver (migration/clients.py): clients over several processes against a real
server on 127.0.0.1, the first pass of answers checked against what each request must get."""

import threading

import numpy as np
import pytest

from andromeda_nb.engine_server import EngineServer
from andromeda_nb.corpus import generate_corpus
from andromeda_nb.store import load_dataset
from migration.clients import AnswerTable, drive


def test_clients_over_processes_count_requests_and_wrong_answers(tmp_path):
    generate_corpus(tmp_path / "corpus", 120, 6, 4)
    dataset = load_dataset(tmp_path / "corpus")
    rng = np.random.default_rng(4)
    answers = {r.request_id: (rng.permutation(1000)[:10].astype(np.int64), np.sort(rng.random(10))[::-1].astype(np.float32))
               for r in dataset.requests}
    server = EngineServer(AnswerTable(answers), dataset)
    threading.Thread(target=server.serve, daemon=True).start()
    location = f"grpc://127.0.0.1:{server.port}"
    try:
        right = [answers[r.request_id] for r in dataset.requests]
        got = drive(location, str(tmp_path / "corpus"), k=10, clients=4, processes=2, seconds=1.0, want=right)
        assert got["requests"] > 8 and got["n_wrong"] == 0 and got["client_processes"] == 2
        wrong = [(ids[::-1], s) for ids, s in right]  # every answer reversed: the first pass of each thread fails
        got = drive(location, str(tmp_path / "corpus"), k=10, clients=2, processes=2, seconds=0.5, want=wrong)
        assert got["n_wrong"] >= 2 and got["wrong_answers"][0].startswith("request ")
    finally:
        server.shutdown()
    with pytest.raises(ValueError, match="split evenly"):
        drive(location, str(tmp_path / "corpus"), k=10, clients=3, processes=2)
