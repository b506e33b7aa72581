"""The address a rollout engine gives SGLang servers for the weight-update group: this machine's on the route to them
(loopback for a server it launched, the pod's own address for a server in another pod), never a constant."""

from miles_core.rollout.engines.sglang_server import address_toward


def test_a_server_on_this_machine_connects_back_over_loopback():
    assert address_toward("http://127.0.0.1:30000") == "127.0.0.1"
    assert address_toward("http://localhost:30000/") == "127.0.0.1"


def test_a_server_elsewhere_connects_back_to_this_machines_network_address():
    outward = address_toward("http://198.51.100.7:30000")  # a host on another machine (nothing is sent)
    assert not outward.startswith("127.")
    assert address_toward(f"http://{outward}:30000") == outward  # a server bound to that address reaches it there
