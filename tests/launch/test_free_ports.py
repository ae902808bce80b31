"""free_loopback_ports: distinct, bindable, and outside the kernel's ephemeral range, from
which outgoing connections take their local ports while a stack starts."""

import socket

from launch.pdlib import stack


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    low = stack._ephemeral_low()
    ports = stack.free_loopback_ports(16)
    assert len(set(ports)) == 16
    assert all(10000 <= p < low for p in ports), (ports, low)
    socks = []
    try:
        for port in ports:
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", port))
    finally:
        for s in socks:
            s.close()


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    held, spare = socket.socket(), socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    spare.bind(("127.0.0.1", 0))
    taken, free = held.getsockname()[1], spare.getsockname()[1]
    spare.close()
    try:
        monkeypatch.setattr(stack, "_candidates", lambda n: [taken, free])
        assert stack.free_loopback_ports(1) == [free]
    finally:
        held.close()
