"""The multi-rank harness: results by rank, failures with tracebacks, no hangs."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from dsa_dcp.launch import RankError, run_on_ranks


def _sum_of_ranks(rank, world, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world, "sum": t.item() * scale}


def _fails_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # would wait forever for rank 1
    return rank


def _sleeps(rank, world):
    time.sleep(60)


def test_results_come_back_in_rank_order():
    out = run_on_ranks(_sum_of_ranks, 3, 2.0)
    assert out == [{"rank": r, "world": 3, "sum": 6.0} for r in range(3)]


def test_a_failing_rank_fails_the_caller_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 1 of 2 failed:.*ValueError: rank one is broken"):
        run_on_ranks(_fails_on_rank_one, 2, timeout=60)
    assert time.monotonic() - start < 60


def test_a_rank_that_never_finishes_times_out():
    with pytest.raises(RankError, match=r"did not finish within 5 s"):
        run_on_ranks(_sleeps, 2, timeout=5)


def _listening_addresses(port):
    """Local addresses of the sockets listening on ``port`` (IPv4 and IPv6), from /proc/net."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


def _store_listeners(rank, world):
    import os

    dist.barrier()
    return _listening_addresses(int(os.environ["MASTER_PORT"])) if rank == 0 else None


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads listening sockets from Linux's /proc/net")
def test_the_store_listens_on_the_loopback_only():
    listeners = run_on_ranks(_store_listeners, 2)[0]
    # 0100007F is 127.0.0.1 (little-endian hex); a store bound to every interface shows 00000000
    # (IPv4) or ::, all zeros (IPv6)
    assert listeners == ["0100007F"], listeners


def _environment_and_output(rank, world):
    print(f"rank {rank} of {world} writes here", flush=True)
    return os.environ.get("DSA_DCP_TEST_MARK")


def test_a_rank_takes_the_callers_environment_and_output_as_it_starts(monkeypatch, capfd):
    """Ranks forked from a server started earlier (dsa_dcp.launch) see what a spawned rank would."""
    monkeypatch.delenv("DSA_DCP_TEST_MARK", raising=False)
    assert run_on_ranks(_environment_and_output, 2) == [None, None]  # the server, if any, starts here
    capfd.readouterr()
    monkeypatch.setenv("DSA_DCP_TEST_MARK", "set after the first ranks")
    assert run_on_ranks(_environment_and_output, 2) == ["set after the first ranks"] * 2
    out = capfd.readouterr().out
    assert "rank 0 of 2 writes here" in out and "rank 1 of 2 writes here" in out, out
