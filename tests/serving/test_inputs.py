"""What one request of a batch may be (serving.inputs), for both request forms: k within 1..MAX_K and
within the server's own --max-k, each fault named by the request's id, and a malformed request an
`InvalidInput` naming the request once, then the JSON path. No server is started."""

from __future__ import annotations

import numpy as np
import pytest

from andromeda_nb import testing
from andromeda_nb.constants import MAX_K
from andromeda_nb.targeting import request_to_json
from serving import protocol as fl
from serving.inputs import InvalidInput, check_k, parse_batch_request
from serving.limits import LimitExceeded, ServiceLimits
from serving.request_columns import request_columns

E, S = 3, 4
KW = dict(seed=7, experts=E, width=S)


def _requests(n: int, seed: int = 3):
    return testing.random_requests(np.random.default_rng(seed), n, experts=E, width=S)


@pytest.mark.parametrize("k", [0, -1, MAX_K + 1])
def test_k_outside_the_range_of_any_answer_is_invalid_input_naming_the_request(k):
    with pytest.raises(InvalidInput, match=f"request 7: k = {k} is outside 1..{MAX_K}"):
        check_k(k, 7)


def test_k_up_to_the_servers_limit_passes_and_one_more_is_over_it():
    assert check_k(1, 1) == 1 and check_k(MAX_K, 1) == MAX_K  # no server limit: MAX_K
    assert check_k(50, 3, max_k=50) == 50
    with pytest.raises(LimitExceeded, match=r"request 3: k = 51 is over the server's limit of 50 \(--max-k\)"):
        check_k(51, 3, max_k=50)


@pytest.mark.parametrize("encode", [fl.request_batch, request_columns], ids=["json", "columns"])
def test_both_request_forms_keep_to_the_servers_max_k(encode):
    requests = _requests(4)
    limits = ServiceLimits(max_k=20)
    got, ks = fl.decode_request_batch(encode(requests, [20, 1, 20, 5]), limits=limits, **KW)
    assert list(got) == requests and ks == [20, 1, 20, 5]
    with pytest.raises(LimitExceeded, match=rf"request {requests[2].request_id}: k = 21 is over the server's "
                                            r"limit of 20 \(--max-k\)"):
        fl.decode_request_batch(encode(requests, [20, 1, 21, 5]), limits=limits, **KW)
    # the server's limit is its own: the same batch passes a server with the default limits
    assert fl.decode_request_batch(encode(requests, [20, 1, 21, 5]), **KW)[1] == [20, 1, 21, 5]


def test_a_malformed_request_names_its_id_once_then_the_path():
    good = {key: value for key, value in request_to_json(_requests(1)[0]).items() if key != "request_id"}
    assert parse_batch_request(good, 12, **KW).request_id == 12
    bad = {**good, "user": {**good["user"], "age": 200}}
    with pytest.raises(InvalidInput) as err:
        parse_batch_request(bad, 12, **KW)
    message = str(err.value)
    assert message.startswith("request 12: user.age: ") and message.count("request") == 1, message
    with pytest.raises(InvalidInput, match="^request 13: "):
        parse_batch_request({"user": good["user"]}, 13, **KW)
