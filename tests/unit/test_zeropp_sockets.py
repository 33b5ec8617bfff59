"""benchmarks/zbench/sockets.py: reading ``ss -tinpH`` and turning two snapshots of the ranks' sockets into the bytes
each rank sent to each other rank (the socket check of benchmarks/zeropp.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from zbench.sockets import Socket, cross_node, parse_ss, sent_per_peer  # noqa: E402

#: As ``ss -tinpH`` prints it: a socket line, its counters on indented continuation lines; a counter still zero is
#: left out; a socket of another user's process has no ``users:`` part.
SS = """\
ESTAB 0      0               127.0.0.1:42755          127.0.0.1:51918 users:(("python",pid=24275,fd=45))
\t bbr wscale:10,10 rto:204 rtt:0.12/0.154 mss:32768 cwnd:18 bytes_sent:190176 bytes_retrans:96 bytes_acked:190080 \
bytes_received:427688 segs_out:6667 send 39321600000bps
ESTAB 0      4096    [::ffff:127.0.0.1]:34077 [::ffff:127.0.0.1]:36022 users:(("python",pid=24273,fd=55),("python",pid=24273,fd=56))
\t bbr wscale:10,10 rto:204 cwnd:15 bytes_sent:12479536 bytes_acked:12454400
\t bytes_received:12454408 segs_out:2434
ESTAB 0      0               127.0.0.1:40000          127.0.0.1:40001
\t cubic bytes_sent:5 bytes_acked:5
SYN-SENT 0   1               127.0.0.1:40002          127.0.0.1:29500 users:(("python",pid=7,fd=3))
\t cubic rto:1000
"""


def test_parse_ss_reads_addresses_process_and_counters() -> None:
    sockets = parse_ss(SS)
    assert [s.pid for s in sockets] == [24275, 24273, 7]  # the socket without a process is skipped
    first, second, syn = sockets
    assert (first.local, first.peer, first.send_q) == ("127.0.0.1:42755", "127.0.0.1:51918", 0)
    assert (first.bytes_sent, first.bytes_retrans, first.bytes_acked, first.bytes_received) == (190176, 96, 190080,
                                                                                                427688)
    # IPv4-mapped IPv6 spelled as IPv4, counters over two continuation lines, Send-Q read.
    assert (second.local, second.peer, second.send_q) == ("127.0.0.1:34077", "127.0.0.1:36022", 4096)
    assert (second.bytes_acked, second.bytes_received, second.bytes_retrans) == (12454400, 12454408, 0)
    assert (syn.bytes_acked, syn.bytes_sent, syn.peer_port, syn.local_port) == (0, 0, 29500, 40002)


def test_parse_ss_refuses_a_line_that_is_not_a_socket() -> None:
    with pytest.raises(ValueError, match="not a socket line"):
        parse_ss("ESTAB 0 0\n")


def _sock(local: int, peer: int, pid: int, acked: int) -> Socket:
    return Socket(f"127.0.0.1:{local}", f"127.0.0.1:{peer}", pid, 0, bytes_acked=acked)


def test_sent_per_peer_matches_each_socket_to_the_rank_at_its_other_end() -> None:
    store = 29500
    # Ranks 0-2 (pids 100-102). 0<->1 over 5001/5002, 0<->2 over 5003/5004, 1<->2 over 5005/5006; the store's
    # server end is in rank 0 (port 29500), rank 1 and 2 connect to it; rank 2 opens 2<->0 over 5007/5008 between
    # the snapshots; rank 1 holds a connection to a process that is no rank (port 6000).
    before = {
        0: [_sock(5001, 5002, 100, 1000), _sock(5003, 5004, 100, 50), _sock(store, 7001, 100, 10)],
        1: [_sock(5002, 5001, 101, 7), _sock(5005, 5006, 101, 0), _sock(7001, store, 101, 3),
            _sock(5900, 6000, 101, 0)],
        2: [_sock(5004, 5003, 102, 20), _sock(5006, 5005, 102, 400), _sock(7002, store, 102, 4)],
    }
    after = {
        0: [_sock(5001, 5002, 100, 1600), _sock(5003, 5004, 100, 50), _sock(store, 7001, 100, 999),
            _sock(5008, 5007, 100, 30)],
        1: [_sock(5002, 5001, 101, 7), _sock(5005, 5006, 101, 250), _sock(7001, store, 101, 999),
            _sock(5900, 6000, 101, 12345)],
        2: [_sock(5004, 5003, 102, 920), _sock(5006, 5005, 102, 400), _sock(7002, store, 102, 999),
            _sock(5007, 5008, 102, 64)],
    }
    sent = sent_per_peer(before, after, store)
    assert sent == {0: {1: 600, 2: 30}, 1: {0: 0, 2: 250}, 2: {0: 900 + 64, 1: 0}}
    # 2 nodes of 2 ranks: ranks 0 and 1 on one, rank 2 on the other.
    assert cross_node(sent, 2) == {0: 30, 1: 250, 2: 964}
