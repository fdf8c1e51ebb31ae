"""Who saved a step, as each saving host says (``sidecar/replicator/agree/attest.py``),
as tables; the same rule in the decision (``decision.decide(signed=True)``)."""

from __future__ import annotations

import pytest

from mtc.errors import ProtocolError
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator import checks
from mtc.sidecar.replicator.agree.attest import origin_of, unattested, why_not_for
from mtc.sidecar.replicator.agree.decision import Decided, Holding, decide


def _c(origin: int, step: int, saving: tuple[int, ...] = (), hosts: int = 0,
       run: str = "") -> pb.StepCopy:
    return pb.StepCopy(origin_rank=origin, step=step, saving_ranks=saving,
                       saved_hosts=hosts or len(saving), run=run)


S01, S1 = {(0, 1)}, {(1,)}


@pytest.mark.parametrize(("said", "members", "counts"), [
    ({0: S01, 1: S01}, [0, 1], True),           # both saved it, both say so
    ({1: S1}, [0, 1], False),                    # rank 1 alone: rank 0 left out on its word
    ({1: S1}, [1], True),                        # a job of rank 1 alone restores its own
    ({1: S01}, [0, 1], False),                   # rank 0 never said it saved
    ({0: S01, 1: {(1, 0)}}, [0, 1], False),      # they disagree
    ({0: {(1, 2)}, 1: {(1, 2)}, 2: {(1, 2)}}, [0, 1, 2], False),  # rank 0 outside its own set
    ({1: {(1, 2)}, 2: {(1, 2)}}, [0, 1, 2], True),  # rank 0 grown in, on two hosts' word
    ({0: S01}, [0], True),                       # a smaller job: rank 0 its own word
    ({0: S01, 1: S01 | S1}, [0, 1], False),     # one origin saying two things
    ({1: {(1, 1)}}, [1], False),                # a rank twice
])
def test_a_saving_set_counts_on_the_saving_hosts_own_words(
        said: dict[int, set[tuple[int, ...]]], members: list[int], counts: bool) -> None:
    assert (why_not_for(said, members) == "") is counts, why_not_for(said, members)


def test_unattested_groups_by_step_and_run() -> None:
    said = [(0, 5, "a", (0, 1)), (1, 5, "a", (0, 1)), (1, 900, "a", (1,)),
            (1, 5, "b", (1,))]
    assert set(unattested(said, [0, 1])) == {(900, "a"), (5, "b")}


@pytest.mark.parametrize(("copies", "host", "want"), [
    ([_c(0, 7, hosts=2), _c(1, 7, hosts=2)], 0, 0),        # host h is rank h
    ([_c(1, 7, (1, 0))], 0, None),                          # rank 0 never said it
    ([_c(1, 7, (1, 0)), _c(0, 7, (1, 0))], 0, 1),           # both say so
    ([_c(1, 7, (1, 0)), _c(0, 7, hosts=2)], 0, None),       # they disagree
    ([_c(0, 7, hosts=2)], 1, 1),                            # rank 1's data lost: 1 is 1
    ([_c(0, 8, (1, 0))], 0, 0),                             # another step says nothing
    ([_c(1, 7, (1, 1))], 0, None),                          # a rank twice
])
def test_a_trainer_reads_a_host_as_the_rank_every_saving_host_names(
        copies: list[pb.StepCopy], host: int, want: int | None) -> None:
    got, why = origin_of(copies, 7, host)
    assert got == want, why
    assert (why == "") is (want is not None)


def test_the_decision_never_picks_a_step_on_one_hosts_word() -> None:
    holdings = {
        0: Holding(frozenset({(0, 5), (1, 5)}), said=frozenset({(0, 5, "", (0, 1)),
                                                                 (1, 5, "", (0, 1))})),
        1: Holding(frozenset({(1, 5), (0, 5), (1, 900)}),
                   saving=frozenset({(900, "", (1,))}),
                   said=frozenset({(1, 5, "", (0, 1)), (0, 5, "", (0, 1)),
                                   (1, 900, "", (1,))})),
    }
    same = lambda r: [r]  # noqa: E731
    assert decide(holdings, [0, 1], same) == Decided(900)  # without TLS: as before
    assert decide(holdings, [0, 1], same, signed=True) == Decided(5)


@pytest.mark.parametrize("ranks", [[1, 1], [0, 2], [0]])
def test_an_inventory_naming_saving_ranks_wrongly_is_refused(ranks: list[int]) -> None:
    inv = pb.Inventory(rank=1, newest_backed_up_step=-1,
                       copies=[pb.StepCopy(origin_rank=1, step=7, saved_hosts=2,
                                           saving_ranks=ranks)])
    with pytest.raises(ProtocolError):
        checks.inventory(inv, rank=1, num_nodes=2)
