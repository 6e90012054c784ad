"""A daemon connection's write-back: the store's per-row refusals reach the client as records."""

from __future__ import annotations

import numpy as np

from attnstore.protocol.keys import token_hash
from attnstore.protocol.requests import exact_request
from attnstore.service.admission import Admission, AdmissionConfig
from attnstore_client.connection import RefusedRow, RowToWrite, connect
from tests.support.server_fixtures import FP, LAYOUT, memory_service, served


def test_a_bad_row_comes_back_refused_with_its_index_code_and_reason_and_the_others_are_stored() -> None:
    service = memory_service()
    service.admission = Admission(AdmissionConfig(admit_after=1))
    rng = np.random.default_rng(0)
    good = RowToWrite(list(range(1, 6)), rng.normal(size=(5, LAYOUT.hidden)).astype(np.float16))
    bad = RowToWrite(list(range(11, 16)), np.full((5, LAYOUT.hidden), np.nan, np.float16))
    with served(service) as (_, remote), connect(f"grpc://{remote.target}") as connection:
        remote.lookup(exact_request("ns", FP, [token_hash(np.array(r.token_ids)) for r in (bad, good)], [5, 5]))
        counts = connection.write_back("ns", FP, [bad, good], timeout=10)
    assert (counts.stored, counts.duplicates, counts.not_admitted) == (1, 0, 0)
    assert len(counts.refused) == 1
    refused = counts.refused[0]
    assert isinstance(refused, RefusedRow) and (refused.row, refused.code) == (0, "INVALID_ARGUMENT")
    assert "write-back row 0: outputs hold NaN or inf" in refused.message
