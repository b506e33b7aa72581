"""Ports and addresses of the servers a run starts.

A server's port is chosen free and below the kernel's ephemeral range (never given to an outgoing connection), without
touching the seeded global generator. The address a rollout engine gives SGLang servers for the weight-update group is
this machine's on the route to them (loopback for a server it launched, the pod's own address for a server in another
pod), never a constant."""

import random
import socket
from pathlib import Path

from miles_core import net
from miles_core.net import address_toward, free_port


def test_a_free_port_is_free_below_the_ephemeral_range_and_leaves_the_seeded_generator_alone():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    random.seed(0)
    state = random.getstate()
    ports = {free_port() for _ in range(20)}
    assert random.getstate() == state
    assert len(ports) > 1 and all(1024 < port < low for port in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_a_port_in_use_is_never_chosen(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port, draw = taken.getsockname()[1], net._pick.randrange
        picks = iter([port, port])
        monkeypatch.setattr(net._pick, "randrange", lambda low, high: next(picks, None) or draw(low, high))
        assert free_port() != port
        assert next(picks, None) is None  # the taken port was drawn twice and refused both times


def test_a_server_on_this_machine_connects_back_over_loopback():
    assert address_toward("http://127.0.0.1:30000") == "127.0.0.1"
    assert address_toward("http://localhost:30000/") == "127.0.0.1"


def test_a_server_elsewhere_connects_back_to_this_machines_network_address():
    outward = address_toward("http://198.51.100.7:30000")  # a host on another machine (nothing is sent)
    assert not outward.startswith("127.")
    assert address_toward(f"http://{outward}:30000") == outward  # a server bound to that address reaches it there
